"""Logs with one segment per bucket: schedule_log and dispatch_log.

Any bucket's segment may be appended to (messages arrive for any delivery time), so there can be
thousands of segments; file descriptors are kept in a small LRU and reopened on demand. fsync works
on the file, not the descriptor, so a segment closed before its fsync is synced by reopening it.

Opened `readonly` (the operator tools), nothing is created, written or truncated: a torn tail is
only hidden from readers, and left for the node to truncate at its next start.
"""
from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import threading
from array import array
from pathlib import Path

from delayserver.storage.buckets import bucket_name, parse_bucket_name
from delayserver.storage.directory import SegmentDirectory
from delayserver.storage.errors import CorruptSegment, StorageError
from delayserver.storage.record import HEADER_SIZE, RecordError, parse_record, record_size
from delayserver.storage.reader import ScanResult, raise_unless_incomplete, read_records, scan, scan_offsets
from delayserver.storage.segment import (
    fsync_dir, fsync_fd, fsync_path, give_back_end, give_back_start, own_descriptor, read_file, write_all,
)

log = logging.getLogger("delayserver.storage")

SUFFIX = ".log"
MAX_OPEN_FDS = 128


def _record_at(read, path_of, bucket: int, offset: int, guess: int):
    """The whole, checked record at `offset` of `bucket` through `read(bucket, start, end)` (None:
    not in memory); `path_of(bucket)` names the file in an error only (a path costs more than the
    read)."""
    data = read(bucket, offset, offset + guess)
    if data is None:
        return None
    if len(data) < HEADER_SIZE:
        raise CorruptSegment(path_of(bucket), offset, "no record here")
    record = _record_in(data, 0, path_of, bucket, offset)
    if record is None:  # bigger than the guess: read it whole
        data = read(bucket, offset, offset + record_size(data, 0))
        if data is None:
            return None
        record = _record_in(data, 0, path_of, bucket, offset)
        if record is None:
            raise CorruptSegment(path_of(bucket), offset, "record cut short")
    return record


#: The most one shared read of neighbouring records takes (`read_records_at`).
SHARED_READ_BYTES = 1 << 16


def _records_at(read, path_of, bucket: int, offsets: list[int], guess: int) -> list:
    """`BucketLog.read_records_at` through `read(bucket, start, end)` (None: not all in memory,
    and then None for every record of that read)."""
    out: list = [None] * len(offsets)
    order = sorted(range(len(offsets)), key=offsets.__getitem__)
    n, i = len(order), 0
    while i < n:
        first = last = offsets[order[i]]
        j = i + 1
        while j < n:
            offset = offsets[order[j]]
            if offset - last > guess or offset + guess - first > SHARED_READ_BYTES:
                break
            last = offset
            j += 1
        data = None
        if j - i > 1:
            data = read(bucket, first, last + guess)
            if data is None:  # not all in memory: the whole run is left to a read that may wait
                i = j
                continue
        for k in order[i:j]:
            offset = offsets[k]
            try:
                record = None if data is None else _record_in(data, offset - first, path_of, bucket, offset)
                out[k] = _record_at(read, path_of, bucket, offset, guess) if record is None else record
            except CorruptSegment as e:
                out[k] = e
        i = j
    return out


def _record_in(data: bytes, at: int, path_of, bucket: int, offset: int):
    """(rtype, data, payload start, payload end) of the record at `at` of `data` (read from
    `offset` of the bucket's segment), or None when `data` does not hold it whole."""
    if at + HEADER_SIZE > len(data):
        return None
    end = at + record_size(data, at)
    if end > len(data):
        return None
    try:
        parsed = parse_record(data, at, end)
    except RecordError as e:
        raise CorruptSegment(path_of(bucket), offset, e.reason) from None
    if parsed is None:
        return None
    rtype, start, stop = parsed
    return rtype, data, start, stop


@contextlib.contextmanager
def _own_descriptor(path: Path, size: int):
    """`read(bucket, start, end)` over a descriptor of its own, up to `size` (for worker threads)."""
    with own_descriptor(path, size) as read:
        yield lambda _bucket, start, end: read(start, end)


#: How many records a worker thread's walk (`offsets_reader`) takes between two yields of the
#: interpreter's lock: about a millisecond.
YIELD_EVERY = 1000


