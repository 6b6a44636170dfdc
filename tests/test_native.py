"""The compiled kernels (delayserver/native) against the Python references they stand in for.

Whatever the input, a kernel gives what its reference gives, or hands back None (the caller then
runs the reference). The kernels must be built: `ops/test` installs with a C compiler, and a
build that failed quietly (the extensions are optional) would leave every node on the slower path.
"""
from __future__ import annotations

import array
import functools
import itertools
import os
import random
import struct
import sys
import weakref
from collections.abc import Mapping
from unittest import mock

import attrs
import hiredis
import pytest
import redis
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from delayserver import client, dedupe, message, replayer
from delayserver import protocol as p
from delayserver.message import BadScheduleTime, Handle, ResultCode, TimeKind, TimeSpec
# The kernels must be built (see the module docstring): imported here, not skipped when missing.
from delayserver.native import dedupe as native_dedupe
from delayserver.native import idmap as native_idmap
from delayserver.native import receive as native_receive
from delayserver.native import records as native_records
from delayserver.native import resp as native_resp
from delayserver.native import send as native_send
from delayserver.native import wheel as native_wheel
from delayserver.node import receiver as receiver_module
from delayserver.storage import id_index, time_index
from delayserver.storage import record as r
from delayserver.sender import redis_streams
from delayserver.sender.transport import OutboundMessage
from delayserver.storage.errors import CorruptSegment
from delayserver.storage.record import RecordType as T
from delayserver.wheel import read_ahead, timingwheel
from delayserver.wheel.timingwheel import TimingWheel

SETTINGS = settings(max_examples=300, deadline=None)
SCALE = 3_600_000


# Lengths around the three-stream blocks' edges (crc32c.h): one block of short parts, one of
# long parts, and a byte either side of each; the rest drawn.
_CRC_PARTS_EDGES = sorted({3 * n + d for n in native_records.CRC32C_PARTS for d in (-1, 0, 1)})


@SETTINGS
@given(st.one_of(st.sampled_from(_CRC_PARTS_EDGES), st.integers(0, 20_000)), st.integers(0, 7),
       st.integers(0, 2**32 - 1), st.randoms(use_true_random=False))
def test_the_kernels_crc32c_is_the_crc32c_package_s_each_way(length, offset, value, rnd):
    """Three streams, one chain and the table all give the crc32c package's checksum, from any
    running value, for any length and alignment (a memoryview of a longer buffer at `offset`)."""
    import crc32c
    data = memoryview(rnd.randbytes(length + offset))[offset:]
    want = crc32c.crc32c(data, value=value)
    three, one, table = native_records.crc32c_each_way(data, value)
    assert table == want
    if native_records.CRC32C_HARDWARE:
        assert (three, one) == (want, want)


def test_the_kernels_crc32c_joins_its_streams_over_records_of_every_size():
    """Every length up to three long blocks and beyond, so that each way of cutting a buffer
    (long blocks, short blocks, the chain left over) meets the package's checksum."""
    import crc32c
    rnd = random.Random(7)
    data = rnd.randbytes(3 * native_records.CRC32C_PARTS[0] * 2 + 64)
    ways = 3 if native_records.CRC32C_HARDWARE else 1
    for length in range(len(data) + 1):
        piece = data[:length]
        got = native_records.crc32c_each_way(piece, 0x9E3779B9)
        assert got[3 - ways:] == (crc32c.crc32c(piece, value=0x9E3779B9),) * ways, length


def test_the_kernels_know_the_record_format_as_record_py_does():
    f = native_records.FORMAT
    assert (f["HEADER_SIZE"], f["OFFSET_SIZE"], f["MESSAGE_HEAD_SIZE"], f["CANCEL_HEAD_SIZE"], f["TXN_PREFIX_SIZE"]) == (
        r.HEADER_SIZE, r.OFFSET.size, r.MESSAGE_HEAD.size, r.CANCEL_HEAD.size, r._TXN_PREFIX.size)
    assert (f["SCHEDULED_HEAD_SIZE"], f["DELIVERED_HEAD_SIZE"], f["DISPATCH_HEAD_SIZE"], f["MAX_PAYLOAD_BYTES"]) == (
        r.SCHEDULED_HEAD.size, r.DELIVERED_HEAD.size, r.DISPATCH_HEAD.size, r.MAX_PAYLOAD_BYTES)
    from delayserver.storage.bucket_log import SHARED_READ_BYTES
    assert f["SHARED_READ_BYTES"] == SHARED_READ_BYTES
    assert f["MAX_HEADERS_BYTES"] == message.MAX_HEADERS_BYTES
    for name in ("MESSAGE", "CANCEL", "SCHEDULED", "SCHEDULED_CANCEL", "EPOCH", "PREPARE", "COMMIT", "ROLLBACK",
                 "TXN_CHECK", "TXN_PARK", "SCHEDULE", "DELIVERED", "DISPATCH"):
        assert f[name] == T[name], name
    # The id length bytes the kernel reads: MESSAGE's at 26, CANCEL's at 24.
    payload = r.encode_message_fields("id-\u00e9", "s.x", b"body", 5, {"k": "v"}, 1)
    assert payload[26] == len("id-\u00e9".encode())
    assert r.encode_cancel(r.Cancel("abc", 5, 1))[24] == 3


# Some with the prefixes the walk's follow_prefix is tried with.
ids = st.builds(lambda prefix, rest: prefix + rest, st.sampled_from(["", "", "m", "schedule:", "schedule"]),
                st.text(st.characters(codec="utf-8"), min_size=1, max_size=6)).filter(lambda s: len(s.encode()) <= 255)
times = st.integers(0, 6 * SCALE) | st.integers(-(2**63), 2**63 - 1)


def stamped(payload: bytes, sched: int, seq: int) -> bytes:
    """`payload` (any message_log type: each starts store_time, schedule_time, sequence) with that
    schedule time and sequence, whatever the encoders would accept."""
    payload = bytearray(payload)
    payload[8:24] = sched.to_bytes(8, "big", signed=True) + seq.to_bytes(8, "big")
    return bytes(payload)


@st.composite
def message_logs(draw):
    """Records as a node's message_log holds them (epochs framing batches, each type it knows),
    sequences in order, and sometimes a damaged one: a type that is not message_log's, a cancel
    whose id is not UTF-8, a head cut short."""
    parts, seq = [], draw(st.integers(0, 2**40))
    for _ in range(draw(st.integers(0, 25))):
        kind = draw(st.sampled_from(["message", "message", "message", "cancel", "commit", "prepare", "rollback",
                                     "check", "park", "schedule", "epoch"]))
        if draw(st.integers(0, 60)) == 0:
            kind = draw(st.sampled_from(["bad-type", "bad-cancel-id", "short"]))
        seq += 1
        sched, mid = draw(times), draw(ids)
        if kind == "message" or kind == "commit":
            body = draw(st.binary(max_size=40))
            payload = r.encode_message_fields(mid, "s.x", body, 0, {"h": "v"} if draw(st.booleans()) else {}, 7)
            parts.append(r.encode_record(T.MESSAGE if kind == "message" else T.COMMIT, stamped(payload, sched, seq)))
        elif kind == "cancel" or kind == "rollback":
            payload = stamped(r.encode_cancel(r.Cancel(mid, 0, 7)), sched, seq)
            parts.append(r.encode_record(T.CANCEL if kind == "cancel" else T.ROLLBACK, payload))
        elif kind == "prepare":
            message = r.encode_message_fields(mid, "s.x", b"b", 0, {}, 7, 0)
            parts.append(r.encode_record(T.PREPARE, stamped(r.encode_prepare("g", 10, message), sched, seq)))
        elif kind == "check":
            payload = stamped(r.encode_txn_check(r.TxnCheck(mid, 0, 2, 7)), sched, seq)
            parts.append(r.encode_record(T.TXN_CHECK, payload))
        elif kind == "park":
            payload = stamped(r.encode_txn_park(r.TxnPark(mid, 0, r.ParkReason(1), 7)), sched, seq)
            parts.append(r.encode_record(T.TXN_PARK, payload))
        elif kind == "schedule":
            parts.append(r.encode_record(T.SCHEDULE, stamped(r.encode_schedule_change({"name": mid}, 7), 0, seq)))
        elif kind == "epoch":
            parts.append(r.encode_epoch_record(draw(st.integers(1, 9))))
        elif kind == "bad-type":
            parts.append(r.encode_record(draw(st.sampled_from([T.SCHEDULED, T.DISPATCH, T.PARKED])), b"x" * 40))
        elif kind == "bad-cancel-id":
            payload = r.CANCEL_HEAD.pack(7, 0, seq, 2) + b"\xff\xfe"
            parts.append(r.encode_record(T.CANCEL, payload))
        else:  # a MESSAGE whose head is cut short: at the end, nothing follows to read it from
            parts.append(r.encode_record(T.MESSAGE, b"\x00" * draw(st.integers(0, 35))))
            break
    return b"".join(parts)


def comparable(walked):
    """A walk's result with its buffers and ids as bytes (the kernel writes bytearrays and ids as
    bytes, the reference joins bytes and slices memoryviews)."""
    per_bucket, ids, runs, txn_notes, followed, end, max_sequence, changes = walked
    return ({b: bytes(v) for b, v in per_bucket.items()},
            {b: [(at, kind, sched, bytes(mid)) for at, kind, sched, mid in v] for b, v in ids.items()},
            runs, txn_notes, followed, end, max_sequence, changes)


def reference(*args):
    try:
        return "ok", comparable(replayer.walk(*args))
    except r.RecordError as e:
        return "error", e.offset, e.reason


@SETTINGS
@given(message_logs(), st.integers(0, 2**40), st.integers(0, 5000), st.integers(0, 2**20), st.booleans(),
       st.integers(1, 2 * SCALE), st.sampled_from([None, b"", b"m", b"schedule:", b"\xff"]))
def test_the_replay_walk_is_the_reference(data, base, limit_at, start, as_bytearray, scale, follow_prefix):
    sizes = {}

    def sizes_of(bucket):  # a bucket's size: anything, the same for both walks
        return sizes.setdefault(bucket, random.Random(bucket).randrange(0, 1 << 30))

    buf = bytearray(data) if as_bytearray else data
    args = (buf, base, base + limit_at, base - start, scale, sizes_of, r.schedule_change_sequence, start,
            follow_prefix)
    native = native_records.walk(*args)
    expected = reference(*args)
    if native is None:  # left to the reference: only for what the reference refuses
        assert expected[0] == "error"
    else:
        assert ("ok", comparable(native)) == expected


