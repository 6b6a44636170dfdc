"""The record format: every record type round-trips, every limit raises its typed error."""
from __future__ import annotations

import struct
import time

import pytest
from hypothesis import example, given, settings, strategies as st

from delayserver.message import (
    DEFAULT_MAX_BODY_BYTES, MAX_HEADERS_BYTES, MAX_ID_BYTES, MAX_TIME_MS, BadHeaders, BadMessageId, BadScheduleTime,
    BadSubject, MessageTooLarge,
)
from delayserver.storage.buckets import DEFAULT_SCALE_MS, bucket_name, bucket_start
from delayserver.storage.record import (
    ParkReason, TxnCheck, TxnPark, encode_prepare, encode_txn_check, encode_txn_park,
    HEADER_SIZE, MAX_PAYLOAD_BYTES, Cancel, Dispatch, Message, RecordError, RecordType, decode_cancel,
    decode_delivered, decode_dispatch, decode_headers, decode_message, decode_parked, decode_payload,
    decode_scheduled, decode_scheduled_cancel, encode_cancel, encode_delivered, encode_dispatch, encode_headers,
    encode_epoch_record, encode_message, encode_parked, encode_record, encode_schedule_change, encode_scheduled, iter_records, parse_record,
    scheduled_key,
)

SUBJECT_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:%|-"
T = 1_800_000_000_000


def utf8_text(max_bytes: int, **kw):
    """Non-empty text whose UTF-8 form is at most `max_bytes` (cut at a character boundary)."""
    return (
        st.text(min_size=1, max_size=max_bytes, **kw)
        .map(lambda s: s.encode("utf-8")[:max_bytes].decode("utf-8", "ignore"))
        .filter(bool)
    )


ids = utf8_text(MAX_ID_BYTES)
subjects = st.text(alphabet=SUBJECT_CHARS, min_size=1, max_size=255)
headers = st.dictionaries(utf8_text(64), st.text(max_size=1024), max_size=16).filter(
    lambda h: len(encode_headers(h)) <= MAX_HEADERS_BYTES
)
times = st.integers(0, MAX_TIME_MS)


