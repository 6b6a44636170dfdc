"""The wire protocol: frames and the payload of each command, as bytes in and values out, no I/O.

Producers, slaves and tools speak one framed binary protocol. This module owns its bytes (h11
style); a connection task is a short pump: `FrameDecoder.feed` what the socket gave, take frames
with `FrameDecoder.next_frame` until NEED_DATA, send `encode(frame)`. A frame, big-endian::

    offset  size  field
    0       4     magic        0x444C5953 ("DLYS")
    4       1     version      1
    5       1     command      a Command
    6       1     flags        bit 0 set: a response; the other bits must be 0
    7       4     request_id   chosen by the requester, echoed by the response
    11      4     length       n, the payload length in bytes
    15      n     payload      the command's payload (layouts below)
    15+n    4     crc32c       over bytes 0 .. 15+n, header and payload

Rules:

- Every request gets one response: the same command and request_id with the response flag set, or
  an ERROR response carrying the request_id (0 when the header could not be read).
- The receiver caps the payload length (`max_frame_bytes`). A header declaring more is refused as
  soon as the header is read, before any payload arrives: a declared length is never an allocation.
- Bad magic, another version, an unknown command or flag bit, an ERROR that is not a response, or a
  crc mismatch raise RemoteProtocolError, and the decoder stays broken: the server answers with an
  ERROR frame carrying the exception's code, then closes the connection.
- Payload decoders check structure only: they raise RemoteProtocolError for anything truncated,
  trailing, out of its enum or not UTF-8. Limits (id 1-128 bytes, subject characters, body size,
  time range) are the server's to check, through `storage.record.encode_message`.

Payload layouts (str16: u16 length then UTF-8; str32: u32 length then UTF-8; bytes32: u32 length
then bytes; i64 times are epoch milliseconds or a delay in milliseconds)::

    PING       request and response: any bytes, echoed unchanged
    SEND       request:  count u32, then per message: time kind u8, time value i64, id length u16,
                         subject length u16, header count u16, body length u32, id, subject,
                         headers (key str16, value str16 each), body
               response: count u32, then per message: code u16, schedule_time i64, id str16,
                         message str32
    CANCEL     request:  schedule_time i64, id str16 (a Handle)
               response: code u16, outcome u8 (CancelOutcome), message str32
    STATUS     request:  schedule_time i64, id str16 (a Handle)
               response: code u16, state u8 (MessageState), dispatch_time i64 (0: none),
                         broker_group str16 ("": none), message str32
    ERROR      response only: code u16, message str32
    AUTH       request: the shared secret, raw bytes; response: empty (a wrong secret gets an
               ERROR with UNAUTHORIZED and the connection closes)
    META       UTF-8 JSON both ways (`encode_json`, `decode_json`)
    RESCHEDULE request:  schedule_time i64, id str16 (a Handle), time kind u8, time value i64
               response: code u16, outcome u8 (CancelOutcome; RESCHEDULED when it moved),
                         new schedule_time i64 (0: not moved), message str32
    BROWSE     UTF-8 JSON both ways: the query (node/browse.py, BrowseQuery.from_json) and the page,
               {"messages": [...], "cursor": str | null, "examined": n}; bodies in base64
    SCHEDULE   UTF-8 JSON both ways: a schedule request and its answer (schedules/service.py)
    PREPARE    request:  producer group str16, check_immunity_ms i64, then a SEND request of one
                         message; response: a SEND response (its handle names the half message)
    COMMIT,    request:  a Handle (as CANCEL)
    ROLLBACK   response: code u16, state u8 (TransactionState: the resolution now holding), message str32
    TXN_CHECK  sent by the server to a producer of the group: checks u32, producer group str16,
               then a SEND request of one message (time kind AT: its schedule time);
               response: state u8 (TransactionState COMMIT, ROLLBACK or UNKNOWN)
    PRODUCER_REGISTER  request: producer group str16 (this connection answers TXN_CHECK for the
               group's half messages); response: empty
    STATUS     with state PREPARED, the response goes on: checks u32, next_check_time i64
    SYNC_*     defined by the replication modules

Result codes are those of `message.ResultCode`; a code this side does not know is kept as an int,
so an older client still reports what a newer server said.
"""
from __future__ import annotations

import enum
import json
import struct
import types
from typing import Any, Mapping, NamedTuple, Sequence

import attrs
import crc32c as _crc32c

from delayserver.message import (
    MAX_BODY_BYTES, CancelOutcome, Handle, MessageState, ResultCode, TimeKind, TimeSpec, TransactionState,
)

try:  # the compiled SEND decoder (delayserver/native/send.pyx), when the install built it
    from delayserver.native.send import (
        decode_results as _native_decode_results, decode_rows as _native_decode_rows, encode_items as _native_encode_items,
        encode_results as _native_encode_results,
    )
except ImportError:
    _native_decode_rows = _native_encode_items = _native_encode_results = _native_decode_results = None