def test_the_replay_walk_takes_a_node_s_batch():
    """A batch as the receiver writes one: the kernel takes it (no None) and equals the reference."""
    payloads = [r.encode_message_fields(f"m{i}", "s.x", b"x" * 1024, SCALE * (i % 3) + i, {}, 1, 0) for i in range(64)]
    data = r.encode_epoch_record(3) + sequenced_frames([(T.MESSAGE, x) for x in payloads], 100)
    args = (data, 4096, 4096 + len(data), 4096, SCALE, lambda b: 10 * b // SCALE, r.schedule_change_sequence, 0)
    native = native_records.walk(*args)
    assert native is not None
    assert comparable(native) == comparable(replayer.walk(*args))
    per_bucket = native[0]
    assert sorted(per_bucket) == [0, SCALE, 2 * SCALE]
    # What it wrote decodes as schedule_log records whose crc checks out.
    records = list(r.iter_records(bytes(per_bucket[SCALE])))
    assert len(records) == 21 and all(rtype == T.SCHEDULED for _, rtype, _, _ in records)


def test_the_replay_walk_makes_each_bucket_s_buffer_its_size_at_once():
    """A group commit's pass (a thousand 1 KiB records, runs of three buckets' and a cancel among
    them): each bucket's buffer is allocated once at the size it ends at, as a bytearray of that
    length is, not grown record by record (a bytearray grows by an eighth at a time, and each
    growth may copy what it holds)."""
    frames = [(T.MESSAGE, r.encode_message_fields(f"m{i}", "s.x", b"x" * 1024, SCALE * (i // 100 % 3) + i, {}, 1, 0))
              for i in range(1000)]
    frames.insert(500, (T.CANCEL, r.encode_cancel(r.Cancel("m7", 7, 1))))
    frames.append((T.MESSAGE, stamped(r.encode_message_fields("before-1970", "s.x", b"y", 0, {}, 1, 0), -5, 0)))
    data = r.encode_epoch_record(3) + sequenced_frames(frames, 100)
    args = (data, 0, len(data), 0, SCALE, lambda b: 0, r.schedule_change_sequence, 0)
    native = native_records.walk(*args)
    assert native is not None and comparable(native) == comparable(replayer.walk(*args))
    per_bucket = native[0]
    assert sorted(per_bucket) == [-SCALE, 0, SCALE, 2 * SCALE]
    for bucket in (0, SCALE, 2 * SCALE):
        assert sys.getsizeof(per_bucket[bucket]) == sys.getsizeof(bytearray(len(per_bucket[bucket]))), bucket


# --- the SEND decoder ---------------------------------------------------------------------------


any_text = st.text(max_size=8) | st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1,
                                         max_size=2)
send_items = st.builds(p.SendItem, st.text(max_size=8), st.sampled_from(["s.x", "s.y", ""]) | st.text(max_size=4),
                       st.builds(TimeSpec, st.sampled_from(TimeKind), st.integers(-(2**63), 2**63 - 1)),
                       st.binary(max_size=16), st.dictionaries(st.sampled_from(["k1", "k2"]) | st.text(max_size=4),
                                                               st.text(max_size=4), max_size=3))


@st.composite
def send_requests(draw):
    """SEND request payloads: encoded batches, some damaged (bytes changed, cut, added)."""
    payload = bytearray(p.encode_send_request(draw(st.lists(send_items, max_size=6))))
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2, 3]))):
        what = draw(st.sampled_from(["flip", "cut", "add", "twin"]))
        if what == "twin" and b"\x00\x02k1" in payload:  # a header key given twice
            payload = payload.replace(b"\x00\x02k2", b"\x00\x02k1", 1)
        elif what == "flip" and payload:
            payload[draw(st.integers(0, len(payload) - 1))] = draw(st.integers(0, 255))
        elif what == "cut":
            del payload[draw(st.integers(0, len(payload))):]
        else:
            payload += draw(st.binary(min_size=1, max_size=4))
    return bytes(payload)


def rows_of(batch):
    return None if batch is None else (batch.buf, batch.rows)


@SETTINGS
@given(send_requests() | st.binary(max_size=64))
def test_the_send_decoder_is_the_reference(payload):
    rows = native_send.decode_rows(payload, p._time_spec, p._AT_KIND)
    assert rows_of(None if rows is None else p.SendBatch(payload, rows)) == rows_of(p._decode_send_request_py(payload))


def test_the_send_decoder_takes_a_producer_s_batch():
    items = [p.SendItem(f"m{i}", "orders.timeout", TimeSpec.delay(1800_000) if i % 3 else TimeSpec.at(NOW + i),
                        b"x" * 100, {"k": "\u00e9"} if i % 2 else {})
             for i in range(64)]
    payload = p.encode_send_request(items)
    rows = native_send.decode_rows(payload, p._time_spec, p._AT_KIND)
    assert rows is not None and list(p.SendBatch(payload, rows)) == items
    # An epoch time is its value in the row, as the reference keeps it: no TimeSpec made per message.
    assert [row[2] for row in rows[:4]] == [NOW, TimeSpec.delay(1800_000), TimeSpec.delay(1800_000), NOW + 3]
    assert rows == p._decode_send_request_py(payload).rows
    assert p.decode_send_request(payload).rows == rows  # the public decoder takes the kernel's rows


# --- the receiver's framing ---------------------------------------------------------------------

def sequenced_frames(records, sequence: int) -> bytearray:
    """`records` (type, payload) framed and sequenced from `sequence` on, as the receiver writes them."""
    framed_ = r.frame_records(records)
    assert r.sequence_framed(framed_, len(records), sequence) == len(framed_)
    return framed_


def test_the_framing_writes_records_that_check():
    payloads = [r.encode_message_fields(f"m{i}", "s.x", b"x" * 1024, 5, {}, 1) for i in range(64)]
    framed_ = r.frame_records((T.MESSAGE, x) for x in payloads)
    assert native_records.sequence_framed(framed_, 64, 41) == len(framed_)
    data = bytes(framed_)
    assert [r.decode_message(data, s, e).sequence for _, _, s, e in r.iter_records(data)] == list(range(41, 105))


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from([T.MESSAGE, T.CANCEL, T.SCHEDULE, T.PREPARE, T.COMMIT, T.DISPATCH, 0, 255]),
                          st.binary(min_size=24, max_size=60) | st.binary(max_size=30)), max_size=5))
def test_framing_takes_only_sequenced_records_and_leaves_the_checksum_to_the_append(records):
    """`frame_records` refuses, before anything is queued, what the append could not sequence, and
    frames the rest as headers with no checksum yet."""
    fit = all(rtype in r._SEQUENCED_TYPES and len(x) >= 24 for rtype, x in records)
    if not fit:
        with pytest.raises(ValueError):
            r.frame_records(records)
        return
    assert r.frame_records(records) == b"".join(r.HEADER.pack(0, len(x), rtype) + x for rtype, x in records)


def sequenced(fn, framed_: bytearray, count: int, sequence: int):
    """(bytes after, size) of `fn`'s sequencing of a copy of `framed_`, or the error it raised."""
    copy = bytearray(framed_)
    try:
        size = fn(copy, count, sequence)
    except (ValueError, struct.error) as e:
        return type(e), bytes(copy) == framed_
    return None if size is None else (bytes(copy), size)


sequenced_records = st.lists(st.tuples(st.sampled_from([T.MESSAGE, T.CANCEL, T.COMMIT, T.SCHEDULE, T.DISPATCH, 0]),
                                       st.binary(min_size=24, max_size=60) | st.binary(max_size=30)), max_size=5)


@SETTINGS
@given(sequenced_records, st.integers(-1, 1), st.integers(0, 2**64 - 1) | st.integers(2**64 - 6, 2**64 - 1),
       st.sampled_from([b"", b"", b"\x00", b"\x00" * 12]))
def test_sequencing_framed_records_is_the_reference(records, count_off, sequence, tail):
    framed_ = bytearray(b"".join(r.HEADER.pack(0, len(x), rtype) + x for rtype, x in records) + tail)
    count = len(records) + count_off
    native = sequenced(native_records.sequence_framed, framed_, count, sequence)
    reference_ = sequenced(r._sequence_framed_py, framed_, count, sequence)
    if native is None:  # left to the reference, which refuses it and changes nothing, or overflows
        assert reference_[0] in (ValueError, struct.error) and (reference_[1] or reference_[0] is struct.error)
    else:
        assert native == reference_
    assert sequenced(r.sequence_framed, framed_, count, sequence) == reference_


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from([T.MESSAGE, T.CANCEL, T.PREPARE]), st.binary(min_size=24, max_size=60)),
                max_size=5), st.integers(0, 2**63))
def test_framed_records_once_sequenced_are_the_records_of_their_payloads(records, sequence):
    """What the receiver writes of a request (its records framed, then `sequence_framed`) is each
    payload given its sequence (after store time and schedule time) behind its checked header."""
    framed_ = r.frame_records(records)
    assert r.sequence_framed(framed_, len(records), sequence) == len(framed_)
    assert bytes(framed_) == b"".join(
        r.encode_record(rtype, x[:16] + struct.pack(">Q", sequence + k) + x[24:])
        for k, (rtype, x) in enumerate(records))


# --- the SEND response encoder ------------------------------------------------------------------


values = st.integers(-(2**63), 2**63 - 1) | st.integers(2**63, 2**64) | st.integers(-(2**64), -(2**63) - 1)
send_results = st.builds(p.SendResult, st.sampled_from(ResultCode) | st.integers(-1, 0x10000) | st.booleans()
                         | st.just(1.0), any_text | st.just(b"x"), values, any_text | st.just(None))


@SETTINGS
@given(st.lists(st.builds(p.SendResult, st.sampled_from(ResultCode), st.sampled_from(["stored", "dup"]),
                          st.integers(0, 2**45), st.text(max_size=8)), max_size=8)
       | st.lists(send_results, max_size=4) | st.lists(st.tuples(st.just(0), st.just("a"), st.just(1), st.just("b")),
                                                        max_size=2))
def test_the_send_response_encoder_is_the_reference(results):
    native, reference_ = native_send.encode_results(results, p.SendResult), p._encode_send_response_py(results)
    if native is None:  # left to the reference: what it refuses too, or results of another type
        assert reference_ is None or any(type(x) is not p.SendResult for x in results)
    else:
        assert native == reference_


def _response_bytes(results, cut, garble):
    """A SEND response: the encoding of `results`, then cut short or lengthened by `cut` bytes, with
    byte `garble` (when given) replaced by 0xFF (breaking a length or the UTF-8 of a text)."""
    data = bytearray(p._encode_send_response_checked(results))
    data = data[:len(data) + cut] if cut < 0 else data + bytes(cut)
    if garble is not None and data:
        data[garble % len(data)] = 0xFF
    return bytes(data)


@SETTINGS
@given(st.lists(st.builds(p.SendResult, st.sampled_from(ResultCode) | st.integers(0, 0xFFFF),
                          st.sampled_from(["stored", "dup", "", "\u00e9t\u00e9"]) | st.text(max_size=4),
                          st.integers(-(2**63), 2**63 - 1), st.text(max_size=6)), max_size=6),
       st.integers(-3, 2), st.none() | st.integers(0, 200))
def test_the_send_response_decoder_is_the_reference(results, cut, garble):
    data = _response_bytes(results, cut, garble)
    native, reference_ = native_send.decode_results(data, p.SendResult, p._RESULT_CODE_BY_VALUE), \
        p._decode_send_response_py(data)
    assert native == reference_
    assert native is None or all(type(x) is p.SendResult and type(x.code) is type(y.code)
                                 for x, y in zip(native, reference_))
    if cut == 0 and garble is None:
        assert native == results
    # The producer's own decoding: a stored message's result is its Handle, the others as they are.
    handles = native_send.decode_handles(data, p.SendResult, p._RESULT_CODE_BY_VALUE, Handle, ResultCode.OK,
                                         ResultCode.DUPLICATE)
    if reference_ is None:
        assert handles is None
    else:
        expected = [Handle(r.schedule_time, r.message_id) if r.code in (ResultCode.OK, ResultCode.DUPLICATE) else r
                    for r in reference_]
        assert handles == (expected, all(r.code in (ResultCode.OK, ResultCode.DUPLICATE) for r in reference_))
        assert [type(x) for x in handles[0]] == [type(x) for x in expected]


# --- the Redis transport's XADD commands -------------------------------------------------------


texts = st.sampled_from(["orders.q", "s", "\u00e9t\u00e9", "a\udc80"]) | st.text(max_size=5)
numbers = st.integers(-(2**63), 2**63 - 1) | st.sampled_from([0, -1, 9, 10, 99, 100, 2**64, True]) | st.just(1.5)
outbound = st.builds(OutboundMessage, texts, st.sampled_from(["orders.q", "b.x"]) | texts,
                     st.binary(max_size=12) | st.binary(max_size=3).map(memoryview),
                     st.just({}) | st.dictionaries(texts, texts, max_size=2), numbers, numbers, numbers)


@SETTINGS
@given(st.lists(outbound, max_size=5), st.sampled_from(["{subject}", "q:{subject}", "one"]),
       st.none() | st.integers(0, 10**6))
def test_the_xadd_encoder_is_the_reference(messages, template, maxlen):
    try:
        expected = redis_streams._xadd_commands_py(messages, template, maxlen)
    except Exception as e:  # what the reference refuses, the kernel leaves to it
        expected = type(e)
    assert redis_streams._native_xadd_commands is native_resp.xadd_commands  # the transport calls the kernel
    native = redis_streams._xadd_commands_native(messages, template, maxlen)
    if native is None:  # left to the reference: a refusal, a body that is not bytes, a number not an int64
        assert type(expected) is type or any(
            type(m.body) is not bytes
            or any(type(x) is float or not -(2**63) <= x < 2**63 for x in (m.schedule_time, m.dispatch_time, m.attempt))
            for m in messages)
    else:
        assert native == expected
    if type(expected) is bytes:  # and the transport's own call gives the same
        assert redis_streams.xadd_commands(messages, template, maxlen) == expected


# --- the Redis transport's reply scan ----------------------------------------------------------