@st.composite
def bodies(draw):
    """Any allowed size, from 0 to the 4 MiB limit, filled with a drawn pattern (cheap to build)."""
    size = draw(st.one_of(st.integers(0, 2048), st.integers(0, DEFAULT_MAX_BODY_BYTES)))
    pattern = draw(st.binary(min_size=1, max_size=16))
    return (pattern * (size // len(pattern) + 1))[:size]


def test_every_record_type_round_trips_through_its_codec():
    m = Message("id-1", "orders.created", b"\x00body\xff", T, {"k": "v", "é": "ü"}, 5, 7, 3)
    c = Cancel("id-1", T, 6, 8)
    d = Dispatch(4096, T + 12, "group-a")
    payload = encode_message(m)
    assert decode_message(payload) == m
    assert decode_cancel(encode_cancel(c)) == c
    assert decode_scheduled(encode_scheduled(123, payload)) == (123, m)
    assert decode_scheduled_cancel(encode_scheduled(124, encode_cancel(c))) == (124, c)
    assert decode_dispatch(encode_dispatch(d)) == d
    assert decode_delivered(encode_delivered(T + 1, 2, payload)) == (T + 1, 2, m)
    parked = decode_parked(encode_parked(T + 3, 4, 77, "rejected", encode_scheduled(125, payload)))
    assert (parked.parked_time, parked.attempt, parked.schedule_offset, parked.reason) == (T + 3, 4, 77, "rejected")
    assert (parked.message_log_offset, parked.message) == (125, m)


def test_records_of_every_type_frame_and_decode_through_decode_payload():
    m = Message("id-1", "s", b"b", T)
    payloads = {
        RecordType.MESSAGE: encode_message(m),
        RecordType.CANCEL: encode_cancel(Cancel("id-1", T)),
        RecordType.SCHEDULED: encode_scheduled(1, encode_message(m)),
        RecordType.SCHEDULED_CANCEL: encode_scheduled(2, encode_cancel(Cancel("id-1", T))),
        RecordType.DISPATCH: encode_dispatch(Dispatch(0, T, "g")),
        RecordType.DELIVERED: encode_delivered(T, 1, encode_message(m)),
        RecordType.PARKED: encode_parked(T, 1, 0, "why", encode_scheduled(3, encode_message(m))),
        RecordType.SCHEDULE: encode_schedule_change({"op": "delete", "name": "n"}, T),
        # transactions
        RecordType.PREPARE: encode_prepare("producers", 0, encode_message(m)),
        RecordType.COMMIT: encode_message(m),
        RecordType.ROLLBACK: encode_cancel(Cancel("id-1", T)),
        RecordType.TXN_CHECK: encode_txn_check(TxnCheck("id-1", T, 1)),
        RecordType.TXN_PARK: encode_txn_park(TxnPark("id-1", T, ParkReason.CHECK_MAX)),
        RecordType.EPOCH: encode_epoch_record(5)[HEADER_SIZE:],
    }
    assert set(payloads) == set(RecordType)
    buf = b"".join(encode_record(t, p) for t, p in payloads.items())
    seen = [(rtype, decode_payload(rtype, buf, s, e)) for _, rtype, s, e in iter_records(buf)]
    assert [t for t, _ in seen] == list(payloads)
    assert all(decode_payload(t, p, 0, len(p)) == v for (t, v), p in zip(seen, payloads.values()))


@settings(max_examples=60, deadline=None)
@given(mid=ids, subject=subjects, hdrs=headers, body=bodies(), sched=times,
       store=times, seq=st.integers(0, 2**64 - 1), flags=st.integers(0, 0xFFFF))
@example(mid="a", subject="s", hdrs={}, body=b"", sched=0, store=0, seq=0, flags=0)
@example(mid="é" * 64, subject="x" * 255, hdrs={}, body=bytes(DEFAULT_MAX_BODY_BYTES),
         sched=MAX_TIME_MS, store=MAX_TIME_MS, seq=2**64 - 1, flags=0xFFFF)
def test_message_round_trips_for_any_valid_fields(mid, subject, hdrs, body, sched, store, seq, flags):
    m = Message(mid, subject, body, sched, hdrs, store, seq, flags)
    record = encode_record(RecordType.MESSAGE, encode_message(m))
    [(pos, rtype, s, e)] = list(iter_records(record))
    assert (pos, rtype, e) == (0, RecordType.MESSAGE, len(record))
    assert decode_message(record, s, e) == m
    scheduled = encode_scheduled(9, encode_message(m))
    assert scheduled_key(scheduled, 0) == (9, sched, seq, mid)
    assert decode_scheduled(memoryview(scheduled)) == (9, m)


@settings(max_examples=60, deadline=None)
@given(mid=ids, sched=times, seq=st.integers(0, 2**64 - 1), offset=st.integers(0, 2**64 - 1))
def test_cancel_round_trips_for_any_valid_fields(mid, sched, seq, offset):
    c = Cancel(mid, sched, sched, seq)
    assert decode_cancel(encode_cancel(c)) == c
    assert decode_scheduled_cancel(encode_scheduled(offset, encode_cancel(c))) == (offset, c)


@settings(max_examples=60, deadline=None)
@given(offset=st.integers(0, 2**64 - 1), when=times, group=utf8_text(255))
def test_dispatch_round_trips_for_any_valid_fields(offset, when, group):
    d = Dispatch(offset, when, group)
    assert decode_dispatch(encode_dispatch(d)) == d


@settings(max_examples=60, deadline=None)
@given(offsets=st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(-1, 2**63 - 1)), max_size=5), when=times,
       group=utf8_text(255))
def test_dispatch_records_of_a_batch_are_the_bytes_of_one_record_each(offsets, when, group):
    """The sender encodes a batch's dispatch records with one struct: byte for byte what the
    codec writes for each, with or without its message_log offset."""
    from delayserver.storage.record import encode_dispatch_records

    assert encode_dispatch_records(when, group, offsets) == [
        encode_record(RecordType.DISPATCH, encode_dispatch(Dispatch(offset, when, group, mlo))) for offset, mlo in offsets]


@pytest.mark.parametrize("mid", ["", "x" * (MAX_ID_BYTES + 1), "é" * 64 + "x", "\ud800", None, 12, b"bytes"])
def test_bad_message_id_is_refused(mid):
    with pytest.raises(BadMessageId):
        encode_message(Message(mid, "s", b"", T))
    with pytest.raises(BadMessageId):
        encode_cancel(Cancel(mid, T))


@pytest.mark.parametrize("subject", ["", "x" * 256, "a b", "a/b", "é", "a\n", "\ud800", None, b"s"])
def test_bad_subject_is_refused(subject):
    with pytest.raises(BadSubject):
        encode_message(Message("id", subject, b"", T))


