"""Read-ahead of the messages about to fall due, so that delivery does not wait for the disk.

The wheel holds refs only: a message's record is read from its schedule_log segment when it is
taken for delivery, on the event loop. A segment written an hour ago may no longer be in the page
cache (memory pressure, or proactive reclaim of pages not touched for a while), and then each such
read waits for the disk with the whole loop: `ops/bench deliver --bucket-load 3000000` saw sender
steps of 47 and 61 ms, with no garbage collection in them, when the next bucket's load began.

`prefetch_due` runs beside the tick task: every `step_ms` it asks the kernel to read ahead
(`posix_fadvise(POSIX_FADV_WILLNEED)`, which starts the reads and does not wait for them) the
records of the entries falling due within the next `horizon_ms`, each range of nearby records as
one request, from a worker thread. By the time they fall due their pages are in memory.
"""
from __future__ import annotations

import logging
import os

import trio

from delayserver.storage.threads import run_disk
from delayserver.wheel.tick_manager import READ_GUESS_BYTES, TickManager

log = logging.getLogger("delayserver.wheel")

#: Read ahead what falls due within this long.
HORIZON_MS = 1000
#: How often to look ahead.
STEP_MS = 100
#: Records closer than this are read ahead as one range.
GAP_BYTES = 64 << 10


def ranges(offsets: list[int], record_bytes: int = READ_GUESS_BYTES, gap: int = GAP_BYTES) -> list[tuple[int, int]]:
    """(start, length) ranges covering `record_bytes` from each offset, nearby ones merged."""
    out: list[tuple[int, int]] = []
    start = end = None
    for offset in sorted(offsets):
        if start is not None and offset <= end + gap:
            end = max(end, offset + record_bytes)
            continue
        if start is not None:
            out.append((start, end - start))
        start, end = offset, offset + record_bytes
    if start is not None:
        out.append((start, end - start))
    return out


def advise(paths_and_ranges: list[tuple[str, list[tuple[int, int]]]]) -> int:
    """Ask the kernel to read the ranges ahead (a worker thread's part); returns how many."""
    count = 0
    for path, spans in paths_and_ranges:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # a bucket cleaned meanwhile: nothing to read ahead
        try:
            for start, length in spans:
                os.posix_fadvise(fd, start, length, os.POSIX_FADV_WILLNEED)
                count += 1
        finally:
            os.close(fd)
    return count


def plan(ticks: TickManager, start_ms: int, end_ms: int) -> list[tuple[str, list[tuple[int, int]]]]:
    """The segment ranges holding the entries due in [start_ms, end_ms), per segment file."""
    by_bucket: dict[int, list[int]] = {}
    for ref in ticks.wheel.refs_due_between(start_ms, end_ms):
        bucket, offset = ticks.split(ref)
        by_bucket.setdefault(bucket, []).append(offset)
    return [(str(ticks.store.schedule_log.path(bucket)), ranges(offsets)) for bucket, offsets in by_bucket.items()]


async def prefetch_due(ticks: TickManager, clock, *, horizon_ms: int = HORIZON_MS, step_ms: int = STEP_MS,
                       advise=advise, run_blocking=run_disk,
                       task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Read ahead, every `step_ms`, what falls due up to `horizon_ms` from now (see the module
    docstring), calling `advise` through `run_blocking` (a worker thread); each entry is asked for
    once, unless the clock steps back."""
    task_status.started()
    done_until = None
    while True:
        now = clock.now_ms()
        if done_until is None or done_until < now or done_until > now + horizon_ms:
            done_until = now  # first round, fell behind, or the clock stepped back
        end = now + horizon_ms
        wanted = plan(ticks, done_until, end)  # nothing when the clock has not moved
        done_until = end
        if wanted:
            try:
                await run_blocking(advise, wanted)
            except OSError as e:  # only a hint: delivery reads the records anyway
                log.debug("read-ahead failed: %s", e)
        await trio.sleep(step_ms / 1000)
