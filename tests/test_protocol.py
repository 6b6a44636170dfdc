"""The wire codec, without I/O: frames, the decoder's rules, every payload codec, handles."""
from __future__ import annotations

import struct
import time

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delayserver import protocol as p
from delayserver.message import MAX_TIME_MS, CancelOutcome, Handle, MessageState, ResultCode, TimeKind, TimeSpec

HEAVY = settings(max_examples=200, deadline=None)
LIGHT = settings(max_examples=100, deadline=None)

u32 = st.integers(0, p.MAX_U32)
i64 = st.integers(-(2**63), 2**63 - 1)
texts = st.text(max_size=40)
codes = st.sampled_from(ResultCode) | st.integers(0, 0xFFFF)


@st.composite
def frames(draw, max_payload: int = 300):
    command = draw(st.sampled_from(p.Command))
    is_response = command is p.Command.ERROR or draw(st.booleans())
    return p.Frame(command, draw(u32), draw(st.binary(max_size=max_payload)), is_response)


def raw_frame(
    command=1, payload=b"", *, magic=p.MAGIC, version=p.VERSION, flags=0, request_id=1, length=None
):
    """A frame with any header fields, and a crc that matches them."""
    length = len(payload) if length is None else length
    head = p.HEADER.pack(magic, version, command, flags, request_id, length)
    return head + payload + struct.pack(">I", crc32c.crc32c(head + payload))


def drain(decoder: p.FrameDecoder) -> list[p.Frame]:
    out = []
    while (frame := decoder.next_frame()) is not p.NEED_DATA:
        out.append(frame)
    return out


def decode_one(data: bytes, max_frame_bytes: int = p.DEFAULT_MAX_FRAME_BYTES):
    decoder = p.FrameDecoder(max_frame_bytes)
    decoder.feed(data)
    return decoder.next_frame()


# --- frames ---------------------------------------------------------------------------------


def test_frame_layout_is_as_documented():
    head = bytes.fromhex("444C5953" "01" "02" "01" "00000007" "00000002")
    expected = head + b"hi" + struct.pack(">I", crc32c.crc32c(head + b"hi"))
    assert p.encode(p.Frame(p.Command.SEND, 7, b"hi", is_response=True)) == expected
    assert len(expected) == p.FRAME_OVERHEAD + 2


@HEAVY
@given(frames())
def test_any_frame_round_trips(frame):
    assert decode_one(p.encode(frame)) == frame


@HEAVY
@given(st.lists(frames(), max_size=8), st.data())
def test_frames_split_anywhere_decode_the_same(sent, data):
    stream = b"".join(p.encode(f) for f in sent)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    decoder = p.FrameDecoder()
    received = []
    for start, stop in zip([0, *cuts], [*cuts, len(stream)]):
        decoder.feed(stream[start:stop])
        received += drain(decoder)
    assert received == sent
    assert decoder.buffered_bytes == 0


def test_a_partial_frame_is_need_data_and_counted_as_buffered():
    decoder = p.FrameDecoder()
    decoder.feed(p.encode(p.Frame(p.Command.PING, 1, b"token"))[:-1])
    assert decoder.next_frame() is p.NEED_DATA
    assert decoder.buffered_bytes == p.FRAME_OVERHEAD + 4


def test_decoding_many_frames_from_one_chunk_is_linear():
    # A decoder that copied its buffer per frame would take minutes here, not well under a second.
    count = 100_000
    chunk = p.encode(p.Frame(p.Command.PING, 1, b"abcdefgh")) * count
    decoder = p.FrameDecoder()
    started = time.perf_counter()
    decoder.feed(chunk)
    assert len(drain(decoder)) == count
    assert time.perf_counter() - started < 10


@LIGHT
@given(st.binary(max_size=200), st.binary(max_size=200))
def test_garbage_raises_only_protocol_errors(prefix, garbage):
    # With and without a plausible header in front, so the checks past the magic are reached too.
    for data in (garbage, p.HEADER.pack(p.MAGIC, p.VERSION, 1, 0, 1, len(prefix)) + prefix + garbage):
        decoder = p.FrameDecoder(1024)
        decoder.feed(data)
        try:
            drain(decoder)
        except p.RemoteProtocolError:
            pass


def test_declared_length_over_the_cap_fails_before_the_payload_arrives():
    decoder = p.FrameDecoder(max_frame_bytes=1000)
    decoder.feed(raw_frame(length=1001)[: p.HEADER_SIZE])
    with pytest.raises(p.RemoteProtocolError) as caught:
        decoder.next_frame()
    assert caught.value.code is ResultCode.MESSAGE_TOO_LARGE


def test_a_length_at_the_cap_is_accepted():
    assert decode_one(raw_frame(payload=b"x" * 1000), 1000).payload == b"x" * 1000


