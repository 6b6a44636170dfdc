"""`ops/bench threads [--calls N]`: what handing a blocking call to a worker thread and its result
back costs, trio's `to_thread.run_sync` (with a limiter, as the node's calls had) against the node's
`ThreadPool` (delayserver/storage/threads.py), for a call that does nothing: the CPU time of the
whole process per call (the loop's thread and the worker's), and the wall time.

Each figure is the least of five rounds of N calls one after another. On an idle process each call
also pays two thread wake-ups, which the busy server partly does not (its loop is often awake).
"""
from __future__ import annotations

import argparse
import os
import time

import trio

from delayserver.storage.threads import ThreadPool


def _nothing() -> None:
    return None


async def _rounds(call, calls: int) -> tuple[float, float]:
    best_cpu = best_wall = float("inf")
    for _ in range(5):
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(calls):
            await call()
        best_cpu = min(best_cpu, time.process_time() - cpu)
        best_wall = min(best_wall, time.perf_counter() - wall)
    return best_cpu * 1e6 / calls, best_wall * 1e6 / calls


async def _main(calls: int) -> None:
    limiter = trio.CapacityLimiter(16)
    pool = ThreadPool(16)
    ways = {
        "trio.to_thread.run_sync": lambda: trio.to_thread.run_sync(_nothing, limiter=limiter),
        "ThreadPool.run": lambda: pool.run(_nothing),
    }
    print(f"threads benchmark on {os.cpu_count()} cores, load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}; "
          f"{calls:,} calls a round, the least of five rounds")
    for name, call in ways.items():
        cpu, wall = await _rounds(call, calls)
        print(f"  {name}: {cpu:.1f} us of CPU per call, {wall:.1f} us wall")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="ops/bench threads", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls a round (default 2,000)")
    args = parser.parse_args(argv)
    trio.run(_main, args.calls)
