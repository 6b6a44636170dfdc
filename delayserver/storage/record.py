"""The one record format of every log: header, record types, payload layouts, limits.

A record on disk is a 9-byte header then the payload::

    crc32c  u32   over the type byte followed by the payload
    length  u32   payload length in bytes
    type    u8    a RecordType

All integers are big-endian. Readers and writers of every log (message_log, schedule_log,
dispatch_log, the spool, parked messages) and every tool use this module and no other layout: the
byte positions below are written down here and nowhere else. Every failure to decode, whatever its
cause (a bad header, a crc mismatch, fields that do not add up, text that is not UTF-8), raises
the one RecordError; `storage.reader` turns it into a damage report.

Payload layouts (see the `*_HEAD` structs):

- MESSAGE: store_time q, schedule_time q, sequence Q, flags H, id_len B, subject_len B,
  headers_len I, body_len I, then id, subject, headers, body.
  Headers: repeated (key_len H, key, value_len H, value), UTF-8.
- CANCEL: store_time q, schedule_time q, sequence Q, id_len B, then id (the message to cancel).
- SCHEDULED / SCHEDULED_CANCEL (schedule_log): message_log offset Q, then a MESSAGE / CANCEL payload.
- DISPATCH (dispatch_log): schedule_log offset Q, dispatch_time q, group_len B, broker group,
  then the message_log offset Q of the message delivered (absent in records written before it was
  added: the payload ends after the group). A slave applies a replicated DISPATCH only when its own
  schedule_log record at that offset came from that message_log offset.
- DELIVERED (spool): dispatch_time q, attempt I, then a MESSAGE payload.
- PARKED: parked_time q, attempt I, schedule_offset Q, reason_len H, reason, then a SCHEDULED
  payload (the schedule_log offset lets a reload skip what was parked).
- SCHEDULE (message_log only, not replayed into schedule_log): store_time q, 0 q, sequence Q, then
  a recurring schedule's change as UTF-8 JSON (delayserver/schedules/registry.py).

Transactional records (message_log; every one starts store_time q, schedule_time q, sequence Q like
MESSAGE and CANCEL, so the master sets its sequence the same way):

- PREPARE: store_time q, schedule_time q, sequence Q, check_immunity_ms q, group_len B, then the
  producer group, then the MESSAGE payload of the half message (not scheduled until committed).
- COMMIT: a MESSAGE payload (the committed message, FLAG_TRANSACTIONAL set): replayed into
  schedule_log as a SCHEDULED record, and it resolves the half message of its (schedule_time, id).
- ROLLBACK: the CANCEL layout, naming the half message it drops.
- TXN_CHECK: store_time q, schedule_time q, sequence Q, checks I, id_len B, then id: the master
  asked the producer group for the `checks`-th time (at store_time).
- TXN_PARK: store_time q, schedule_time q, sequence Q, reason B (a ParkReason), id_len B, then id:
  the half message goes to the parked messages of `%TRANS_CHECK_MAX%<group>`.
- EPOCH (message_log): epoch Q. The first record of every batch a node appends to message_log:
  the master epoch under which the records after it, up to the next EPOCH record, were written.
  A slave copies it with the batch, byte for byte, so the epoch of every record is the same on
  every node that holds it. Records before the first EPOCH record of a log (a log written before
  epochs existed) are of epoch 0.
"""
from __future__ import annotations

import enum
import json
import struct
import types
from typing import Iterator, Mapping, NamedTuple

import attrs
import crc32c as _crc32c

from delayserver.message import (
    DEFAULT_MAX_BODY_BYTES, MAX_HEADERS_BYTES, BadHeaders, BadSubject, MessageTooLarge, _utf8, check_body_size,
    check_schedule_time, encode_id, encode_subject,
)

try:  # the compiled sequencing and decoding (delayserver/native/records.pyx), when the install built them
    from delayserver.native.records import decode_scheduled as _native_decode_scheduled
    from delayserver.native.records import sequence_framed as _native_sequence_framed
except ImportError:
    _native_decode_scheduled = _native_sequence_framed = None
try:
    from delayserver.native.records import dispatch_data as _native_dispatch_data
    from delayserver.native.records import dispatch_records as _native_dispatch_records
except ImportError:  # pragma: no cover - a build without a C compiler
    _native_dispatch_data = _native_dispatch_records = None

HEADER = struct.Struct(">IIB")
HEADER_SIZE = HEADER.size

MESSAGE_HEAD = struct.Struct(">qqQHBBII")
CANCEL_HEAD = struct.Struct(">qqQB")
OFFSET = struct.Struct(">Q")
_pack_offset, _OFFSET_SIZE = OFFSET.pack, OFFSET.size
_pack_header_offset = struct.Struct(">IIBQ").pack  # a record header, then an OFFSET: one pack
SCHEDULED_HEAD = struct.Struct(">QqqQHBBII")  # OFFSET + MESSAGE_HEAD, for one-call decoding
SCHEDULED_CANCEL_HEAD = struct.Struct(">QqqQB")
DISPATCH_HEAD = struct.Struct(">QqB")
DELIVERED_HEAD = struct.Struct(">qI")
PARKED_HEAD = struct.Struct(">qIQH")
PREPARE_HEAD = struct.Struct(">qqQqB")
TXN_CHECK_HEAD = struct.Struct(">qqQIB")
TXN_PARK_HEAD = struct.Struct(">qqQBB")
EPOCH_HEAD = struct.Struct(">Q")
HEADER_ITEM = struct.Struct(">H")
_MESSAGE_HEAD_SIZE = MESSAGE_HEAD.size
_unpack_message_head = MESSAGE_HEAD.unpack_from
_SCHEDULED_HEAD_SIZE = SCHEDULED_HEAD.size
_pack_item_len = HEADER_ITEM.pack
_HEADER_ITEM_OVERHEAD = 2 * HEADER_ITEM.size

