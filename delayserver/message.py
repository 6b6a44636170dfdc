"""The message kernel: what a message is, whoever carries it. Pure: no I/O, no other module.

Owned here, and nowhere else:

- the limits (id, subject, headers, body, time range, the one body limit a client checks before
  sending) and the subject rule;
- the validators, which turn a field into its bytes or raise the error of its result code;
- the result codes (`ResultCode`) and the exceptions that carry them (`DelayServerError` and its
  subclasses): one table for the wire, the server, the storage layer and the clients;
- the values a producer holds: `TimeSpec` (when), `Handle` (which message), `MessageState` and
  `CancelOutcome` (what became of it);
- `parse_address`, the one reader of ``HOST:PORT`` for configuration, clients and tools.

Storage, the protocol, the meta server and the clients import this module; it imports none of them.
"""
from __future__ import annotations

import enum
import re
import urllib.parse
from typing import NamedTuple

import attrs

# --- limits ---------------------------------------------------------------------------------

MAX_ID_BYTES = 128
MAX_SUBJECT_BYTES = 255
MAX_HEADERS_BYTES = 32 * 1024
#: The default of `max_message_bytes`, the body limit a node enforces.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
#: The largest body any node can take (a node's `max_message_bytes` may not be set above it): a
#: client refuses a bigger body before sending it, with MessageTooLarge, instead of sending a
#: frame the server would have to cut off.
MAX_BODY_BYTES = 8 * 1024 * 1024
#: Schedule times are epoch milliseconds from 1970 to the end of year 9999 (UTC). Anything outside
#: is refused before it reaches arithmetic, so no far time can wrap around into "now".
MIN_TIME_MS = 0
MAX_TIME_MS = 253_402_300_799_999
#: A delay or delay level travels as a signed 64-bit number; anything outside cannot be a time.
MIN_I64 = -(1 << 63)
MAX_I64 = (1 << 63) - 1

SUBJECT_RE = re.compile(rb"[A-Za-z0-9._:%|\-]{1,255}\Z")


# --- result codes and their exceptions -------------------------------------------------------


class ResultCode(enum.IntEnum):
    OK = 0
    BAD_REQUEST = 1
    MESSAGE_TOO_LARGE = 2
    BAD_SUBJECT = 3
    BAD_MESSAGE_ID = 4
    BAD_SCHEDULE_TIME = 5
    BAD_HEADERS = 6
    NOT_MASTER = 7
    DISK_FULL = 8
    READ_ONLY = 9
    BUSY = 10
    UNAUTHORIZED = 11
    NOT_FOUND = 12
    INTERNAL = 13
    NODE_ID_TAKEN = 14
    UNAVAILABLE = 15
    # browse, reschedule, dedupe, schedules: 30-39
    DUPLICATE = 30  # a success: the id was accepted within dedupe_window; the answer is its first handle
    # transactions (24-29)
    TXN_NOT_FOUND = 24
    TXN_RESOLVED = 25
    # replication
    NOT_ENOUGH_REPLICAS = 16
    # epochs and fencing
    FENCED = 20
    DIVERGED = 21

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    ResultCode.OK: "ok",
    ResultCode.BAD_REQUEST: "the request is malformed",
    ResultCode.MESSAGE_TOO_LARGE: "the message is over the size limit",
    ResultCode.BAD_SUBJECT: "the subject is empty, too long or has characters outside [A-Za-z0-9._:%|-]",
    ResultCode.BAD_MESSAGE_ID: "the message id must be 1 to 128 bytes of UTF-8",
    ResultCode.BAD_SCHEDULE_TIME: "the delivery time is out of range",
    ResultCode.BAD_HEADERS: "the headers are over 32 KiB or malformed",
    ResultCode.NOT_MASTER: "this node is not the master of its delay group",
    ResultCode.DISK_FULL: "the disk is full; the message was not stored",
    ResultCode.READ_ONLY: "the node accepts no writes (read-only or a failed fsync)",
    ResultCode.BUSY: "the node is overloaded; retry later",
    ResultCode.UNAUTHORIZED: "authentication failed",
    ResultCode.NOT_FOUND: "no such message",
    ResultCode.INTERNAL: "internal error",
    ResultCode.NODE_ID_TAKEN: "a live node is registered under this node id (another session)",
    ResultCode.UNAVAILABLE: "the service cannot reach its database now; ask another instance",
    ResultCode.DUPLICATE: "a message with this id was accepted within dedupe_window: its handle is returned",
    # transactions
    ResultCode.TXN_NOT_FOUND: "no half message with this handle (never prepared, or resolved long ago)",
    ResultCode.TXN_RESOLVED: "the half message was already resolved the other way (rolled back, committed or parked)",
    ResultCode.NOT_ENOUGH_REPLICAS: "no in-sync slave acknowledged in time (replication = \"sync\"); retry later",
    ResultCode.FENCED: "this node holds no unexpired master lease for its group's current epoch; nothing was "
                       "acknowledged: ask the meta server for the master and retry",
    ResultCode.DIVERGED: "the replica's history parts from this master's: it must find where (SYNC_EPOCH_END) "
                         "and truncate there",
}
assert set(_DESCRIPTIONS) == set(ResultCode)


