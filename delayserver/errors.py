"""The one table of result codes, and the exceptions that carry them.

Every response on the wire carries one of these codes and a human-readable message; every
exception the server raises for bad input maps to exactly one code.
"""
from __future__ import annotations

import enum


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


def error_for(code: int, message: str) -> DelayServerError:
    """The exception a client raises for a non-OK result from the server."""
    by_code = {cls.code: cls for cls in (MessageTooLarge, BadSubject, BadMessageId, BadScheduleTime, BadHeaders)}
    code = ResultCode(code) if code in ResultCode._value2member_map_ else ResultCode.INTERNAL
    cls = by_code.get(code, DelayServerError)
    return cls(message, code=code)
