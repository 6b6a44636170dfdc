"""Test helpers: damage files the way crashes and disks do, and build records to damage.

Every recovery test is built from these three: flip a bit, truncate, zero-fill (LevelDB's log
tests do the same).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path

import pytest

from delayserver.storage.record import (
    Message, RecordType, encode_message, encode_record, encode_scheduled, iter_records,
)


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    """Flip one bit of the byte at `offset`."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def truncate(path: Path, size: int) -> None:
    os.truncate(path, size)


def zero_fill(path: Path, offset: int, length: int) -> None:
    """Overwrite (or extend the file with) `length` zero bytes at `offset`."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes(length))


def evict(*paths: Path, timeout_s: float = 10.0) -> None:
    """Drop the files from the page cache, so that reading them waits for the disk; skip the test
    where the pages stay in memory.

    On some machines a drop takes effect a little later, and pages under a read-ahead still in
    flight are not dropped at all: the drop is repeated until no page of the files is in memory,
    as mincore(2) tells (a read would tell too, but a read that misses starts one)."""
    deadline = time.monotonic() + timeout_s
    fds = [os.open(path, os.O_RDONLY) for path in paths]
    try:
        for fd in fds:
            os.fsync(fd)
        while True:
            for fd in fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if not any(resident_pages(fd) for fd in fds):
                return
            if time.monotonic() > deadline:
                pytest.skip("this file system keeps pages in memory")
            time.sleep(0.01)
    finally:
        for fd in fds:
            os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def gives_back_pages(directory: Path) -> bool:
    """Whether the file system of `directory` drops a file's fsynced pages from the page cache when
    told to (`posix_fadvise(DONTNEED)`); tmpfs, whose pages are the file, does not."""
    path = Path(directory) / ".gives-back-pages"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, bytes(16 * mmap.PAGESIZE))
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return not any(resident_map(fd))
    finally:
        os.close(fd)
        path.unlink()


def resident_pages(fd: int) -> int:
    """How many pages of the file are in the page cache (mincore over a mapping of it)."""
    return sum(resident_map(fd))


def resident_map(fd: int) -> list[bool]:
    """Per page of the file, whether it is in the page cache (mincore over a mapping of it)."""
    size = os.fstat(fd).st_size
    if size == 0:
        return []
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    try:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        if _libc.mincore(addr, size, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return [bool(v & 1) for v in vec]
    finally:
        _libc.munmap(addr, size)


def record_offsets(path: Path) -> list[int]:
    """The offset of every whole record of an undamaged file, and its size last."""
    data = Path(path).read_bytes()
    return [pos for pos, *_ in iter_records(data)] + [len(data)]


def message(i: int, *, schedule_time: int = 1_800_000_000_000, body_bytes: int = 32, **kw) -> Message:
    return Message(f"m-{i}", "orders.created", bytes([i % 251]) * body_bytes, schedule_time,
                   kw.pop("headers", {"n": str(i)}), sequence=i, **kw)


def message_record(i: int, **kw) -> bytes:
    return encode_record(RecordType.MESSAGE, encode_message(message(i, **kw)))


def scheduled_record(i: int, message_log_offset: int = 0, **kw) -> bytes:
    payload = encode_scheduled(message_log_offset, encode_message(message(i, **kw)))
    return encode_record(RecordType.SCHEDULED, payload)