bulk_reply = st.binary(max_size=20).map(lambda b: b"$%d\r\n%b\r\n" % (len(b), b))
#: Replies of other shapes, and malformed ones: an error, a nil, an integer, a simple string, a push,
#: an array, a length not a number, a string longer than its length, a length missing.
OTHER_REPLIES = (b"-ERR not now\r\n", b"-WRONGTYPE x\r\n", b"$-1\r\n", b":1\r\n", b"+OK\r\n",
                 b">2\r\n$7\r\nMOVING!\r\n:1\r\n", b"*1\r\n$1\r\na\r\n", b"$1x\r\n", b"$3\r\nabcd\r\n", b"$\r\n")


def _hiredis_replies(data: bytes) -> list | type:
    """The replies hiredis finds in `data`, or InvalidResponse."""
    reader = hiredis.Reader(protocolError=redis.InvalidResponse, replyError=redis.ResponseError)
    reader.feed(data)
    replies = []
    try:
        while (reply := reader.gets(False)) is not False:
            replies.append(reply)
    except redis.InvalidResponse:
        return redis.InvalidResponse
    return replies


@SETTINGS
@given(st.lists(bulk_reply | st.sampled_from(OTHER_REPLIES), max_size=6), st.integers(0, 200), st.integers(0, 8))
def test_the_reply_scan_passes_only_whole_bulk_strings_as_hiredis_parses_them(replies, cut, want):
    assert redis_streams._native_scan_bulk_replies is native_resp.scan_bulk_replies  # the transport calls the kernel
    data = b"".join(replies)[:cut]
    at, got, clean = native_resp.scan_bulk_replies(bytearray(data), 0, want)
    # What it passed over is its first `got` replies, each a bulk string as hiredis reads it.
    assert got <= want and data[:at] == b"".join(replies[:got])
    passed = _hiredis_replies(data[:at])
    assert len(passed) == got and all(type(x) is bytes for x in passed)
    if not clean:  # it stopped at the start of a reply of another shape, for hiredis to parse
        assert replies[got] in OTHER_REPLIES
    elif got < want:  # it stopped for want of bytes: hiredis finds no whole reply there either
        assert at == len(data) or _hiredis_replies(data[at:]) == []


def test_the_reply_scan_goes_on_from_where_it_stopped():
    """Fed as the bytes come: a scan from the position the last one reached finds the rest."""
    data = bytearray(b"$3\r\n1-1\r\n$3\r\n1-2\r\n$3\r\n1-3\r\n")
    assert native_resp.scan_bulk_replies(data[:12], 0, 3) == (9, 1, True)
    assert native_resp.scan_bulk_replies(data, 9, 2) == (27, 2, True)
    assert native_resp.scan_bulk_replies(data, 0, 2) == (18, 2, True)  # never past `want`


# --- index keys ---------------------------------------------------------------------------------


index_ids = st.lists(st.tuples(st.integers(0, 2**30) | st.just(2**70),
                               st.sampled_from([T.SCHEDULED, T.SCHEDULED_CANCEL, 3, 4, 2**70]),
                               st.integers(-(2**63), 2**63 - 1) | st.integers(0, 6 * SCALE) | st.just(-(2**70)),
                               st.binary(max_size=12) | st.binary(max_size=4).map(memoryview)), max_size=6)


@SETTINGS
@given(index_ids, st.integers(0, 2**39), st.integers(1, 2 * SCALE))
def test_the_index_keys_are_the_reference(ids, pos, scale):
    native = native_records.id_keys(ids, pos)
    expected = id_index._id_keys(ids, pos)
    big = any(abs(x) >= 2**64 for at, rtype, sched, _ in ids for x in (at, rtype, sched))
    if native is None:  # left to the reference: ids as the Python walk gives them (memoryviews), or odd
        assert big or any(type(mid) is not bytes for _, _, _, mid in ids)
    else:
        assert type(native) is array.array and native.typecode == "Q" and list(native) == expected
    native = native_records.time_keys(ids, pos, scale)
    if native is None:
        assert big
    else:
        assert type(native) is array.array and native.typecode == "Q"
        assert list(native) == time_index._time_keys(ids, pos, scale)


def test_the_indexes_take_the_walk_s_keys():
    """A replayed batch: the id and time indexes find each message by the keys the kernels made."""
    payloads = [r.encode_message_fields(f"m{i}", "s.x", b"x", SCALE + i * 7, {}, 1, 0) for i in range(50)]
    data = r.encode_epoch_record(1) + sequenced_frames([(T.MESSAGE, x) for x in payloads], 1)
    per_bucket, ids = native_records.walk(data, 0, len(data), 0, SCALE, lambda b: 512, r.schedule_change_sequence, 0)[:2]
    keys = native_records.id_keys(ids[SCALE], 512)
    assert list(keys) == [id_index.key_hash(SCALE + i * 7, f"m{i}".encode()) << id_index.OFFSET_BITS | (512 + at)
                    for i, (at, _, _, _) in enumerate(ids[SCALE])]
    assert list(native_records.time_keys(ids[SCALE], 512, SCALE)) == [
        time_index.time_key(SCALE + i * 7, SCALE, 512 + at) for i, (at, _, _, _) in enumerate(ids[SCALE])]


# --- the dedupe table ---------------------------------------------------------------------------


class Colliding(str):
    """An id whose hash is one of six: a few of them fill one run of the map's slots, wrapping
    past its end over the home slot of others (hash 0), so that removals must close up runs the
    way probes read them; a negative hash ("y...") lands in another of the map's shards."""

    def __hash__(self):
        return 6 if self.startswith("z") else -2 if self.startswith("y") else 0 if self.startswith("a") \
            else len(self) % 3 + 5


map_ops = st.lists(st.tuples(st.sampled_from(["set", "del", "pop", "get", "remove_if"]),
                             st.sampled_from([f"k{i}" for i in range(40)] + ["zz", "zzz", "yy", "yyy", "ab", "abc", "abcd", "\u00e9"]),
                             st.one_of(st.integers(0, 3), st.integers(0, 2**62))), max_size=200)


@SETTINGS
@given(map_ops, st.booleans())
def test_the_id_map_answers_as_a_dict(ops, colliding):
    """Every answer of the compiled map equals a dict's, after every step; keys that share hashes
    (`Colliding`) and runs that wrap past the last slot included."""
    m, d = native_idmap.IdMap(), {}
    for op, key, value in ops:
        key = Colliding(key) if colliding else key
        if op == "set":
            m[key] = value
            d[key] = value
        elif op == "del":
            if key in d:
                del m[key]
                del d[key]
            else:
                with pytest.raises(KeyError):
                    del m[key]
        elif op == "pop":
            assert m.pop(key, None) == d.pop(key, None)
        elif op == "remove_if":
            removed = d.get(key) == value % 4
            assert m.remove_if(key, value % 4) == removed
            if removed:
                del d[key]
        assert m.get(key) == d.get(key) and (key in m) == (key in d) and len(m) == len(d)
        assert sorted(m.items()) == sorted(d.items())
        for k in d:  # every key still reachable from its home slot
            assert m[k] == d[k]


def test_the_id_map_closes_up_a_run_that_wraps_past_its_last_slot():
    m = native_idmap.IdMap()  # 8 slots: "zz" and "zzz" at 6 and 7, "ab" and "abc" (home 0) at 0 and 1
    keys = [Colliding(k) for k in ("zz", "zzz", "ab", "abc")]
    for i, key in enumerate(keys):
        m[key] = i
    del m[keys[0]]  # "zzz" moves back to 6; "ab", "abc" stay at their home and after it
    assert [m.get(k) for k in keys] == [None, 1, 2, 3]
    del m[keys[1]]
    assert [m.get(k) for k in keys] == [None, None, 2, 3] and len(m) == 2


def test_the_id_map_holds_a_reference_to_each_key_until_it_lets_go():
    key = "".join(["order-", "000001"])  # (a string of its own)
    before = sys.getrefcount(key)
    m = native_idmap.IdMap()
    m[key] = 1
    m[key] = 2  # (the same key again: no second reference)
    assert sys.getrefcount(key) == before + 1
    del m[key]
    assert sys.getrefcount(key) == before
    m.update({key: 3})
    del m
    assert sys.getrefcount(key) == before


def test_the_id_map_refuses_what_is_not_an_id_or_a_position():
    m = native_idmap.IdMap()
    with pytest.raises(TypeError):
        m[b"bytes"] = 1
    with pytest.raises(ValueError):
        m["a"] = -1
    with pytest.raises(OverflowError):
        m["a"] = 2**63
    assert len(m) == 0 and m.get(b"bytes") is None and None not in m and m.pop(7, "none") == "none"
    assert m.remove_if(None, 0) is False


def test_the_id_map_grows_a_shard_at_a_time():
    # One array for every id held the event loop for about 90 ms when it doubled at a million ids
    # (`ops/bench dedupe`'s slowest request): a put now moves the slots of one shard of 256.
    m = native_idmap.IdMap()
    m.update((f"m{i}", i) for i in range(200_000))
    assert len(m) == 200_000 and all(m[f"m{i}"] == i for i in range(0, 200_000, 997))
    assert 0 < m.largest_grow <= 200_000 // 64  # (one array: 131,072 slots moved in one put)


def test_the_id_map_grows_and_stays_at_most_half_full():
    m = native_idmap.IdMap()
    small = sys.getsizeof(m)
    m.update((f"m{i}", i) for i in range(100_000))
    assert len(m) == 100_000 and all(m[f"m{i}"] == i for i in range(0, 100_000, 997))
    assert sys.getsizeof(m) - small >= 2 * 100_000 * 24  # slots of 24 bytes, half of them empty at most
    for i in range(0, 100_000, 2):
        del m[f"m{i}"]
    assert len(m) == 50_000 and "m0" not in m and m["m99999"] == 99_999


def test_the_dedupe_table_keeps_its_ids_in_the_compiled_map(tmp_path):
    table = dedupe.DedupeTable(WINDOW)
    assert type(table._positions) is native_idmap.IdMap and table.screen() == (table._positions, None)
    table.remember_many([("a", 5), ("\u00e9", 6)], 0)
    path = tmp_path / "dedupe.bin"
    table.save_to(path, 0)
    again = dedupe.DedupeTable(WINDOW)
    again.load(path)  # ids not all ASCII are read back as strings, into a map of their own
    assert type(again._positions) is native_idmap.IdMap and dict(again._positions) == {"a": 0, "\u00e9": 1}


WINDOW = 1000


def columns(table):
    saved = None if table._saved is None else table._saved.current.tolist()
    return (dict(table._positions.items()), list(table._keys), list(table._stores), list(table._scheds),
            list(table._hashes), list(table._updates), table.changes, table._base, table._head, saved, len(table))


@st.composite
def dedupe_steps(draw):
    """Requests' ids (from a small pool, so that ids come again within and after the window) with
    their acceptance times, and expiries between them."""
    steps, now = [], 0
    for _ in range(draw(st.integers(1, 12))):
        now += draw(st.sampled_from([0, 1, 10, WINDOW - 1, WINDOW, 3 * WINDOW]))
        if draw(st.integers(0, 4)) == 0:
            steps.append(("expire", now))
        else:
            ids = draw(st.lists(st.sampled_from(["a", "b", "c", "d", "\u00e9", "a\x00redriven"]), max_size=6))
            steps.append(("remember", [(i, now + draw(st.integers(0, 5))) for i in ids], now))
    return steps


def replay_steps(table, steps, native: bool):
    for step in steps:
        if step[0] == "expire":
            table.expire(step[1])
        elif native:
            table.remember_many(step[1], step[2])
        else:
            table._remember_many_py(step[1], step[2])


@SETTINGS
@given(dedupe_steps(), dedupe_steps())
def test_the_dedupe_bookkeeping_is_the_reference(tmp_path_factory, before, after):
    assert dedupe._native_remember_many is native_dedupe.remember_many
    tables = [dedupe.DedupeTable(WINDOW), dedupe.DedupeTable(WINDOW)]
    for table, native in zip(tables, (True, False)):
        replay_steps(table, before, native)
    assert columns(tables[0]) == columns(tables[1])
    # Then as a node restarted on what it saved: the ids read back are looked for among the saved.
    path = tmp_path_factory.mktemp("dedupe") / "dedupe.bin"
    tables[1].save_to(path, 0)
    restarted = [dedupe.DedupeTable(WINDOW), dedupe.DedupeTable(WINDOW)]
    for table, native in zip(restarted, (True, False)):
        table.load(path)
        replay_steps(table, after, native)
    assert columns(restarted[0]) == columns(restarted[1])
    now = max([s[-1] for s in after], default=0)
    for key in ("a", "b", "c", "d", "\u00e9", "a\x00redriven"):
        assert restarted[0].find(key, now) == restarted[1].find(key, now)


