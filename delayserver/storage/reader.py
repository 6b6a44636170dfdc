"""The one reader of log images: every good record, then a damage report (LevelDB's log reader).

Every log (message_log, schedule_log, dispatch_log, the spool, parked messages) is read through
`read_records`: it walks the records of a buffer front to back, yields each whole valid one and,
where reading stops before the end, classifies what stopped it and hands a `Damage` to the
caller's `report` callback:

- clean end: every byte belongs to a whole, valid record; `report` is not called;
- torn tail (`Damage.torn`): the records stop being valid and nothing valid follows (a write cut
  short by a crash, a zero-filled tail, a flipped bit in the last record);
- corruption: damage with a valid record after it, so inside data that was once whole; in a
  `sealed` image (which has no tail that may be torn) any damage; and a record whose crc holds
  but whose payload does not decode (with `decode`). Nothing past it is ever yielded.

Without `report`, corruption raises CorruptSegment and a torn tail ends the reading quietly. What
to do about a torn tail (truncate it, wait for the append in progress to finish, report it to an
operator) is the caller's: recovery truncates, tools report, replication refuses.
"""
from __future__ import annotations

import re
import time
from array import array
from pathlib import Path
from typing import Callable, Iterator

import attrs

from delayserver.storage.errors import CorruptSegment
from delayserver.storage.record import (
    HEADER, HEADER_SIZE, MAX_PAYLOAD_BYTES, VALID_TYPES, RecordError, RecordType, checksum, decode_payload,
    iter_records,
)


@attrs.frozen
class Damage:
    """Where reading a log image stopped before its end: a torn tail (`torn`) or corruption."""

    path: Path | None
    offset: int
    reason: str
    torn: bool
    #: Bytes from `offset` to the end of the image (all of them are dropped if a torn tail is cut).
    length: int = 0
    #: The image ends inside a record whose start is sound: a torn tail, or an append in progress
    #: when the image was taken from a live file.
    incomplete: bool = False

    def __str__(self) -> str:
        what = "torn tail" if self.torn else "corrupt record"
        return f"{self.path}: {what} at offset {self.offset}: {self.reason}"

    def error(self) -> CorruptSegment:
        return CorruptSegment(self.path, self.offset, self.reason)


Reporter = Callable[[Damage], None]


def _raise_corruption(damage: Damage) -> None:
    if not damage.torn:
        raise damage.error()


def raise_unless_incomplete(damage: Damage) -> None:
    """A reporter for images of whole appends: any damage but an incomplete last record raises."""
    if not damage.incomplete:
        raise damage.error()


def valid_record_at(buf, pos: int) -> bool:
    """Whether a whole valid record starts at `pos` of `buf`."""
    end = len(buf)
    if pos + HEADER_SIZE > end or buf[pos + _TYPE_AT] not in VALID_TYPES:
        return False
    crc, length, rtype = HEADER.unpack_from(buf, pos)
    if length > MAX_PAYLOAD_BYTES or pos + HEADER_SIZE + length > end:
        return False
    return checksum(rtype, memoryview(buf)[pos + HEADER_SIZE : pos + HEADER_SIZE + length]) == crc


# A byte that could be a record's type: candidates for a record start are found by a regex search
# (in C) rather than a Python loop per byte, so a torn tail of megabytes of zeros scans quickly.
_TYPE_BYTE = re.compile(b"[" + b"".join(re.escape(bytes([t])) for t in sorted(VALID_TYPES)) + b"]")
_TYPE_AT = HEADER_SIZE - 1


def find_valid_record_after(buf, pos: int) -> int | None:
    """The first offset past `pos` where a whole valid record starts, or None.

    Used only after damage is found, to tell a torn tail (nothing valid follows) from corruption
    (valid data follows, so truncating would destroy it). Its cost is the distance to the next
    valid record.
    """
    for match in _TYPE_BYTE.finditer(buf, pos + 1 + _TYPE_AT):
        candidate = match.start() - _TYPE_AT
        if valid_record_at(buf, candidate):
            return candidate
    return None