def test_a_huge_declared_length_is_refused_without_allocating():
    with pytest.raises(p.RemoteProtocolError):
        decode_one(raw_frame(length=p.MAX_U32)[: p.HEADER_SIZE])


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(raw_frame(magic=0x444C5954), id="bad-magic"),
        pytest.param(raw_frame(version=2), id="unknown-version"),
        pytest.param(raw_frame(command=99), id="unknown-command"),
        pytest.param(raw_frame(command=0), id="command-zero"),
        pytest.param(raw_frame(flags=0x02), id="unknown-flag"),
        pytest.param(raw_frame(command=p.Command.ERROR), id="error-as-request"),
    ],
)
def test_bad_header_is_a_remote_error(data):
    with pytest.raises(p.RemoteProtocolError) as caught:
        decode_one(data)
    assert caught.value.code is ResultCode.BAD_REQUEST


@HEAVY
@given(frames(max_payload=100), st.data())
def test_any_flipped_byte_is_a_remote_error(frame, data):
    raw = bytearray(p.encode(frame))
    index = data.draw(st.integers(0, len(raw) - 1))
    raw[index] ^= data.draw(st.integers(1, 255))
    # A flip that raises the declared length under the cap makes the decoder wait: the padding
    # gives it the bytes, and the crc, read from the wrong place, must still fail.
    with pytest.raises(p.RemoteProtocolError):
        decode_one(bytes(raw) + bytes(4096), max_frame_bytes=4000)


def test_a_failed_decoder_stays_failed():
    decoder = p.FrameDecoder()
    decoder.feed(raw_frame(magic=0))
    with pytest.raises(p.RemoteProtocolError):
        decoder.next_frame()
    decoder.feed(p.encode(p.Frame(p.Command.PING, 1, b"")))
    with pytest.raises(p.RemoteProtocolError):
        decoder.next_frame()


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(p.Frame(p.Command.PING, -1, b""), id="negative-request-id"),
        pytest.param(p.Frame(p.Command.PING, 2**32, b""), id="request-id-over-u32"),
        pytest.param(p.Frame(99, 1, b""), id="unknown-command"),
        pytest.param(p.Frame(p.Command.PING, 1, "text"), id="payload-not-bytes"),
        pytest.param(p.Frame(p.Command.ERROR, 1, b""), id="error-as-request"),
    ],
)
def test_encoding_an_invalid_frame_is_a_local_error(frame):
    with pytest.raises(p.LocalProtocolError):
        p.encode(frame)


def test_encoding_a_payload_over_the_cap_is_a_local_error():
    with pytest.raises(p.LocalProtocolError):
        p.encode(p.Frame(p.Command.SEND, 1, bytes(11)), max_frame_bytes=10)


# --- payload codecs -------------------------------------------------------------------------

time_specs = st.builds(TimeSpec, st.sampled_from(TimeKind), i64)
send_items = st.builds(
    p.SendItem,
    message_id=texts,
    subject=texts,
    time=time_specs,
    body=st.binary(max_size=100),
    headers=st.dictionaries(texts, texts, max_size=4),
)
handles = st.builds(Handle, i64, texts)
CODECS = {
    "send-request": (st.lists(send_items, max_size=4), p.encode_send_request, p.decode_send_request),
    "send-response": (
        st.lists(st.builds(p.SendResult, codes, texts, i64, texts), max_size=4),
        p.encode_send_response,
        p.decode_send_response,
    ),
    "handle": (handles, p.encode_handle, p.decode_handle),
    "cancel-response": (
        st.builds(p.CancelResult, codes, texts, st.sampled_from(CancelOutcome)),
        p.encode_cancel_response,
        p.decode_cancel_response,
    ),
    "status-response": (
        st.builds(p.StatusResult, codes, texts, st.sampled_from(MessageState), i64, texts),
        p.encode_status_response,
        p.decode_status_response,
    ),
    "error": (st.builds(p.ErrorResult, codes, texts), p.encode_error, p.decode_error),
}
codec_names = pytest.mark.parametrize("name", sorted(CODECS))


@codec_names
@HEAVY
@given(data=st.data())
def test_payload_codec_round_trips(name, data):
    values, encode, decode = CODECS[name]
    value = data.draw(values)
    assert decode(encode(value)) == value


@codec_names
@HEAVY
@given(data=st.data())
def test_truncated_or_extended_payload_is_a_remote_error(name, data):
    values, encode, decode = CODECS[name]
    raw = encode(data.draw(values))
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(p.RemoteProtocolError):
        decode(raw[:cut])
    with pytest.raises(p.RemoteProtocolError):
        decode(raw + data.draw(st.binary(min_size=1, max_size=3)))


