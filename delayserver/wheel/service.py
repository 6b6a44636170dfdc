"""The trio task around the tick manager: load ahead, advance the wheel, wake the sender.

Loading a bucket goes in slices of about a millisecond; between two, the wheel advances and the
sender is woken, and while deliveries are under way (and the bucket does not start soon) the loader
pauses between slices so that delivery keeps the event loop first.

It sleeps until the earliest of: the next due entry, the next bucket's load time, a wake-up from
the replayer (an entry earlier than the current sleep), or at most `max_sleep_ms` (so that a
wall-clock step is noticed within that time). It never spins through empty ticks.
"""
from __future__ import annotations

import logging

import trio

from delayserver.wakeup import Wakeup
from delayserver.wheel.tick_manager import TickManager

log = logging.getLogger("delayserver.wheel")

#: The pause between two load slices while deliveries are under way (about a slice's length).
LOAD_PAUSE_S = 0.001


def _load_is_urgent(ticks: TickManager, now: int) -> bool:
    """Whether the bucket being loaded starts within a quarter of `load_ahead`: load at full speed."""
    return ticks.loading_bucket is None or ticks.loading_bucket - now <= ticks.load_ahead_ms // 4


async def serve_ticks(ticks: TickManager, clock, ready: Wakeup, *, max_sleep_ms: int = 1000,
                      active=lambda: True, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Recover (load every bucket up to the load target) before reporting started, then tick.

    While `active()` is false (a slave, or a master fenced off by a newer epoch) nothing is loaded
    and memory is emptied: on becoming active again the load starts over from disk, so it skips
    whatever dispatch_log says was delivered meanwhile.
    """
    while active() and ticks.load_step(clock.now_ms()):
        if ticks.ready:
            ready.set()
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
        while ticks.load_step(now):
            # Loading goes in slices of a millisecond or so: between two, what fell due goes out.
            # A load has until its bucket starts: while deliveries are under way and the bucket is
            # not close, it pauses as long as each slice took, so delivery gets the loop first.
            if (ticks.ready or ticks.inflight) and not _load_is_urgent(ticks, now):
                await trio.sleep(LOAD_PAUSE_S)
            else:
                await trio.lowlevel.checkpoint()
            now = clock.now_ms()
            if ticks.advance(now) or ticks.ready:
                ready.set()
        ticks.advance(now)
        if ticks.ready:
            ready.set()
        wake_at = now + max_sleep_ms
        due = ticks.wheel.next_due()
        if due is not None:
            wake_at = min(wake_at, due)
        wake_at = min(wake_at, ticks.next_load_time())
        ticks.sleeping_until = wake_at
        with trio.move_on_after(max(0, wake_at - now) / 1000 + 0.0005):
            await ticks.changed.wait()
        ticks.sleeping_until = None
