"""Writing a big file without stalling the fsyncs that acknowledgements and deliveries wait for.

A save of the dedupe table or of a bucket's id index writes tens of megabytes in a worker thread
and makes them durable with one fsync. Until that fsync the bytes sit dirty in the page cache, and
the fsync sends them to the disk all at once: an fsync of message_log, dispatch_log or the spool
issued meanwhile waits behind them (one filesystem journal, one disk queue). At 50,000 messages
falling due a second (`ops/bench deliver --transports spool --rate 50000`) the first save of a
table of 500,000 ids, 60 s after the node started, made the deliveries due in the next few
hundred milliseconds late by 18 to 61 ms at the median: the run's P99 (29 and 59 ms, against 9 and
9 ms with the writeback paced).

`write_paced` writes such a file step by step and has the kernel start each step's writeback as
soon as it is written (`sync_file_range` with SYNC_FILE_RANGE_WRITE), then waits for the step
before it to reach the disk before going on: no more than two steps are ever dirty or in flight,
so an fsync of another file waits behind a step or two at most, and the final fsync of this one
finds little left to write. The final fsync is still what makes the file durable:
`sync_file_range` writes data only, never the file's size or allocation.

Where `sync_file_range` does not exist (not Linux), the bytes are written as they are and the
final fsync does all the work, as before.
"""
from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable, Iterable

#: Bytes written between two starts of writeback: a step a concurrent fsync may wait behind.
WRITEBACK_STEP = 1 << 20

# The flags of sync_file_range(2).
WAIT_BEFORE = 1
WRITE = 2
WAIT_AFTER = 4


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _libc_sync_file_range()


def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> None:
    """sync_file_range(2); raises OSError as the call fails (a writeback error it reports is one
    the file's next fsync may no longer see: the write has failed). A no-op where it does not exist."""
    if _sync_file_range is None:
        return
    if _sync_file_range(fd, offset, nbytes, flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"sync_file_range: {os.strerror(code)}")


class Writeback:
    """Paces the writeback of a file written front to back through `fd` (see the module docstring):
    tell it how far the file is written (`written`) and it starts the writeback of each `step`
    written since, and waits for the one before. `sync_range` is the system call (tests record it)."""

    def __init__(self, fd: int, start: int = 0, step: int = WRITEBACK_STEP,
                 sync_range: Callable[[int, int, int, int], None] = sync_file_range):
        self.fd, self.step, self.sync_range = fd, step, sync_range
        self.started = start  # writeback started for the bytes before this offset
        self._previous: tuple[int, int] | None = None  # the range started last, not waited for yet

    def written(self, end: int, *, last: bool = False) -> None:
        """The file holds what was written up to offset `end`: start its writeback once a step is
        due (or now, `last`), then wait for the range started before."""
        if end - self.started < (1 if last else self.step):
            return
        self.sync_range(self.fd, self.started, end - self.started, WRITE)
        if self._previous is not None:
            self.sync_range(self.fd, *self._previous, WAIT_BEFORE | WRITE | WAIT_AFTER)
        self._previous = (self.started, end - self.started)
        self.started = end


def write_paced(fd: int, parts: Iterable, at: int = 0, step: int = WRITEBACK_STEP,
                sync_range: Callable[[int, int, int, int], None] = sync_file_range) -> int:
    """Write the buffers of `parts` (anything with the buffer protocol) one after the other from
    offset `at` of `fd`, the writeback paced by `Writeback`; returns the offset after the last.
    The caller fsyncs. Raises OSError as a write or a writeback fails."""
    pace = Writeback(fd, at, step, sync_range)
    pos = at
    for part in parts:
        view = memoryview(part).cast("B")
        done = 0
        while done < len(view):
            # At most a step a call: the writeback of a big part starts as it is written.
            n = os.pwrite(fd, view[done:done + step], pos)
            if n == 0:
                raise OSError(errno.EIO, "pwrite wrote nothing")
            done += n
            pos += n
            pace.written(pos)
    pace.written(pos, last=True)
    return pos


def write_file_paced(path, parts: Iterable, *, append: bool = False) -> int:
    """`write_paced` of `parts` into the file at `path` (made anew, or after its end with
    `append`), then fsync; returns the file's size. Raises OSError."""
    flags = os.O_WRONLY | os.O_CREAT | (0 if append else os.O_TRUNC)
    fd = os.open(path, flags, 0o644)
    try:
        end = write_paced(fd, parts, os.fstat(fd).st_size if append else 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    return end