@codec_names
@LIGHT
@given(garbage=st.binary(max_size=64))
def test_garbage_payload_raises_only_remote_errors(name, garbage):
    try:
        CODECS[name][2](garbage)
    except p.RemoteProtocolError:
        pass


def test_unknown_result_code_is_kept_as_an_int():
    (result,) = p.decode_send_response(p.encode_send_response([p.SendResult(999, "new", 5, "a")]))
    assert result.code == 999 and not isinstance(result.code, ResultCode)
    (result,) = p.decode_send_response(p.encode_send_response([p.SendResult(0, "ok", 5, "a")]))
    assert result.code is ResultCode.OK
    assert result.handle == Handle(5, "a")


def test_an_id_that_is_not_utf8_is_a_remote_error():
    with pytest.raises(p.RemoteProtocolError, match="UTF-8"):
        p.decode_handle(struct.pack(">qH", 1, 2) + b"\xff\xfe")


def test_an_unknown_enum_value_is_a_remote_error():
    with pytest.raises(p.RemoteProtocolError, match="outcome"):
        p.decode_cancel_response(struct.pack(">HBI", 0, 9, 0))
    with pytest.raises(p.RemoteProtocolError, match="state"):
        p.decode_status_response(struct.pack(">HBqHI", 0, 0, 0, 0, 0))


def test_a_header_key_given_twice_is_a_remote_error():
    raw = p.encode_send_request([p.SendItem("id", "s", TimeSpec.delay(1), b"", {"k": "1", "x": "2"})])
    with pytest.raises(p.RemoteProtocolError, match="twice"):
        p.decode_send_request(raw.replace(b"\x00\x01x", b"\x00\x01k"))


@pytest.mark.parametrize(
    "item",
    [
        pytest.param(p.SendItem("x" * 0x10000, "s", TimeSpec.at(1)), id="id-over-u16"),
        pytest.param(p.SendItem("id", "\ud800", TimeSpec.at(1)), id="subject-not-utf8"),
        pytest.param(p.SendItem("id", "s", TimeSpec.at(2**63)), id="time-over-i64"),
        pytest.param(p.SendItem("id", "s", TimeSpec(9, 1)), id="unknown-time-kind"),
        pytest.param(p.SendItem("id", "s", TimeSpec.level(1), "body"), id="body-not-bytes"),
        pytest.param(p.SendItem(7, "s", TimeSpec.level(1)), id="id-not-str"),
    ],
)
def test_encoding_an_unrepresentable_send_item_is_a_local_error(item):
    with pytest.raises(p.LocalProtocolError):
        p.encode_send_request([item])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=20,
)


@LIGHT
@given(json_values)
def test_json_round_trips(value):
    assert p.decode_json(p.encode_json(value)) == value


@pytest.mark.parametrize("payload", [b"\xff", b"{", b"NaN", b"[1] x", b"[" * 100_000])
def test_bad_json_is_a_remote_error(payload):
    with pytest.raises(p.RemoteProtocolError):
        p.decode_json(payload)


@pytest.mark.parametrize("value", [object(), float("nan"), {1j: 1}])
def test_unencodable_json_is_a_local_error(value):
    with pytest.raises(p.LocalProtocolError):
        p.encode_json(value)


# --- handles --------------------------------------------------------------------------------

valid_ids = st.text(min_size=1, max_size=128).filter(lambda s: len(s.encode("utf-8")) <= 128)


def test_handle_text_examples():
    assert str(Handle(1732252800000, "order-42")) == "1732252800000:order-42"
    assert str(Handle(0, "a b/ü~")) == "0:a%20b%2F%C3%BC%7E"


@HEAVY
@given(st.integers(0, MAX_TIME_MS), valid_ids)
def test_handle_text_round_trips_and_is_shell_safe(schedule_time, message_id):
    handle = Handle(schedule_time, message_id)
    text = str(handle)
    assert Handle.parse(text) == handle
    assert set(text) <= set("0123456789:%.-_ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "123",
        "123:",
        ":abc",
        "-1:abc",
        "01:abc",
        "1.5:abc",
        " 1:abc",
        "1:abc\n",
        "1:a b",
        "1:a~b",
        "1:%zz",
        "1:%4",
        "1:%41",  # "A" need not be escaped: one text per handle
        "1:%c3%bc",  # lowercase hex
        "1:%FF",  # not UTF-8
        "1:" + "a" * 129,
        "253402300800000:abc",  # past MAX_TIME_MS
        "1:abc:def",
    ],
)
def test_handle_parse_rejects_garbage(text):
    with pytest.raises(ValueError):
        Handle.parse(text)


@LIGHT
@given(st.text(max_size=40))
def test_handle_parse_raises_only_value_error(text):
    try:
        handle = Handle.parse(text)
    except ValueError:
        return
    assert str(handle) == text
