"""One segment file: append, read, fsync, and recovery of its tail.

Recovery reads the segment with the one reader (`storage.reader.scan`), which keeps the three
outcomes apart: clean end; torn tail (truncated here, with the file, offset and bytes dropped
logged); corruption (CorruptSegment names the file and offset; nothing past it is ever yielded).
Where the writer bounds how far it runs ahead of its last completed fsync (`power_loss_window`),
damage within that many bytes of the last valid record is a power-loss tail, truncated and logged
like a torn one (see `reader.scan`).

fsync failures are final (fsyncgate): Linux reports a writeback error once and may drop the dirty
pages, so a later fsync of the same file, through any descriptor, that succeeds proves nothing.
Every failed fsync is remembered per file for the life of the process, and every later fsync of
that file raises FsyncFailed too: nothing written to it since its last good fsync is ever counted
durable. `fsync_failures()` lists them (the node turns read-only and says why).

Every fsync is timed (`FSYNC_TIMES`, the histogram `delayserver_fsync_seconds{log}`), and one that
takes `SLOW_FSYNC_S` or more is logged: acknowledgements and deliveries wait for these fsyncs, so a
stretch of late deliveries with no slow step of the event loop is usually a slow disk, and this
says so.
"""
from __future__ import annotations

import bisect
import contextlib
import errno
import logging
import os
import threading
import time
from pathlib import Path

import attrs

from delayserver import failpoints
from delayserver.storage.errors import DiskFull, FsyncFailed, StorageError
from delayserver.storage.reader import scan, valid_record_at

log = logging.getLogger("delayserver.storage")


# path -> why its fsync failed; see the module docstring (fsyncgate).
_failed_fsyncs: dict[str, str] = {}


def _fsync_key(path) -> str:
    return os.path.abspath(os.fspath(path))


# path -> an I/O error (EIO, not ENOSPC) of a write or rename of it: the device is failing.
_io_errors: dict[str, str] = {}


def _under(failures: dict[str, str], under) -> dict[str, str]:
    if under is None or not failures:
        return dict(failures)
    root = _fsync_key(under)
    return {k: v for k, v in failures.items() if k == root or k.startswith(root + os.sep)}


def fsync_failures(under=None) -> dict[str, str]:
    """Every file (or directory) whose fsync failed in this process, with the error; with
    `under`, those of that directory and below only."""
    return _under(_failed_fsyncs, under)


def storage_failures(under=None) -> dict[str, str]:
    """fsync failures and I/O errors (not a full disk) of writes and renames: what turns a node
    read-only."""
    return {**_under(_io_errors, under), **_under(_failed_fsyncs, under)}


def note_io_error(path, error: OSError) -> None:
    """Remember an I/O error (EIO and the like; a full disk is not one) of a write or rename."""
    if error.errno not in (errno.ENOSPC, errno.EDQUOT):
        _io_errors.setdefault(_fsync_key(path), str(error))


def forget_fsync_failures(under) -> None:
    """Forget the failed fsyncs of files under `under`: only for a data directory being opened
    afresh by recovery, which trusts only what is on disk (a restart within one process)."""
    for failures in (_failed_fsyncs, _io_errors):
        for key in _under(failures, under):
            del failures[key]


