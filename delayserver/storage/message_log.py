"""message_log: the append-only log every received message lands in first.

Segments roll at `segment_bytes` and are named by their 20-digit base offset; an offset is global
(base + position in segment). Only the last segment is written; sealed ones were fsynced before the
roll, so damage in them is corruption, never a torn tail.

Sealed segments are not scanned at open (that would read the whole log); a bad record in one is
found when it is read. Their sizes are checked at open, though: each must end where the next one
begins. One that does not is quarantined: opening succeeds and says so loudly, and any read that
reaches the segment raises CorruptSegment (a read from a later offset is unaffected).

The last durable offset. The writer (the receiver) never lets the log's end run more than
`max_unsynced_bytes` past its last completed fsync: a batch that would go further waits for the
fsync in progress. So after a power loss the last durable offset is at least the end of the last
valid record on disk minus `max_unsynced_bytes`, and nothing before that point was written after
the last completed fsync. At open, damage in the active segment followed by valid records is a
power-loss tail when it starts within `max_unsynced_bytes` of the last valid record: it is
truncated and the records dropped with it are logged (no acknowledgement, replay checkpoint or
replica relied on them, since all of those wait for an fsync). Damage before that point is
corruption. Sealed segments were fsynced whole at their roll, so damage in them is corruption.

The replay checkpoint's offset is a durable point too: replay reads only what an fsync covered,
and the checkpoint is written after. The active segment is walked from there at open (when a valid
record starts there), so a start does not walk a whole segment again, and damage before it is
never taken for a power-loss tail and cut with the acknowledged records after it: like damage in
a sealed segment, it is corruption, found when it is read.

Epochs. Each batch opens with an EPOCH record naming the master epoch that wrote it
(storage/record.py); `epochs` (storage/epochs.py) indexes where each epoch begins, so that a node
can find where its history and its master's part (storage/epochs.py, node/divergence.py).
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Callable, Iterator

from delayserver import failpoints
from delayserver.storage.directory import SegmentDirectory
from delayserver.storage.epochs import EpochHistory
from delayserver.storage.errors import CorruptSegment
from delayserver.storage.record import HEADER, HEADER_SIZE, RecordError, iter_records, parse_record
from delayserver.storage.segment import (
    Segment, fsync_dir, fsync_path, give_back_end, give_back_start, own_descriptor, read_file,
)

log = logging.getLogger("delayserver.storage")

DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
#: How far the log's end may run ahead of its last completed fsync (see the module docstring).
DEFAULT_MAX_UNSYNCED_BYTES = 32 * 1024 * 1024
SUFFIX = ".log"


def segment_name(base: int) -> str:
    return f"{base:020d}{SUFFIX}"


class MessageLog:
    def __init__(self, directory: Path, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 max_unsynced_bytes: int = DEFAULT_MAX_UNSYNCED_BYTES):
        self.directory = Path(directory)
        self.segment_bytes = segment_bytes
        self.max_unsynced_bytes = max_unsynced_bytes
        self.segments: SegmentDirectory[int] = SegmentDirectory()  # base -> size of sealed segment
        self.active: Segment | None = None
        self.active_base = 0
        self.quarantined: dict[int, tuple[int, str]] = {}  # base -> (file offset, reason)
        self.epochs: EpochHistory | None = None  # set by open
        # Below this offset the log's pages were handed back to the kernel (`pages_to_give_back`).
        self.given_back = 0

    @classmethod
    def open(cls, directory: Path, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
             max_unsynced_bytes: int = DEFAULT_MAX_UNSYNCED_BYTES, durable_to: int = 0) -> "MessageLog":
        """Open the log, recovering the last segment's torn or power-loss tail and quarantining
        sealed segments that do not end where the next one begins. Raises CorruptSegment for
        damage in the last segment before its last durable offset (module docstring).

        `durable_to`: an offset a checkpoint written after an fsync names (the replay
        checkpoint's): the last segment is walked from there (`Segment.open`).
        """
        self = cls(directory, segment_bytes, max_unsynced_bytes)
        self.directory.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.directory.glob("*" + SUFFIX)):
            stem = path.name[: -len(SUFFIX)]
            if len(stem) == 20 and stem.isdigit():
                self.segments[int(stem)] = path.stat().st_size
        self._check_sealed_sizes()
        last = self.segments.last()
        if last is None:
            self._start_segment(0)
        else:
            self.active_base = last
            self.active = Segment.open(self.path(last), power_loss_window=max_unsynced_bytes,
                                       durable_to=max(0, durable_to - last))
            self.segments[last] = self.active.size
        self.epochs = EpochHistory.open(self)
        return self

    def _check_sealed_sizes(self) -> None:
        bases = self.segments.keys()
        for base, nxt in zip(bases, bases[1:]):
            size = self.segments[base]
            if base + size != nxt:
                reason = f"segment ends at offset {base + size} but the next one starts at {nxt}"
                self.quarantined[base] = (min(size, nxt - base), reason)
                log.error("%s: corrupt sealed segment, quarantined: %s", self.path(base), reason)

    def path(self, base: int) -> Path:
        """The file of the segment starting at offset `base`."""
        return self.directory / segment_name(base)

    def _start_segment(self, base: int) -> None:
        self.active = Segment.open(self.path(base), recover=False)
        self.active_base = base
        self.segments[base] = 0
        fsync_dir(self.directory)

    @property
    def end_offset(self) -> int:
        return self.active_base + self.active.size

    @property
    def start_offset(self) -> int:
        return self.segments.first()

    def append(self, data: bytes, epoch: int | None = None) -> int:
        """Append already-encoded records in one write; returns the offset of the first byte.

        `epoch`: the epoch of the EPOCH record `data` opens with (a batch this node frames);
        None: `data` is records copied from elsewhere, whose EPOCH records are read from it. A new
        epoch goes into the epoch history before the write. Rolls to a new segment first when
        `data` would not fit in the active one. Does not fsync: call `sync()` before
        acknowledging. Raises DiskFull / StorageError with the log intact (EpochRegression for a
        batch of an older epoch than the log's last).
        """
        if self.active.size and self.active.size + len(data) > self.segment_bytes:
            self.roll()
        if epoch is None:
            self.epochs.note_batches(data, self.end_offset)
        else:
            self.epochs.begin(epoch, self.end_offset)
        pos = self.active.append(data)
        self.segments[self.active_base] = self.active.size
        return self.active_base + pos

    def _give_back_span(self, upto: int) -> tuple[int, int]:
        """(start, end) of what `pages_to_give_back(upto)` names: from where the last call stopped
        up to `upto`, never nearer the log's end than `segment.give_back_end` lets."""
        return max(self.given_back, self.start_offset or 0), min(upto, give_back_end(self.end_offset))

    def give_back_due(self, upto: int) -> int:
        """How many bytes `pages_to_give_back(upto)` would name now (none if not above 0): a
        caller's cheap look before it works out `upto` (the node's page floor)."""
        start, end = self._give_back_span(upto)
        return end - start

    def pages_to_give_back(self, upto: int, at_least: int = 1) -> list[tuple[Path, int, int]]:
        """The ranges ``(path, start, end)`` of the log's segments from where the last call stopped
        up to `upto` (an offset an fsync covered; never nearer the log's end than
        `segment.give_back_end` lets), for `segment.give_back_pages` in a worker thread; the next
        call starts where this one ended. Nothing ([]) while that is under `at_least` bytes
        (nothing taken then). Each range starts at a folio's boundary below its first byte
        (`segment.give_back_start`), so that what a call ended inside goes with the next one."""
        start, upto = self._give_back_span(upto)
        if upto - start < max(at_least, 1):
            return []
        ranges = []
        base = self.segments.locate(start)
        while base is not None and base < upto:
            end = self.active_base + self.active.size if base == self.active_base else base + self.segments[base]
            first = max(start, base) - base
            last = min(upto, end) - base
            if last > first:
                ranges.append((self.path(base), give_back_start(first), last))
            base = self.segments.higher(base)
        self.given_back = upto
        return ranges

    def roll(self) -> None:
        self.active.sync(site="roll")
        failpoints.hit("segment-roll")
        base = self.end_offset
        self.active.close()
        self._start_segment(base)

    def sync(self) -> None:
        """fsync the active segment through a descriptor of its own, so that a worker thread may
        call it while the event loop goes on appending or rolls the log: a roll fsyncs the segment
        it seals before it closes that segment's descriptor, so whichever segment this finds
        active, what was written before the call is covered. Raises FsyncFailed."""
        fsync_path(self.path(self.active_base))

    def truncate(self, offset: int) -> None:
        """Drop everything at and after `offset` (a slave realigning with its master)."""
        unlinked = False
        while self.active_base > offset:
            self.active.close()
            self.path(self.active_base).unlink()
            self.segments.pop(self.active_base)
            unlinked = True
            base = self.segments.last()
            self.active_base = base
            self.active = Segment.open(self.path(base), recover=False)
        if unlinked:
            # Else a crash could bring the dropped segments back as the log's end.
            fsync_dir(self.directory)
        self.active.truncate(offset - self.active_base)
        self.segments[self.active_base] = self.active.size
        self.given_back = min(self.given_back, offset)
        self.quarantined.pop(self.active_base, None)
        self.epochs.truncate(offset)

    def resume_offset(self, saved: int | None, what: str) -> int:
        """Where to read from to rebuild `what`, saved as covering message_log up to `saved` (None:
        nothing saved): the log's start when it no longer holds that offset (said in a warning),
        never past its end."""
        if saved is None or saved < self.start_offset:
            if saved is not None:
                log.warning("%s covers message_log to %d, which starts at %d now: what lies between is lost",
                            what, saved, self.start_offset)
            saved = self.start_offset
        return min(saved, self.end_offset)

    def read_from(self, offset: int, chunk_bytes: int = 8 << 20) -> Iterator[bytes]:
        """The log from `offset` to its end, in chunks of whole records (see `read`)."""
        while offset < self.end_offset:
            data, base = self.read(offset, chunk_bytes)
            if not data:
                return
            yield data
            offset = base + len(data)

    def read(self, offset: int, max_bytes: int = 1 << 20) -> tuple[bytes, int]:
        """Raw bytes of whole records from `offset`: ``(data, base_offset_of_data)``.

        At least one whole record is returned when one exists, even one over `max_bytes`. At a
        segment's end the read moves to the next segment. Empty data means nothing new. Whole
        records before damage are returned; the read that starts at the damage raises
        CorruptSegment (a bad record, a sealed segment that ends inside a record, or a quarantined
        segment). Raises ValueError for an offset before the first segment.
        """
        located = self._locate(offset)
        if located is None:
            return b"", offset
        base, pos, size = located
        return _whole_records(functools.partial(self._read, base), self.path(base), pos, size, max_bytes), base + pos

    def reader(self, offset: int, max_bytes: int = 1 << 20) -> Callable[[], tuple[bytes, int]]:
        """A function for a worker thread returning what `read(offset, max_bytes)` returns now,
        read through a descriptor of its own (the segment is found here, on the caller's thread:
        the directory is the event loop's). The caller keeps the segment from the cleaner until
        it is read (a slave's pull pins its offset)."""
        located = self._locate(offset)
        if located is None:
            return lambda: (b"", offset)
        base, pos, size = located
        path = self.path(base)

        def read() -> tuple[bytes, int]:
            with own_descriptor(path, size) as pread:
                return _whole_records(pread, path, pos, size, max_bytes), base + pos

        return read

    def _locate(self, offset: int) -> tuple[int, int, int] | None:
        """(segment base, position in it, its size) where a read from `offset` starts, or None at
        the end of the log. Raises as `read` does."""
        base = self.segments.locate(offset)
        if base is None:
            raise ValueError(f"offset {offset} is before the first message_log segment")
        self._check_not_quarantined(base)
        size = self.segments[base]
        if offset - base >= size:
            nxt = self.segments.higher(base)
            if nxt is None:
                return None
            base, offset = nxt, nxt
            self._check_not_quarantined(base)
            size = self.segments[base]
        return base, offset - base, size

    def _check_not_quarantined(self, base: int) -> None:
        if base in self.quarantined:
            raise CorruptSegment(self.path(base), *self.quarantined[base])

    def _read(self, base: int, start: int, end: int) -> bytes:
        if base == self.active_base:
            return self.active.read(start, end)
        return read_file(self.path(base), start, end)

    def iter_from(self, offset: int):
        """Yield ``(offset, rtype, payload)`` for every record from `offset` to the end."""
        while True:
            data, base = self.read(offset)
            if not data:
                return
            for pos, rtype, start, stop in iter_records(data):
                yield base + pos, rtype, data[start:stop]
            offset = base + len(data)

    def delete_before(self, offset: int) -> list[int]:
        """Delete sealed segments that end at or before `offset`; returns their bases."""
        deleted = []
        for base in self.segments.keys():
            if base == self.active_base or base + self.segments[base] > offset:
                break
            self.path(base).unlink()
            self.segments.pop(base)
            self.quarantined.pop(base, None)
            deleted.append(base)
        if deleted:
            fsync_dir(self.directory)
        return deleted

    def close(self) -> None:
        if self.active is not None:
            self.active.close()


def _whole_records(read: Callable[[int, int], bytes], path: Path, pos: int, size: int, max_bytes: int) -> bytes:
    """The whole records of a segment `size` bytes long from `pos`, through `read(start, end)`:
    `MessageLog.read`'s data."""
    chunk = read(pos, min(size, pos + max_bytes))
    end = 0
    try:
        for _, _, _, end in iter_records(chunk):
            pass
    except RecordError as e:
        # The whole records before the damage are returned; the next read raises.
        if not e.offset:
            raise CorruptSegment(path, pos, e.reason) from None
        end = e.offset
    if end:
        return chunk[:end]
    # One whole record larger than max_bytes, or CorruptSegment.
    header = read(pos, min(size, pos + HEADER_SIZE))
    if len(header) == HEADER_SIZE:
        _, length, _ = HEADER.unpack_from(header)
        record = read(pos, min(size, pos + HEADER_SIZE + length))
        try:
            if parse_record(record, 0) is not None:
                return record
        except RecordError as e:
            raise CorruptSegment(path, pos, e.reason) from None
    raise CorruptSegment(path, pos, "incomplete record at the end of a sealed segment")