#: The delay server's default port (the meta server's is 20800).
DEFAULT_PORT = 20801
MAGIC = 0x444C5953
VERSION = 1
FLAG_RESPONSE = 0x01
HEADER = struct.Struct(">IBBBII")
HEADER_SIZE = HEADER.size
CRC = struct.Struct(">I")
FRAME_OVERHEAD = HEADER_SIZE + CRC.size
#: Room for one message at the largest body limit (message.MAX_BODY_BYTES) plus its id, subject
#: and headers: the one frame cap of clients and, by default, of servers (`max_frame_bytes`).
DEFAULT_MAX_FRAME_BYTES = MAX_BODY_BYTES + 128 * 1024
MAX_U32 = 0xFFFFFFFF


class Command(enum.IntEnum):
    PING = 1
    SEND = 2
    CANCEL = 3
    STATUS = 4
    ERROR = 5
    AUTH = 6
    SYNC_MESSAGE_LOG = 16
    SYNC_DISPATCH_LOG = 17
    SYNC_SNAPSHOT = 18
    SYNC_DISPATCH_DIGEST = 19
    # epochs and fencing
    SYNC_EPOCH_END = 24
    META = 32
    # browse, reschedule, dedupe, schedules: 48-63
    RESCHEDULE = 48
    BROWSE = 49
    SCHEDULE = 50
    # transactions (40-47)
    PREPARE = 40
    COMMIT = 41
    ROLLBACK = 42
    TXN_CHECK = 43
    PRODUCER_REGISTER = 44


_COMMANDS = {int(c): c for c in Command}


class ProtocolError(Exception):
    """The protocol was broken, by this side or by the peer."""


class LocalProtocolError(ProtocolError):
    """This side tried to encode something the protocol cannot carry."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that break the protocol; `code` is what to answer in an ERROR frame,
    `request_id` the request it answers (0: none could be read). For a frame refused for its
    declared length, `unread` is how many of its bytes have not arrived yet: a server may read and
    drop that many before closing, so that the peer, done sending, reads the answer."""

    def __init__(self, message: str, code: ResultCode = ResultCode.BAD_REQUEST, *, request_id: int = 0,
                 unread: int = 0):
        super().__init__(message)
        self.code = code
        self.request_id = request_id
        self.unread = unread


class _NeedData(enum.Enum):
    NEED_DATA = "NEED_DATA"

    def __repr__(self) -> str:
        return "NEED_DATA"


#: What `FrameDecoder.next_frame` returns while no whole frame is buffered.
NEED_DATA = _NeedData.NEED_DATA


@attrs.frozen
class Frame:
    """One frame; `payload` is the command's payload, encoded by the codecs below."""

    command: Command
    request_id: int
    payload: bytes
    is_response: bool = False