#: An fsync this slow or slower is logged (at most one line a second; the rest are counted in it).
SLOW_FSYNC_S = 0.05
#: The files whose fsyncs are told apart, by the name of their directory in the data directory.
FSYNC_LOGS = ("message_log", "schedule_log", "dispatch_log", "checkpoint", "spool", "parked")
#: The histogram's upper bounds, in seconds (then one count over the last, as metrics.py's histograms).
FSYNC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class FsyncTimes:
    """How long this process's fsyncs took, per log (`FSYNC_LOGS`, else "other"): per log, the
    counts per bound of FSYNC_BUCKETS and over the last (the layout of metrics.py's histograms,
    which exports them) and their sum; and the longest. Worker threads fsync at once: updated
    under a lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self.counts: dict[str, list[int]] = {}
        self.sums: dict[str, float] = {}
        self.longest_s = 0.0
        self._slow_logged_at = None
        self._slow_unlogged = 0

    @staticmethod
    def log_of(path) -> str:
        parts = os.fspath(path).split(os.sep)
        for name in reversed(parts[-2:]):  # the directory itself, or the file's
            if name in FSYNC_LOGS:
                return name
        return "other"

    def observe(self, path, seconds: float) -> None:
        name = self.log_of(path)
        k = bisect.bisect_left(FSYNC_BUCKETS, seconds)
        with self._lock:
            counts = self.counts.get(name)
            if counts is None:
                counts = self.counts[name] = [0] * (len(FSYNC_BUCKETS) + 1)
            counts[k] += 1
            self.sums[name] = self.sums.get(name, 0.0) + seconds
            self.longest_s = max(self.longest_s, seconds)
            if seconds < SLOW_FSYNC_S:
                return
            now = time.monotonic()
            if self._slow_logged_at is not None and now - self._slow_logged_at < 1.0:
                self._slow_unlogged += 1
                return
            more, self._slow_logged_at, self._slow_unlogged = self._slow_unlogged, now, 0
        log.warning("slow fsync: %s took %.0f ms (acknowledgements and deliveries waiting for it waited as "
                    "long)%s", path, seconds * 1000, f" ({more} more slow fsyncs since the last warning)" if more else "")

    def snapshot(self) -> tuple[dict[str, list[int]], dict[str, float]]:
        with self._lock:
            return {name: list(c) for name, c in self.counts.items()}, dict(self.sums)


FSYNC_TIMES = FsyncTimes()


def _fsync(fd: int, path, op: str, site: str | None = None) -> None:
    key = _fsync_key(path)
    earlier = _failed_fsyncs.get(key)
    if earlier is not None:
        raise FsyncFailed(f"{path}: an earlier fsync of it failed ({earlier}); nothing written to it since "
                          "its last good fsync counts as durable")
    try:
        failpoints.io(op, path, site)
        began = time.perf_counter()
        os.fsync(fd)
        FSYNC_TIMES.observe(path, time.perf_counter() - began)
    except OSError as e:
        _failed_fsyncs[key] = str(e)
        log.critical("%s: fsync failed (%s): what was written to it since its last good fsync is never counted "
                     "durable, and no later fsync of it is trusted", path, e)
        raise FsyncFailed(f"{path}: fsync failed: {e}") from e


def fsync_dir(path: Path) -> None:
    """fsync a directory (after creating, renaming or deleting in it). Raises FsyncFailed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise StorageError(f"{path}: could not open the directory to fsync it: {e}") from e
    try:
        _fsync(fd, path, "dirfsync")
    finally:
        os.close(fd)


def read_file(path: Path, start: int = 0, end: int | None = None) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read() if end is None else f.read(end - start)