class BucketLog:
    """A directory of per-bucket segments; `sizes` maps bucket start -> end of the last record."""

    def __init__(self, directory: Path, max_open: int = MAX_OPEN_FDS, readonly: bool = False,
                 power_loss_window: int | None = None):
        self.directory = Path(directory)
        self.readonly = readonly
        # How far past its last completed fsync a segment may have been written (see segment.scan):
        # damage that close to the end, followed by valid records, is a power-loss tail.
        self.power_loss_window = power_loss_window
        self.sizes: SegmentDirectory[int] = SegmentDirectory()
        self._fds: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._dirty: set[int] = set()
        self._max_open = max_open
        self._new_files = False
        # Indexes following the log: `appended(bucket, pos, data, ids)`, `truncated(bucket, size)`,
        # `removed(bucket)` (storage/id_index.py).
        self.listeners: list = []
        # Whether reads that never wait for the disk (RWF_NOWAIT) work here (see `read_cached`).
        self._nowait_reads = hasattr(os, "RWF_NOWAIT")
        self._read_buf = bytearray(4096)  # `read_cached`'s buffer (the event loop's thread only)
        # The paths of the buckets it holds, made once: a Path join costs 5 us, and appends, fsync
        # rounds and reads ask for one per batch.
        self._paths: dict[int, Path] = {}
        # Held by a reader of mapped segments while it copies from them (the read-ahead's worker,
        # wheel/prefetch.py): a segment is truncated only while none does, since touching a
        # mapped page past the end of its file kills the process (SIGBUS).
        self.truncation = threading.Lock()
        # Per bucket, the size up to which its segment's pages were handed back (`pages_to_give_back`).
        self._given_back: dict[int, int] = {}

    @classmethod
    def open(cls, directory: Path, **kw) -> "BucketLog":
        """List the segments; no scan (callers recover tails against their checkpoint).

        A missing directory is created, or with `readonly=True` read as empty.
        """
        self = cls(directory, **kw)
        if not self.readonly:
            self.directory.mkdir(parents=True, exist_ok=True)
        for path in self.directory.glob("*" + SUFFIX):
            try:
                bucket = parse_bucket_name(path.name[: -len(SUFFIX)])
            except ValueError:
                continue
            self.sizes[bucket] = path.stat().st_size
        return self

    def path(self, bucket: int) -> Path:
        path = self._paths.get(bucket)
        if path is None:
            path = self.directory / (bucket_name(bucket) + SUFFIX)
            if bucket in self.sizes:  # (kept for the buckets it holds only: any bucket may be asked about)
                self._paths[bucket] = path
        return path

    def buckets(self) -> list[int]:
        return self.sizes.keys()

    def size(self, bucket: int) -> int:
        return self.sizes[bucket] if bucket in self.sizes else 0

    def _fd(self, bucket: int) -> int:
        fd = self._fds.get(bucket)
        if fd is not None:
            self._fds.move_to_end(bucket)
            return fd
        if self.readonly:
            fd = os.open(self.path(bucket), os.O_RDONLY)
        else:
            if bucket not in self.sizes:
                self.sizes[bucket] = 0
                self._new_files = True
            fd = os.open(self.path(bucket), os.O_RDWR | os.O_CREAT, 0o644)
        self._fds[bucket] = fd
        while len(self._fds) > self._max_open:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        return fd

    def append(self, bucket: int, data: bytes, ids: list | None = None) -> int:
        """Append encoded records to the bucket's segment in one write; returns their offset.

        `ids`, when the caller knows them, handed to the listeners so that they need not parse the
        records again: for schedule_log ``(offset within data, record type, schedule_time,
        message id bytes)`` of every SCHEDULED and SCHEDULED_CANCEL record in `data`; for
        dispatch_log the schedule offset of each DISPATCH record in `data`, in order, when they
        are all of one length (one broker group's). Does not fsync (see `sync`).
        Raises DiskFull / StorageError with the segment intact.
        """
        self._check_writable()
        pos = self.size(bucket)
        write_all(self._fd(bucket), data, pos, self.path(bucket))
        self.sizes[bucket] = pos + len(data)
        self._dirty.add(bucket)
        for listener in self.listeners:
            listener.appended(bucket, pos, data, ids)
        return pos

    def sync(self) -> None:
        """fsync every segment written since the last sync, and the directory if files appeared."""
        for bucket in sorted(self._dirty):
            fsync_fd(self._fd(bucket), self.path(bucket))
        self._dirty.clear()
        if self._new_files:
            fsync_dir(self.directory)
            self._new_files = False

    def dirty_buckets(self) -> list[int]:
        """The buckets appended to (or cut) since the last `take_dirty`, in order."""
        return sorted(self._dirty)

    def take_dirty(self) -> tuple[list[Path], bool]:
        """Hand over what `sync` would fsync, for `sync_paths` in a worker thread."""
        paths = [self.path(b) for b in sorted(self._dirty)]
        new_files, self._new_files = self._new_files, False
        self._dirty.clear()
        return paths, new_files

    def mark_dirty(self, paths: list[Path]) -> None:
        """Put back what a failed `sync_paths` did not make durable."""
        for path in paths:
            self._dirty.add(parse_bucket_name(path.name[: -len(SUFFIX)]))
        self._new_files = True

    def sync_paths(self, paths: list[Path], new_files: bool) -> None:
        """fsync files by path (safe off the trio thread: it shares no descriptor with the LRU)."""
        for path in paths:
            fsync_path(path)
        if new_files:
            fsync_dir(self.directory)

    def pages_to_give_back(self, buckets) -> list[tuple[Path, int, int]]:
        """For `segment.give_back_pages` (in a worker thread, after an fsync covered them): per
        bucket of `buckets`, ``(path, start, end)`` from where the last call for it stopped (from a
        folio's boundary below it, `segment.give_back_start`, so that what a call ended inside goes
        once it is whole) to as near its segment's end now as `segment.give_back_end` lets."""
        ranges = []
        for bucket in buckets:
            size = give_back_end(self.size(bucket))
            start = self._given_back.get(bucket, 0)
            if size > start:
                ranges.append((self.path(bucket), give_back_start(start), size))
                self._given_back[bucket] = size
        return ranges

    def read(self, bucket: int, start: int = 0, end: int | None = None) -> bytes:
        size = self.size(bucket)
        end = size if end is None else min(end, size)
        if end <= start:
            return b""
        return os.pread(self._fd(bucket), end - start, start)

    def read_cached(self, bucket: int, start: int = 0, end: int | None = None) -> bytes | None:
        """As `read`, from the page cache only: None when some of the range is not in memory, so
        that reading it would wait for the disk (a non-blocking read, RWF_NOWAIT). Where the file
        system or kernel cannot read without blocking, a plain read."""
        size = self.size(bucket)
        end = size if end is None else min(end, size)
        if end <= start:
            return b""
        if not self._nowait_reads:
            return self.read(bucket, start, end)
        if len(self._read_buf) < end - start:
            self._read_buf = bytearray(end - start)
        buf = memoryview(self._read_buf)[: end - start]
        try:
            n = os.preadv(self._fd(bucket), [buf], start, os.RWF_NOWAIT)
        except BlockingIOError:
            return None
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            self._nowait_reads = False
            return self.read(bucket, start, end)
        return bytes(buf) if n == len(buf) else None  # one copy, as os.pread makes

    def cached_reader(self, bucket: int) -> tuple[int, int] | None:
        """(descriptor, size) of the bucket's segment for a page-cache-only read of its own
        (RWF_NOWAIT, on the event loop's thread: the descriptor is the cache's), or None where reads
        cannot be page-cache-only (then `read_cached` reads plainly)."""
        if not self._nowait_reads:
            return None
        return self._fd(bucket), self.size(bucket)

    def read_record(self, bucket: int, offset: int, guess: int = 512) -> tuple[int, bytes, int, int]:
        """(rtype, data, payload start, payload end) of the whole, checked record at `offset`.

        One read of `guess` bytes covers most records whole; a bigger one takes a second read.
        Raises CorruptSegment when there is no whole valid record there."""
        return _record_at(self.read, self.path, bucket, offset, guess)

    def read_records_at(self, bucket: int, offsets: list[int], guess: int = 512, *,
                        cached_only: bool = False) -> list:
        """Per offset of `offsets` (in any order), the record there as `read_record` gives it, or
        the CorruptSegment (the others are still read); with `cached_only`, None for a record not
        all in the page cache.

        Offsets near each other share one read of at most SHARED_READ_BYTES: a bucket's records lie in
        the order they arrived, which for messages of one delay is the order they fall due, so a
        tick's due records are mostly neighbours (one read, and one copy, per record before). A
        record the shared read does not hold whole is read on its own."""
        return _records_at(self.read_cached if cached_only else self.read, self.path, bucket, offsets, guess)

    def range_reader(self, bucket: int, start: int, end: int):
        """A function for a worker thread returning `read(bucket, start, end)`, from a descriptor of
        its own (the descriptor cache is the event loop's)."""
        path, size = self.path(bucket), self.size(bucket)

        def read() -> bytes:
            with _own_descriptor(path, size) as pread:
                return pread(bucket, start, end)

        return read

    def records_reader(self, bucket: int):
        """A function `read(offsets, guess)` for a worker thread: per offset, the record there as
        `read_record` gives it, or the CorruptSegment. It opens the segment itself (the descriptor
        cache is the event loop's) and reads up to the size the segment has now."""
        path, size = self.path(bucket), self.size(bucket)

        def read(offsets: list[int], guess: int) -> list:
            with _own_descriptor(path, size) as pread:
                return _records_at(pread, lambda _: path, bucket, offsets, guess)

        return read

    def _check_writable(self) -> None:
        if self.readonly:
            raise StorageError(f"{self.directory} is open read-only")

    def truncate(self, bucket: int, size: int) -> None:
        self._check_writable()
        if self.size(bucket) > size:
            with self.truncation:
                os.ftruncate(self._fd(bucket), size)
            self.sizes[bucket] = size
            self._dirty.add(bucket)
            if self._given_back.get(bucket, 0) > size:
                self._given_back[bucket] = size
            for listener in self.listeners:
                listener.truncated(bucket, size)

    def recover_tail(self, bucket: int) -> ScanResult | None:
        """Scan the bucket's segment; truncate a torn tail (logged) and return the scan, or None
        when there is no segment. Read-only, the tail is hidden from readers, not truncated.

        Raises CorruptSegment when the damage is not a torn tail.
        """
        path = self.path(bucket)
        if not path.exists():
            return None
        return self.cut_tail(bucket, scan(read_file(path), path, power_loss_window=self.power_loss_window))

    def offsets_reader(self, bucket: int, rtype: int, offset_of):
        """A function for a worker thread: `scan_offsets` of the bucket's segment ((None, empty
        array) when there is none), or the CorruptSegment it raised with an empty array. It reads
        the file by its path (the descriptor cache is the event loop's); the loop then cuts a torn
        tail with `cut_tail`. Only for a segment nothing is appended to meanwhile."""
        path, window = self.path(bucket), self.power_loss_window

        def read():
            try:
                buf = read_file(path)
            except FileNotFoundError:
                return None, array("q")
            try:
                return scan_offsets(buf, path, rtype, offset_of, power_loss_window=window,
                                    yield_every=YIELD_EVERY)
            except CorruptSegment as e:
                return e, array("q")

        return read

    def cut_tail(self, bucket: int, result: ScanResult) -> ScanResult:
        """Truncate the torn tail a scan of the bucket's segment found (logged); read-only, hide it
        from readers instead. Returns `result`."""
        path = self.path(bucket)
        if result.torn_bytes:
            if self.readonly:
                log.warning("%s: torn tail at offset %d (%s): %d bytes left for the node to truncate",
                            path, result.valid_end, result.torn_reason, result.torn_bytes)
                self.sizes[bucket] = result.valid_end
                return result
            log.warning("%s: torn tail at offset %d (%s): truncating %d bytes",
                        path, result.valid_end, result.torn_reason, result.torn_bytes)
            self.sizes[bucket] = path.stat().st_size
            self.truncate(bucket, result.valid_end)
            self.sync()
        return result

    def records(self, bucket: int, start: int = 0, end: int | None = None):
        """Yield ``(offset, rtype, payload)`` for whole records; raises CorruptSegment on a bad one."""
        data = self.read(bucket, start, end)
        for pos, rtype, s, e in read_records(data, self.path(bucket), base=start, report=raise_unless_incomplete):
            yield pos, rtype, data[s:e]

    def remove(self, bucket: int) -> None:
        self._check_writable()
        fd = self._fds.pop(bucket, None)
        if fd is not None:
            os.close(fd)
        self._dirty.discard(bucket)
        self._given_back.pop(bucket, None)
        if bucket in self.sizes:
            self.sizes.pop(bucket)
        self.path(bucket).unlink(missing_ok=True)
        self._paths.pop(bucket, None)
        fsync_dir(self.directory)
        for listener in self.listeners:
            listener.removed(bucket)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
