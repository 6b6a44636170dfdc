"""Segment files as the tools read them: every good record decoded, then what stopped the reading.

Tools never write to a data directory: a torn tail is reported, not truncated (the node truncates
it at its next start), and corruption is reported with its file and offset.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import attrs

from delayserver.storage.reader import Damage, read_records
from delayserver.storage.record import TRANSACTION_TYPES, RecordType
from delayserver.storage.segment import read_file

#: Which log a segment belongs to, told by the type of its records.
LOG_OF_TYPE = {
    RecordType.MESSAGE: "message_log",
    RecordType.CANCEL: "message_log",
    RecordType.EPOCH: "message_log",
    RecordType.SCHEDULED: "schedule_log",
    RecordType.SCHEDULED_CANCEL: "schedule_log",
    RecordType.DISPATCH: "dispatch_log",
    RecordType.DELIVERED: "spool",
    RecordType.PARKED: "parked",
    RecordType.SCHEDULE: "message_log",
    **{t: "message_log" for t in TRANSACTION_TYPES},
}


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

    def records(self) -> Iterator[tuple[int, int, object]]:
        self.damage = None
        yield from read_records(self.data, self.path, sealed=self.sealed, decode=True, report=self._report)

    def _report(self, damage: Damage) -> None:
        if damage.torn:
            damage = attrs.evolve(damage, reason=f"{damage.length} bytes ({damage.reason})")
        self.damage = damage