def classify(buf, pos: int, reason: str, path=None, *, sealed: bool = False, base: int = 0) -> Damage:
    """The Damage of reading `buf` stopped at `pos` for `reason` (see the module docstring);
    offsets reported are `base` + offsets into `buf`."""
    length = len(buf) - pos
    if sealed:
        return Damage(path, base + pos, f"{reason} in a sealed segment", False, length)
    following = find_valid_record_after(buf, pos)
    if following is not None:
        return Damage(path, base + pos, f"{reason}; valid records follow at offset {base + following}", False, length)
    return Damage(path, base + pos, reason, True, length)


def read_records(buf, path=None, *, start: int = 0, base: int = 0, sealed: bool = False,
                 decode: bool = False, report: Reporter | None = None) -> Iterator[tuple]:
    """Yield each whole valid record of `buf` from `start`, then report any damage once.

    Yields ``(offset, rtype, payload_start, payload_end)``, or with `decode` ``(offset, rtype,
    value)`` where value is what `record.decode_payload` gives. Offsets are `base` + offsets into
    `buf` (`base`: where `buf` starts in its file). `report` gets the Damage where reading stopped
    before the end; without it, corruption raises CorruptSegment and a torn tail ends quietly.
    """
    report = report or _raise_corruption
    stop = yield from _walk(buf, path, start, base, decode)
    if stop is not None:
        at, reason, undecodable = stop
        if undecodable:
            report(Damage(path, base + at, reason, False, len(buf) - at))
        else:
            report(_classified(buf, at, reason, path, sealed, base))


def _walk(buf, path, start: int, base: int, decode: bool):
    """Yield records until the first damage; return None at a clean end, or (offset in buf,
    reason, undecodable) where reading stopped."""
    end = len(buf)
    pos = start
    try:
        for pos, rtype, s, e in iter_records(buf, start, end):
            if decode:
                try:
                    value = decode_payload(rtype, buf, s, e)
                except RecordError as err:
                    return pos, f"undecodable {RecordType(rtype).name} payload ({err.reason})", True
                yield base + pos, rtype, value
            else:
                yield base + pos, rtype, s, e
            pos = e
    except RecordError as err:
        return err.offset, err.reason, False
    return (pos, INCOMPLETE, False) if pos < end else None


INCOMPLETE = "incomplete record"


def _classified(buf, at: int, reason: str, path, sealed: bool, base: int) -> Damage:
    damage = classify(buf, at, reason, path, sealed=sealed, base=base)
    return attrs.evolve(damage, incomplete=True) if damage.torn and reason == INCOMPLETE else damage


def read_file_records(f, path=None, *, start: int = 0, chunk_bytes: int = 1 << 20,
                      report: Reporter | None = None) -> Iterator[tuple[int, int, bytes]]:
    """`read_records` over an open binary file from `start`, read `chunk_bytes` at a time (a file
    that may be large, or growing): yields ``(offset, rtype, record bytes)``.

    A bad record is classified against the rest of the file, read only then; a record the file
    ended inside of when it was read is judged on what was read and reported as incomplete
    (`Damage.incomplete`), so that a reader following a file being appended to (the spool) takes
    an append in progress for what it is and reads the record whole next time.
    """
    report = report or _raise_corruption
    pos, want = start, chunk_bytes
    while True:
        f.seek(pos)
        chunk = f.read(want)
        if not chunk:
            return
        walk = _walk(chunk, path, 0, pos, False)
        try:
            while True:
                offset, rtype, s, e = next(walk)
                yield offset, rtype, chunk[s - HEADER_SIZE : e]
        except StopIteration as done:
            stop = done.value
        if stop is None:
            pos, want = pos + len(chunk), chunk_bytes
            continue
        at, reason, _ = stop
        if reason == INCOMPLETE:
            if len(chunk) == want:
                # The chunk ended inside a record: read on from its start, the whole record at least.
                length = HEADER.unpack_from(chunk, at)[1] if len(chunk) - at >= HEADER_SIZE else 0
                pos, want = pos + at, max(chunk_bytes, HEADER_SIZE + length)
                continue
            # The file ended inside a record when it was read: judged on what was read, since a
            # writer may have appended the rest since (the record is then whole next time).
            report(_classified(chunk, at, reason, path, False, pos))
            return
        f.seek(pos + at)
        report(_classified(f.read(), 0, reason, path, False, pos + at))
        return