# --- the SEND request encoder (the producer's side) ---------------------------------------------

odd_items = st.builds(p.SendItem, any_text, any_text,
                      st.builds(TimeSpec, st.sampled_from(TimeKind) | st.integers(0, 5),
                                values | st.just(1.5) | st.just(True)),
                      st.binary(max_size=20) | st.just(bytearray(b"ab")),
                      st.dictionaries(any_text, any_text, max_size=3) | st.just({"k": 1}))


@SETTINGS
@given(st.lists(send_items, max_size=6) | st.lists(odd_items, max_size=4)
       | st.lists(st.tuples(st.just("a"), st.just("s"), st.just(TimeSpec.delay(1)), st.just(b""), st.just({})),
                  max_size=2))
def test_the_send_request_encoder_is_the_reference(items):
    native, reference_ = native_send.encode_items(items, p.SendItem, TimeKind), p._encode_send_request_py(items)
    if native is None:  # left to the reference: what it refuses too, or items of another type
        assert reference_ is None or any(type(x) is not p.SendItem for x in items)
    else:
        assert native == reference_


# --- a producer's batch of messages into its requests, in one pass ---------------------------------

plain_messages = st.builds(
    client.Message, st.sampled_from(["s.x", "s.\u00e9"]), st.binary(max_size=40),
    deliver_at=st.none() | st.integers(-(2**63), 2**63 - 1), message_id=st.none() | st.just("") | st.text(max_size=6),
    headers=st.dictionaries(st.sampled_from(["k1", "k2"]), st.text(max_size=4), max_size=2))
odd_messages = st.builds(
    client.Message, any_text | st.just(b"s"), st.binary(max_size=40) | st.just(bytearray(b"ab")) | st.just("text"),
    deliver_at=st.none() | values | st.just(True) | st.just(1.5), delay=st.none() | values,
    delay_level=st.none() | st.integers(0, 20), message_id=st.none() | any_text | st.just(7) | st.just("i" * 70_000),
    headers=st.dictionaries(any_text, any_text, max_size=2) | st.just({"k": 1}))


def _checked_requests(messages, batch, max_frame, head):
    """What send_many's checked path makes of `messages` (ids made from `head` and a counter), or
    None when it refuses a message or a request before sending."""
    counter = itertools.count()
    with mock.patch.object(client, "new_message_id", lambda now_ms: f"{head}{next(counter) & 0xFFFFFF:06x}"), \
            mock.patch.object(p, "DEFAULT_MAX_FRAME_BYTES", max_frame):
        try:
            requests, out = client.AsyncProducer("127.0.0.1:1")._requests_checked(messages, batch)
        except Exception:  # ValueError for two times, a TypeError for an odd field: raised to the caller
            return None
    if any(r is not None for r in out) or any(not isinstance(payload, bytes) for payload, _, _, _ in requests):
        return None
    return requests


@SETTINGS
@given(st.lists(plain_messages, max_size=12) | st.lists(plain_messages | odd_messages, max_size=6),
       st.integers(1, 5), st.integers(40, 400))
def test_a_producer_s_requests_are_the_checked_path_s(messages, batch, max_frame):
    """The kernel's requests are those the checked path makes, cut at the same messages, or it
    leaves the batch to that path; it never leaves a batch of plain messages that fit."""
    head = "0" * 22
    native = native_send.encode_messages(messages, client.Message, lambda now_ms: head, itertools.count(),
                                         lambda: 0, batch, max_frame, message.MAX_BODY_BYTES, TimeKind.AT,
                                         TimeKind.DELAY)
    reference_ = _checked_requests(messages, batch, max_frame, head)
    if native is not None:
        assert native == reference_
    elif reference_ is not None:  # left to the checked path: only for what is not plain
        plain = [type(m.subject) is str and type(m.body) is bytes and m.delay_level is None
                 and (m.deliver_at is None or type(m.deliver_at) is int) and m.delay is None
                 and (m.message_id is None or type(m.message_id) is str) for m in messages]
        big = any(4 + len(payload) > max_frame for payload, _, n, _ in reference_ if n == 1)
        assert not all(plain) or big, "the kernel left plain messages to the checked path"


def test_a_producer_s_requests_keep_what_was_measured():
    """A header dict changed while ids are made (other Python runs then) does not change what is
    written: each message's fields are taken once, before any byte is written."""
    headers = {"k": "v"}
    messages = [client.Message("s", b"b", message_id="given", headers=headers), client.Message("s", b"b")]

    def head(now_ms):
        headers["k"] = "a much longer value than was measured"
        return "0" * 22

    (payload, first, count, _), = native_send.encode_messages(messages, client.Message, head, itertools.count(),
                                                          lambda: 0, 64, 1 << 20, message.MAX_BODY_BYTES,
                                                          TimeKind.AT, TimeKind.DELAY)
    items = p.decode_send_request(payload)
    assert (first, count) == (0, 2) and items[0].headers == {"k": "v"} and items[1].message_id == "0" * 22 + "000000"


def test_the_send_request_encoder_writes_the_headers_it_measured():
    """Headers that answer differently each time they are asked (an odd Mapping) are asked once:
    what is written is what was measured, as the reference writes it."""
    class Growing(Mapping):
        calls = 0

        def items(self):
            Growing.calls += 1
            return [("k", "v" * 100 * Growing.calls)]

        def __getitem__(self, key):
            return dict(self.items())[key]

        def __iter__(self):
            return iter(["k"])

        def __len__(self):
            return 1

    def item():
        return p.SendItem("id", "s.x", TimeSpec.delay(5), b"body", Growing())

    native = native_send.encode_items([item()], p.SendItem, TimeKind)
    Growing.calls = 0
    assert native == p._encode_send_request_py([item()]) and len(native) < 200


# --- the receiver's pass over a request ---------------------------------------------------------


NOW = 1_700_000_000_000


class OtherSend:
    """Another request's commit, as `committing` names it: `_Pending.when_of` tells its times."""

    def when_of(self, key) -> int:
        return NOW + 9


PENDING = OtherSend()

admit_items = st.builds(
    p.SendItem, st.sampled_from(["a", "b", "c", "d", "e", "f", "", "x" * 129, "\u00e9"]),
    st.sampled_from(["orders.timeout"] * 4 + ["orders.x", "bad subject", "s" * 300, ""]),
    st.builds(TimeSpec, st.just(TimeKind.DELAY), st.sampled_from([0, 5, 1000, 1000, -5]))
    # epoch times about the window `admitted` gives (NOW to NOW + 1000) and far outside it
    | st.builds(TimeSpec, st.just(TimeKind.AT), st.sampled_from([NOW - 1, NOW, NOW + 5, NOW + 1000, NOW + 1001, 5, -5])),
    st.binary(max_size=24), st.sampled_from([{}, {}, {}, {"k": "v"}, {"reconsume-times": "2"}, {"": "v"}]))


def schedule_time(spec, now):  # (an int is an epoch time, as Receiver.schedule_time takes one)
    kind, value = (TimeKind.AT, spec) if type(spec) is int else (spec.kind, spec.value)
    if value < 0:
        raise BadScheduleTime(f"schedule time {value} is outside the range")
    return now + value if kind == TimeKind.DELAY else NOW + value


def admitted(fn, rows, items, view, refused, table, committing, max_bytes):
    results, accepted, framed_, keys, twins, waits = fn(
        rows, items, view, NOW, refused, None if refused is None else "refused: reasons", table, committing,
        schedule_time, (NOW, NOW + 1000), max_bytes, receiver_module._admit_context())
    return results, accepted, bytes(framed_), keys, twins, waits


def restarted_table(path, saved: list[str], since: list[str], store_time: int) -> dedupe.DedupeTable:
    """A table read back from a file holding `saved` (accepted at `store_time`), then `since`
    accepted: as a node has it after a restart."""
    table = dedupe.DedupeTable(60_000)
    table.remember_many([(k, NOW + 7) for k in saved], store_time)
    table.save_to(path, 0)
    again = dedupe.DedupeTable(60_000)
    again.load(path)
    again.remember_many([(k, NOW + 8) for k in since], store_time)
    return again


@SETTINGS
@given(st.lists(admit_items, max_size=8), st.booleans(), st.sampled_from([None, None, None, ResultCode.READ_ONLY]),
       st.sampled_from([None, "fresh", "restarted"]), st.lists(st.sampled_from(["a", "b", "c\x002", "\u00e9"]), max_size=2),
       st.lists(st.sampled_from(["a", "b", "c"]), max_size=2), st.sampled_from([10, 1 << 20]),
       st.sampled_from([NOW - 10, NOW - 60_000]))
def test_the_receivers_pass_is_the_reference(tmp_path_factory, items, as_batch, refused, with_table, known,
                                             committing_ids, max_bytes, accepted_at):
    if as_batch:
        batch = p.decode_send_request(p.encode_send_request(items))
        if type(batch) is not p.SendBatch:
            return
        rows, view, items = batch.rows, memoryview(batch.buf), batch
    else:
        rows, view = [(i.message_id, i.subject, i.time, i.headers, -1, 0, 0, 0, 0) for i in items], None
    table = None
    if with_table == "fresh":
        table = dedupe.DedupeTable(60_000)
        table.remember_many([(k, NOW + 7) for k in known], accepted_at)
    elif with_table == "restarted":  # the ids read back at start are screened by their hashes' bits
        table = restarted_table(tmp_path_factory.mktemp("dedupe") / "dedupe.bin", known, known[1:], accepted_at)
    committing = {k: PENDING for k in committing_ids}
    checked = dict(r.CHECKED_SUBJECTS)  # the first run may add subjects: the second starts from the same
    expected = admitted(receiver_module._admit, rows, items, view, refused, table, committing, max_bytes)
    r.CHECKED_SUBJECTS.clear()
    r.CHECKED_SUBJECTS.update(checked)
    assert admitted(native_receive.admit, rows, items, view, refused, table, committing, max_bytes) == expected
    assert receiver_module._native_admit is native_receive.admit


def test_ids_a_restarted_table_does_not_hold_are_screened_without_a_lookup(tmp_path):
    """After a restart, the ids read back are no Python objects: a lookup among them is a Python
    call (`find`, `_saved_position`). The compiled passes test a bit of the saved hashes' bitmap
    first, and make that call only for the few new ids whose bit another id set (at most 1 in 8);
    every saved id still answers DUPLICATE, and is kept once."""
    saved = [f"order-{i:07d}" for i in range(10_000)]
    table = restarted_table(tmp_path / "dedupe.bin", saved, [], NOW - 10)
    calls = {"find": 0, "saved": 0}
    find, saved_position = table.find, table._saved_position

    def counted_find(key, now):
        calls["find"] += 1
        return find(key, now)

    def counted_saved_position(*args):
        calls["saved"] += 1
        return saved_position(*args)

    table.find, table._saved_position = counted_find, counted_saved_position
    ids = [f"order-{i:07d}" for i in range(10_000, 10_500)] + saved[:5]
    rows = [(i, "orders.timeout", NOW + 5, {}, -1, 0, 0, 0, 0) for i in ids]
    items = [p.SendItem(i, "orders.timeout", TimeSpec(TimeKind.AT, NOW + 5), b"", {}) for i in ids]
    results, accepted, _, keys, _, _ = admitted(native_receive.admit, rows, items, None, None, table, {}, 1 << 20)
    assert [x.code for x in results[500:]] == [ResultCode.DUPLICATE] * 5 and results[:500] == [None] * 500
    assert 5 <= calls["find"] <= 5 + 100  # (before: one call for each of the 505 ids)
    table.remember_accepted(keys, accepted, NOW)
    assert calls["saved"] <= 100 and len(table) == 10_500
    assert all(table.find(i, NOW) == NOW + 5 for i in ids[:500])


@SETTINGS
@given(st.lists(st.sampled_from(["a", "b", "c", "d", "e"]), min_size=1, max_size=6, unique=True),
       st.data())