class DelayServerError(Exception):
    """An error with a result code; `str()` is the human-readable message."""

    code: ResultCode = ResultCode.INTERNAL

    def __init__(self, message: str | None = None, *, code: ResultCode | None = None):
        if code is not None:
            self.code = code
        super().__init__(message or self.code.description)

    @property
    def message(self) -> str:
        return str(self)


class InvalidMessage(DelayServerError):
    code = ResultCode.BAD_REQUEST


class MessageTooLarge(InvalidMessage):
    code = ResultCode.MESSAGE_TOO_LARGE


class BadSubject(InvalidMessage):
    code = ResultCode.BAD_SUBJECT


class BadMessageId(InvalidMessage):
    code = ResultCode.BAD_MESSAGE_ID


class BadScheduleTime(InvalidMessage):
    code = ResultCode.BAD_SCHEDULE_TIME


class BadHeaders(InvalidMessage):
    code = ResultCode.BAD_HEADERS


_ERROR_BY_CODE = {cls.code: cls for cls in (MessageTooLarge, BadSubject, BadMessageId, BadScheduleTime, BadHeaders)}


def error_for(code: int, message: str) -> DelayServerError:
    """The exception a client raises for a non-OK result from the server."""
    code = ResultCode(code) if code in ResultCode._value2member_map_ else ResultCode.INTERNAL
    return _ERROR_BY_CODE.get(code, DelayServerError)(message, code=code)


# --- validators -------------------------------------------------------------------------------


def check_schedule_time(schedule_time: int) -> None:
    """Raise BadScheduleTime unless `schedule_time` is an int within MIN_TIME_MS..MAX_TIME_MS."""
    if type(schedule_time) is int and MIN_TIME_MS <= schedule_time <= MAX_TIME_MS:
        return  # the usual case, once per message on the hot path: no further checks
    if (
        isinstance(schedule_time, bool)
        or not isinstance(schedule_time, int)
        or not MIN_TIME_MS <= schedule_time <= MAX_TIME_MS
    ):
        raise BadScheduleTime(
            f"schedule time {schedule_time!r} is outside {MIN_TIME_MS}..{MAX_TIME_MS} epoch ms"
        )


def _utf8(value) -> bytes | None:
    """`value` as UTF-8, or None when it is not a str or cannot be encoded (a lone surrogate)."""
    if not isinstance(value, str):
        return None
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError:
        return None


