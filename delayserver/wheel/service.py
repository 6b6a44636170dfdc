"""The trio task around the tick manager: load ahead, advance the wheel, wake the sender.

Loading a bucket goes in slices of about a millisecond; between two, the wheel advances and
`fell_due()` tells the sender (the node's is `Sender.dispatch_now`, which takes and routes what fell
due in this task's step; a test's may be a `Wakeup`'s `set`). While deliveries are under way
(something ready or in flight, or due within a second) and the bucket does not start soon, the
loader is paced to its deadline, in slices of half a millisecond: it pauses between slices so that
it takes only the share of the event loop it needs to finish in three quarters of the time left
before the load turns urgent (a quarter of `load_ahead` before the bucket starts), and delivery
keeps the rest. The wheel goes on advancing through a pause, as entries fall due. A big bucket
loading during a busy delivery window would otherwise take half the loop and let delivery fall
behind.

A slice reads its part of the segment on the loop only when it is in the page cache (a read that
cannot wait); otherwise the tick task reads it in a worker thread and advances the wheel meanwhile,
so that a segment evicted since it was written does not make the loop wait for the disk. What a
bucket's load must skip (its dispatch_log and parked records) is read in a worker thread before
the bucket begins. Recovery, before the node reports started, loads the same way, unpaced.

It sleeps until the earliest of: the next due entry, the next bucket's load time, a wake-up from
the replayer (an entry earlier than the current sleep), or at most `max_sleep_ms` (so that a
wall-clock step is noticed within that time). It never spins through empty ticks.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import trio

from delayserver.storage.threads import run_disk
from delayserver.wheel.tick_manager import LOAD_SLICE_S, TickManager

log = logging.getLogger("delayserver.wheel")

#: The least share of the event loop a paced load takes (it never stalls for good).
MIN_LOAD_SHARE = 0.02
#: The longest pause between two load slices.
MAX_LOAD_PAUSE_S = 0.05
#: A load is paced while something is ready or in flight, or falls due within this time: between
#: two deliveries the ready queue is empty most of the time, and an unpaced load would then take the
#: loop back in full slices, each one delaying every step of the next delivery.
DELIVERING_HORIZON_MS = 1000
#: The longest load slice while paced: a delivery that finds a slice running waits at most this long.
PACED_SLICE_S = 0.0005


def load_pause_s(slice_s: float, bytes_per_s: float, bytes_left: int, seconds_left: float) -> float:
    """How long to pause after a load slice of `slice_s` seconds so that the load, at `bytes_per_s`
    while it runs, finishes its `bytes_left` in three quarters of `seconds_left`, taking no more of
    the loop than that needs (and at least MIN_LOAD_SHARE of it). 0 when there is no time to spare."""
    budget = seconds_left * 0.75
    if budget <= 0 or bytes_per_s <= 0:
        return 0.0
    share = min(1.0, max(MIN_LOAD_SHARE, bytes_left / bytes_per_s / budget))
    return min(MAX_LOAD_PAUSE_S, slice_s * (1 / share - 1))


def _urgent_at(ticks: TickManager) -> int:
    return ticks.loading_bucket - ticks.load_ahead_ms // 4


def _delivering(ticks: TickManager, now: int) -> bool:
    """Whether deliveries are under way: something ready or in flight, or due within the horizon."""
    return bool(ticks.ready or ticks.inflight) or ticks.wheel.holds_due_by(now + DELIVERING_HORIZON_MS)


async def _sleep_until(ticks: TickManager, now: int, limit_ms: int) -> None:
    """Sleep until `limit_ms` or the next due entry, whichever comes first (wall ms, half a
    millisecond past it so that the clock has reached it), or until the replayer adds an entry due
    sooner."""
    wake_at = limit_ms
    due = ticks.wheel.next_due()
    if due is not None:
        wake_at = min(wake_at, due)
    ticks.sleeping_until = wake_at
    with trio.move_on_after(max(0, wake_at - now) / 1000 + 0.0005):
        await ticks.changed.wait()
    ticks.sleeping_until = None


async def _pause(ticks: TickManager, clock, fell_due: Callable[[], None], pause_s: float | None) -> None:
    """No loading for `pause_s` (None: until cancelled), but the wheel advances as entries fall
    due: a paced load's pause between two slices, or the wait for a slice's read in a worker
    thread. (At 10,000 msg/s one falls due every 0.1 ms: ending a paced pause for it would end
    every pause at once, and the load would take half the loop again.)"""
    end = None if pause_s is None else trio.current_time() + pause_s
    while True:
        now = clock.now_ms()
        if ticks.advance(now) or ticks.ready:
            fell_due()
        left = 1.0 if end is None else end - trio.current_time()
        if left <= 0:
            return
        await _sleep_until(ticks, now, now + int(left * 1000))


async def _read_off_loop_unless_cached(ticks: TickManager, clock, fell_due: Callable[[], None],
                                       max_s: float) -> bytes | None:
    """What the next load slice reads: from the page cache here, or, when some of it is not
    there, in a worker thread, so that the loop does not wait for the disk; the wheel goes on
    advancing meanwhile, as entries fall due. None when the slice reads nothing, or when the load
    moved on while the thread read (the slice then reads for itself)."""
    pending = ticks.pending_read(max_s=max_s)
    if pending is None:
        return None
    log_ = ticks.store.schedule_log
    data = log_.read_cached(*pending)
    if data is not None:
        return data
    ticks.load_disk_reads += 1
    data = await _in_thread_advancing(ticks, clock, fell_due, log_.range_reader(*pending))
    if ticks.pending_read(max_s=max_s) != pending:
        return None
    return data


async def _in_thread_advancing(ticks: TickManager, clock, fell_due: Callable[[], None], fn):
    """`fn()` in a disk worker thread, the wheel advancing meanwhile as entries fall due."""
    got = []
    async with trio.open_nursery() as nursery:
        async def run() -> None:
            got.append(await run_disk(fn))
            nursery.cancel_scope.cancel()

        nursery.start_soon(run)
        await _pause(ticks, clock, fell_due, None)
    return got[0]


async def _prepare_begin(ticks: TickManager, clock, fell_due: Callable[[], None], now: int) -> None:
    """When the next load step begins a bucket, read what its load must skip (its dispatch_log,
    the parked records) in a worker thread first: after a restart in a busy bucket that is
    millions of records, which would hold the loop for seconds."""
    bucket = ticks.pending_begin(now)
    if bucket is None:
        return
    generation = ticks.generation
    settled = await _in_thread_advancing(ticks, clock, fell_due, ticks.settled_reader(bucket))
    ticks.prepare_begin(bucket, generation, settled)


def _load_is_urgent(ticks: TickManager, now: int) -> bool:
    """Whether the bucket being loaded starts within a quarter of `load_ahead`: load at full speed."""
    return ticks.loading_bucket is None or now >= _urgent_at(ticks)


async def serve_ticks(ticks: TickManager, clock, fell_due: Callable[[], None], *, max_sleep_ms: int = 1000,
                      active=lambda: True, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Recover (load every bucket up to the load target) before reporting started, then tick.

    While `active()` is false (a slave, or a master fenced off by a newer epoch) nothing is loaded
    and memory is emptied: on becoming active again the load starts over from disk, so it skips
    whatever dispatch_log says was delivered meanwhile.
    """
    while active():
        # As the tick loop below loads, unpaced: what is not in the page cache is read in worker
        # threads, so that producers served meanwhile do not wait for the disk.
        now = clock.now_ms()
        await _prepare_begin(ticks, clock, fell_due, now)
        data = await _read_off_loop_unless_cached(ticks, clock, fell_due, LOAD_SLICE_S)
        if not ticks.load_step(now, data=data):
            break
        if ticks.ready:
            fell_due()
        await trio.lowlevel.checkpoint()
    log.info("recovered: %d messages in memory, %d overdue", ticks.loaded, len(ticks.ready))
    task_status.started()
    while True:
        now = clock.now_ms()
        if not active():
            if ticks.loading_bucket is not None or ticks.loaded:
                log.warning("not delivering: dropping the loaded window (%d messages)", ticks.loaded)
                ticks.reset(now)
            with trio.move_on_after(max_sleep_ms / 1000):
                await ticks.changed.wait()
            continue
        ticks.advance(now)
        bytes_per_s = 0.0
        paced = False
        while True:
            max_s = PACED_SLICE_S if paced else LOAD_SLICE_S
            await _prepare_begin(ticks, clock, fell_due, now)
            data = await _read_off_loop_unless_cached(ticks, clock, fell_due, max_s)
            began, offset_before = time.perf_counter(), ticks.loaded_offset
            if not ticks.load_step(now, max_s=max_s, data=data):
                break
            # Loading goes in slices of a millisecond or so: between two, what fell due goes out.
            # A load has until its bucket starts: while deliveries are under way and the bucket is
            # not close, it is paced to that deadline (module docstring), so delivery gets the loop.
            slice_s = time.perf_counter() - began
            if slice_s > 0 and ticks.loaded_offset > offset_before:
                rate = (ticks.loaded_offset - offset_before) / slice_s
                bytes_per_s = rate if not bytes_per_s else 0.8 * bytes_per_s + 0.2 * rate
            pause = 0.0
            paced = _delivering(ticks, now) and not _load_is_urgent(ticks, now)
            if paced:
                pause = load_pause_s(slice_s, bytes_per_s, ticks.loading_end - ticks.loaded_offset,
                                     (_urgent_at(ticks) - now) / 1000)
            if pause:
                await _pause(ticks, clock, fell_due, pause)
            else:
                await trio.lowlevel.checkpoint()
            now = clock.now_ms()
            if ticks.advance(now) or ticks.ready:
                fell_due()
        ticks.advance(now)
        if ticks.ready:
            fell_due()
        await _sleep_until(ticks, now, min(now + max_sleep_ms, ticks.next_load_time()))