#: The hard cap on a record payload, whatever max_message_bytes says; a declared length over it is
#: damage, never an allocation.
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024


class RecordType(enum.IntEnum):
    MESSAGE = 1
    CANCEL = 2
    SCHEDULED = 3
    SCHEDULED_CANCEL = 4
    DISPATCH = 5
    DELIVERED = 6
    PARKED = 7
    # browse, reschedule, dedupe, schedules: 24-31
    SCHEDULE = 24
    # transactions (16-23)
    PREPARE = 16
    COMMIT = 17
    ROLLBACK = 18
    TXN_CHECK = 19
    TXN_PARK = 20
    EPOCH = 12


#: Plain ints of the types the per-record loops compare against: `RecordType.X` is a lookup
#: through the enum's class on every use (about 0.1 us), a module global a dict lookup.
T_MESSAGE, T_CANCEL, T_COMMIT = int(RecordType.MESSAGE), int(RecordType.CANCEL), int(RecordType.COMMIT)
T_SCHEDULED, T_SCHEDULED_CANCEL = int(RecordType.SCHEDULED), int(RecordType.SCHEDULED_CANCEL)
T_SCHEDULE, T_EPOCH = int(RecordType.SCHEDULE), int(RecordType.EPOCH)

_TYPE_CRC = {t: _crc32c.crc32c(bytes([t])) for t in RecordType}
_crc = _crc32c.crc32c
VALID_TYPES = frozenset(int(t) for t in RecordType)
#: The crc seed of each type byte (None: not a record type), indexed faster than a dict is looked up.
_SEED_BY_TYPE = tuple(_TYPE_CRC.get(t) for t in range(256))


def checksum(rtype: int, payload) -> int:
    """crc32c over the type byte followed by the payload."""
    return _crc32c.crc32c(payload, value=_TYPE_CRC[rtype])


def checksum_continue(crc: int, more) -> int:
    """Extend a checksum over further payload bytes (a payload written in pieces)."""
    return _crc32c.crc32c(more, value=crc)