def test_a_stored_requests_bookkeeping_is_the_reference(ids, data):
    """The three passes over a stored request's accepted messages: committing marked and unmarked
    (a key another request holds now is left to it) and the results."""
    n = len(ids)
    keys = list(ids)
    picked = data.draw(st.lists(st.sampled_from(range(n)), unique=True, max_size=n))
    accepted = [(i, NOW + 10 * i + data.draw(st.integers(0, 5))) for i in picked]
    mine, other = object(), object()
    taken_over = data.draw(st.lists(st.sampled_from(ids), unique=True, max_size=2))

    def run(mark, unmark, stored):
        committing = {"z": other}
        mark(committing, keys, accepted, mine)
        marked = dict(committing)
        for k in taken_over:  # another request of the same id took its key over meanwhile
            if k in committing:
                committing[k] = other
        unmark(committing, keys, accepted, mine)
        results = [None] * n
        stored(results, accepted, [(k, "s") for k in ids], p.SendResult, ResultCode.OK, "stored")
        return marked, committing, results

    expected = run(receiver_module._mark_committing, receiver_module._unmark_committing,
                   receiver_module._stored_results)
    got = run(native_receive.mark_committing, native_receive.unmark_committing, native_receive.stored_results)
    assert got == expected
    assert all(got[0][keys[i]] is mine for i, _ in accepted)  # the request itself: no tuple per message
    assert [type(x) for x in got[2]] == [type(x) for x in expected[2]]
    assert receiver_module.stored_results is native_receive.stored_results
    assert receiver_module.unmark_committing is native_receive.unmark_committing


@SETTINGS
@given(st.lists(st.sampled_from(["a", "b", "\u00e9", "c\x002", "order-1", "\U0001f600x"]), min_size=1, max_size=8,
                unique=True), st.data())
def test_a_stored_requests_ids_are_remembered_from_its_keys_and_accepted(tmp_path_factory, ids, data):
    """`remember_accepted(keys, accepted, t)` is `remember_many` of ``(keys[i], when)`` of each
    accepted message, compiled and in Python, column for column, on a fresh table and on one read
    back at start (some of the ids among those read back, within their window or past it)."""
    keys = list(ids)
    picked = data.draw(st.lists(st.sampled_from(range(len(keys))), unique=True, max_size=len(keys)))
    accepted = [(i, NOW + 10 * i) for i in picked]
    known = data.draw(st.lists(st.sampled_from(ids), unique=True, max_size=3))
    restarted = data.draw(st.booleans())
    stored_at = data.draw(st.sampled_from([NOW - 10, NOW - 60_000]))

    def table():
        if restarted:
            return restarted_table(tmp_path_factory.mktemp("dedupe") / "dedupe.bin", known, [], stored_at)
        t = dedupe.DedupeTable(60_000)
        t.remember_many([(k, NOW + 7) for k in known], stored_at)
        return t

    def columns(t):
        return (dict(t._positions.items()), list(t._keys), list(t._stores), list(t._scheds), list(t._hashes),
                list(t._updates), t.changes)

    reference, compiled = table(), table()
    reference._remember_many_py([(keys[i], when) for i, when in accepted], NOW)
    compiled.remember_accepted(keys, accepted, NOW)
    assert columns(compiled) == columns(reference)
    assert all(h == dedupe.key_hash(k.encode("utf-8"))  # (a key read back at start is no object: None)
               for k, h in zip(compiled._keys, compiled._hashes) if k is not None)


def test_the_saved_hash_of_each_remembered_id_is_taken_without_a_python_call(monkeypatch):
    """The compiled bookkeeping hashes each new id in C (libxxhash), as `key_hash` does: with the
    module's `key_hash` made to fail, a request's ids are still remembered, each with its hash."""
    ids = [f"order-{i:06d}" for i in range(200)] + ["\u00e9t\u00e9", "\U0001f600"]
    expected = [dedupe.key_hash(k.encode("utf-8")) for k in ids]

    def no_call(raw):
        raise AssertionError("key_hash called from Python")

    monkeypatch.setattr(dedupe, "key_hash", no_call)
    table = dedupe.DedupeTable(60_000)
    table.remember_accepted(ids, [(i, NOW + i) for i in range(len(ids))], NOW)
    table.remember_many([("one-more", NOW)], NOW)
    assert list(table._hashes) == expected + [xxhash.xxh3_64_intdigest(b"one-more") & 0xFFFFFFFF]
    assert [table.find(k, NOW) for k in ids] == [NOW + i for i in range(len(ids))]


# --- the timing wheel's adds in bulk ------------------------------------------------------------


WHEEL_START = 1_000_000


def wheel_state(w):
    return ([None if e is None else list(e) for e in w._slot_entries], list(w._heap), len(w), w._nonempty,
            w.next_due())


@st.composite
def wheel_steps(draw):
    """Adds in bulk (due times before, at and after now, over several rounds of a small wheel,
    ties, descending runs), advances (the clock stepping back too) and cancels."""
    steps, now, ref = [], WHEEL_START, 0
    for _ in range(draw(st.integers(1, 15))):
        what = draw(st.sampled_from(["add", "add", "add", "advance", "cancel"]))
        if what == "add":
            items = []
            for _ in range(draw(st.integers(0, 12))):
                ref += 1
                items.append((now + draw(st.integers(-30, 2000) | st.sampled_from([0, 1, 5, 5, 640, 1280])), ref))
            steps.append(("add", items, now))
        elif what == "advance":
            now += draw(st.integers(-200, 700))
            steps.append(("advance", now))
        else:
            steps.append(("cancel", draw(st.integers(1, max(ref, 1)))))
    return steps


@SETTINGS
@given(wheel_steps())
def test_the_wheel_adds_in_bulk_as_the_reference(steps):
    """Every entry taken (`min_offset` 0, the refs the offsets themselves)."""
    wheels = [TimingWheel(start_ms=WHEEL_START, tick_ms=10, slots=64) for _ in range(2)]
    for step in steps:
        if step[0] == "add":
            entries = [(ref, due) for due, ref in step[1]]
            refused = [native_wheel.add_entries(wheels[0], list(entries), 0, step[2], 0),
                       wheels[1]._add_entries_py(list(entries), 0, step[2], 0)]
            assert refused[0] == refused[1]
        elif step[0] == "advance":
            assert native_wheel.advance(wheels[0], step[1]) == wheels[1]._advance_py(step[1])
        else:
            assert wheels[0].cancel(step[1]) == wheels[1].cancel(step[1])
        assert wheel_state(wheels[0]) == wheel_state(wheels[1])


@SETTINGS
@given(wheel_steps(), st.data())
def test_the_wheel_adds_one_at_a_time_as_the_reference(steps, data):
    """`add` (a bucket loading adds its records so), refusals included: a ref outside
    0..MAX_REF, a due time past 64 bits (the wheel unchanged by either), one already due."""
    assert timingwheel._native_add is native_wheel.add
    wheels = [TimingWheel(start_ms=WHEEL_START, tick_ms=10, slots=64) for _ in range(2)]
    for step in steps:
        if step[0] == "add":
            for due, ref in step[1]:
                bad = data.draw(st.sampled_from([None] * 6 + ["ref", "due"]))
                if bad == "ref":
                    ref = data.draw(st.sampled_from([-1, 1 << 63]))
                elif bad == "due":
                    due = 1 << 64
                got = []
                for add in (functools.partial(native_wheel.add, wheels[0]), wheels[1]._add_py):
                    try:
                        got.append(add(due, ref, step[2]))
                    except (ValueError, OverflowError) as e:
                        got.append(type(e))
                assert got[0] == got[1] and (bad is None or due <= step[2] or got[0] in (ValueError, OverflowError))
                assert wheel_state(wheels[0]) == wheel_state(wheels[1])
        elif step[0] == "advance":
            assert native_wheel.advance(wheels[0], step[1]) == wheels[1]._advance_py(step[1])
        else:
            assert wheels[0].cancel(step[1]) == wheels[1].cancel(step[1])
        assert wheel_state(wheels[0]) == wheel_state(wheels[1])


@SETTINGS
@given(wheel_steps(), st.data())
def test_the_wheel_adds_a_buckets_replayed_records_as_the_reference(steps, data):
    """`add_entries`: (offset, due) entries of one bucket, its refs' base above the offsets, those
    before a pinned offset left out, against the reference on the same steps."""
    assert timingwheel._native_add_entries is native_wheel.add_entries
    wheels = [TimingWheel(start_ms=WHEEL_START, tick_ms=10, slots=64) for _ in range(2)]
    base = 3 << 40
    for step in steps:
        if step[0] == "add":
            entries = [(ref, due) for due, ref in step[1]]
            min_offset = data.draw(st.sampled_from([0, 0, *(ref for _, ref in step[1]), 10 ** 6]))
            got = [native_wheel.add_entries(wheels[0], list(entries), base, step[2], min_offset),
                   wheels[1]._add_entries_py(list(entries), base, step[2], min_offset)]
            assert got[0] == got[1]
        elif step[0] == "advance":
            assert native_wheel.advance(wheels[0], step[1]) == wheels[1]._advance_py(step[1])
        else:
            assert wheels[0].cancel(base | step[1]) == wheels[1].cancel(base | step[1])
        assert wheel_state(wheels[0]) == wheel_state(wheels[1])


def test_the_wheel_advances_to_a_time_past_64_bits_as_the_reference():
    """A `now` outside 64 bits (a due time cannot be): nothing (far back) or everything (far ahead)."""
    assert timingwheel._native_advance is native_wheel.advance
    wheels = [TimingWheel(start_ms=WHEEL_START, tick_ms=10, slots=64) for _ in range(2)]
    for w in wheels:
        w.add_entries([(ref, WHEEL_START + 7 * ref) for ref in range(1, 200)], 0, WHEEL_START)
    for now in (-(1 << 70), WHEEL_START + 333, 1 << 70):
        assert native_wheel.advance(wheels[0], now) == wheels[1]._advance_py(now)
        assert wheel_state(wheels[0]) == wheel_state(wheels[1])
    assert len(wheels[0]) == 0


def test_the_wheel_refuses_a_bad_ref_in_bulk_as_add_does():
    wheels = [TimingWheel(start_ms=WHEEL_START), TimingWheel(start_ms=WHEEL_START)]
    entries = [(1, WHEEL_START + 50), (-1, WHEEL_START + 60), (3, WHEEL_START + 70)]
    for fn, w in ((native_wheel.add_entries, wheels[0]), (TimingWheel._add_entries_py, wheels[1])):
        with pytest.raises(ValueError, match="ref must be"):
            fn(w, list(entries), 0, WHEEL_START, -5)
    assert wheel_state(wheels[0]) == wheel_state(wheels[1]) and len(wheels[0]) == 1
    wheels = [TimingWheel(start_ms=WHEEL_START), TimingWheel(start_ms=WHEEL_START)]
    entries = [(1, WHEEL_START + 50), (2, WHEEL_START + 60)]
    for fn, w in ((native_wheel.add_entries, wheels[0]), (TimingWheel._add_entries_py, wheels[1])):
        with pytest.raises(ValueError, match="ref must be"):
            fn(w, list(entries), 1 << 63, WHEEL_START, 0)
    assert wheel_state(wheels[0]) == wheel_state(wheels[1]) and len(wheels[0]) == 0


# --- due messages taken and sent -----------------------------------------------------------------

DUE_FIELDS = ("ref", "bucket", "schedule_offset", "message", "generation", "attempt", "tried", "group", "suspect",
              "message_log_offset")


def due_fields(d) -> tuple:
    return tuple(getattr(d, name) for name in DUE_FIELDS)


def test_the_compiled_due_is_the_reference_s_fields_defaults_and_identity():
    from delayserver.wheel import due_queue

    assert due_queue.Due is native_wheel.Due and due_queue._native_dues_of is native_wheel.dues_of
    assert tuple(f.name for f in attrs.fields(due_queue.DueReference)) == DUE_FIELDS
    m = r.Message("id-1", "orders", b"body", 1_000, {"k": "v"}, 900, 7, 0)
    for args, kw in (((1, 2, 3, m), {}), ((1, 2, 3, None, 4), dict(attempt=2, tried=("a",), suspect=True)),
                     ((5, 6, 7, m), dict(message_log_offset=8, group="g"))):
        native, reference = native_wheel.Due(*args, **kw), due_queue.DueReference(*args, **kw)
        assert due_fields(native) == due_fields(reference)
        assert repr(native) == repr(reference).replace("DueReference(", "Due(", 1)
        assert native != native_wheel.Due(*args, **kw) and native == native  # identity, as eq=False
    d = native_wheel.Due(1, 2, 3, m)
    d.attempt, d.group, d.message = 3, "g", None  # the sender sets them as it goes
    assert (d.attempt, d.group, d.message) == (3, "g", None)
    with pytest.raises(AttributeError):
        d.other = 1  # slotted, as the reference
    assert weakref.ref(d)() is d
    with pytest.raises(TypeError):
        native_wheel.Due(1, 2, 3)


