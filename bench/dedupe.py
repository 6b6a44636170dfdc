"""`ops/bench dedupe`: what idempotent send costs: memory per id, save and rebuild times, and the
ingest rate with dedupe on and off.

- Memory: N ids of the client's generated form (28 hex digits) put in a DedupeTable, the process's
  traced memory (tracemalloc) before and after, divided by N.
- Remember: after the saves, the CPU per id of putting N new ids more into that table, 64 at a time
  (`remember_many`, as the receiver does once a request is durable).
- Save: the table written to its file (what a node does every minute and at shutdown), and read
  back (what a restart does before it feeds message_log from the saved offset); the table read
  back, its traced memory per id (its ids stay in the file's columns), and the time of a lookup of
  an id it does not hold and of one it holds (a retried send), and the CPU per new id of
  `remember_many` into it while the ids read back are live (every message after a restart: the
  compiled passes screen a new id by a bit of the saved hashes' bitmap, and look it up among the
  saved ids only when another id set that bit).
- The event loop during a node's save (`Dedupe.save`, in slices, the writing in a thread): the
  longest a task sleeping 1 ms at a time waited; and expiry of a twentieth of the table at once.
- The node's next save, after a hundredth of the table's count of new ids came in and as many
  handles moved: its time and the bytes it wrote (`wchar` of /proc/self/io: every byte passed to
  a write), which the journal makes proportional to what changed.
- Ingest: `bench.ingest load` (8 producers, batches of 64 x 1 KiB) for S seconds against a real
  server on a fresh data directory, with dedupe_window = 24h (the default) and with 0 (off),
  alternating, --rounds times each (the first run of a process is slower on a cold machine): every
  run's figure is printed, and the best of each.

Options: --ids N (default 1,000,000), --seconds S (5), --rounds R (3), --dir PATH.
"""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path


def memory_per_id(n: int) -> tuple[float, "DedupeTable"]:  # noqa: F821
    from delayserver.client import new_message_id
    from delayserver.dedupe import DedupeTable

    now = time.time_ns() // 1_000_000
    ids = [new_message_id(now) for _ in range(n)]
    table = DedupeTable(24 * 3_600_000)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i, message_id in enumerate(ids):
        table.remember(message_id, now + 60_000 + i, now)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    # The ids themselves are counted too: a node holds them only in the table.
    id_bytes = sum(sys.getsizeof(x) for x in ids)
    return (after - before + id_bytes) / n, table


def remember_per_id(table, n: int, batch: int = 64) -> float:
    """CPU microseconds per id of `DedupeTable.remember_many` putting `n` new ids into `table`, a
    request's `batch` at a time (what the receiver does once a request is durable)."""
    return remember_timed(table, n, batch)[0]


def remember_timed(table, n: int, batch: int = 64) -> tuple[float, float]:
    """`remember_per_id`, and the longest one request's `remember_many` took (seconds, wall
    clock): the event loop's step that does it (the map of ids doubling in one put held it for
    about 90 ms at a million ids)."""
    from delayserver.client import new_message_id

    now = time.time_ns() // 1_000_000
    ids = [new_message_id(now) for _ in range(n)]
    requests = [[(message_id, now + 60_000) for message_id in ids[i:i + batch]] for i in range(0, n, batch)]
    slowest = 0.0
    start = time.process_time()
    for request in requests:
        t0 = time.perf_counter()
        table.remember_many(request, now)
        slowest = max(slowest, time.perf_counter() - t0)
    return (time.process_time() - start) / n * 1e6, slowest