@contextlib.contextmanager
def own_descriptor(path: Path, size: int):
    """`read(start, end)` of the file through a descriptor of its own, up to `size` (for worker
    threads: the logs' descriptors are the event loop's)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        def read(start: int, end: int) -> bytes:
            end = min(end, size)
            return os.pread(fd, end - start, start) if end > start else b""
        yield read
    finally:
        os.close(fd)


def write_all(fd: int, data, pos: int, path) -> None:
    """pwrite all of `data` at `pos`; on failure truncate back to `pos` and raise.

    Raises DiskFull on ENOSPC/EDQUOT and StorageError on any other OSError. Either way the file
    ends where it ended before the call, so nothing stored is damaged.
    """
    view = memoryview(data)
    written = 0
    try:
        failpoints.io("write", path)
        while written < len(view):
            written += os.pwrite(fd, view[written:], pos + written)
    except OSError as e:
        try:
            os.ftruncate(fd, pos)
        except OSError:
            log.error("%s: could not truncate back to %d after a failed write", path, pos)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(f"{path}: no space left on device") from e
        note_io_error(path, e)
        raise StorageError(f"{path}: write failed: {e}") from e


#: The largest folio the page cache may keep a file's bytes in (a PMD's 2 MiB on x86-64; ext4 takes
#: large folios for big writes). Advice drops only the folios wholly inside its range, so each range
#: a log gives back starts at such a boundary below its first byte (`give_back_start`): the folio
#: that held the last range's end, kept then, is wholly inside the next one.
FOLIO_ALIGN_BYTES = 2 << 20
#: How far behind a log's end its pages are given back (`give_back_pages`). The kernel keeps the
#: pages a CPU has just written in a per-CPU batch before they reach its lists; advice that meets
#: one of them drains every CPU's batch (`lru_add_drain_all`: work run on each CPU, the event
#: loop's included, and waited for) and walks the range again. A MiB behind, none is in a batch.
GIVE_BACK_LAG_BYTES = 1 << 20


def give_back_start(offset: int) -> int:
    """Where a range given back from `offset` on starts (FOLIO_ALIGN_BYTES)."""
    return offset - offset % FOLIO_ALIGN_BYTES


def give_back_end(end: int) -> int:
    """How far a log whose written bytes end at `end` may give its pages back (GIVE_BACK_LAG_BYTES)."""
    return end - GIVE_BACK_LAG_BYTES


def give_back_pages(ranges) -> None:
    """Ask the kernel to drop from the page cache the folios wholly inside each ``(path, start, end)``
    of `ranges` (`posix_fadvise(DONTNEED)` through a descriptor of its own, so that a worker thread may
    call it while the event loop goes on writing or rolls the log). Advice only: the pages must be
    clean (fsynced), else the kernel keeps them; a file gone meanwhile (cleaned) or advice the file
    system refuses costs nothing stored and is passed over."""
    for path, start, end in ranges:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def fsync_fd(fd: int, path, site: str | None = None) -> None:
    """fsync, translated: an fsync error is never retried (the page cache may have dropped data),
    and once an fsync of `path` failed, every later one raises FsyncFailed too."""
    _fsync(fd, path, "fsync", site)


def fsync_path(path) -> None:
    """fsync a file through a descriptor of its own (safe in a worker thread while the owner of
    the file's main descriptor goes on writing, or closes it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fsync_fd(fd, path)
    finally:
        os.close(fd)


@attrs.define(eq=False)
class Segment:
    """An open segment file. `size` is the end of the last whole record."""

    path: Path
    fd: int
    size: int

    @classmethod
    def open(cls, path: Path, *, create: bool = True, recover: bool = True, sealed: bool = False,
             power_loss_window: int | None = None, durable_to: int = 0) -> "Segment":
        """Open (and with `recover`, scan) a segment; a torn tail is truncated and logged.

        `durable_to`: an offset a checkpoint names that was written after an fsync covered the
        file up to it. No power loss damaged what lies before it, so the walk starts there when
        a valid record does (or the file ends there); else it starts at the file's start.

        Raises CorruptSegment when damage is not a torn tail (see `scan`).
        """
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(path, flags, 0o644)
        try:
            size = os.fstat(fd).st_size
            start = durable_to if 0 < durable_to <= size else 0
            buf = read_file(path, start) if recover and size else b""
            if start and buf and not valid_record_at(buf, 0):  # not where a record starts
                start, buf = 0, read_file(path)
            if buf:
                result = scan(buf, path, allow_torn_tail=not sealed, power_loss_window=power_loss_window,
                              base=start)
                if result.torn_bytes:
                    log.warning(
                        "%s: torn tail at offset %d (%s): truncating %d bytes%s",
                        path, result.valid_end, result.torn_reason, result.torn_bytes,
                        f" holding {result.dropped_records} whole records never acknowledged" if result.dropped_records
                        else "",
                    )
                    os.ftruncate(fd, result.valid_end)
                    fsync_fd(fd, path)
                size = result.valid_end
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, size)

    def append(self, data) -> int:
        """Write `data` at the end; returns the offset it starts at. Does not fsync."""
        pos = self.size
        write_all(self.fd, data, pos, self.path)
        self.size = pos + len(data)
        return pos

    def sync(self, site: str | None = None) -> None:
        fsync_fd(self.fd, self.path, site)

    def read(self, start: int, end: int | None = None) -> bytes:
        end = self.size if end is None else min(end, self.size)
        if end <= start:
            return b""
        return os.pread(self.fd, end - start, start)

    def truncate(self, size: int) -> None:
        if size < self.size:
            os.ftruncate(self.fd, size)
            self.size = size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