@given(st.lists(st.one_of(st.none(), st.tuples(st.integers(0, 2**40), st.integers(0, 2**40), st.integers(-1, 2**40))),
                max_size=40), st.integers(0, 5))
def test_dues_are_made_from_reads_as_the_reference_makes_them(reads, generation):
    from delayserver.wheel import due_queue

    m = r.Message("id", "s", b"", 1, {}, 1, 1, 0)
    reads = [None if x is None else (x[0], x[1], x[2], m) for x in reads]
    refs = list(range(100, 100 + len(reads)))
    made = native_wheel.dues_of(refs, reads, generation)
    expected = [due_queue.DueReference(ref, read[0], read[1], read[3], generation, message_log_offset=read[2])
                for ref, read in zip(refs, reads) if read is not None]
    assert all(type(d) is native_wheel.Due for d in made)
    assert [due_fields(d) for d in made] == [due_fields(d) for d in expected]
    with pytest.raises(ValueError):
        native_wheel.dues_of(refs + [1], reads, generation)


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 10**6)), max_size=40),
       st.integers(0, 2), st.integers(-10**6, 10**13))
def test_a_settled_batch_is_passed_over_as_the_sender_s_reference_does(dues, generation, now):
    """`settled` (the sender's one pass over a batch whose dispatch records are durable): the
    lateness of each, the refs of the current generation, the dues of the sending group freed and
    counted, those of another group left to the caller, as `_settled_py` does them."""
    from delayserver.sender import sender as sender_module

    assert sender_module._native_settled is native_wheel.settled
    sending, other = object(), object()
    groups = (sending, other, None)

    def batch():
        return [native_wheel.Due(k, 1, k, r.Message(f"id-{k}", "s", b"", at, {}, 0, 0, 0), gen, group=groups[g])
                for k, (gen, g, at) in enumerate(dues)]

    native, reference = batch(), batch()
    got = native_wheel.settled(native, now, sending, generation)
    expected = sender_module._settled_py(reference, now, sending, generation)
    assert got[:3] == expected[:3]
    assert [d.ref for d in got[3]] == [d.ref for d in expected[3]] and all(d.group is other for d in got[3])
    assert [d.group for d in native] == [d.group for d in reference]
    assert got[2] == sum(g == 0 for _, g, _ in dues) and got[1] == [k for k, (gen, _, _) in enumerate(dues) if gen == generation]
    # What it leaves to the reference, touching nothing: a due of another class, one without its message.
    for odd in ([*batch(), object()], [*batch(), native_wheel.Due(0, 1, 0, None, generation, group=sending)]):
        assert native_wheel.settled(odd, now, sending, generation) is None
        assert [d.group for d in odd[:-1]] == [groups[g] for _, g, _ in dues]


def test_outbound_messages_are_made_as_the_sender_s_reference_makes_them():
    messages = [r.Message(f"id-{k}", f"s{k % 3}", bytes([k]) * k, 1_000 + k, {"h": str(k)} if k % 2 else {}, 900, k, 0)
                for k in range(20)]
    batch = [native_wheel.Due(k, 1, k * 10, m, attempt=1 + k % 4) for k, m in enumerate(messages)]
    made = native_wheel.outbound_of(batch, 5_000, OutboundMessage, r.Message)
    expected = [OutboundMessage(m.message_id, m.subject, m.body, m.headers, m.schedule_time, 5_000, d.attempt)
                for d, m in zip(batch, messages)]
    assert made == expected and all(type(o) is OutboundMessage for o in made)
    assert made[3].headers is messages[3].headers and made[3].body is messages[3].body
    # What it leaves to the caller: a due of another class, a message of another shape, other types.
    assert native_wheel.outbound_of(batch + [object()], 1, OutboundMessage, r.Message) is None
    assert native_wheel.outbound_of([native_wheel.Due(1, 1, 1, None)], 1, OutboundMessage, r.Message) is None
    assert native_wheel.outbound_of(batch, 1, tuple, r.Message) is None
    assert native_wheel.outbound_of(batch, 1, OutboundMessage, OutboundMessage) is None
    assert native_wheel.outbound_of([], 1, OutboundMessage, r.Message) == []


def test_the_messages_and_outbound_tuples_made_are_out_of_the_collector_s_generations(tmp_path):
    """A decoded message, its read and its outbound tuple hold strings, bytes, ints and a dict of
    strings only: made untracked, not walked by every collection until their delivery is durable.
    One whose headers dict the collector tracks (a value that is a container) stays tracked."""
    import gc

    payload = r.encode_scheduled(77, r.encode_message(r.Message("id-1", "s.a", b"body", 1_000, {"k": "v"}, 900, 3, 0)))
    record = r.encode_record(T.SCHEDULED, payload)
    mlo, decoded = native_records.decode_scheduled(payload, 0, len(payload), r.Message)
    assert (mlo, decoded) == r._decode_scheduled_py(payload, 0, len(payload))
    assert type(decoded) is r.Message and not gc.is_tracked(decoded)
    (tmp_path / "segment").write_bytes(record)
    fd = os.open(tmp_path / "segment", os.O_RDONLY)
    try:
        [read] = native_records.read_scheduled(fd, len(record), [0], 512, 5, r.Message, [record])
        [read_from_file] = native_records.read_scheduled(fd, len(record), [0], 512, 5, r.Message)
    finally:
        os.close(fd)
    for got in (read, read_from_file):
        assert got == (5, 0, 77, decoded) and not gc.is_tracked(got) and not gc.is_tracked(got[3])
    [out] = native_wheel.outbound_of([native_wheel.Due(1, 5, 0, decoded)], 9, OutboundMessage, r.Message)
    assert out == OutboundMessage("id-1", "s.a", b"body", {"k": "v"}, 1_000, 9, 1) and not gc.is_tracked(out)
    holding = r.Message("id-2", "s.a", b"", 1_000, {"k": ["a container"]})
    [kept] = native_wheel.outbound_of([native_wheel.Due(1, 5, 0, holding)], 9, OutboundMessage, r.Message)
    assert gc.is_tracked(holding.headers) and gc.is_tracked(kept)


# --- reading due messages ------------------------------------------------------------------------

@st.composite
def schedule_segments(draw):
    """(segment bytes, record starts, big) of SCHEDULED records (a SCHEDULED_CANCEL now and
    then), some damaged: a byte changed, an id or subject that is not UTF-8, headers that do not
    decode."""
    parts, starts, pos = [], [], 0
    for _ in range(draw(st.integers(0, 12))):
        if draw(st.integers(0, 5)) == 0:
            rec = r.encode_record(T.SCHEDULED_CANCEL, r.OFFSET.pack(draw(st.integers(0, 2**64 - 1)))
                                  + r.encode_cancel(r.Cancel(draw(ids), draw(st.integers(0, 2**40)))))
        else:
            body = draw(st.binary(max_size=64) | st.binary(min_size=4000, max_size=9000))
            headers = draw(st.dictionaries(st.text(min_size=1, max_size=4), st.text(max_size=4), max_size=3))
            payload = r.encode_message_fields(draw(ids), draw(st.sampled_from(["s.a", "s|b:%", "x" * 200])), body,
                                              0, headers, draw(st.integers(-(2**63), 2**63 - 1)), 0,
                                              draw(st.integers(0, 0xFFFF)))
            payload = stamped(payload, draw(times), draw(st.integers(0, 2**64 - 1)))
            payload = r.encode_scheduled(draw(st.integers(0, 2**64 - 1)), payload)
            rec = bytearray(r.encode_record(T.SCHEDULED, payload))
            damage = draw(st.sampled_from(["none"] * 6 + ["byte", "id", "headers"]))
            if damage == "byte":
                at = draw(st.integers(0, len(rec) - 1))
                rec[at] ^= draw(st.integers(1, 255))
            elif damage in ("id", "headers"):
                at = r.HEADER_SIZE + r.SCHEDULED_HEAD.size
                if damage == "headers":
                    at += rec[r.HEADER_SIZE + 42] + rec[r.HEADER_SIZE + 43]
                if at < len(rec):
                    rec[at] = 0xFF  # not UTF-8; or a headers block whose first key length is wrong
                    rec[:4] = r.checksum(T.SCHEDULED, bytes(rec[r.HEADER_SIZE:])).to_bytes(4, "big")
            rec = bytes(rec)
        parts.append(rec)
        starts.append(pos)
        pos += len(rec)
    tail = draw(st.binary(max_size=20))  # a torn tail now and then
    return b"".join(parts) + tail, starts


def decoded(fn, buf, start, end):
    """What `fn` (a decoder of SCHEDULED payloads) gives for ``buf[start:end]``, or the kind of
    error it raised."""
    try:
        return fn(buf, start, end)
    except r.RecordError:
        return r.RecordError


@SETTINGS
@given(schedule_segments(), st.data())
def test_a_scheduled_payload_is_decoded_as_the_reference_decodes_it(segment, data):
    """Every record's payload of a segment (damaged ones among them, and spans cut short or run
    long): the kernel's message where it decodes one, None only where the reference raises; and
    the public decoder answers as the reference, from bytes or a bytearray."""
    body, starts = segment
    for start in starts:
        _, length, _ = r.HEADER.unpack_from(body, start)
        s = start + r.HEADER_SIZE
        e = data.draw(st.sampled_from([s + length] * 4 + [s + length - 1, s + length + 1, s, s + 43]))
        e = min(e, len(body))
        buf = data.draw(st.sampled_from([body, bytearray(body)]))
        native = native_records.decode_scheduled(buf, s, e, r.Message)
        expected = decoded(r._decode_scheduled_py, buf, s, e)
        if native is None:
            assert expected is r.RecordError
        else:
            assert native == expected and type(native[1]) is r.Message
        assert decoded(r.decode_scheduled, buf, s, e) == expected
    # What it leaves to the reference: other buffers, spans outside the buffer.
    payload = r.encode_scheduled(5, r.encode_message_fields("m", "s.a", b"b", 0, {}, 1, 0))
    assert native_records.decode_scheduled(memoryview(payload), 0, len(payload), r.Message) is None
    assert native_records.decode_scheduled(payload, 0, len(payload) + 1, r.Message) is None
    assert native_records.decode_scheduled(payload, -1, len(payload), r.Message) is None
    assert r.decode_scheduled(memoryview(payload)) == r.decode_scheduled(payload) == (5, r.decode_message(payload, 8))


def reference_reads(data: bytes, offsets: list[int], guess: int, bucket: int) -> list:
    """Per offset what TickManager.read_messages gives from the page cache: its tuple, None, the
    CorruptSegment, or ("raises", text) for an error it raises."""
    from delayserver.storage.bucket_log import _records_at
    from delayserver.wheel.tick_manager import _message_of

    def read(_bucket, start, end):
        return data[start:min(end, len(data))] if min(end, len(data)) > start else b""
    out = []
    for offset, record in zip(offsets, _records_at(read, lambda _: "seg", bucket, offsets, guess)):
        try:
            out.append(_message_of(bucket, offset, record))
        except Exception as e:
            out.append(("raises", str(e)))
    return out