@pytest.mark.parametrize("hdrs", [
    {"k": "v" * (MAX_HEADERS_BYTES - 4)},
    {f"k{i:05d}": "v" * 1000 for i in range(40)},
    {"": "v"},
    {"k": 1},
    {1: "v"},
    {"k": "\udc80"},
    [("k", "v")],
    None,
])
def test_bad_headers_are_refused(hdrs):
    with pytest.raises(BadHeaders):
        encode_message(Message("id", "s", b"", T, hdrs))


def test_headers_of_exactly_the_limit_are_accepted():
    hdrs = {"k": "v" * (MAX_HEADERS_BYTES - 5)}
    assert len(encode_headers(hdrs)) == MAX_HEADERS_BYTES
    assert decode_message(encode_message(Message("id", "s", b"", T, hdrs))).headers == hdrs


def test_body_over_the_limit_is_refused():
    with pytest.raises(MessageTooLarge):
        encode_message(Message("id", "s", bytes(DEFAULT_MAX_BODY_BYTES + 1), T))
    with pytest.raises(MessageTooLarge):
        encode_message(Message("id", "s", bytes(11), T), max_body_bytes=10)
    assert len(encode_message(Message("id", "s", bytes(10), T), max_body_bytes=10)) > 10


def test_record_payload_over_the_hard_cap_is_refused():
    with pytest.raises(MessageTooLarge):
        encode_record(RecordType.MESSAGE, bytes(MAX_PAYLOAD_BYTES + 1))


@pytest.mark.parametrize("when", [-1, MAX_TIME_MS + 1, 2**63 - 1, 2**63, 2**64, -(2**63), 1.5e12, True, None, "1"])
def test_schedule_time_outside_the_range_is_refused(when):
    with pytest.raises(BadScheduleTime):
        encode_message(Message("id", "s", b"", when))
    with pytest.raises(BadScheduleTime):
        encode_cancel(Cancel("id", when))


def test_far_future_time_never_wraps_into_now():
    now = int(time.time() * 1000)
    # A 64-bit wrap of these would land on "now"; they must be refused, not stored.
    for wrapped in (2**64 + now, 2**63 + now, now - 2**64):
        with pytest.raises(BadScheduleTime):
            encode_message(Message("id", "s", b"", wrapped))
    latest = decode_message(encode_message(Message("id", "s", b"", MAX_TIME_MS)))
    assert latest.schedule_time == MAX_TIME_MS
    start = bucket_start(MAX_TIME_MS, DEFAULT_SCALE_MS)
    assert start > now
    assert bucket_name(start) == "999912312300"


def test_crc_covers_the_type_byte():
    record = bytearray(encode_record(RecordType.MESSAGE, encode_message(Message("id", "s", b"", T))))
    record[8] = RecordType.CANCEL
    with pytest.raises(RecordError, match="crc mismatch"):
        list(iter_records(bytes(record)))


def test_incomplete_record_is_not_returned():
    record = encode_record(RecordType.MESSAGE, encode_message(Message("id", "s", b"body", T)))
    for cut in range(len(record)):
        assert parse_record(record[:cut], 0) is None
        assert list(iter_records(record + record[:cut])) == [(0, RecordType.MESSAGE, HEADER_SIZE, len(record))]


def test_unknown_type_and_oversized_length_are_record_errors():
    with pytest.raises(RecordError, match="unknown record type 0"):
        parse_record(bytes(HEADER_SIZE), 0)
    with pytest.raises(RecordError, match="over the cap"):
        parse_record(struct.pack(">IIB", 0, MAX_PAYLOAD_BYTES + 1, RecordType.MESSAGE), 0)


def test_a_scheduled_payload_that_does_not_decode_is_a_record_error_at_its_start():
    """The delivery path's decoder, written without the generic wrapper, raises as the others do:
    a RecordError at the payload's start, for a payload cut short, one with bytes to spare, and
    an id that is not UTF-8."""
    payload = encode_scheduled(7, encode_message(Message("id", "s", b"body", T)))
    bad_id = bytearray(payload)
    bad_id[8 + 36] = 0xFF  # the id's first byte, after the offset (8 bytes) and the message head (36)
    for buf in (b"xx" + payload[:20], b"xx" + payload + b"!", b"xx" + bytes(bad_id)):
        with pytest.raises(RecordError, match="undecodable scheduled payload") as info:
            decode_scheduled(buf, 2, len(buf))
        assert info.value.offset == 2
    assert decode_scheduled(b"xx" + payload, 2) == (7, Message("id", "s", b"body", T))


