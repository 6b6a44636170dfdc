import pytest

from delayserver.sender.transport import int_option, make_transport


def test_unknown_kind_names_the_kind(tmp_path):
    with pytest.raises(ValueError, match="transport kind 'kafka'"):
        make_transport("kafka", "localhost:9092", {}, tmp_path)


@pytest.mark.parametrize("value", [0, -1, "3", 2.5, True])
def test_int_option_refuses_what_is_not_a_positive_int(value):
    with pytest.raises(ValueError, match="option 'n'"):
        int_option("x", {"n": value}, "n", 7)


def test_int_option_default_when_absent_or_none():
    assert int_option("x", {}, "n", 7) == 7
    assert int_option("x", {"n": None}, "n", 7) == 7
    assert int_option("x", {}, "n", None) is None