def encode(frame: Frame, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """The bytes of `frame`.

    Raises LocalProtocolError for an unknown command, a request_id outside u32, a payload that is
    not bytes or is longer than `max_frame_bytes` (the peer would refuse it), or an ERROR frame
    that is not a response.
    """
    command = _COMMANDS.get(frame.command) if isinstance(frame.command, int) else None
    if command is None:
        raise LocalProtocolError(f"unknown command {frame.command!r}")
    if not isinstance(frame.request_id, int) or not 0 <= frame.request_id <= MAX_U32:
        raise LocalProtocolError(f"request id {frame.request_id!r} is outside 0..{MAX_U32}")
    if not isinstance(frame.payload, bytes):
        raise LocalProtocolError(f"payload must be bytes, not {type(frame.payload).__name__}")
    if len(frame.payload) > max_frame_bytes:
        raise LocalProtocolError(f"payload of {len(frame.payload)} bytes is over {max_frame_bytes}")
    if command is Command.ERROR and not frame.is_response:
        raise LocalProtocolError("an ERROR frame must be a response")
    flags = FLAG_RESPONSE if frame.is_response else 0
    header = HEADER.pack(MAGIC, VERSION, command, flags, frame.request_id, len(frame.payload))
    crc = _crc32c.crc32c(frame.payload, value=_crc32c.crc32c(header))
    return b"".join((header, frame.payload, CRC.pack(crc)))


@attrs.define(eq=False)
class FrameDecoder:
    """Turns the bytes of one connection into Frames; see the module docstring for the rules."""

    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    # Bytes before _pos are decoded already; feed() drops them, so the buffer holds at most the
    # undecoded tail plus what one feed adds, and next_frame() never copies it.
    _buffer: bytearray = attrs.field(factory=bytearray, init=False)
    _pos: int = attrs.field(default=0, init=False)
    _error: RemoteProtocolError | None = attrs.field(default=None, init=False)

    @property
    def buffered_bytes(self) -> int:
        """Bytes received and not yet returned as a frame (non-zero at EOF: a torn frame)."""
        return len(self._buffer) - self._pos

    def feed(self, data: bytes) -> None:
        """Append bytes received from the peer (ignored once the decoder is broken)."""
        if self._error is not None:
            return
        if self._pos:
            # Deleting a bytearray's prefix moves its start pointer, it does not copy the rest.
            del self._buffer[: self._pos]
            self._pos = 0
        self._buffer += data

    def next_frame(self) -> Frame | _NeedData:
        """The next whole frame, or NEED_DATA.

        Raises RemoteProtocolError when the peer broke the protocol, and again on every later call.
        """
        if self._error is not None:
            raise RemoteProtocolError(f"connection already failed: {self._error}", self._error.code,
                                      request_id=self._error.request_id)
        try:
            return self._next_frame()
        except RemoteProtocolError as exc:
            self._error = exc
            raise

    def _next_frame(self) -> Frame | _NeedData:
        buf, pos = self._buffer, self._pos
        if len(buf) - pos < HEADER_SIZE:
            return NEED_DATA
        magic, version, command, flags, request_id, length = HEADER.unpack_from(buf, pos)
        if magic != MAGIC:
            raise RemoteProtocolError(f"bad magic {magic:#010x}")
        if version != VERSION:
            raise RemoteProtocolError(f"unsupported protocol version {version}")
        if command not in _COMMANDS:
            raise RemoteProtocolError(f"unknown command {command}")
        if flags & ~FLAG_RESPONSE:
            raise RemoteProtocolError(f"unknown flag bits {flags:#04x}")
        if length > self.max_frame_bytes:
            raise RemoteProtocolError(
                f"declared payload of {length} bytes is over {self.max_frame_bytes}",
                ResultCode.MESSAGE_TOO_LARGE, request_id=request_id,
                unread=max(0, FRAME_OVERHEAD + length - (len(buf) - pos)),
            )
        is_response = bool(flags & FLAG_RESPONSE)
        if command == Command.ERROR and not is_response:
            raise RemoteProtocolError("an ERROR frame must be a response")
        stop = pos + HEADER_SIZE + length
        if len(buf) - stop < CRC.size:
            return NEED_DATA
        with memoryview(buf) as view:
            crc = _crc32c.crc32c(view[pos:stop])
            payload = bytes(view[pos + HEADER_SIZE : stop])
        if crc != CRC.unpack_from(buf, stop)[0]:
            raise RemoteProtocolError(f"crc mismatch in frame of request {request_id}")
        self._pos = stop + CRC.size
        return Frame(_COMMANDS[command], request_id, payload, is_response)


# --- values carried by payloads ---------------------------------------------------------------


# SendItem and SendResult are made once per message on both sides of the hot path: named tuples,
# immutable as a frozen attrs class is, are built without its per-field object.__setattr__ calls.
_NO_HEADERS: Mapping[str, str] = types.MappingProxyType({})


class SendItem(NamedTuple):
    message_id: str
    subject: str
    time: TimeSpec
    body: bytes = b""
    headers: Mapping[str, str] = _NO_HEADERS


class SendResult(NamedTuple):
    code: int
    message: str
    schedule_time: int
    message_id: str

    @property
    def handle(self) -> Handle:
        return Handle(self.schedule_time, self.message_id)


@attrs.frozen
class CancelResult:
    code: int
    message: str
    outcome: CancelOutcome


@attrs.frozen
class StatusResult:
    code: int
    message: str
    state: MessageState
    dispatch_time: int = 0
    broker_group: str = ""
    # A PREPARED half message: how often the producer group was asked, and when it is asked next.
    checks: int = 0
    next_check_time: int = 0


@attrs.frozen
class RescheduleResult:
    code: int
    message: str
    outcome: CancelOutcome
    schedule_time: int = 0  # the new handle's time when the message moved


@attrs.frozen
class ErrorResult:
    code: int
    message: str


# --- encoding and decoding helpers ------------------------------------------------------------

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_SEND_ITEM = struct.Struct(">BqHHHI")  # time kind, time value, id, subject, header count, body
_SEND_RESULT = struct.Struct(">HqH")  # code, schedule_time, id length
_HANDLE = struct.Struct(">qH")  # schedule_time, id length
_CANCEL_RESULT = struct.Struct(">HBI")  # code, outcome, message length
_STATUS_RESULT = struct.Struct(">HBqH")  # code, state, dispatch_time, broker_group length
_ERROR_RESULT = struct.Struct(">HI")  # code, message length
_TXN_STATUS = struct.Struct(">Iq")  # checks, next_check_time


def _pack(layout: struct.Struct, *values) -> bytes:
    try:
        return layout.pack(*values)
    except struct.error as exc:
        raise LocalProtocolError(f"a field is out of range or of the wrong type: {exc}") from None


def _utf8(text: str, what: str, limit: int = 0xFFFF) -> bytes:
    if not isinstance(text, str):
        raise LocalProtocolError(f"{what} must be a str, not {type(text).__name__}")
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise LocalProtocolError(f"{what} cannot be encoded as UTF-8: {exc}") from None
    if len(raw) > limit:
        raise LocalProtocolError(f"{what} is {len(raw)} bytes, over {limit}")
    return raw


def _str32(text: str, what: str) -> bytes:
    raw = _utf8(text, what, MAX_U32)
    return _U32.pack(len(raw)) + raw


def _enum(cls: type[enum.IntEnum], raw: int, what: str):
    try:
        return cls(raw)
    except ValueError:
        raise RemoteProtocolError(f"unknown {what} {raw}") from None


def _result_code(raw: int) -> int:
    return ResultCode(raw) if raw in ResultCode._value2member_map_ else raw


class _Reader:
    """Reads a payload front to back; every shortfall or leftover is a RemoteProtocolError."""

    def __init__(self, payload: bytes, what: str):
        self._view = memoryview(payload)
        self._pos = 0
        self._what = what

    def unpack(self, layout: struct.Struct) -> tuple:
        end = self._pos + layout.size
        if end > len(self._view):
            raise RemoteProtocolError(f"{self._what} payload is truncated")
        values = layout.unpack_from(self._view, self._pos)
        self._pos = end
        return values

    def take(self, length: int) -> bytes:
        end = self._pos + length
        if end > len(self._view):
            raise RemoteProtocolError(f"{self._what} payload is truncated")
        raw = bytes(self._view[self._pos : end])
        self._pos = end
        return raw

    def text(self, length: int, what: str) -> str:
        try:
            return self.take(length).decode("utf-8")
        except UnicodeDecodeError:
            raise RemoteProtocolError(f"{what} in {self._what} payload is not UTF-8") from None

    def str16(self, what: str) -> str:
        return self.text(self.unpack(_U16)[0], what)

    def str32(self, what: str) -> str:
        return self.text(self.unpack(_U32)[0], what)

    def rest(self) -> bytes:
        """What is left of the payload, all taken."""
        return self.take(len(self._view) - self._pos)

    def finish(self) -> None:
        if self._pos != len(self._view):
            trailing = len(self._view) - self._pos
            raise RemoteProtocolError(f"{self._what} payload has {trailing} trailing bytes")


# --- payload codecs ---------------------------------------------------------------------------
# Encoders raise LocalProtocolError for a value the layout cannot carry (a length or number out
# of its field, a str that is not encodable); decoders raise RemoteProtocolError and nothing else.


SEND_REQUEST_OVERHEAD = _U32.size


def send_item_size(item: SendItem) -> int:
    """The bytes `item` takes in a SEND request payload (a client cuts its batches by it)."""
    message_id, subject = item.message_id, item.subject
    if not item.headers and type(message_id) is str and type(subject) is str and message_id.isascii() \
            and subject.isascii():  # the usual item: an ASCII string's length is its length in UTF-8
        return _SEND_ITEM_SIZE + len(item.body) + len(message_id) + len(subject)
    size = _SEND_ITEM.size + len(item.body)
    for text in (item.message_id, item.subject, *item.headers.keys(), *item.headers.values()):
        size += len(text.encode("utf-8", "surrogatepass")) if isinstance(text, str) else 0
    return size + 2 * _U16.size * len(item.headers)


# The SEND codecs run per message of every batch, on the server and in producers. Each has a fast
# path written for the valid case and the reference codec, which checks field by field and raises
# the precise error: the fast path gives up (None) on anything it does not take whole, and the
# reference codec then decides. The fast path accepts only what the reference accepts, and returns
# the same value (tests/test_protocol_fast.py checks both on generated and damaged payloads).

_SEND_ITEM_SIZE = _SEND_ITEM.size
_SEND_RESULT_SIZE = _SEND_RESULT.size
#: The TimeKind of each u8 value (None: not a time kind), indexed faster than an enum is called.
#: A SEND item's time of this kind is kept in its SendBatch row as the epoch ms itself (an int),
#: not a TimeSpec: a batch of order timeouts carries a time per message, and the receiver takes
#: one within its window as it is (`Receiver.send`).
_AT_KIND = int(TimeKind.AT)
_TIME_KIND_BY_VALUE = tuple(TimeKind(v) if v in TimeKind._value2member_map_ else None for v in range(256))
#: The ResultCode of each u16 value that is one, else the int itself (`_result_code`).
_RESULT_CODE_BY_VALUE = {c.value: c for c in ResultCode}


def encode_send_request(items: Sequence[SendItem]) -> bytes:
    """The SEND request payload for a batch of messages."""
    payload = _encode_send_request_fast(items)
    return payload if payload is not None else _encode_send_request_checked(items)


def _encode_send_request_fast(items: Sequence[SendItem]) -> bytes | None:
    """The compiled kernel (delayserver/native/send.pyx) when built, else `_encode_send_request_py`;
    None on anything they do not take whole."""
    if _native_encode_items is not None:
        return _native_encode_items(items, SendItem, TimeKind)
    return _encode_send_request_py(items)


def _encode_send_request_py(items: Sequence[SendItem]) -> bytes | None:
    """The SEND request in one pass, in Python: the compiled kernel's reference."""
    try:
        parts = [_U32.pack(len(items))]
        append, pack_item, pack_u16 = parts.append, _SEND_ITEM.pack, _U16.pack
        for item in items:
            message_id, subject, body, time, headers = item.message_id, item.subject, item.body, item.time, item.headers
            if (type(message_id) is not str or type(subject) is not str or type(body) is not bytes
                    or type(time.kind) is not TimeKind):
                return None
            raw_id, raw_subject = message_id.encode(), subject.encode()
            if len(raw_id) > 0xFFFF or len(raw_subject) > 0xFFFF:
                return None
            append(pack_item(time.kind, time.value, len(raw_id), len(raw_subject), len(headers), len(body)))
            append(raw_id)
            append(raw_subject)
            for key, value in headers.items():
                if type(key) is not str or type(value) is not str:
                    return None
                raw_key, raw_value = key.encode(), value.encode()
                if len(raw_key) > 0xFFFF or len(raw_value) > 0xFFFF:
                    return None
                append(pack_u16(len(raw_key)))
                append(raw_key)
                append(pack_u16(len(raw_value)))
                append(raw_value)
            append(body)
        return b"".join(parts)
    except Exception:  # anything odd (a lone surrogate, a value out of its field): the reference decides
        return None


def _encode_send_request_checked(items: Sequence[SendItem]) -> bytes:
    parts = [_pack(_U32, len(items))]
    for item in items:
        message_id = _utf8(item.message_id, "message id")
        subject = _utf8(item.subject, "subject")
        headers = [(_utf8(k, "header key"), _utf8(v, "header value")) for k, v in item.headers.items()]
        if not isinstance(item.body, bytes):
            raise LocalProtocolError(f"body must be bytes, not {type(item.body).__name__}")
        if not isinstance(item.time.kind, TimeKind):
            raise LocalProtocolError(f"unknown time kind {item.time.kind!r}")
        lengths = (len(message_id), len(subject), len(headers), len(item.body))
        parts.append(_pack(_SEND_ITEM, item.time.kind, item.time.value, *lengths))
        parts += (message_id, subject)
        for key, value in headers:
            parts += (_U16.pack(len(key)), key, _U16.pack(len(value)), value)
        parts.append(item.body)
    return b"".join(parts)


def decode_send_request(payload: bytes) -> Sequence[SendItem]:
    """The batch of a SEND request payload (a SendBatch when it takes the common shape, else a
    list); a header key given twice is a RemoteProtocolError."""
    batch = _decode_send_request_fast(payload)
    return batch if batch is not None else _decode_send_request_checked(payload)


class SendBatch(Sequence[SendItem]):
    """A decoded SEND request: a sequence of SendItems, made only when asked for, over the request
    itself. Each item's row tells where its message lies in `buf`: id, subject, header block and
    body back to back, in the order and layout of a MESSAGE record's variable part (record.py), so
    that the receiver stores a message by putting its head in front of that span, not by encoding
    the message again.

    `rows[i]`: ``(message_id, subject, time, headers, id_at, id_len, subject_len, headers_len,
    body_len)``; `time` a TimeSpec, or for an epoch time (`TimeKind.AT`) its value, an int."""

    __slots__ = ("buf", "rows")

    def __init__(self, buf: bytes, rows: list[tuple]):
        self.buf = buf
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def _item(self, row: tuple) -> SendItem:
        message_id, subject, time, headers, id_at, id_len, subject_len, headers_len, body_len = row
        body_at = id_at + id_len + subject_len + headers_len
        if type(time) is int:
            time = TimeSpec(TimeKind.AT, time)
        return SendItem(message_id, subject, time, self.buf[body_at : body_at + body_len], headers)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._item(row) for row in self.rows[i]]
        return self._item(self.rows[i])

    def __iter__(self):
        return map(self._item, self.rows)

    def __eq__(self, other) -> bool:  # equal to the list of the same items, as the other decoder gives
        if isinstance(other, (SendBatch, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"SendBatch({list(self)!r})"


def _time_spec(kind: int, value: int) -> TimeSpec | None:
    time_kind = _TIME_KIND_BY_VALUE[kind]
    return None if time_kind is None else TimeSpec(time_kind, value)


def _decode_send_request_fast(payload: bytes) -> SendBatch | None:
    """One pass over the payload with every bound checked; None on anything else. The compiled
    kernel (delayserver/native/send.pyx) when built, else `_decode_send_request_py`."""
    buf = payload if type(payload) is bytes else bytes(payload)
    if _native_decode_rows is None:
        return _decode_send_request_py(buf)
    rows = _native_decode_rows(buf, _time_spec, _AT_KIND)
    return None if rows is None else SendBatch(buf, rows)


def _decode_send_request_py(payload: bytes) -> SendBatch | None:
    """`_decode_send_request_fast` in Python: every bound checked by hand; the compiled kernel's
    reference."""
    buf = payload if type(payload) is bytes else bytes(payload)
    end = len(buf)
    if end < 4:
        return None
    count = buf[0] << 24 | buf[1] << 16 | buf[2] << 8 | buf[3]
    if count * _SEND_ITEM_SIZE > end - 4:
        return None
    pos, size, unpack, kinds = 4, _SEND_ITEM_SIZE, _SEND_ITEM.unpack_from, _TIME_KIND_BY_VALUE
    rows = []
    append = rows.append
    # A batch usually shares its time spec (one delay, or one level): each distinct one is made once.
    specs: dict[tuple[int, int], TimeSpec] = {}
    try:
        for _ in range(count):
            if pos + size > end:
                return None
            kind, value, id_len, subject_len, header_count, body_len = unpack(buf, pos)
            spec = value if kind == _AT_KIND else specs.get((kind, value))
            if spec is None:
                time_kind = kinds[kind]
                if time_kind is None:
                    return None
                spec = specs[kind, value] = TimeSpec(time_kind, value)
            id_at = pos + size
            subject_at = id_at + id_len
            at = headers_at = subject_at + subject_len
            headers = {}
            for _ in range(header_count):
                key_at = at + 2
                if key_at > end:
                    return None
                value_len_at = key_at + (buf[at] << 8 | buf[at + 1])
                value_at = value_len_at + 2
                if value_at > end:
                    return None
                at = value_at + (buf[value_len_at] << 8 | buf[value_len_at + 1])
                if at > end:
                    return None
                key = buf[key_at:value_len_at].decode()
                if key in headers:
                    return None
                headers[key] = buf[value_at:at].decode()
            pos = at + body_len
            if pos > end:
                return None
            append((buf[id_at:subject_at].decode(), buf[subject_at:headers_at].decode(), spec, headers,
                    id_at, id_len, subject_len, at - headers_at, body_len))
    except UnicodeDecodeError:
        return None
    return SendBatch(buf, rows) if pos == end else None


def _decode_send_request_checked(payload: bytes) -> list[SendItem]:
    reader = _Reader(payload, "SEND request")
    (count,) = reader.unpack(_U32)
    items = []
    for _ in range(count):
        kind, value, id_len, subject_len, header_count, body_len = reader.unpack(_SEND_ITEM)
        time = TimeSpec(_enum(TimeKind, kind, "time kind"), value)
        message_id = reader.text(id_len, "message id")
        subject = reader.text(subject_len, "subject")
        headers = {}
        for _ in range(header_count):
            key = reader.str16("header key")
            if key in headers:
                raise RemoteProtocolError(f"header {key!r} is given twice")
            headers[key] = reader.str16("header value")
        items.append(SendItem(message_id, subject, time, reader.take(body_len), headers))
    reader.finish()
    return items


def encode_send_response(results: Sequence[SendResult]) -> bytes:
    """The SEND response payload: one result per message, in request order."""
    payload = _encode_send_response_fast(results)
    return payload if payload is not None else _encode_send_response_checked(results)


def _encode_send_response_fast(results: Sequence[SendResult]) -> bytes | None:
    """The compiled kernel (delayserver/native/send.pyx) when built, else `_encode_send_response_py`;
    None on anything they do not take whole."""
    if _native_encode_results is not None:
        return _native_encode_results(results, SendResult)
    return _encode_send_response_py(results)


def _encode_send_response_py(results: Sequence[SendResult]) -> bytes | None:
    """The SEND response in one pass, in Python: the compiled kernel's reference."""
    try:
        parts = [_U32.pack(len(results))]
        append, pack_result, pack_u32 = parts.append, _SEND_RESULT.pack, _U32.pack
        # The result texts repeat ("stored"): each distinct one is encoded once.
        texts: dict[str, bytes] = {}
        for result in results:
            message_id, message = result.message_id, result.message
            if type(message_id) is not str or type(message) is not str:
                return None
            raw_id = message_id.encode()
            if len(raw_id) > 0xFFFF:
                return None
            text = texts.get(message)
            if text is None:
                raw = message.encode()
                if len(raw) > MAX_U32:
                    return None
                text = texts[message] = pack_u32(len(raw)) + raw
            append(pack_result(result.code, result.schedule_time, len(raw_id)))
            append(raw_id)
            append(text)
        return b"".join(parts)
    except Exception:  # the reference decides (and raises LocalProtocolError)
        return None


def _encode_send_response_checked(results: Sequence[SendResult]) -> bytes:
    parts = [_pack(_U32, len(results))]
    for result in results:
        message_id = _utf8(result.message_id, "message id")
        parts += (
            _pack(_SEND_RESULT, result.code, result.schedule_time, len(message_id)),
            message_id,
            _str32(result.message, "result message"),
        )
    return b"".join(parts)


def decode_send_response(payload: bytes) -> list[SendResult]:
    results = _decode_send_response_fast(payload)
    return results if results is not None else _decode_send_response_checked(payload)


def _decode_send_response_fast(payload: bytes) -> list[SendResult] | None:
    """The compiled kernel (delayserver/native/send.pyx) when built, else `_decode_send_response_py`;
    None on anything they do not take whole (the checked decoder then says what is wrong)."""
    if _native_decode_results is not None:
        return _native_decode_results(payload if type(payload) is bytes else bytes(payload), SendResult,
                                      _RESULT_CODE_BY_VALUE)
    return _decode_send_response_py(payload)


def _decode_send_response_py(payload: bytes) -> list[SendResult] | None:
    """The SEND response in one pass, in Python: the compiled kernel's reference."""
    buf = payload if type(payload) is bytes else bytes(payload)
    end = len(buf)
    if end < 4:
        return None
    count = buf[0] << 24 | buf[1] << 16 | buf[2] << 8 | buf[3]
    if count * _SEND_RESULT_SIZE > end - 4:
        return None
    pos, size, unpack, codes = 4, _SEND_RESULT_SIZE, _SEND_RESULT.unpack_from, _RESULT_CODE_BY_VALUE
    new = tuple.__new__
    texts: dict[bytes, str] = {}
    results = []
    append = results.append
    try:
        for _ in range(count):
            if pos + size > end:
                return None
            code, schedule_time, id_len = unpack(buf, pos)
            id_at = pos + size
            length_at = id_at + id_len
            text_at = length_at + 4
            if text_at > end:
                return None
            pos = text_at + (buf[length_at] << 24 | buf[length_at + 1] << 16 | buf[length_at + 2] << 8
                             | buf[length_at + 3])
            if pos > end:
                return None
            raw = buf[text_at:pos]
            text = texts.get(raw)
            if text is None:
                text = texts[raw] = raw.decode()
            # As SendResult(...) makes it, without the named tuple's Python-level constructor.
            append(new(SendResult, (codes.get(code, code), text, schedule_time, buf[id_at:length_at].decode())))
    except UnicodeDecodeError:
        return None
    return results if pos == end else None


def _decode_send_response_checked(payload: bytes) -> list[SendResult]:
    reader = _Reader(payload, "SEND response")
    (count,) = reader.unpack(_U32)
    results = []
    for _ in range(count):
        code, schedule_time, id_len = reader.unpack(_SEND_RESULT)
        message_id = reader.text(id_len, "message id")
        message = reader.str32("result message")
        results.append(SendResult(_result_code(code), message, schedule_time, message_id))
    reader.finish()
    return results


def encode_handle(handle: Handle) -> bytes:
    """The CANCEL or STATUS request payload for the message `handle` names."""
    message_id = _utf8(handle.message_id, "message id")
    return _pack(_HANDLE, handle.schedule_time, len(message_id)) + message_id


def decode_handle(payload: bytes) -> Handle:
    """The Handle of a CANCEL or STATUS request; its limits are not checked here."""
    reader = _Reader(payload, "handle")
    schedule_time, id_len = reader.unpack(_HANDLE)
    handle = Handle(schedule_time, reader.text(id_len, "message id"))
    reader.finish()
    return handle


def encode_cancel_response(result: CancelResult) -> bytes:
    if not isinstance(result.outcome, CancelOutcome):
        raise LocalProtocolError(f"unknown cancel outcome {result.outcome!r}")
    message = _utf8(result.message, "result message", MAX_U32)
    return _pack(_CANCEL_RESULT, result.code, result.outcome, len(message)) + message


def decode_cancel_response(payload: bytes) -> CancelResult:
    reader = _Reader(payload, "CANCEL response")
    code, outcome, message_len = reader.unpack(_CANCEL_RESULT)
    outcome = _enum(CancelOutcome, outcome, "cancel outcome")
    result = CancelResult(_result_code(code), reader.text(message_len, "result message"), outcome)
    reader.finish()
    return result


def encode_status_response(result: StatusResult) -> bytes:
    if not isinstance(result.state, MessageState):
        raise LocalProtocolError(f"unknown message state {result.state!r}")
    group = _utf8(result.broker_group, "broker group")
    head = _pack(_STATUS_RESULT, result.code, result.state, result.dispatch_time, len(group))
    tail = _pack(_TXN_STATUS, result.checks, result.next_check_time) if result.state == MessageState.PREPARED else b""
    return b"".join((head, group, _str32(result.message, "result message"), tail))


def decode_status_response(payload: bytes) -> StatusResult:
    reader = _Reader(payload, "STATUS response")
    code, state, dispatch_time, group_len = reader.unpack(_STATUS_RESULT)
    state = _enum(MessageState, state, "message state")
    group = reader.text(group_len, "broker group")
    message = reader.str32("result message")
    checks, next_check_time = reader.unpack(_TXN_STATUS) if state == MessageState.PREPARED else (0, 0)
    result = StatusResult(_result_code(code), message, state, dispatch_time, group, checks, next_check_time)
    reader.finish()
    return result


_TIME_SPEC = struct.Struct(">Bq")
_RESCHEDULE_RESULT = struct.Struct(">HBq")  # code, outcome, new schedule_time


def encode_reschedule_request(handle: Handle, time: TimeSpec) -> bytes:
    if not isinstance(time.kind, TimeKind):
        raise LocalProtocolError(f"unknown time kind {time.kind!r}")
    return encode_handle(handle) + _pack(_TIME_SPEC, time.kind, time.value)


def decode_reschedule_request(payload: bytes) -> tuple[Handle, TimeSpec]:
    reader = _Reader(payload, "RESCHEDULE request")
    schedule_time, id_len = reader.unpack(_HANDLE)
    handle = Handle(schedule_time, reader.text(id_len, "message id"))
    kind, value = reader.unpack(_TIME_SPEC)
    reader.finish()
    return handle, TimeSpec(_enum(TimeKind, kind, "time kind"), value)


def encode_reschedule_response(result: RescheduleResult) -> bytes:
    if not isinstance(result.outcome, CancelOutcome):
        raise LocalProtocolError(f"unknown outcome {result.outcome!r}")
    head = _pack(_RESCHEDULE_RESULT, result.code, result.outcome, result.schedule_time)
    return head + _str32(result.message, "result message")


def decode_reschedule_response(payload: bytes) -> RescheduleResult:
    reader = _Reader(payload, "RESCHEDULE response")
    code, outcome, schedule_time = reader.unpack(_RESCHEDULE_RESULT)
    outcome = _enum(CancelOutcome, outcome, "outcome")
    result = RescheduleResult(_result_code(code), reader.str32("result message"), outcome, schedule_time)
    reader.finish()
    return result


def encode_error(result: ErrorResult) -> bytes:
    """The ERROR response payload."""
    message = _utf8(result.message, "error message", MAX_U32)
    return _pack(_ERROR_RESULT, result.code, len(message)) + message


def decode_error(payload: bytes) -> ErrorResult:
    reader = _Reader(payload, "ERROR response")
    code, message_len = reader.unpack(_ERROR_RESULT)
    result = ErrorResult(_result_code(code), reader.text(message_len, "error message"))
    reader.finish()
    return result


def encode_json(obj: Any) -> bytes:
    """Compact UTF-8 JSON of `obj`; LocalProtocolError if it is not JSON (NaN and Infinity included)."""
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:
        raise LocalProtocolError(f"not encodable as JSON: {exc}") from None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def decode_json(payload: bytes) -> Any:
    """The value of a UTF-8 JSON payload; RemoteProtocolError for anything else (NaN included)."""
    try:
        return json.loads(payload.decode("utf-8"), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise RemoteProtocolError(f"payload is not JSON: {exc}") from None


# --- transactions -----------------------------------------------------------------------------

_I64 = struct.Struct(">q")
_TXN_RESULT = struct.Struct(">HBI")  # code, TransactionState, message length
_TXN_ANSWER = struct.Struct(">B")


@attrs.frozen
class TransactionResult:
    """The answer to COMMIT or ROLLBACK: `state` is the resolution now holding."""

    code: int
    message: str
    state: TransactionState


@attrs.frozen
class CheckRequest:
    """The server asks a producer of `group` how the local transaction of `item` ended."""

    group: str
    checks: int
    item: SendItem


def _str16(text: str, what: str) -> bytes:
    raw = _utf8(text, what)
    return _U16.pack(len(raw)) + raw


def _one_item(reader: _Reader, what: str) -> SendItem:
    items = decode_send_request(reader.rest())
    if len(items) != 1:
        raise RemoteProtocolError(f"{what} carries {len(items)} messages, not one")
    return items[0]


def encode_prepare_request(group: str, check_immunity_ms: int, item: SendItem) -> bytes:
    return _str16(group, "producer group") + _pack(_I64, check_immunity_ms) + encode_send_request([item])


def decode_prepare_request(payload: bytes) -> tuple[str, int, SendItem]:
    """``(producer group, check_immunity_ms, message)`` of a PREPARE request."""
    reader = _Reader(payload, "PREPARE request")
    group = reader.str16("producer group")
    (immunity,) = reader.unpack(_I64)
    return group, immunity, _one_item(reader, "PREPARE request")


def encode_transaction_response(result: TransactionResult) -> bytes:
    if not isinstance(result.state, TransactionState):
        raise LocalProtocolError(f"unknown transaction state {result.state!r}")
    message = _utf8(result.message, "result message", MAX_U32)
    return _pack(_TXN_RESULT, result.code, result.state, len(message)) + message


def decode_transaction_response(payload: bytes) -> TransactionResult:
    reader = _Reader(payload, "transaction response")
    code, state, message_len = reader.unpack(_TXN_RESULT)
    state = _enum(TransactionState, state, "transaction state")
    result = TransactionResult(_result_code(code), reader.text(message_len, "result message"), state)
    reader.finish()
    return result


def encode_check_request(check: CheckRequest) -> bytes:
    return _pack(_U32, check.checks) + _str16(check.group, "producer group") + encode_send_request([check.item])


def decode_check_request(payload: bytes) -> CheckRequest:
    reader = _Reader(payload, "TXN_CHECK request")
    (checks,) = reader.unpack(_U32)
    group = reader.str16("producer group")
    return CheckRequest(group, checks, _one_item(reader, "TXN_CHECK request"))


def encode_check_response(state: TransactionState) -> bytes:
    if state not in (TransactionState.COMMIT, TransactionState.ROLLBACK, TransactionState.UNKNOWN):
        raise LocalProtocolError(f"a check is answered COMMIT, ROLLBACK or UNKNOWN, not {state!r}")
    return _TXN_ANSWER.pack(state)


def decode_check_response(payload: bytes) -> TransactionState:
    reader = _Reader(payload, "TXN_CHECK response")
    (raw,) = reader.unpack(_TXN_ANSWER)
    reader.finish()
    state = _enum(TransactionState, raw, "transaction state")
    if state == TransactionState.PARKED:
        raise RemoteProtocolError("a check is answered COMMIT, ROLLBACK or UNKNOWN, not PARKED")
    return state


def encode_register_request(group: str) -> bytes:
    return _str16(group, "producer group")


def decode_register_request(payload: bytes) -> str:
    reader = _Reader(payload, "PRODUCER_REGISTER request")
    group = reader.str16("producer group")
    reader.finish()
    return group