@SETTINGS
@given(schedule_segments(), st.data(), st.sampled_from([9, 16, 100, 512, 4096]))
def test_due_messages_are_read_as_the_reference_reads_them(tmp_path_factory, segment, data, guess):
    body, starts = segment
    offsets = data.draw(st.lists(st.sampled_from(starts), max_size=16) if starts else st.just([]))
    offsets += data.draw(st.lists(st.integers(0, len(body) + 50), max_size=3))
    if starts:  # beside a record: a run's read shares it with records read on their own
        offsets += data.draw(st.lists(st.builds(lambda s, d: max(0, s + d), st.sampled_from(starts),
                                                st.integers(-12, 12)), max_size=4))
    if offsets:  # the same record asked for twice
        offsets += data.draw(st.lists(st.sampled_from(offsets), max_size=3))
    offsets = data.draw(st.permutations(offsets))
    path = tmp_path_factory.mktemp("seg") / "bucket.log"
    path.write_bytes(body)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = native_records.read_scheduled(fd, len(body), offsets, guess, 7, r.Message)
    finally:
        os.close(fd)
    assert got is not None, "the kernel left the whole read to the reference (no RWF_NOWAIT here?)"
    expected = reference_reads(body, offsets, guess, 7)
    for offset, mine, theirs in zip(offsets, got, expected):
        if mine is False:  # left to the reference: only what it reports as damage or raises
            assert isinstance(theirs, CorruptSegment) or (isinstance(theirs, tuple) and theirs[0] == "raises"), offset
        else:
            assert mine == theirs, offset
            assert mine is None or type(mine[3]) is r.Message


def test_due_messages_the_kernel_reads_are_all_the_good_ones():
    """Undamaged records are the kernel's own (a kernel that left everything to the reference
    would pass the property above)."""
    messages = [r.encode_record(T.SCHEDULED, r.encode_scheduled(
        i, r.encode_message_fields(f"m-{i}", "s.a", bytes(i * 300), 1000 + i, {"k": str(i)} if i % 2 else {}, 5)))
        for i in range(40)]
    body = b"".join(messages)
    starts = [sum(map(len, messages[:i])) for i in range(40)]
    offsets = starts[::-1] + starts[:5]
    import tempfile
    with tempfile.NamedTemporaryFile() as f:
        f.write(body)
        f.flush()
        got = native_records.read_scheduled(f.fileno(), len(body), offsets, 4096, 3, r.Message)
    assert [(b, o, mlo, m.message_id, len(m.body), m.headers) for b, o, mlo, m in got] == [
        (3, o, starts.index(o), f"m-{starts.index(o)}", starts.index(o) * 300,
         {"k": str(starts.index(o))} if starts.index(o) % 2 else {}) for o in offsets]


def test_due_messages_of_one_subject_share_its_string():
    """A due message whose subject is the one before's carries that very string (none made per
    message, its hash kept for routing and encoding); another subject, or one that differs in its
    last byte or its length, is a string of its own, equal to what the reference decodes."""
    subjects = ["s.a", "s.a", "s.a", "s.b", "s.b", "s.a", "s.ab", "s.c", "s.c", "s.a"]
    messages = [r.encode_record(T.SCHEDULED, r.encode_scheduled(
        i, r.encode_message_fields(f"m-{i}", subject, b"x", 1000 + i, {}, 5))) for i, subject in enumerate(subjects)]
    body = b"".join(messages)
    offsets = [sum(map(len, messages[:i])) for i in range(len(messages))]
    import tempfile
    with tempfile.NamedTemporaryFile() as f:
        f.write(body)
        f.flush()
        got = native_records.read_scheduled(f.fileno(), len(body), offsets, 4096, 3, r.Message)
        ahead = native_records.read_scheduled(f.fileno(), len(body), offsets, 4096, 3, r.Message,
                                              [body[o:o + len(m)] for o, m in zip(offsets, messages)])
    for reads in (got, ahead):
        decoded = [m.subject for _, _, _, m in reads]
        assert decoded == subjects
        assert [a is b for a, b in zip(decoded, decoded[1:])] == [a == b for a, b in zip(subjects, subjects[1:])]
    assert got[-1][3].subject is ahead[0][3].subject  # and from one call to the next


def written(tmp_path_factory, body: bytes) -> int:
    """A read-only descriptor of a file holding `body` (closed by the caller)."""
    path = tmp_path_factory.mktemp("seg") / "bucket.log"
    path.write_bytes(body)
    return os.open(path, os.O_RDONLY)


@SETTINGS
@given(schedule_segments(), st.data(), st.sampled_from([9, 16, 100, 512]), st.sampled_from([9, 100, 600, 65536]),
       st.sampled_from([None, 0, 50, 700, 1 << 20]), st.sampled_from([None, 0, 1, 4096, 1 << 20]))
def test_the_read_ahead_is_the_reference(tmp_path_factory, segment, data, first_read, max_record, gap, mapped):
    # `gap`: how far apart records may lie to share a read (None: the kernel's own). What is read
    # is the same whatever it is: only how many reads it takes changes. `mapped`: copied from a
    # mapping of the file that many bytes past its end (None: read), as the read-ahead's worker does.
    body, starts = segment
    offsets = data.draw(st.lists(st.sampled_from(starts), max_size=16) if starts else st.just([]))
    offsets += data.draw(st.lists(st.integers(0, len(body) + 50), max_size=3))
    offsets = data.draw(st.permutations(offsets))
    # A segment shorter than its file, or longer (the file cut since its size was taken).
    size = data.draw(st.sampled_from([len(body), max(0, len(body) - 30), len(body) + 40]))
    fd = written(tmp_path_factory, body)
    try:
        segment_map = None if mapped is None else native_records.SegmentMap(fd, len(body) + mapped or 1)
        got = native_records.read_ahead(fd, size, offsets, first_read, max_record,
                                        *(() if gap is None else (gap,)), mapped=segment_map)
        expected = read_ahead._read_ahead_py(fd, size, offsets, first_read, max_record)
        assert native_records.read_ahead(fd, size, offsets, first_read, max_record, -1) is None
    finally:
        os.close(fd)
    assert got == expected
    assert set(got) <= set(offsets)
    for offset, raw in got.items():  # what it holds is the record, as the file holds it
        assert raw == body[offset:offset + len(raw)]
        assert len(raw) == r.HEADER_SIZE + int.from_bytes(raw[4:8], "big") <= max_record
    if starts and max_record == 65536:  # every record that fits is read
        for offset in offsets:
            if offset in starts and offset + r.HEADER_SIZE <= size:
                length = r.HEADER_SIZE + int.from_bytes(body[offset + 4:offset + 8], "big")
                assert (offset in got) == (offset + length <= size and length <= max_record), offset


@SETTINGS
@given(schedule_segments(), st.data())
def test_due_messages_read_ahead_are_decoded_as_the_file_is_read(tmp_path_factory, segment, data):
    """`read_scheduled` given what `read_ahead` read (or garbage in its place) answers what it
    answers reading the file; and it decodes what was read ahead without reading the file."""
    body, starts = segment
    offsets = data.draw(st.lists(st.sampled_from(starts), max_size=16) if starts else st.just([]))
    offsets += data.draw(st.lists(st.integers(0, len(body) + 50), max_size=3))
    offsets = data.draw(st.permutations(offsets))
    fd = written(tmp_path_factory, body)
    empty = written(tmp_path_factory, b"")
    try:
        held = native_records.read_ahead(fd, len(body), offsets, 512, 65536)
        ahead = [held.get(offset) for offset in offsets]
        # Garbage in places: a byte changed, bytes cut short, not bytes.
        mixed = [data.draw(st.sampled_from(["as read", "byte", "short", "not bytes"])) for _ in offsets]
        for k, how in enumerate(mixed):
            raw = ahead[k]
            if raw is None or how == "as read":
                continue
            if how == "byte":
                at = data.draw(st.integers(0, len(raw) - 1))
                ahead[k] = raw[:at] + bytes([raw[at] ^ 0x5A]) + raw[at + 1:]
            elif how == "short":
                ahead[k] = raw[:-1]
            else:
                ahead[k] = bytearray(raw)
        from_file = native_records.read_scheduled(fd, len(body), offsets, 4096, 7, r.Message)
        with_ahead = native_records.read_scheduled(fd, len(body), offsets, 4096, 7, r.Message, ahead)
        from_memory = native_records.read_scheduled(empty, len(body), offsets, 4096, 7, r.Message, ahead)
    finally:
        os.close(fd)
        os.close(empty)
    for k, offset in enumerate(offsets):
        assert with_ahead[k] == from_file[k], offset
    sound = [k for k, raw in enumerate(ahead) if type(raw) is bytes and mixed[k] == "as read"
             and from_file[k] not in (None, False)]
    for k in sound:  # decoded from memory: the other descriptor has nothing to read
        assert from_memory[k] == from_file[k], offsets[k]
    assert len(native_records.read_scheduled(empty, 0, [], 4096, 7, r.Message, [])) == 0
    assert native_records.read_scheduled(fd, len(body), offsets, 4096, 7, r.Message,
                                         ahead + [None]) is None  # not one per offset: left to the reference


# --- the read-ahead's keeping and taking --------------------------------------------------------

ahead_steps = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, 2), st.dictionaries(st.integers(0, 30), st.binary(min_size=1, max_size=9),
                                                                 max_size=8), st.booleans()),
    st.tuples(st.just("take"), st.integers(0, 2), st.lists(st.integers(0, 30), max_size=8), st.booleans()),
    st.tuples(st.just("truncated"), st.integers(0, 2), st.none(), st.booleans()),
), max_size=30)


def read_ahead_state(ra) -> tuple:
    return ({b: sorted(held.items()) for b, held in ra.records.items()}, ra.held_bytes, ra.hits, ra.epoch)


held_steps = st.lists(st.one_of(
    st.tuples(st.just("set"), st.sampled_from([0, 1, 300, 600, 2**40, 2**63 - 1]) | st.integers(0, 5000),
              st.binary(max_size=8)),
    st.tuples(st.just("put"), st.dictionaries(st.integers(0, 5000), st.binary(max_size=8), max_size=40),
              st.integers(0, 200)),
    st.tuples(st.just("take"), st.lists(st.integers(-3, 5000) | st.sampled_from([2**64, "1"]), max_size=40),
              st.none()),
), max_size=60)


@SETTINGS
@given(held_steps)
def test_held_records_behave_as_the_dict_they_stand_for(steps):
    """`HeldRecords` (a bucket's records read ahead, in an open-addressing table) against a dict
    through the same puts and takes: what each answers, and what each then holds, to the slot
    taken back when a record is taken out (keys that hash near each other included)."""
    held, reference = native_records.HeldRecords(), {}
    for op, arg, extra in steps:  # extra: the value set, or the room of a put
        if op == "set":
            held[arg] = extra
            reference[arg] = extra
        elif op == "put":
            assert native_records.ahead_put(held, dict(arg), extra) == read_ahead._keep_py(reference, dict(arg), extra)
        else:
            assert native_records.ahead_take(held, list(arg)) == read_ahead._take_py(reference, list(arg))
        assert len(held) == len(reference) and sorted(held.items()) == sorted(reference.items())
        assert all(key in held and held[key] == value and held.get(key) == value for key, value in reference.items())
    assert sorted(held) == sorted(held.keys()) == sorted(reference)
    assert sorted(held.values()) == sorted(reference.values())
    for missing in (-1, 5001, 2**64, "1", None):
        assert missing not in held and held.get(missing, "none") == "none"
    with pytest.raises(KeyError):
        held[5001]
    with pytest.raises(TypeError):
        held["1"] = b"x"
    with pytest.raises(TypeError):
        held[1] = "not bytes"


def test_held_records_grow_and_give_back_every_reference():
    held, body = native_records.HeldRecords(), bytes(range(40))
    before = sys.getrefcount(body)
    for k in range(5000):  # grows from 16 slots, past many doublings
        held[k * 300] = body
    assert len(held) == 5000 and sys.getrefcount(body) == before + 5000
    held[0] = body  # the same key again: replaced, not counted twice
    got, found, freed = native_records.ahead_take(held, [k * 300 for k in range(0, 5000, 2)] + [7, 301])
    assert found == 2500 and freed == 2500 * 40 and got[-2:] == [None, None]
    del got
    assert len(held) == 2500 and sys.getrefcount(body) == before + 2500
    assert sorted(held) == [k * 300 for k in range(1, 5000, 2)]
    del held
    assert sys.getrefcount(body) == before


@SETTINGS
@given(ahead_steps, st.integers(0, 60))
def test_the_read_ahead_keeps_and_hands_out_as_the_reference(steps, max_bytes):
    assert read_ahead._native_take is native_records.ahead_take and read_ahead._native_put is native_records.ahead_put
    native, reference = read_ahead.ReadAhead(max_bytes), read_ahead.ReadAhead(max_bytes)
    for op, bucket, arg, stale in steps:
        if op == "put":
            mine = native.put(bucket, dict(arg), native.epoch - stale)
            with mock.patch.object(read_ahead, "_native_put", None):
                theirs = reference.put(bucket, dict(arg), reference.epoch - stale)
        elif op == "take":
            mine = native.take(bucket, list(arg))
            with mock.patch.object(read_ahead, "_native_take", None):
                theirs = reference.take(bucket, list(arg))
        else:
            mine = theirs = None
            native.truncated(bucket, 0)
            reference.truncated(bucket, 0)
        assert mine == theirs
        assert read_ahead_state(native) == read_ahead_state(reference)
        assert native.held_bytes == sum(len(x) for held in native.records.values() for x in held.values())