def encode_record(rtype: int, payload: bytes) -> bytes:
    """A whole record: header then payload."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise MessageTooLarge(f"record payload of {len(payload)} bytes is over {MAX_PAYLOAD_BYTES}")
    return HEADER.pack(checksum(rtype, payload), len(payload), rtype) + payload


class RecordError(ValueError):
    """A record that cannot be decoded at `offset`: bad type, bad length, bad crc, or a payload
    whose fields do not add up. The one error of this module: no struct.error or
    UnicodeDecodeError leaves it."""

    def __init__(self, offset: int, reason: str):
        super().__init__(f"bad record at offset {offset}: {reason}")
        self.offset = offset
        self.reason = reason


def parse_record(buf, pos: int, end: int | None = None):
    """Decode the record at `pos` of `buf`.

    Returns ``(rtype, payload_start, next_pos)``, or None when the buffer ends before the record
    does (an incomplete record). Raises RecordError for a bad type, length or crc.
    """
    end = len(buf) if end is None else end
    if pos + HEADER_SIZE > end:
        return None
    crc, length, rtype = HEADER.unpack_from(buf, pos)
    if rtype not in VALID_TYPES:
        raise RecordError(pos, f"unknown record type {rtype}")
    if length > MAX_PAYLOAD_BYTES:
        raise RecordError(pos, f"declared length {length} over the cap")
    start = pos + HEADER_SIZE
    stop = start + length
    if stop > end:
        return None
    if _crc32c.crc32c(memoryview(buf)[start:stop], value=_TYPE_CRC[rtype]) != crc:
        raise RecordError(pos, "crc mismatch")
    return rtype, start, stop


def iter_records(buf, pos: int = 0, end: int | None = None) -> Iterator[tuple[int, int, int, int]]:
    """Yield ``(offset, rtype, payload_start, payload_end)`` for each whole record from `pos`.

    Stops quietly at an incomplete final record; raises RecordError on a bad one. Callers that
    must tell a torn tail from corruption use `storage.segment.scan`.
    """
    end = len(buf) if end is None else end
    # parse_record, inlined with its globals bound locally: this loop is every reader's hot path.
    view = memoryview(buf)
    unpack, crc32c, seeds = HEADER.unpack_from, _crc32c.crc32c, _SEED_BY_TYPE
    header_size, cap = HEADER_SIZE, MAX_PAYLOAD_BYTES
    while pos + header_size <= end:
        crc, length, rtype = unpack(buf, pos)
        seed = seeds[rtype]
        if seed is None:
            raise RecordError(pos, f"unknown record type {rtype}")
        if length > cap:
            raise RecordError(pos, f"declared length {length} over the cap")
        start = pos + header_size
        stop = start + length
        if stop > end:
            return
        if crc32c(view[start:stop], value=seed) != crc:
            raise RecordError(pos, "crc mismatch")
        yield pos, rtype, start, stop
        pos = stop


def iter_checked_records(buf, pos: int = 0, end: int | None = None) -> Iterator[tuple[int, int, int, int]]:
    """`iter_records` for a buffer whose records were checked already (crc and all): it reads the
    headers only. Use it only on what a checking reader just returned (MessageLog.read)."""
    end = len(buf) if end is None else end
    unpack, header_size = HEADER.unpack_from, HEADER_SIZE
    while pos + header_size <= end:
        _, length, rtype = unpack(buf, pos)
        stop = pos + header_size + length
        if stop > end:
            return
        yield pos, rtype, pos + header_size, stop
        pos = stop


def record_size(buf, pos: int) -> int:
    """Header plus payload length of the record whose header is at `pos` (header read only)."""
    return HEADER_SIZE + HEADER.unpack_from(buf, pos)[1]


def _decoding(fn):
    """Make `fn` raise RecordError, at its `start` argument, for whatever a bad payload causes."""
    def wrapper(buf, start: int = 0, *args):
        try:
            return fn(buf, start, *args)
        except RecordError:
            raise
        except (struct.error, ValueError, IndexError) as e:  # UnicodeDecodeError is a ValueError
            raise RecordError(start, f"undecodable {fn.__name__.removeprefix('decode_')} payload: {e}") from None
    wrapper.__name__, wrapper.__doc__, wrapper.__wrapped__ = fn.__name__, fn.__doc__, fn
    return wrapper


# --- messages -------------------------------------------------------------------------------


_NO_HEADERS: Mapping[str, str] = types.MappingProxyType({})


class Message(NamedTuple):
    """One message as the producer gave it, plus what the master assigned at append.

    A NamedTuple rather than an attrs class: readers build one per record delivered or
    inspected, and a tuple is built several times faster than a frozen attrs instance.
    """

    message_id: str
    subject: str
    body: bytes
    schedule_time: int
    headers: Mapping[str, str] = _NO_HEADERS
    store_time: int = 0
    sequence: int = 0
    flags: int = 0


def encode_headers(headers: Mapping[str, str]) -> bytes:
    """The headers block; raises BadHeaders for a non-mapping, a non-string or empty key, a value
    that is not a string of UTF-8, or a block over MAX_HEADERS_BYTES."""
    # A dict is told by its type first: the isinstance check against the Mapping ABC is slow.
    if type(headers) is not dict and not isinstance(headers, Mapping):
        raise BadHeaders(f"headers must be a mapping of strings, got {type(headers).__name__}")
    parts = []
    total = 0
    for key, value in headers.items():
        k, v = _utf8(key), _utf8(value)
        if not k or v is None:
            raise BadHeaders("header keys must be non-empty strings and values strings, in UTF-8")
        total += _HEADER_ITEM_OVERHEAD + len(k) + len(v)
        # Checked per item so that a huge header map is refused before it is all encoded.
        if total > MAX_HEADERS_BYTES:
            raise BadHeaders(f"headers take over {MAX_HEADERS_BYTES} bytes")
        parts += (_pack_item_len(len(k)), k, _pack_item_len(len(v)), v)
    return b"".join(parts)


def decode_headers(raw) -> dict[str, str]:
    """Decode a headers block; raises ValueError when it does not add up to its length (the
    message decoders turn it into RecordError)."""
    raw = bytes(raw)
    headers = {}
    pos, end = 0, len(raw)
    while pos < end:
        # Lengths are read as two bytes by hand: cheaper than a struct call per item.
        key_at = pos + 2
        value_len_at = key_at + (raw[pos] << 8 | raw[pos + 1]) if key_at <= end else end
        value_at = value_len_at + 2
        if value_at > end:
            raise ValueError("headers block overruns its length")
        pos = value_at + (raw[value_len_at] << 8 | raw[value_len_at + 1])
        if pos > end:
            raise ValueError("headers block overruns its length")
        headers[raw[key_at:value_len_at].decode("utf-8")] = raw[value_at:pos].decode("utf-8")
    return headers


def encode_message(m: Message, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> bytes:
    """The MESSAGE payload of `m`, after checking every limit (raises an InvalidMessage subtype)."""
    return encode_message_fields(m.message_id, m.subject, m.body, m.schedule_time, m.headers,
                                 m.store_time, m.sequence, m.flags, max_body_bytes)


#: Subjects `encode_message_fields` has checked, with their UTF-8: a subject found here is valid.
CHECKED_SUBJECTS: dict[str, bytes] = {}


def encode_message_fields(message_id: str, subject: str, body: bytes, schedule_time: int,
                          headers: Mapping[str, str], store_time: int = 0, sequence: int = 0,
                          flags: int = 0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> bytes:
    """`encode_message` without building a Message first (the receiver's hot path)."""
    mid = encode_id(message_id)
    # Subjects repeat: remember the ones already checked (bounded, so no input can grow it forever).
    raw_subject = CHECKED_SUBJECTS.get(subject)
    if raw_subject is None:
        raw_subject = encode_subject(subject)
        if len(CHECKED_SUBJECTS) < 4096:
            CHECKED_SUBJECTS[subject] = raw_subject
    raw_headers = b"" if type(headers) is dict and not headers else encode_headers(headers)
    check_schedule_time(schedule_time)
    if type(body) is not bytes:
        body = bytes(body)
    check_body_size(len(body), max_body_bytes)
    head = MESSAGE_HEAD.pack(store_time, schedule_time, sequence, flags, len(mid), len(raw_subject),
                             len(raw_headers), len(body))
    return b"".join((head, mid, raw_subject, raw_headers, body))


def _as_bytes(buf, start: int, end: int | None) -> tuple[bytes, int, int]:
    """`buf` as bytes with `start` and `end` into it: a copy only when it is not bytes already, so
    that every field a decoder takes is a plain bytes slice (the fast path)."""
    if type(buf) is not bytes:
        end = len(buf) if end is None else end
        return bytes(memoryview(buf)[start:end]), 0, end - start
    return buf, start, len(buf) if end is None else end


@_decoding
def decode_message(buf, start: int = 0, end: int | None = None) -> Message:
    """Decode a MESSAGE payload at `start` of `buf` (raises RecordError if it does not add up)."""
    buf, start, end = _as_bytes(buf, start, end)
    store, sched, seq, flags, idlen, slen, hlen, blen = MESSAGE_HEAD.unpack_from(buf, start)
    return _message_at(buf, start + _MESSAGE_HEAD_SIZE, end, store, sched, seq, flags, idlen, slen, hlen, blen)


def _message_at(buf: bytes, id_at: int, end: int, store: int, sched: int, seq: int, flags: int,
                idlen: int, slen: int, hlen: int, blen: int) -> Message:
    """The Message whose variable fields start at `id_at`, given its fixed fields."""
    subject_at = id_at + idlen
    headers_at = subject_at + slen
    body_at = headers_at + hlen
    if body_at + blen != end:
        raise ValueError("message fields do not add up to the payload length")
    # As Message(...) makes it, without the named tuple's Python-level constructor (once per
    # message delivered).
    return _new_tuple(Message, (
        buf[id_at:subject_at].decode("utf-8"),
        buf[subject_at:headers_at].decode("utf-8"),
        buf[body_at:end],
        sched,
        decode_headers(buf[headers_at:body_at]) if hlen else {},
        store,
        seq,
        flags,
    ))


_new_tuple = tuple.__new__


# --- cancel ---------------------------------------------------------------------------------


@attrs.frozen
class Cancel:
    """A request to cancel the message `message_id` due at `schedule_time`."""

    message_id: str
    schedule_time: int
    store_time: int = 0
    sequence: int = 0


def encode_cancel(c: Cancel) -> bytes:
    mid = encode_id(c.message_id)
    check_schedule_time(c.schedule_time)
    return CANCEL_HEAD.pack(c.store_time, c.schedule_time, c.sequence, len(mid)) + mid


@_decoding
def decode_cancel(buf, start: int = 0, end: int | None = None) -> Cancel:
    end = len(buf) if end is None else end
    store, sched, seq, idlen = CANCEL_HEAD.unpack_from(buf, start)
    pos = start + CANCEL_HEAD.size
    if pos + idlen != end:
        raise ValueError("cancel fields do not add up to the payload length")
    return Cancel(bytes(memoryview(buf)[pos:end]).decode("utf-8"), sched, store, seq)


# --- schedule_log, dispatch_log, spool, parked ----------------------------------------------


def encode_scheduled(message_log_offset: int, message_payload: bytes) -> bytes:
    return OFFSET.pack(message_log_offset) + message_payload


def decode_scheduled(buf, start: int = 0, end: int | None = None) -> tuple[int, Message]:
    """``(message_log_offset, message)`` of a SCHEDULED payload; raises RecordError as decode_message.
    The compiled kernel (delayserver/native/records.pyx) when built, else `_decode_scheduled_py`."""
    if _native_decode_scheduled is not None:
        try:
            got = _native_decode_scheduled(buf, start, len(buf) if end is None else end, Message)
        except (OverflowError, TypeError):  # bounds that are no machine integers: the reference's to judge
            got = None
        if got is not None:
            return got
    return _decode_scheduled_py(buf, start, end)


def _decode_scheduled_py(buf, start: int = 0, end: int | None = None) -> tuple[int, Message]:
    """`decode_scheduled` in Python, the compiled kernel's reference: without the `_decoding`
    wrapper's extra calls."""
    try:
        data, at, end = _as_bytes(buf, start, end)
        # One unpack for the offset and the message's fixed fields.
        offset, store, sched, seq, flags, idlen, slen, hlen, blen = SCHEDULED_HEAD.unpack_from(data, at)
        return offset, _message_at(data, at + _SCHEDULED_HEAD_SIZE, end, store, sched, seq, flags,
                                   idlen, slen, hlen, blen)
    except RecordError:
        raise
    except (struct.error, ValueError, IndexError) as e:  # UnicodeDecodeError is a ValueError
        raise RecordError(start, f"undecodable scheduled payload: {e}") from None


@_decoding
def scheduled_key(buf, start: int) -> tuple[int, int, int, str]:
    """Fast path for loading: ``(message_log_offset, schedule_time, sequence, message_id)``."""
    offset, _store, sched, seq, _flags, idlen, _s, _h, _b = SCHEDULED_HEAD.unpack_from(buf, start)
    pos = start + SCHEDULED_HEAD.size
    return offset, sched, seq, bytes(buf[pos : pos + idlen]).decode("utf-8")


@_decoding
def decode_scheduled_cancel(buf, start: int = 0, end: int | None = None) -> tuple[int, Cancel]:
    (offset,) = OFFSET.unpack_from(buf, start)
    return offset, decode_cancel(buf, start + OFFSET.size, end)


# --- record heads: the few fields hot paths read without decoding a whole payload --------------
# Loaders, lookups, the replayer and the receiver take these, never a struct of their own.

#: Where the sequence sits in MESSAGE and CANCEL payloads alike (after store_time and schedule_time).
_SEQUENCE_AT = 16
_SEQUENCE = struct.Struct(">Q")


def frame_records(records) -> bytearray:
    """`records`, ``(type, payload)`` pairs of message_log records (each payload starting with its
    store time, schedule time and sequence), framed one after the other in one bytearray: each
    payload behind its header, whose checksum is left at 0 (the master gives each record its
    sequence, then its checksum, at append: `sequence_framed`). Raises ValueError for a type
    message_log does not hold or a payload without room for its sequence, before the append."""
    framed, header = bytearray(), HEADER.pack
    for rtype, payload in records:
        if rtype not in _SEQUENCED_TYPES or len(payload) < _SEQUENCE_AT + _SEQUENCE.size:
            raise ValueError(f"no sequenced record: type {rtype}, {len(payload)} bytes")
        framed += header(0, len(payload), rtype)
        framed += payload
    return framed


def sequence_framed(framed: bytearray, count: int, sequence: int) -> int:
    """Give each of the `count` records of `framed` (whole records of types message_log holds, one
    after the other, each payload starting with its store time, schedule time and sequence, as
    the receiver's `admit` frames a request's messages) its sequence from `sequence` on and its
    checksum, in place (`frame_records` frames any other request's records the same way). Returns
    the bytes they take. Raises ValueError when `framed` is not `count` such records. The compiled
    kernel (delayserver/native/records.pyx) when built, else `_sequence_framed_py`."""
    if _native_sequence_framed is not None:
        size = _native_sequence_framed(framed, count, sequence)
        if size is not None:
            return size
    return _sequence_framed_py(framed, count, sequence)


def _sequence_framed_py(framed: bytearray, count: int, sequence: int) -> int:
    """`sequence_framed` in Python: the compiled kernel's reference."""
    if type(framed) is not bytearray:
        raise ValueError(f"framed records must be in a bytearray, not a {type(framed).__name__}")
    if count < 0:
        raise ValueError(f"a count of framed records must not be negative, got {count}")
    spans, pos = [], 0
    for _ in range(count):
        if pos + HEADER_SIZE > len(framed):
            raise ValueError(f"framed records end inside a header at {pos}")
        _, length, rtype = HEADER.unpack_from(framed, pos)
        if rtype not in _SEQUENCED_TYPES or length < _SEQUENCE_AT + _SEQUENCE.size \
                or pos + HEADER_SIZE + length > len(framed):
            raise ValueError(f"framed record at {pos} is no sequenced record (type {rtype}, {length} bytes)")
        spans.append((pos, rtype, length))
        pos += HEADER_SIZE + length
    if pos != len(framed):
        raise ValueError(f"framed records end at {pos}, before the {len(framed)} bytes framed")
    put, header = _SEQUENCE.pack_into, HEADER.pack_into
    with memoryview(framed) as view:
        for at, rtype, length in spans:
            payload = at + HEADER_SIZE
            put(framed, payload + _SEQUENCE_AT, sequence)
            sequence += 1
            header(framed, at, _crc32c.crc32c(view[payload : payload + length], value=_TYPE_CRC[rtype]), length, rtype)
    return pos


def scheduled_time(buf, start: int) -> int:
    """The schedule time of the SCHEDULED payload at `start`."""
    return SCHEDULED_HEAD.unpack_from(buf, start)[2]


@_decoding
def cancel_key(buf, start: int = 0) -> tuple[int, str]:
    """``(schedule_time, message_id)`` of the SCHEDULED_CANCEL payload at `start`: the message it
    cancels (the same pair `scheduled_key` gives for a SCHEDULED record, in that order)."""
    _, _, sched, _, idlen = SCHEDULED_CANCEL_HEAD.unpack_from(buf, start)
    pos = start + SCHEDULED_CANCEL_HEAD.size
    return sched, bytes(buf[pos : pos + idlen]).decode("utf-8")


def dispatch_schedule_offset(buf, start: int = 0) -> int:
    """The schedule_log offset a DISPATCH payload at `start` records as delivered."""
    return DISPATCH_HEAD.unpack_from(buf, start)[0]


def message_log_head(buf, start: int, rtype: int) -> tuple[int, int, int, int]:
    """``(schedule_time, sequence, id_start, id_end)`` of a message_log payload at `start`: where its
    message id lies in `buf` for a MESSAGE, COMMIT or CANCEL (the span is empty for the other
    transactional records; it is as the payload says, unchecked against the payload's end).

    Raises RecordError for a payload too short for its head or a type not in message_log. Once per
    replayed record: decoded by hand, without the `_decoding` wrapper's extra calls."""
    try:
        if rtype == T_MESSAGE or rtype == T_COMMIT:  # a COMMIT is a MESSAGE payload
            head = _unpack_message_head(buf, start)
            pos = start + _MESSAGE_HEAD_SIZE
            return head[1], head[2], pos, pos + head[4]
        if rtype == T_CANCEL:
            _, sched, seq, idlen = CANCEL_HEAD.unpack_from(buf, start)
            pos = start + CANCEL_HEAD.size
            return sched, seq, pos, pos + idlen
        if rtype in TRANSACTION_TYPES:
            _, sched, seq = _TXN_PREFIX.unpack_from(buf, start)
            return sched, seq, start, start
    except struct.error as e:
        raise RecordError(start, f"undecodable message_log_head payload: {e}") from None
    raise RecordError(start, f"record type {rtype} is not in message_log")


#: The schedule_log type of each message_log type.
SCHEDULED_TYPE = {RecordType.MESSAGE: RecordType.SCHEDULED, RecordType.CANCEL: RecordType.SCHEDULED_CANCEL,
                  RecordType.COMMIT: RecordType.SCHEDULED}


def scheduled_record_head(message_log_offset: int, rtype: int, payload) -> tuple[int, bytes, int]:
    """The schedule_log record of a message_log MESSAGE, COMMIT or CANCEL `payload`, without
    copying it: ``(size, head, kind)`` where the record is `head` followed by `payload` as it is,
    `size` its length in bytes and `kind` its type. The crc is carried over the two pieces."""
    kind = SCHEDULED_TYPE[rtype]
    offset = _pack_offset(message_log_offset)
    crc = _crc(payload, value=_crc(offset, value=_TYPE_CRC[kind]))
    length = _OFFSET_SIZE + len(payload)
    return HEADER_SIZE + length, _pack_header_offset(crc, length, kind, message_log_offset), kind


@attrs.frozen
class Dispatch:
    """One delivery: the schedule_log record at `schedule_offset` (replayed from message_log at
    `message_log_offset`; -1 in a record written before that field) went to `broker_group`."""

    schedule_offset: int
    dispatch_time: int
    broker_group: str
    message_log_offset: int = -1


def _group_bytes(broker_group: str) -> bytes:
    group = broker_group.encode("utf-8")
    if not 1 <= len(group) <= 255:
        raise ValueError("broker group name must be 1 to 255 bytes")
    return group


def encode_dispatch(d: Dispatch) -> bytes:
    group = _group_bytes(d.broker_group)
    head = DISPATCH_HEAD.pack(d.schedule_offset, d.dispatch_time, len(group)) + group
    return head + OFFSET.pack(d.message_log_offset) if d.message_log_offset >= 0 else head


def encode_dispatch_records(dispatch_time: int, broker_group: str, offsets) -> list[bytes]:
    """The whole DISPATCH records (header and payload) of deliveries to `broker_group` at
    `dispatch_time`, one per (schedule_offset, message_log_offset) of `offsets`: the bytes of
    `encode_record(DISPATCH, encode_dispatch(...))`, with one struct for the batch's fixed part
    (the sender's path: one per delivered message)."""
    group = _group_bytes(broker_group)
    if _native_dispatch_records is not None and type(offsets) is list and type(dispatch_time) is int \
            and -(2**63) <= dispatch_time < 2**63:
        records = _native_dispatch_records(dispatch_time, group, offsets)
        if records is not None:
            return records
    return _encode_dispatch_records_py(dispatch_time, broker_group, group, offsets)


def _encode_dispatch_records_py(dispatch_time: int, broker_group: str, group: bytes, offsets) -> list[bytes]:
    """`encode_dispatch_records` in Python: the reference of the compiled kernel
    (delayserver/native/records.pyx `dispatch_records`), and what runs where it is not built."""
    whole = struct.Struct(f">QqB{len(group)}sQ")  # DISPATCH_HEAD, the group, OFFSET
    pack, crc, seed, header = whole.pack, _crc32c.crc32c, _TYPE_CRC[RecordType.DISPATCH], HEADER.pack
    records = []
    for schedule_offset, message_log_offset in offsets:
        if message_log_offset < 0:  # a record without it, as encode_dispatch writes one
            records.append(encode_record(RecordType.DISPATCH, encode_dispatch(
                Dispatch(schedule_offset, dispatch_time, broker_group, message_log_offset))))
            continue
        payload = pack(schedule_offset, dispatch_time, len(group), group, message_log_offset)
        records.append(header(crc(payload, value=seed), len(payload), RecordType.DISPATCH) + payload)
    return records


def encode_dispatch_data(dispatch_time: int, broker_group: str, schedule_offsets, message_log_offsets) -> bytes:
    """The DISPATCH records of deliveries to `broker_group` at `dispatch_time`, one per schedule
    offset and message_log offset of the two sequences (arrays "Q" and "q" on the sender's path),
    one after the other in one bytes: what `encode_dispatch_records` makes of them, joined, with no
    object per record. The compiled kernel (delayserver/native/records.pyx `dispatch_data`) when
    built, else `_encode_dispatch_data_py`."""
    if _native_dispatch_data is not None and type(dispatch_time) is int and -(2**63) <= dispatch_time < 2**63:
        data = _native_dispatch_data(dispatch_time, _group_bytes(broker_group), schedule_offsets, message_log_offsets)
        if data is not None:
            return data
    return _encode_dispatch_data_py(dispatch_time, broker_group, schedule_offsets, message_log_offsets)


def _encode_dispatch_data_py(dispatch_time: int, broker_group: str, schedule_offsets, message_log_offsets) -> bytes:
    """`encode_dispatch_data` in Python: the compiled kernel's reference."""
    if len(schedule_offsets) != len(message_log_offsets):
        raise ValueError(f"{len(schedule_offsets)} schedule offsets and {len(message_log_offsets)} message_log offsets")
    return b"".join(encode_dispatch_records(dispatch_time, broker_group,
                                            list(zip(schedule_offsets, message_log_offsets))))


@_decoding
def decode_dispatch(buf, start: int = 0, end: int | None = None) -> Dispatch:
    end = len(buf) if end is None else end
    offset, when, glen = DISPATCH_HEAD.unpack_from(buf, start)
    pos = start + DISPATCH_HEAD.size
    group_end = pos + glen
    if group_end == end:
        message_log_offset = -1
    elif group_end + OFFSET.size == end:
        (message_log_offset,) = OFFSET.unpack_from(buf, group_end)
    else:
        raise ValueError("dispatch fields do not add up to the payload length")
    group = bytes(memoryview(buf)[pos:group_end]).decode("utf-8")
    return Dispatch(offset, when, group, message_log_offset)


def encode_delivered(dispatch_time: int, attempt: int, message_payload: bytes) -> bytes:
    return DELIVERED_HEAD.pack(dispatch_time, attempt) + message_payload


@_decoding
def decode_delivered(buf, start: int = 0, end: int | None = None) -> tuple[int, int, Message]:
    when, attempt = DELIVERED_HEAD.unpack_from(buf, start)
    return when, attempt, decode_message(buf, start + DELIVERED_HEAD.size, end)


@attrs.frozen
class Parked:
    """A message a broker rejected for good, kept aside until an operator redrives it."""

    parked_time: int
    attempt: int
    schedule_offset: int
    reason: str
    message_log_offset: int
    message: Message


def encode_parked(parked_time: int, attempt: int, schedule_offset: int, reason: str,
                  scheduled_payload: bytes) -> bytes:
    raw = reason.encode("utf-8")[:0xFFFF]
    while True:
        try:
            raw.decode("utf-8")
            break
        except UnicodeDecodeError:  # the cut fell inside a character
            raw = raw[:-1]
    return PARKED_HEAD.pack(parked_time, attempt, schedule_offset, len(raw)) + raw + scheduled_payload


@_decoding
def decode_parked(buf, start: int = 0, end: int | None = None) -> Parked:
    when, attempt, soff, rlen = PARKED_HEAD.unpack_from(buf, start)
    pos = start + PARKED_HEAD.size
    reason = bytes(memoryview(buf)[pos : pos + rlen]).decode("utf-8")
    offset, message = decode_scheduled(buf, pos + rlen, end)
    return Parked(when, attempt, soff, reason, offset, message)


# --- schedules -------------------------------------------------------------------------------


@attrs.frozen
class ScheduleChange:
    """A change to the recurring schedules (a JSON object), as message_log stores it."""

    change: dict
    store_time: int = 0
    sequence: int = 0


def encode_schedule_change(change: dict, store_time: int) -> bytes:
    raw = json.dumps(change, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return _SCHEDULE_HEAD.pack(store_time, 0, 0) + raw


@_decoding
def decode_schedule_change(buf, start: int = 0, end: int | None = None) -> ScheduleChange:
    end = len(buf) if end is None else end
    store, _, seq = _SCHEDULE_HEAD.unpack_from(buf, start)
    change = json.loads(bytes(memoryview(buf)[start + _SCHEDULE_HEAD.size : end]).decode("utf-8"))
    if not isinstance(change, dict):
        raise ValueError("a schedule change is a JSON object")
    return ScheduleChange(change, store, seq)


_SCHEDULE_HEAD = struct.Struct(">qqQ")


def schedule_change_sequence(buf, start: int) -> int:
    return _SCHEDULE_HEAD.unpack_from(buf, start)[2]


# --- epochs ---------------------------------------------------------------------------------


@attrs.frozen
class Epoch:
    """The master epoch of the message_log records that follow, up to the next EPOCH record."""

    epoch: int


#: The size of a whole EPOCH record: what each batch of message_log carries on top of its records.
EPOCH_RECORD_SIZE = HEADER_SIZE + EPOCH_HEAD.size


def encode_epoch_record(epoch: int) -> bytes:
    """The whole EPOCH record (header and payload) that opens a message_log batch of `epoch`."""
    return encode_record(RecordType.EPOCH, EPOCH_HEAD.pack(epoch))


@_decoding
def decode_epoch(buf, start: int = 0, end: int | None = None) -> Epoch:
    end = len(buf) if end is None else end
    if end - start != EPOCH_HEAD.size:
        raise ValueError(f"an epoch payload is {EPOCH_HEAD.size} bytes, not {end - start}")
    return Epoch(EPOCH_HEAD.unpack_from(buf, start)[0])


def decode_payload(rtype: int, buf, start: int, end: int):
    """Decode any record's payload into its value (used by tools, not hot paths)."""
    if rtype in TRANSACTION_TYPES:
        return decode_transaction(rtype, buf, start, end)
    if rtype == RecordType.MESSAGE:
        return decode_message(buf, start, end)
    if rtype == RecordType.CANCEL:
        return decode_cancel(buf, start, end)
    if rtype == RecordType.SCHEDULED:
        return decode_scheduled(buf, start, end)
    if rtype == RecordType.SCHEDULED_CANCEL:
        return decode_scheduled_cancel(buf, start, end)
    if rtype == RecordType.DISPATCH:
        return decode_dispatch(buf, start, end)
    if rtype == RecordType.DELIVERED:
        return decode_delivered(buf, start, end)
    if rtype == RecordType.PARKED:
        return decode_parked(buf, start, end)
    if rtype == RecordType.SCHEDULE:
        return decode_schedule_change(buf, start, end)
    if rtype == RecordType.EPOCH:
        return decode_epoch(buf, start, end)
    raise RecordError(start, f"unknown record type {rtype}")


# --- transactions -----------------------------------------------------------------------------

#: message_log records of transactional (half) messages.
TRANSACTION_TYPES = frozenset({RecordType.PREPARE, RecordType.COMMIT, RecordType.ROLLBACK,
                               RecordType.TXN_CHECK, RecordType.TXN_PARK})
#: The fields every message_log record starts with: store_time, schedule_time, sequence.
_TXN_PREFIX = struct.Struct(">qqQ")
#: Set in the flags of a MESSAGE that a COMMIT made (a committed half message).
FLAG_TRANSACTIONAL = 0x0001
#: The record types whose payloads start with store time, schedule time and sequence, as message_log holds them.
_SEQUENCED_TYPES = frozenset({RecordType.MESSAGE, RecordType.CANCEL, RecordType.SCHEDULE}) | TRANSACTION_TYPES
_MAX_GROUP_BYTES = 255


class ParkReason(enum.IntEnum):
    CHECK_MAX = 1  # asked `check_max` times, never answered COMMIT or ROLLBACK
    RETENTION = 2  # unresolved past retention


@attrs.frozen
class Prepare:
    """A half message: stored, invisible until committed; `group` is the producer group to ask."""

    group: str
    check_immunity_ms: int
    message: Message
    sequence: int = 0


@attrs.frozen
class TxnCheck:
    message_id: str
    schedule_time: int
    checks: int
    store_time: int = 0
    sequence: int = 0


@attrs.frozen
class TxnPark:
    message_id: str
    schedule_time: int
    reason: ParkReason
    store_time: int = 0
    sequence: int = 0


#: Where half messages checked `check_max` times are parked: this prefix, then the producer group.
TRANS_CHECK_MAX_PREFIX = "%TRANS_CHECK_MAX%"


def encode_group(group: str) -> bytes:
    """A producer group's bytes: 1 or more of a subject's characters, short enough that
    `%TRANS_CHECK_MAX%<group>` is a subject (raises BadSubject)."""
    if not isinstance(group, str) or not group:
        raise BadSubject("a producer group is 1 or more characters of [A-Za-z0-9._:%|-]")
    encode_subject(TRANS_CHECK_MAX_PREFIX + group)
    return group.encode("utf-8")


def encode_prepare(group: str, check_immunity_ms: int, message_payload: bytes) -> bytes:
    """The PREPARE payload of a half message whose MESSAGE payload is `message_payload` (its store
    and schedule times are copied into the head)."""
    raw_group = encode_group(group)
    store, sched = MESSAGE_HEAD.unpack_from(message_payload)[:2]
    if not 0 <= check_immunity_ms <= (1 << 62):
        raise ValueError(f"check immunity must be 0 to 2**62 ms, got {check_immunity_ms}")
    return PREPARE_HEAD.pack(store, sched, 0, check_immunity_ms, len(raw_group)) + raw_group + message_payload


@_decoding
def decode_prepare(buf, start: int = 0, end: int | None = None) -> Prepare:
    end = len(buf) if end is None else end
    _store, _sched, seq, immunity, glen = PREPARE_HEAD.unpack_from(buf, start)
    pos = start + PREPARE_HEAD.size
    group = bytes(memoryview(buf)[pos : pos + glen]).decode("utf-8")
    if not group:
        raise ValueError("empty producer group")
    return Prepare(group, immunity, decode_message(buf, pos + glen, end), seq)


def encode_txn_check(c: TxnCheck) -> bytes:
    mid = encode_id(c.message_id)
    return TXN_CHECK_HEAD.pack(c.store_time, c.schedule_time, c.sequence, c.checks, len(mid)) + mid


@_decoding
def decode_txn_check(buf, start: int = 0, end: int | None = None) -> TxnCheck:
    end = len(buf) if end is None else end
    store, sched, seq, checks, idlen = TXN_CHECK_HEAD.unpack_from(buf, start)
    pos = start + TXN_CHECK_HEAD.size
    if pos + idlen != end:
        raise ValueError("check fields do not add up to the payload length")
    return TxnCheck(bytes(memoryview(buf)[pos:end]).decode("utf-8"), sched, checks, store, seq)


def encode_txn_park(t: TxnPark) -> bytes:
    mid = encode_id(t.message_id)
    return TXN_PARK_HEAD.pack(t.store_time, t.schedule_time, t.sequence, t.reason, len(mid)) + mid


@_decoding
def decode_txn_park(buf, start: int = 0, end: int | None = None) -> TxnPark:
    end = len(buf) if end is None else end
    store, sched, seq, reason, idlen = TXN_PARK_HEAD.unpack_from(buf, start)
    pos = start + TXN_PARK_HEAD.size
    if pos + idlen != end:
        raise ValueError("park fields do not add up to the payload length")
    return TxnPark(bytes(memoryview(buf)[pos:end]).decode("utf-8"), sched, ParkReason(reason), store, seq)


def decode_transaction(rtype: int, buf, start: int = 0, end: int | None = None):
    """The value of a transactional record: Prepare, Message (COMMIT), Cancel (ROLLBACK), TxnCheck
    or TxnPark; RecordError if it does not decode."""
    if rtype == RecordType.PREPARE:
        return decode_prepare(buf, start, end)
    if rtype == RecordType.COMMIT:
        return decode_message(buf, start, end)
    if rtype == RecordType.ROLLBACK:
        return decode_cancel(buf, start, end)
    if rtype == RecordType.TXN_CHECK:
        return decode_txn_check(buf, start, end)
    if rtype == RecordType.TXN_PARK:
        return decode_txn_park(buf, start, end)
    raise RecordError(start, f"record type {rtype} is not transactional")
