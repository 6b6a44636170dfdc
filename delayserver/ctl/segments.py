"""Segment files as the tools read them: every good record decoded, then what stopped the reading.

Tools never write to a data directory: a torn tail is reported, not truncated (the node truncates
it at its next start), and corruption is reported with its file and offset.
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Iterator

import attrs

from delayserver.storage.record import RecordType, decode_payload, iter_records
from delayserver.storage.segment import CorruptSegment, read_file, scan

#: Which log a segment belongs to, told by the type of its records.
LOG_OF_TYPE = {
    RecordType.MESSAGE: "message_log",
    RecordType.CANCEL: "message_log",
    RecordType.SCHEDULED: "schedule_log",
    RecordType.SCHEDULED_CANCEL: "schedule_log",
    RecordType.DISPATCH: "dispatch_log",
    RecordType.DELIVERED: "spool",
    RecordType.PARKED: "parked",
}


@attrs.frozen
class Damage:
    """Where reading a segment stopped: a torn tail (`torn`) or corruption."""

    path: Path
    offset: int
    reason: str
    torn: bool

    def __str__(self) -> str:
        what = "torn tail" if self.torn else "corrupt record"
        return f"{self.path}: {what} at offset {self.offset}: {self.reason}"


class SegmentFile:
    """One segment file, read whole. `records()` yields ``(offset, rtype, value)`` for each record
    before any damage and then sets `damage` (None for a clean end).

    A `sealed` segment has no tail that may be torn: any damage in it is corruption. A record whose
    crc holds but whose payload does not decode is corruption too, and is never yielded.
    """

    def __init__(self, path: Path, *, sealed: bool = False):
        self.path = Path(path)
        self.data = read_file(self.path)
        self.sealed = sealed
        self.damage: Damage | None = None

    @property
    def size(self) -> int:
        return len(self.data)

    def _limit(self) -> tuple[int, Damage | None]:
        """Where the good records end, and the damage found there."""
        try:
            result = scan(self.data, self.path, allow_torn_tail=not self.sealed)
        except CorruptSegment as e:
            return e.offset, Damage(self.path, e.offset, e.reason, torn=False)
        if result.torn_bytes:
            reason = f"{result.torn_bytes} bytes ({result.torn_reason})"
            return result.valid_end, Damage(self.path, result.valid_end, reason, torn=True)
        return result.valid_end, None

    def records(self) -> Iterator[tuple[int, int, object]]:
        limit, damage = self._limit()
        for pos, rtype, start, stop in iter_records(self.data, 0, limit):
            try:
                value = decode_payload(rtype, self.data, start, stop)
            except (ValueError, struct.error) as e:
                self.damage = Damage(self.path, pos, f"undecodable {RecordType(rtype).name} payload ({e})", torn=False)
                return
            yield pos, rtype, value
        self.damage = damage
