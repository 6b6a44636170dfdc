"""The message kernel: one address reader, one table of result codes, the time spec's rules."""
from __future__ import annotations

import pytest

from delayserver.message import (
    AddressError, BadScheduleTime, MessageTooLarge, ResultCode, TimeKind, TimeSpec, error_for, format_address,
    parse_address,
)


@pytest.mark.parametrize("text, kw, want", [
    ("127.0.0.1:20801", {}, ("127.0.0.1", 20801)),
    ("[::1]:9", {}, ("::1", 9)),
    ("example.org", {"default_port": 20800}, ("example.org", 20800)),
    ("[::1]", {"default_port": 7}, ("::1", 7)),
    ("127.0.0.1:0", {"allow_port_zero": True}, ("127.0.0.1", 0)),
])
def test_parse_address_reads_host_and_port(text, kw, want):
    assert parse_address(text, **kw) == want
    assert parse_address(format_address(*want), allow_port_zero=True) == want


@pytest.mark.parametrize("text", [
    "127.0.0.1:notaport", "127.0.0.1", ":80", "::1:80", "[::1", "[::1]x", "host:70000", "host:0", "host:-1",
    "host:٣", 80, None,
])
def test_parse_address_refuses_what_is_not_host_port(text):
    with pytest.raises(AddressError):
        parse_address(text)


def test_error_for_maps_each_code_to_its_exception_and_keeps_unknown_codes_internal():
    assert isinstance(error_for(ResultCode.MESSAGE_TOO_LARGE, "big"), MessageTooLarge)
    err = error_for(999, "from a newer server")
    assert err.code == ResultCode.INTERNAL and str(err) == "from a newer server"


def test_time_spec_of_takes_one_whole_number():
    assert TimeSpec.of() == TimeSpec(TimeKind.DELAY, 0)
    assert TimeSpec.of(delay_level=3) == TimeSpec(TimeKind.LEVEL, 3)
    assert TimeSpec.of(deliver_at=5) == TimeSpec(TimeKind.AT, 5)
    with pytest.raises(ValueError):
        TimeSpec.of(deliver_at=1, delay=2)


@pytest.mark.parametrize("kw", [{"delay": 1.5}, {"delay": 2**70}, {"deliver_at": -(2**64)}, {"delay": True},
                                {"delay_level": "3"}])
def test_time_spec_of_refuses_fractions_and_numbers_past_64_bits(kw):
    with pytest.raises(BadScheduleTime):
        TimeSpec.of(**kw)