def encode_id(message_id: str) -> bytes:
    """The id as UTF-8; raises BadMessageId unless it is 1 to MAX_ID_BYTES bytes of UTF-8."""
    if type(message_id) is str and message_id.isascii() and 1 <= len(message_id) <= MAX_ID_BYTES:
        return message_id.encode()  # the usual id, once per message on the hot path
    raw = _utf8(message_id)
    if raw is None or not 1 <= len(raw) <= MAX_ID_BYTES:
        got = "not a string of UTF-8" if raw is None else f"{len(raw)} bytes"
        raise BadMessageId(f"message id must be 1 to {MAX_ID_BYTES} bytes of UTF-8, got {got}")
    return raw


def encode_subject(subject: str) -> bytes:
    """The subject as bytes; raises BadSubject unless it is 1 to 255 bytes of the allowed set."""
    raw = _utf8(subject)
    if raw is None or not SUBJECT_RE.match(raw):
        raise BadSubject(f"bad subject {subject!r}: 1 to 255 bytes of [A-Za-z0-9._:%|-]")
    return raw


def check_body_size(size: int, limit: int = MAX_BODY_BYTES) -> None:
    """Raise MessageTooLarge for a body of `size` bytes over `limit`."""
    if size > limit:
        raise MessageTooLarge(f"body of {size} bytes is over the limit of {limit}")


# --- when, which, what became of it -----------------------------------------------------------


class TimeKind(enum.IntEnum):
    AT = 1  # absolute epoch milliseconds
    DELAY = 2  # milliseconds from the server's now
    LEVEL = 3  # a delay level, 1..N of the configured levels


class TransactionState(enum.IntEnum):
    """A producer's answer for a half message (RocketMQ's LocalTransactionState), and what a
    COMMIT or ROLLBACK request reports: the resolution that now holds."""

    COMMIT = 1
    ROLLBACK = 2
    UNKNOWN = 3
    PARKED = 4  # checked `check_max` times (or past retention) without an answer: parked


class CancelOutcome(enum.IntEnum):
    CANCELLED = 1
    ALREADY_DELIVERED = 2
    ALREADY_CANCELLED = 3
    UNKNOWN = 4
    RESCHEDULED = 5  # a reschedule or promote won: the message moved to its new handle


class MessageState(enum.IntEnum):
    PENDING = 1
    DELIVERED = 2
    CANCELLED = 3
    UNKNOWN = 4
    # transactions: a half message prepared and not resolved yet (never delivered until committed)
    PREPARED = 16


@attrs.frozen
class TimeSpec:
    """When to deliver: at an epoch time, after a delay, or after a delay level (all whole
    milliseconds or a whole level number)."""

    kind: TimeKind
    value: int

    @classmethod
    def at(cls, epoch_ms: int) -> TimeSpec:
        return cls(TimeKind.AT, epoch_ms)

    @classmethod
    def delay(cls, delay_ms: int) -> TimeSpec:
        return cls(TimeKind.DELAY, delay_ms)

    @classmethod
    def level(cls, level: int) -> TimeSpec:
        return cls(TimeKind.LEVEL, level)

    @classmethod
    def of(cls, deliver_at=None, delay=None, delay_level=None) -> TimeSpec:
        """The spec for at most one of `deliver_at` (epoch ms), `delay` (ms) and `delay_level`
        (none: deliver now).

        Raises ValueError when more than one is given, and BadScheduleTime for a value that is
        not a whole number (1.5 ms is refused, not rounded) or does not fit in 64 bits.
        """
        if deliver_at is None and delay_level is None:  # the usual spec, once per message sent
            kind, value = TimeKind.DELAY, 0 if delay is None else delay
        else:
            given = [(k, v) for k, v in ((TimeKind.AT, deliver_at), (TimeKind.DELAY, delay),
                                         (TimeKind.LEVEL, delay_level)) if v is not None]
            if len(given) > 1:
                raise ValueError("give at most one of deliver_at, delay, delay_level")
            kind, value = given[0]
        if type(value) is not int and (isinstance(value, bool) or not isinstance(value, int)):
            raise BadScheduleTime(f"{kind.name.lower()} must be a whole number, got {value!r}")
        if not MIN_I64 <= value <= MAX_I64:
            raise BadScheduleTime(f"{kind.name.lower()} {value} is out of range")
        return cls(kind, value)