def read_back(path: Path, table) -> tuple[float, float, float, float]:
    """(traced bytes per id of the table read back from `path`, microseconds per lookup of an id
    it does not hold, and of one it holds, and CPU microseconds per new id remembered into it
    while the ids read back are live: what a node does for each message after a restart)."""
    from delayserver.client import new_message_id
    from delayserver.dedupe import DedupeTable

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    again = DedupeTable(table.window_ms)
    again.load(path)
    per_id = (tracemalloc.get_traced_memory()[0] - before) / max(len(again), 1)
    tracemalloc.stop()
    now = time.time_ns() // 1_000_000
    new = [new_message_id(now) for _ in range(100_000)]
    held = [table._keys[i] for i in range(0, len(table._keys), max(1, len(table._keys) // 100_000))]
    t0 = time.perf_counter()
    assert all(again.find(message_id, now) is None for message_id in new)
    new_us = (time.perf_counter() - t0) / len(new) * 1e6
    t0 = time.perf_counter()
    assert all(again.find(message_id, now) is not None for message_id in held)
    held_us = (time.perf_counter() - t0) / len(held) * 1e6
    return per_id, new_us, held_us, remember_per_id(again, 200_000)


def written_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def loop_during_save(table, root: Path) -> tuple[float, float, float, int]:
    """(seconds the save took, the longest a 1 ms ticker beside it waited) for a node's save, then
    (seconds, bytes written) for its next save after a hundredth of new ids and moved handles."""
    import trio

    from bench.harness import sleep_late
    from delayserver.dedupe import Dedupe

    dedupe = Dedupe(table.window_ms, root)
    dedupe.table = table
    result = {}

    async def main():
        done, late = False, []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sleep_late, late, lambda: done)
            await trio.sleep(0.05)
            began = time.perf_counter()
            now = time.time_ns() // 1_000_000
            await dedupe.save(now, 1)
            result["save"] = time.perf_counter() - began
            done = True
        result["worst"] = max(late, default=0.0) + 0.001  # the longest gap between two wake-ups
        changed = max(1, len(table) // 100)
        moved = [table._keys[i] for i in range(0, len(table), len(table) // changed)][:changed]
        for i, key in enumerate(moved):
            table.remember(key, now + 120_000 + i, now)  # a reschedule moves its handle
            table.remember(f"new-{i:024x}", now + 60_000, now)
        written, began = written_bytes(), time.perf_counter()
        await dedupe.save(now, 2)
        result["next"], result["next_bytes"] = time.perf_counter() - began, written_bytes() - written

    # The table just built is in the collector's youngest generation: its first collections would
    # walk its list of ids during the measurement (a node's table is old, or frozen at start).
    gc.collect()
    trio.run(main)
    return result["save"], result["worst"], result["next"], result["next_bytes"]


def expiry_seconds(n: int) -> float:
    """Seconds to expire a twentieth of a table of n ids at once."""
    from delayserver.dedupe import DedupeTable

    table = DedupeTable(3_600_000)
    t0 = 1_795_000_000_000
    for i in range(n):
        table.remember(f"{i:028x}", t0, t0 + i)
    began = time.perf_counter()
    table.expire(t0 + 3_600_000 + n // 20 - 1)
    return time.perf_counter() - began


def ingest(root: Path, seconds: float, window: str) -> float:
    from bench.harness import DelayServerProcess

    root.mkdir(parents=True)
    config = root / "node.toml"
    config.write_text(f'dedupe_window = "{window}"\n' if window != "0" else "dedupe_window = 0\n")
    server = DelayServerProcess(root / "data", config_path=config)
    server.start(timeout=600)
    try:
        out = subprocess.run([sys.executable, "-m", "bench.ingest", "load", server.address, "8", str(seconds), "64"],
                             capture_output=True, check=True, text=True)
        return json.loads(out.stdout)["msgs_per_s"]
    finally:
        server.stop()


def main(argv: list[str]) -> None:
    from bench.harness import environment_note
    from delayserver.dedupe import DedupeTable

    parser = argparse.ArgumentParser(prog="ops/bench dedupe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ids", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args(argv)

    print(f"dedupe benchmark on {environment_note()}", flush=True)
    per_id, table = memory_per_id(args.ids)
    print(f"  memory: {per_id:.0f} bytes per id ({args.ids:,} ids of 28 characters, id strings included)",
          flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-dedupe-", dir=args.dir))
    try:
        path = root / "dedupe.bin"
        t0 = time.perf_counter()
        table.save_to(path, 0)
        saved = time.perf_counter() - t0
        t0 = time.perf_counter()
        DedupeTable(table.window_ms).load(path)
        loaded = time.perf_counter() - t0
        print(f"  save {saved:.2f} s, load {loaded:.2f} s ({path.stat().st_size / args.ids:.0f} bytes per id on disk)",
              flush=True)
        per_id_back, new_us, held_us, remember_back_us = read_back(path, table)
        print(f"  the table read back: {per_id_back:.0f} bytes per id; a lookup of a new id {new_us:.2f} us, "
              f"of an id it holds {held_us:.2f} us; remember: {remember_back_us:.2f} us of CPU per new id "
              "(200,000, requests of 64)", flush=True)
        took, worst, next_took, next_bytes = loop_during_save(table, root)
        print(f"  a node's save: {took:.2f} s; the event loop waited at most {worst * 1000:.0f} ms meanwhile", flush=True)
        print(f"  its next save, {args.ids // 100:,} new ids and {args.ids // 100:,} moved handles later: "
              f"{next_took:.3f} s, {next_bytes:,} bytes written", flush=True)
        held = len(table)  # the table after the saves: it goes on growing here
        per_id, slowest = remember_timed(table, args.ids)
        print(f"  remember: {per_id:.2f} us of CPU per new id, requests of 64, into a table of {held:,} ids "
              f"growing to {held + args.ids:,}; the slowest request {slowest * 1000:.1f} ms", flush=True)
        print(f"  expiry of {args.ids // 20:,} of {args.ids:,} ids at once: {expiry_seconds(args.ids) * 1000:.0f} ms",
              flush=True)
        runs = {"0": [], "24h": []}
        for r in range(args.rounds):
            for window in ("0", "24h"):
                runs[window].append(ingest(root / f"{window}-{r}", args.seconds, window))
                print(f"  ingest, dedupe_window = {window:<4} {runs[window][-1]:>10,.0f} msg/s", flush=True)
        if not args.rounds:
            return
        on, off = max(runs["24h"]), max(runs["0"])
        print(f"  best: dedupe on {on:,.0f} msg/s, off {off:,.0f} msg/s ({on / max(off, 1) - 1:+.1%} with dedupe on)")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main(sys.argv[1:])
