"""The SEND codecs' fast paths against the reference codecs they stand in for.

Each SEND codec (request and response, both ways) has a fast path for the valid case that gives
up on anything it does not take whole, and a reference codec that checks field by field. Whatever
the input, valid, damaged or of the wrong types, the public codec must give what the reference
gives: the same value, or the same error.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delayserver import protocol as p
from delayserver.message import ResultCode, TimeKind, TimeSpec

SETTINGS = settings(max_examples=300, deadline=None)

# Any text, lone surrogates included (not encodable: the encoders must refuse them the same way).
any_text = st.text(max_size=12) | st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1,
                                          max_size=2)
headers = st.dictionaries(any_text, any_text, max_size=3)
kinds = st.sampled_from(TimeKind) | st.integers(0, 5)
values = st.integers(-(2**63), 2**63 - 1) | st.integers(2**63, 2**64)
items = st.builds(p.SendItem, any_text, any_text, st.builds(TimeSpec, kinds, values),
                  st.binary(max_size=20) | st.just(bytearray(b"ab")), headers)
results = st.builds(p.SendResult, st.sampled_from(ResultCode) | st.integers(-1, 0x10000), any_text,
                    values, any_text)


def outcome(fn, *args):
    """The value `fn` returns, or the type and text of what it raises."""
    try:
        return "ok", fn(*args)
    except p.ProtocolError as e:
        return type(e), str(e)


@SETTINGS
@given(st.lists(items, max_size=4))
def test_encode_send_request_is_the_reference(batch):
    assert outcome(p.encode_send_request, batch) == outcome(p._encode_send_request_checked, batch)


@SETTINGS
@given(st.lists(results, max_size=4))
def test_encode_send_response_is_the_reference(batch):
    assert outcome(p.encode_send_response, batch) == outcome(p._encode_send_response_checked, batch)


@SETTINGS
@given(items)
def test_send_item_size_is_what_the_item_takes_in_a_request(item):
    """A client cuts its batches by this size: ASCII ids without headers are counted without
    encoding them, any other item by its encoding."""
    try:
        encoded = p._encode_send_request_checked([item])
    except p.LocalProtocolError:
        return  # an item no request carries: the client refuses it before counting it
    assert p.send_item_size(item) == len(encoded) - p.SEND_REQUEST_OVERHEAD


def test_send_item_size_counts_bytes_not_characters():
    plain = p.SendItem("a" * 10, "orders", TimeSpec.delay(1), b"xyz")
    wide = p.SendItem("é" * 10, "orders", TimeSpec.delay(1), b"xyz", {"k": "ü"})
    for item in (plain, wide):
        assert p.send_item_size(item) == len(p.encode_send_request([item])) - p.SEND_REQUEST_OVERHEAD
    assert p.send_item_size(wide) - p.send_item_size(plain) == 10 + 2 * 2 + 1 + 2


def valid_request(batch) -> bytes:
    try:
        return p._encode_send_request_checked(batch)
    except p.LocalProtocolError:
        return b"\x00\x00\x00\x00"


def valid_response(batch) -> bytes:
    try:
        return p._encode_send_response_checked(batch)
    except p.LocalProtocolError:
        return b"\x00\x00\x00\x00"


@st.composite
def damaged(draw, payloads):
    """A valid payload, then cut, extended or with a few bytes changed (or none of these)."""
    data = bytearray(draw(payloads))
    for _ in range(draw(st.integers(0, 3))):
        if data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    data += draw(st.binary(max_size=3))
    return bytes(data)


@SETTINGS
@given(damaged(st.lists(items, max_size=4).map(valid_request)) | st.binary(max_size=60))
def test_decode_send_request_is_the_reference(payload):
    assert outcome(p.decode_send_request, payload) == outcome(p._decode_send_request_checked, payload)


@SETTINGS
@given(damaged(st.lists(results, max_size=4).map(valid_response)) | st.binary(max_size=60))
def test_decode_send_response_is_the_reference(payload):
    assert outcome(p.decode_send_response, payload) == outcome(p._decode_send_response_checked, payload)


def test_the_fast_paths_take_a_plain_batch():
    """A batch as producers send it goes the fast way, not through the reference."""
    batch = [p.SendItem(f"id-{i}", "orders.created", TimeSpec.delay(1000), b"x" * 10, {"k": "v"}) for i in range(3)]
    payload = p._encode_send_request_fast(batch)
    assert payload == p._encode_send_request_checked(batch)
    assert p._decode_send_request_fast(payload) == batch
    answers = [p.SendResult(ResultCode.OK, "stored", 5, f"id-{i}") for i in range(3)]
    payload = p._encode_send_response_fast(answers)
    assert payload == p._encode_send_response_checked(answers)
    assert p._decode_send_response_fast(payload) == answers


@pytest.mark.parametrize("payload", [
    b"",
    b"\x00\x00\x00\x01",  # one item announced, none there
    b"\xff\xff\xff\xff" + (b"\x01" + b"\x00" * 18) * 2,  # a count no payload this size can hold
])
def test_a_truncated_request_is_refused_as_before(payload):
    with pytest.raises(p.RemoteProtocolError, match="truncated"):
        p.decode_send_request(payload)


def test_a_header_given_twice_is_refused_as_before():
    item = p.SendItem("a", "s", TimeSpec.delay(1), b"", {"k": "v"})
    one = p.encode_send_request([item])[4:]
    # Splice a second ("k", "v") header into the first item: header count 2, the pair twice.
    head = bytearray(one[: p._SEND_ITEM.size])
    head[13:15] = (2).to_bytes(2, "big")
    pair = b"\x00\x01k\x00\x01v"
    payload = b"\x00\x00\x00\x01" + bytes(head) + b"as" + pair + pair
    with pytest.raises(p.RemoteProtocolError, match="given twice"):
        p.decode_send_request(payload)
