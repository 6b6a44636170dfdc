"""Read-ahead of the messages about to fall due, so that delivery does not wait for the disk.

The wheel holds refs only: a message's record is read from its schedule_log segment when it is
taken for delivery, on the event loop. A segment written an hour ago may no longer be in the page
cache (memory pressure, or proactive reclaim of pages not touched for a while), and then each such
read waits for the disk with the whole loop: `ops/bench deliver --bucket-load 3000000` saw sender
steps of 47 and 61 ms, with no garbage collection in them, when the next bucket's load began.
And even from the page cache, one read per record cost the loop a fifth of its time at 40,000
msg/s falling due in random order (read_ahead.py).

`prefetch_due` runs beside the tick task: every `step_ms` it has a worker thread read the records
of the entries falling due within the next `horizon_ms` into memory (`ReadAhead`, read_ahead.py),
where delivery decodes them without a read; what is over its budget is only asked of the kernel
(`posix_fadvise(POSIX_FADV_WILLNEED)`, which starts the reads and does not wait for them), each
range of nearby records as one request. By the time they fall due they are in memory.

The worker copies the records from a mapping of their segment (`SegmentMap`), kept from one round
to the next while the segment has messages falling due, rather than reading each: a read cost
1.4 us per record scattered over a segment in the page cache, a copy from the mapping 0.4 (a
page fault once per page of it, not a system call per record each round). The pages the
mapping has touched are the page cache's own, shared, not a copy: they show in the process's
RSS as file pages (RssFile in /proc/<pid>/status), and the kernel reclaims them as any other
cached page of the file. A segment is truncated only while no copy runs (`BucketLog.truncation`):
a mapped page past the end of its file would kill the process.
"""
from __future__ import annotations

import functools
import logging
import os

import trio

from delayserver.storage.threads import run_disk
from delayserver.wheel.read_ahead import HORIZON_MS, SegmentMap, read_records
from delayserver.wheel.tick_manager import READ_GUESS_BYTES, TickManager

log = logging.getLogger("delayserver.wheel")

#: How often to look ahead. A round reads what fell into the horizon since the one before: the
#: longer the step, the closer together a round's records lie in their segment when messages
#: arrive in random order of their due time, and the more of them share a read (`fetch`); but
#: the bigger each round's bursts on the event loop and under the interpreter's lock. Rounds
#: every 500 ms cut the read-ahead's CPU per record from 1.77 to 1.03 us at 50,000 msg/s falling
#: due, but delivery's P99 to Redis measured 25, 21 and 54 ms against 22, 11 and 11 before, and
#: 9 and 9 ms against 13 and 11 once back at 100 ms (`ops/bench deliver --transports redis
#: --rate 50000`, alternated): not a trade to make.
STEP_MS = 100
#: Records closer than this are read ahead as one range.
GAP_BYTES = 64 << 10
#: Records read into memory per read_records call: the interpreter's lock is held while their
#: bytes objects are made (0.35 ms for 2,048 of 340 bytes, of a call of 2.9 ms reading them from
#: the page cache in random order), and the budget is looked at between two.
FETCH_CHUNK = 2048
#: A segment is mapped this far past its size, so that one that grows is seldom mapped again.
MAP_HEADROOM_BYTES = 64 << 20


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


def due_offsets(ticks: TickManager, start_ms: int, end_ms: int) -> dict[int, list[int]]:
    """The schedule_log offsets of the entries due in [start_ms, end_ms), per bucket."""
    return ticks.offsets_by_bucket(ticks.wheel.refs_due_between(start_ms, end_ms))


def fetch_jobs(ticks: TickManager, start_ms: int, end_ms: int) -> list[tuple[int, str, int, list[int]]]:
    """`fetch`'s jobs for the entries due in [start_ms, end_ms): (bucket, its segment's path, its
    size, the offsets)."""
    schedule_log = ticks.store.schedule_log
    return [(bucket, str(schedule_log.path(bucket)), schedule_log.size(bucket), offsets)
            for bucket, offsets in due_offsets(ticks, start_ms, end_ms).items()]