@attrs.frozen
class ScanResult:
    valid_end: int
    records: int
    torn_bytes: int
    torn_reason: str = ""
    #: Power-loss damage: whole valid records past the damage that were dropped with it.
    dropped_records: int = 0


def last_valid_end(buf, pos: int) -> tuple[int, int]:
    """After damage at `pos`: the end of the last whole valid record past it, and how many valid
    records lie past it ((pos, 0) when none)."""
    end, count = pos, 0
    nxt = find_valid_record_after(buf, pos)
    while nxt is not None:
        p = nxt
        for _, _, _, p in read_records(buf, start=nxt, report=_ignore):
            count += 1
        end = p
        nxt = find_valid_record_after(buf, p)
    return end, count


def _ignore(damage: Damage) -> None:
    pass


def scan(buf, path, *, allow_torn_tail: bool = True, power_loss_window: int | None = None,
         base: int = 0) -> ScanResult:
    """Walk every record of a segment image and classify its end (recovery's view of
    `read_records`): where the valid records end, how many there are, and the torn tail.
    Offsets are `base` + offsets into `buf` (`base`: where `buf` starts in its file).

    Raises CorruptSegment for damage followed by valid data, or for any damage when
    `allow_torn_tail` is False (a sealed segment has no tail that may be torn).

    A file written past its last completed fsync can come back from a power loss damaged in any
    way: unsynced writes lost, reordered or torn, so a hole can be followed by valid later writes.
    Where the writer bounds how far it runs ahead of its last completed fsync, `power_loss_window`
    is that bound: damage followed by valid data that starts within that many bytes of the end of
    the last valid record is past what anyone relied on, and is cut like a torn tail (the result
    counts the whole records dropped with it). Damage before that point stays corruption.
    """
    found: list[Damage] = []
    count = sum(1 for _ in read_records(buf, path, base=base, sealed=not allow_torn_tail, report=found.append))
    return _classified_end(buf, found, count, allow_torn_tail, power_loss_window, base)


def scan_offsets(buf, path, rtype: int, offset_of, *, power_loss_window: int | None = None,
                 yield_every: int = 0) -> tuple[ScanResult, array]:
    """`scan` of a segment that may have a torn tail, in the same walk collecting
    `offset_of(buf, payload_start)` of every valid record of type `rtype` before its end, in
    record order (one pass where a scan followed by a read walks the records twice). Returned as
    an `array("q")`: no Python object per record, and no hash table to regrow.

    `yield_every`: in a worker thread, give the interpreter's lock away every that many records,
    so that the event loop waits for it about a millisecond, not a whole switch interval (5 ms)."""
    found: list[Damage] = []
    offsets = array("q")
    append, count = offsets.append, 0
    for _, t, s, _ in read_records(buf, path, report=found.append):
        count += 1
        if t == rtype:
            append(offset_of(buf, s))
        if yield_every and not count % yield_every:
            time.sleep(0)
    return _classified_end(buf, found, count, True, power_loss_window), offsets


def _classified_end(buf, found: list, count: int, allow_torn_tail: bool,
                    power_loss_window: int | None, base: int = 0) -> ScanResult:
    """`scan`'s verdict on where a walk of `count` records that met the damage in `found` ends."""
    if not found:
        return ScanResult(base + len(buf), count, 0)
    damage = found[0]
    if damage.torn:
        return ScanResult(damage.offset, count, damage.length, damage.reason)
    if allow_torn_tail and power_loss_window is not None:
        valid_end, dropped = last_valid_end(buf, damage.offset - base)
        valid_end += base
        if damage.offset >= valid_end - power_loss_window:
            return ScanResult(damage.offset, count, damage.length,
                              f"{damage.reason}, then {dropped} valid records written after the last durable "
                              "point (power loss)", dropped)
    raise damage.error()