def test_payload_that_does_not_add_up_is_a_value_error():
    payload = encode_message(Message("id", "s", b"body", T, {"k": "v"}))
    with pytest.raises(ValueError):
        decode_message(payload + b"x")
    with pytest.raises(ValueError):
        decode_message(payload[:-1])
    with pytest.raises(ValueError):
        decode_dispatch(encode_dispatch(Dispatch(1, T, "g")) + b"x")


@pytest.mark.parametrize("raw", [b"\x00", b"\x00\x01a", b"\x00\x01a\x00", b"\x00\x01a\x00\x02b",
                                 b"\x00\x05ab", b"\x00\x01\xff\x00\x00"])
def test_malformed_headers_block_is_a_value_error(raw):
    with pytest.raises(ValueError):
        decode_headers(raw)


# --- record heads: what hot paths read without decoding a payload --------------------------------


def test_record_heads_agree_with_the_full_decoders():
    from delayserver.storage.record import (
        cancel_key, dispatch_schedule_offset, frame_records, message_log_head, record_size,
        scheduled_record_head, scheduled_time, sequence_framed,
    )

    record = frame_records([(RecordType.MESSAGE, encode_message(Message("m-1", "s", b"body", T, {"k": "v"},
                                                                       store_time=5)))])
    size = sequence_framed(record, 1, 77)
    message = record[HEADER_SIZE:]
    assert decode_message(bytes(message)).sequence == 77
    head_size = len(message) - len(b"m-1s") - len(encode_headers({"k": "v"})) - len(b"body")
    assert message_log_head(message, 0, RecordType.MESSAGE) == (T, 77, head_size, head_size + 3)
    assert message[head_size : head_size + 3] == b"m-1"
    assert record == encode_record(RecordType.MESSAGE, bytes(message)) and record_size(record, 0) == len(record)
    assert size == len(record)

    size, head, kind = scheduled_record_head(900, RecordType.MESSAGE, message)
    assert kind == RecordType.SCHEDULED
    scheduled = head + message
    assert scheduled == encode_record(RecordType.SCHEDULED, encode_scheduled(900, bytes(message)))
    assert size == len(scheduled) and scheduled_time(scheduled, HEADER_SIZE) == T

    cancel = frame_records([(RecordType.CANCEL, encode_cancel(Cancel("m-1", T, 6)))])
    sequence_framed(cancel, 1, 78)
    cancel = cancel[HEADER_SIZE:]
    assert decode_cancel(bytes(cancel)).sequence == 78
    _, _, at, end = message_log_head(cancel, 0, RecordType.CANCEL)
    assert message_log_head(cancel, 0, RecordType.CANCEL)[:2] == (T, 78) and cancel[at:end] == b"m-1"
    _, head, kind = scheduled_record_head(901, RecordType.CANCEL, cancel)
    assert kind == RecordType.SCHEDULED_CANCEL
    (rtype, start, stop) = parse_record(head + cancel, 0)
    assert rtype == RecordType.SCHEDULED_CANCEL
    assert cancel_key((head + cancel)[start:stop]) == (T, "m-1") == scheduled_key(scheduled, HEADER_SIZE)[1::2]

    assert dispatch_schedule_offset(encode_dispatch(Dispatch(123, T, "g"))) == 123
    with pytest.raises(RecordError):
        message_log_head(encode_dispatch(Dispatch(1, T, "g")), 0, RecordType.DISPATCH)
    with pytest.raises(RecordError):
        cancel_key(b"\x00" * 30 + b"\xff")  # an id that is not UTF-8


def test_a_dispatch_record_names_its_message_and_old_records_still_decode():
    d = Dispatch(4096, T + 12, "group-a", 77_000)
    assert decode_dispatch(encode_dispatch(d)) == d
    old = encode_dispatch(Dispatch(4096, T + 12, "group-a"))  # written before the field was added
    assert len(old) == len(encode_dispatch(d)) - 8
    assert decode_dispatch(old) == Dispatch(4096, T + 12, "group-a", -1)
    with pytest.raises(ValueError):
        decode_dispatch(encode_dispatch(d) + b"x")