_HANDLE_RE = re.compile(r"(0|[1-9][0-9]{0,14}):([A-Za-z0-9._%-]+)")


def _quote_id(message_id: str) -> str:
    # quote() leaves "~" alone, but a shell expands it after ":" in an assignment (H=1:~x).
    return urllib.parse.quote(message_id, safe="").replace("~", "%7E")


class Handle(NamedTuple):
    """What a producer keeps to cancel or query a message later, from any process.

    Its text form is ``<schedule_time>:<message id>``: the time in decimal epoch milliseconds, the
    id percent-encoded as UTF-8 with every byte outside ``[A-Za-z0-9._-]`` written ``%XX``
    (uppercase hex), e.g. ``1732252800000:order%2F42``. The text is printable, needs no quoting in
    a shell, URL or file name, and there is exactly one text per handle.
    """

    schedule_time: int
    message_id: str

    def __str__(self) -> str:
        return f"{self.schedule_time}:{_quote_id(self.message_id)}"

    @classmethod
    def parse(cls, text: str) -> Handle:
        """The handle whose `str()` is `text`.

        Raises ValueError unless `text` is exactly that form, with a schedule time within
        MIN_TIME_MS..MAX_TIME_MS and an id of 1 to 128 bytes of UTF-8.
        """
        match = _HANDLE_RE.fullmatch(text)
        if match is None:
            raise ValueError(f"not a handle (want <epoch ms>:<percent-encoded id>): {text!r}")
        schedule_time = int(match[1])
        if not MIN_TIME_MS <= schedule_time <= MAX_TIME_MS:
            raise ValueError(f"handle time {schedule_time} is outside {MIN_TIME_MS}..{MAX_TIME_MS}")
        raw = urllib.parse.unquote_to_bytes(match[2])
        if not 1 <= len(raw) <= MAX_ID_BYTES:
            raise ValueError(f"handle id must be 1 to {MAX_ID_BYTES} bytes, got {len(raw)}")
        try:
            message_id = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"handle id is not UTF-8: {text!r}") from None
        if _quote_id(message_id) != match[2]:
            raise ValueError(f"handle id is not in canonical percent-encoding: {text!r}")
        return cls(schedule_time, message_id)


# --- addresses --------------------------------------------------------------------------------


class AddressError(ValueError):
    """Not a ``HOST:PORT`` address."""


def parse_address(text: str, *, default_port: int | None = None, allow_port_zero: bool = False) -> tuple[str, int]:
    """(host, port) of ``HOST:PORT`` or ``[IPv6]:PORT``; ``HOST`` or ``[IPv6]`` alone when
    `default_port` is given.

    Raises AddressError for anything else, or a port outside 1..65535 (0..65535 with
    `allow_port_zero`, for a listener that lets the system pick).
    """
    if not isinstance(text, str):
        raise AddressError(f"an address must be a str, not {type(text).__name__}")
    port_text = None if default_port is None else str(default_port)
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise AddressError(f"bad address {text!r}: want [IPv6]:PORT")
        if rest:
            port_text = rest[1:]
    elif text.count(":") > 1:
        raise AddressError(f"bad address {text!r}: write an IPv6 host in brackets, [::1]:PORT")
    elif ":" in text:
        host, _, port_text = text.partition(":")
    else:
        host = text
    if not host or port_text is None or not port_text.isascii() or not port_text.isdigit():
        raise AddressError(f"bad address {text!r}: want HOST:PORT")
    port = int(port_text)
    if not (0 if allow_port_zero else 1) <= port <= 65535:
        raise AddressError(f"bad address {text!r}: port {port} is out of range")
    return host, port


def format_address(host: str, port: int) -> str:
    """The text `parse_address` reads back as (host, port)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
