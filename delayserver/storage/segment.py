"""One segment file: append, read, fsync, and recovery of its tail.

Recovery reads the segment with the one reader (`storage.reader.scan`), which keeps the three
outcomes apart: clean end; torn tail (truncated here, with the file, offset and bytes dropped
logged); corruption (CorruptSegment names the file and offset; nothing past it is ever yielded).
"""
from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import attrs

from delayserver.storage.errors import CorruptSegment, DiskFull, FsyncFailed, StorageError
from delayserver.storage.reader import scan

log = logging.getLogger("delayserver.storage")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_file(path: Path, start: int = 0, end: int | None = None) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read() if end is None else f.read(end - start)


def write_all(fd: int, data, pos: int, path) -> None:
    """pwrite all of `data` at `pos`; on failure truncate back to `pos` and raise.

    Raises DiskFull on ENOSPC/EDQUOT and StorageError on any other OSError. Either way the file
    ends where it ended before the call, so nothing stored is damaged.
    """
    view = memoryview(data)
    written = 0
    try:
        while written < len(view):
            written += os.pwrite(fd, view[written:], pos + written)
    except OSError as e:
        try:
            os.ftruncate(fd, pos)
        except OSError:
            log.error("%s: could not truncate back to %d after a failed write", path, pos)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(f"{path}: no space left on device") from e
        raise StorageError(f"{path}: write failed: {e}") from e


def fsync_fd(fd: int, path) -> None:
    """fsync, translated: an fsync error is never retried (the page cache may have dropped data)."""
    try:
        os.fsync(fd)
    except OSError as e:
        raise FsyncFailed(f"{path}: fsync failed: {e}") from e


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
    def open(cls, path: Path, *, create: bool = True, recover: bool = True, sealed: bool = False) -> "Segment":
        """Open (and with `recover`, scan) a segment; a torn tail is truncated and logged.

        Raises CorruptSegment when damage is not a torn tail (see `scan`).
        """
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(path, flags, 0o644)
        try:
            size = os.fstat(fd).st_size
            if recover and size:
                result = scan(read_file(path), path, allow_torn_tail=not sealed)
                if result.torn_bytes:
                    log.warning(
                        "%s: torn tail at offset %d (%s): truncating %d bytes",
                        path, result.valid_end, result.torn_reason, result.torn_bytes,
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

    def sync(self) -> None:
        fsync_fd(self.fd, self.path)

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