def segment_map(maps: dict, bucket: int, fd: int, size: int):
    """The mapping of `bucket`'s segment (open as `fd`; its first `size` bytes are read) kept in
    `maps`, made again when the file there is another one (removed and made again) or has grown
    past it; None where none can be had (not built, an empty segment, or the mmap failed: the
    records are read instead)."""
    if SegmentMap is None or size <= 0:
        return None
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    mapped = maps.get(bucket)
    if mapped is not None and mapped.key == key and mapped.length >= size:
        return mapped
    maps.pop(bucket, None)
    try:
        mapped = maps[bucket] = SegmentMap(fd, 2 * size + MAP_HEADROOM_BYTES)
    except OSError as e:
        log.debug("cannot map the segment of bucket %d, reading it instead: %s", bucket, e)
        return None
    return mapped


def fetch(jobs: list[tuple[int, str, int, list[int]]], room: int, advise=advise,
          chunk: int = FETCH_CHUNK, maps: dict | None = None, truncation=None) -> list[tuple[int, dict[int, bytes]]]:
    """A worker thread's part: the records of each job (bucket, segment path, its size, offsets)
    read into memory, `chunk` records a read in the order they lie in the segment, while they fit
    in `room` bytes, [(bucket, {offset: bytes})]; what is past it is only advised to the kernel. A
    segment that cannot be opened is left alone (a bucket cleaned meanwhile: nothing falls due
    from it).

    In segment order, so that a chunk's records lie close together and neighbours share a read
    (`read_records`): in the order they fall due, the records of messages that arrived in random
    order of their due time lie all over the segment, one read each. (Over the budget, which
    records are read and which only advised then follows their place, not their due time: both
    are in memory when they fall due.)

    `maps` ({bucket: SegmentMap}, the caller's, kept from one call to the next) and `truncation`
    (the schedule_log's `BucketLog.truncation` lock): the records are copied from a mapping of
    their segment, with the lock held, rather than read; the mappings of buckets no job names
    are dropped (their segments may be removed: a mapping keeps the file's space)."""
    out, rest = [], []
    if maps is not None:
        named = {job[0] for job in jobs}
        for bucket in [b for b in maps if b not in named]:
            del maps[bucket]
    for bucket, path, size, offsets in jobs:
        if room <= 0:
            rest.append((path, ranges(offsets)))
            continue
        offsets = sorted(offsets)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            mapped = None if maps is None or truncation is None else segment_map(maps, bucket, fd, size)
            for at in range(0, len(offsets), chunk):
                if room <= 0:
                    rest.append((path, ranges(offsets[at:])))
                    break
                if mapped is None:
                    records = read_records(fd, size, offsets[at:at + chunk])
                else:
                    with truncation:
                        records = read_records(fd, size, offsets[at:at + chunk], mapped=mapped)
                out.append((bucket, records))
                room -= sum(map(len, records.values()))
        finally:
            os.close(fd)
    if rest:
        advise(rest)
    return out


async def prefetch_due(ticks: TickManager, clock, *, horizon_ms: int = HORIZON_MS, step_ms: int = STEP_MS,
                       advise=advise, run_blocking=run_disk, maps: dict | None = None,
                       task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Read ahead, every `step_ms`, what falls due up to `horizon_ms` from now (see the module
    docstring), through `run_blocking` (a worker thread), into `ticks.ahead` and, over its
    budget, by `advise`; each entry is asked for once, unless the clock steps back. `maps`: the
    dict of the segments' mappings (`fetch`), for a test to look at; they are let go in a round
    that finds nothing falling due."""
    task_status.started()
    done_until = None
    ahead = ticks.ahead
    maps = {} if maps is None else maps  # the worker's mappings of the segments it reads from (`fetch`)
    mapped_fetch = functools.partial(fetch, maps=maps, truncation=ticks.store.schedule_log.truncation)
    while True:
        now = clock.now_ms()
        if done_until is None or done_until < now or done_until > now + horizon_ms:
            done_until = now  # first round, fell behind, or the clock stepped back
        end = now + horizon_ms
        jobs = fetch_jobs(ticks, done_until, end)  # none when the clock has not moved
        done_until = end
        ahead.forget_before(now - horizon_ms, ticks.scale)
        if jobs:
            epoch = ahead.epoch
            try:
                got = await run_blocking(mapped_fetch, jobs, ahead.room, advise)
            except OSError as e:  # only a hint: delivery reads the records anyway
                log.debug("read-ahead failed: %s", e)
            else:
                for bucket, records in got:
                    ahead.put(bucket, records, epoch)  # (dropped if the records changed meanwhile)
                    await trio.lowlevel.checkpoint()  # a chunk a step: deliveries go between them
        elif maps:  # nothing falls due soon: let go of the segments (unmapped in the worker)
            await run_blocking(maps.clear)
        await trio.sleep(step_ms / 1000)