# --- the spool's DELIVERED records -----------------------------------------------------------------

outbound = st.builds(
    OutboundMessage,
    st.sampled_from(["m-1", "\u00e9t\u00e9", "", "x" * 128, "x" * 129]) | ids,
    st.sampled_from(["s.a", "s|b:%", "bad subject", "x" * 256, "unseen.subject"]),
    st.binary(max_size=40) | st.sampled_from([bytearray(b"ba"), memoryview(b"mv")]),
    st.sampled_from([{}, {"k": "v"}, {"": "v"}, {"k": 1}, {"trace": "0af7", "\u00e9": "\u00e9t\u00e9\U0001f600"},
                     {"k": "\ud800"}, {"k": "x" * (32 * 1024 - 5)}, {"k": "x" * (32 * 1024 - 4)},
                     {"a": "1", "b": "2", "c": ""}])
    | st.dictionaries(st.text(min_size=1, max_size=5), st.text(max_size=5), max_size=4),
    st.integers(-5, 2**48) | st.sampled_from([True, 2**63, 1.5]),
    st.integers(-(2**63), 2**63 - 1) | st.sampled_from([2**63, "x"]),
    st.integers(0, 2**32 - 1) | st.sampled_from([-1, 2**32, None]),
)


def _ordinary_headers(headers) -> bool:
    """Headers the spool's kernel encodes itself: str keys (not empty) and values, all UTF-8, the
    block within the limit."""
    try:
        raw = [(k.encode(), v.encode()) for k, v in headers.items() if type(k) is str and type(v) is str]
    except UnicodeEncodeError:
        return False
    return (len(raw) == len(headers) and all(k for k, _ in raw)
            and sum(4 + len(k) + len(v) for k, v in raw) <= message.MAX_HEADERS_BYTES)


@SETTINGS
@given(st.lists(outbound, max_size=8))
def test_the_spool_records_are_the_reference(messages):
    from delayserver.message import MAX_ID_BYTES, MAX_TIME_MS, MIN_TIME_MS
    from delayserver.sender import spool
    r.encode_message_fields("x", "s.a", b"", 1, {})  # the subjects a node has checked by then
    r.encode_message_fields("x", "s|b:%", b"", 1, {})
    # The kernel's calls see these two only: the reference below adds each subject it checks to the
    # node's dict, so passing that dict would let the second call encode what the first one left.
    checked = {s: r.CHECKED_SUBJECTS[s] for s in ("s.a", "s|b:%")}
    got = native_records.delivered_records(messages, checked, MIN_TIME_MS, MAX_TIME_MS, MAX_ID_BYTES)
    assert len(got) == len(messages)
    for m, mine in zip(messages, got):
        try:
            theirs = spool._encode(m)
        except Exception as e:
            theirs = e
        if mine is not None:
            assert mine == theirs
        elif _ordinary_headers(m.headers) and type(m.body) is bytes and m.message_id in ("m-1", "x" * 128) \
                and m.subject in ("s.a", "s|b:%") and type(m.schedule_time) is int and 0 <= m.schedule_time <= MAX_TIME_MS \
                and type(m.dispatch_time) is int and -(2**63) <= m.dispatch_time < 2**63 \
                and type(m.attempt) is int and 0 <= m.attempt < 2**32:
            raise AssertionError(f"the kernel left an ordinary message to the reference: {m}")
    # The batch in one piece: the records joined when the kernel encodes them all, else None.
    whole = native_records.delivered_data(messages, checked, MIN_TIME_MS, MAX_TIME_MS, MAX_ID_BYTES)
    if messages and None not in got:
        assert whole == b"".join(got)
    else:
        assert whole is None


@SETTINGS
@given(st.integers(-(2**63), 2**63 - 1), st.sampled_from(["g", "group-\u00e9", "x" * 255]),
       st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1) | st.integers(-3, -1)), max_size=6))
def test_the_dispatch_records_are_the_reference(when, group, offsets):
    mine = native_records.dispatch_records(when, r._group_bytes(group), offsets)
    theirs = r._encode_dispatch_records_py(when, group, r._group_bytes(group), offsets)
    if mine is None:
        assert any(mlo < 0 for _, mlo in offsets), "an ordinary batch was left to the reference"
    else:
        assert mine == theirs
    assert r.encode_dispatch_records(when, group, offsets) == theirs
    for rec, (so, mlo) in zip(theirs, offsets):
        d = r.decode_dispatch(rec, r.HEADER_SIZE)
        assert (d.schedule_offset, d.dispatch_time, d.broker_group, d.message_log_offset) == (so, when, group, max(mlo, -1))


@SETTINGS
@given(st.integers(-(2**63), 2**63 - 1), st.sampled_from(["g", "group-\u00e9", "x" * 255]),
       st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**63 - 1) | st.integers(-3, -1)), max_size=6),
       st.integers(-1, 1), st.booleans())
def test_the_dispatch_data_is_the_reference(when, group, offsets, count_off, as_arrays):
    """The records of a batch in one piece: the reference's, which are the records
    `encode_dispatch_records` makes, joined."""
    schedule_offsets = [so for so, _ in offsets]
    message_log_offsets = [mlo for _, mlo in offsets][:max(0, len(offsets) + count_off)]
    if as_arrays:  # as the sender hands them over
        schedule_offsets, message_log_offsets = array.array("Q", schedule_offsets), array.array("q", message_log_offsets)
    mine = native_records.dispatch_data(when, r._group_bytes(group), schedule_offsets, message_log_offsets)
    try:
        theirs = r._encode_dispatch_data_py(when, group, schedule_offsets, message_log_offsets)
    except ValueError:  # not an offset of each kind per record
        assert mine is None and len(message_log_offsets) != len(schedule_offsets)
        return
    assert theirs == b"".join(r.encode_dispatch_records(when, group, offsets))
    if mine is None:
        assert not as_arrays or any(mlo < 0 for _, mlo in offsets), "an ordinary batch was left to the reference"
    else:
        assert mine == theirs
    assert r.encode_dispatch_data(when, group, schedule_offsets, message_log_offsets) == theirs


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from([3_600_000, 7_200_000]), st.integers(0, 2**63 - 1) | st.sampled_from([2**63, 2**64]),
                          st.integers(0, 2**63 - 1) | st.integers(-2, -1)), max_size=5),
       st.booleans())
def test_the_dispatch_fields_are_the_reference(fields, compiled):
    """The sender's pass over an acknowledged batch: its bucket and both offsets of each, in
    arrays, for a batch of one bucket whose dues all have both; None otherwise."""
    from delayserver.sender import sender as sender_module
    from delayserver.wheel import due_queue
    cls = native_wheel.Due if compiled else due_queue.DueReference
    batch = [cls(k, bucket, so, None, message_log_offset=mlo) for k, (bucket, so, mlo) in enumerate(fields)]
    theirs = sender_module._dispatch_fields_py(batch)
    ordinary = bool(fields) and len({b for b, _, _ in fields}) == 1 and all(
        0 <= so < 2**63 and mlo >= 0 for _, so, mlo in fields)
    assert (theirs is not None) == ordinary
    if theirs is not None:
        bucket, schedule_offsets, message_log_offsets = theirs
        assert bucket == fields[0][0] and list(schedule_offsets) == [so for _, so, _ in fields]
        assert list(message_log_offsets) == [mlo for _, _, mlo in fields]
        assert (schedule_offsets.typecode, message_log_offsets.typecode) == ("Q", "q")
    mine = native_wheel.dispatch_fields(batch)
    if compiled:
        assert mine == theirs
    else:
        assert mine is None  # (the compiled pass takes only its own dues)
    assert sender_module._dispatch_fields is native_wheel.dispatch_fields


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(["s.a", "s.b", "same", 7]), st.sampled_from([None, "g"]),
                          st.sampled_from([(), ("g",), ["g"]]), st.sampled_from(["message", None, "tuple", "reference"])),
                max_size=5))
def test_the_untried_subject_of_a_batch_is_the_reference(fields):
    """The sender's look at a taken batch before routing it in bulk: its one subject when every
    due is in no group and untried, None otherwise; the compiled pass also None for dues or
    messages of other kinds (they are routed one by one, which ends the same)."""
    from delayserver.sender import sender as sender_module
    from delayserver.wheel import due_queue
    shared = "".join(["s", ".a"])  # equal to "s.a", not the same object
    batch, ordinary = [], True
    for subject, group, tried, kind in fields:
        subject = shared if subject == "same" else subject
        message = r.Message("m", subject, b"", 1, {}) if kind in ("message", "reference") else \
            (None if kind is None else ("m", subject, b"", 1, {}, 0, 0, 0))
        cls = due_queue.DueReference if kind == "reference" else native_wheel.Due
        batch.append(cls(len(batch), 5, len(batch), message, group=group, tried=tried))
        ordinary = ordinary and kind == "message" and type(tried) is tuple and type(subject) is str
    mine = native_wheel.untried_subject(batch, r.Message)
    if ordinary and fields:
        assert mine == sender_module._untried_subject_py(batch)
        if mine is not None:
            assert {d.message.subject for d in batch} == {mine} and not any(d.group or d.tried for d in batch)
            native_wheel.set_group(batch, "chosen")
            assert {d.group for d in batch} == {"chosen"}
    else:
        assert mine is None
    assert sender_module._set_group is native_wheel.set_group
    with pytest.raises(TypeError, match="named tuple"):
        native_wheel.untried_subject(batch, dict)
    with pytest.raises(TypeError, match="compiled dues"):
        native_wheel.set_group([due_queue.DueReference(0, 5, 0, None)], "chosen")


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from([0, 1, 7, 2**23 - 1]), st.integers(0, 2**40 - 1)), max_size=6),
       st.sampled_from([None, "big", "negative", "bool"]))
def test_the_refs_split_is_the_reference(pairs, odd):
    """The tick manager's split of a batch's refs into their one bucket and offsets: the same as
    the reference for refs of one bucket, None for several buckets or none; None too for what is
    not a plain int from 0 to 2**63 - 1 (the general way handles those)."""
    from delayserver.wheel import tick_manager
    bits = tick_manager.OFFSET_BITS
    refs = [(index << bits) | offset for index, offset in pairs]
    theirs = tick_manager._split_refs_py(refs, bits)
    assert (theirs is not None) == (len({index for index, _ in pairs}) == 1)
    if theirs is not None:
        assert theirs == (pairs[0][0], [offset for _, offset in pairs])
    assert native_wheel.split_refs(refs, bits) == theirs
    assert native_wheel.split_refs(refs, bits, False) == tick_manager._split_refs_py(refs, bits, False) \
        == (None if theirs is None else (theirs[0], None))
    if odd is not None and refs:
        refs[-1] = {"big": 2**63 + refs[-1], "negative": -1, "bool": True}[odd]
        assert native_wheel.split_refs(refs, bits) is None
    assert tick_manager._split_refs is native_wheel.split_refs


def test_the_source_distribution_holds_every_source_of_the_kernels(tmp_path):
    """A build from the sdist compiles the kernels only if their headers and .pxd files are in it;
    without them the optional extensions fail quietly and every node runs the references. Built
    from a copy without the egg-info an install leaves, whose file list the sdist would reuse."""
    import shutil
    import subprocess
    import sys
    import tarfile
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    tree = tmp_path / "tree"
    shutil.copytree(root, tree, ignore=shutil.ignore_patterns(
        ".git", ".venv", "var", "build", "dist", "*.egg-info", "__pycache__", "*.so", "test-artifacts", ".hypothesis"))
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=tree, check=True,
                   capture_output=True)
    [archive] = tmp_path.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        held = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    sources = {f"delayserver/native/{p.name}" for p in (root / "delayserver" / "native").iterdir()
               if p.suffix in (".pyx", ".pxd", ".h")}
    assert {"delayserver/native/crc32c.h", "delayserver/native/endian.pxd"} <= sources
    assert sources - held == set()
