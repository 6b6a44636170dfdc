"""What of a file the page cache holds (mincore(2)), for the tests of what the logs give back."""
from __future__ import annotations

import ctypes
import mmap
import os


def resident_pages(path) -> int:
    """How many of the file's pages are in the page cache (mincore(2) over a private mapping)."""
    size = os.path.getsize(path)
    if not size:
        return 0
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        anchor = ctypes.c_char.from_buffer(mapped)  # (the mapping's address; let go before it closes)
        try:
            found = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
            assert found == 0, os.strerror(ctypes.get_errno())
        finally:
            del anchor
    return sum(v & 1 for v in vec)


def on_tmpfs(path) -> bool:
    """Whether `path` is on a file system without a page cache of its own to give back (tmpfs)."""
    best, kind = "", ""
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, point, fstype, *_ = line.split()
            if os.path.realpath(path).startswith(point.rstrip("/") + "/") and len(point) > len(best):
                best, kind = point, fstype
    return kind in ("tmpfs", "ramfs")

