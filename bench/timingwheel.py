"""The timing wheel's benchmark, run by ``ops/bench wheel``: throughput and memory per entry.

The load is the tick manager's worst case with the defaults: ``n`` entries (1,000,000) due at
random over one and a half hours (a 1 h bucket plus the 30 min load-ahead), 10 ms ticks and the
server's default slot count (8192, an 82 s revolution), so each slot holds many rounds at once.
Then a burst: 100,000 entries due within one tick, as a campaign sent for one instant makes.
"""
from __future__ import annotations

import gc
import random
import time
import tracemalloc
from array import array

import psutil

from delayserver.wheel.timingwheel import TimingWheel

SPREAD_MS = 90 * 60 * 1000
SLOTS = 1 << 13  # Config.wheel_slots
#: Entries of the burst: all due within one tick.
BURST = 100_000
START_MS = 1_700_000_000_000


def _entries(n: int, seed: int) -> tuple[array, array]:
    rng = random.Random(seed)
    dues = array("q", (START_MS + 1 + rng.randrange(SPREAD_MS) for _ in range(n)))
    return dues, array("q", range(n))


def _fill(dues: array, refs: array) -> TimingWheel:
    wheel = TimingWheel(start_ms=START_MS, slots=SLOTS)
    add = wheel.add
    for due, ref in zip(dues, refs):
        add(due, ref, START_MS)
    return wheel


def bench_wheel(n: int = 1_000_000) -> dict:
    """Measure the wheel and return the figures; prints nothing.

    Keys: ``entries``; ``adds_per_s``; ``advance_per_s`` (entries fired per second when
    advancing tick by tick through the whole spread, as the tick manager does under load);
    ``advance_calls_per_s``; ``follow_per_s`` (entries per second when each advance is made at
    exactly ``next_due()``, the precise schedule); ``jump_per_s`` (entries per second out of one
    advance over the whole spread, a clock jump); ``next_due_per_s`` (calls);
    ``bytes_per_entry_rss`` (resident-set growth while filling, allocator slack included);
    ``bytes_per_entry_traced`` (tracemalloc: the Python allocations alone); ``burst`` and
    ``burst_adds_per_s``: adds per second of ``burst`` entries (100,000, at most ``n``) due within
    one tick, in due order, 64 at a time (`_burst`).
    """
    dues, refs = _entries(n, seed=1)
    process = psutil.Process()
    gc.collect()
    rss_before = process.memory_info().rss
    began = time.perf_counter()
    wheel = _fill(dues, refs)
    add_s = time.perf_counter() - began
    rss_after = process.memory_info().rss
    assert len(wheel) == n

    next_due = wheel.next_due
    began = time.perf_counter()
    for _ in range(100_000):
        next_due()
    next_due_s = time.perf_counter() - began

    advance = wheel.advance
    calls = SPREAD_MS // wheel.tick_ms + 1
    fired = 0
    began = time.perf_counter()
    for tick in range(1, calls + 1):
        fired += len(advance(START_MS + tick * wheel.tick_ms))
    advance_s = time.perf_counter() - began
    assert fired == n and len(wheel) == 0

    wheel = _fill(dues, refs)
    advance, next_due = wheel.advance, wheel.next_due
    fired = 0
    began = time.perf_counter()
    while (due := next_due()) is not None:
        fired += len(advance(due))
    follow_s = time.perf_counter() - began
    assert fired == n

    wheel = _fill(dues, refs)
    began = time.perf_counter()
    fired = len(wheel.advance(START_MS + SPREAD_MS + 1))
    jump_s = time.perf_counter() - began
    assert fired == n
    del wheel
    gc.collect()

    tracemalloc.start()
    traced_before = tracemalloc.get_traced_memory()[0]
    wheel = _fill(dues, refs)
    traced = tracemalloc.get_traced_memory()[0] - traced_before
    tracemalloc.stop()
    del wheel
    burst = min(n, BURST)
    burst_s = _burst(burst)
    return {
        "entries": n,
        "adds_per_s": round(n / add_s),
        "advance_per_s": round(n / advance_s),
        "advance_calls_per_s": round(calls / advance_s),
        "follow_per_s": round(n / follow_s),
        "jump_per_s": round(n / jump_s),
        "next_due_per_s": round(100_000 / next_due_s),
        "bytes_per_entry_rss": round((rss_after - rss_before) / n, 1),
        "bytes_per_entry_traced": round(traced / n, 1),
        "burst": burst,
        "burst_adds_per_s": round(burst / burst_s),
    }


def _burst(n: int) -> float:
    """Seconds to add `n` entries due within one tick (a campaign sent for one instant: one slot
    holds them all), in due order, 64 at a time as replayed records come (`add_entries`)."""
    wheel = TimingWheel(start_ms=START_MS, slots=SLOTS)
    due = START_MS + 60_000
    entries = [(ref, due + ref * wheel.tick_ms // n) for ref in range(n)]
    began = time.perf_counter()
    for i in range(0, n, 64):
        wheel.add_entries(entries[i : i + 64], 0, START_MS)
    took = time.perf_counter() - began
    assert len(wheel) == n and len(wheel.advance(due + wheel.tick_ms)) == n
    return took
