"""`ops/bench wheel`: the timing wheel's throughput and memory, and the time to recover to serving.

- wheel: 1,000,000 entries due at random over 90 minutes, 10 ms ticks, 8192 slots
  (`bench.timingwheel`): adds/s; entries fired/s advancing tick by tick and in one clock
  jump; bytes per loaded entry (RSS delta, and the Python allocations alone); adds/s of a burst
  of 100,000 entries due within one tick (one slot).
- recovery: a data directory holding 1,000,000 pending messages (100 B bodies) over 24 one-hour
  buckets, the current one holding 100,000 and the 23 after it the rest, written with the storage
  code (message_log, replayed into schedule_log, checkpointed). Timed in a fresh process from
  Store.open to serve-ready: Replayer.open, then loading every bucket up to the load target, which
  is what serve_ticks does before it reports started. The clock reads 10 minutes into the current
  bucket, so the load target (30 minutes ahead) is the current bucket. The files were just written:
  the page cache is warm.

- restart in a busy bucket (`--delivered N`, off by default): the current bucket holds N messages
  already delivered (their DISPATCH records in dispatch_log) and 100,000 still to come, as after a
  restart in the middle of a busy hour. Timed in a fresh process: serve_ticks from its start to
  started, beside a task that sleeps 1 ms at a time on the same event loop; the longest of its
  waits is how long recovery held the loop (producers are served meanwhile).

Targets: >= 500,000 adds/s, <= 120 bytes per loaded entry, recovery within 2 s.
Options: --entries N (wheel), --messages N and --current N (recovery), --delivered N, --dir PATH.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOUR_MS = 3_600_000
BUCKETS = 24
BATCH = 4096
BODY = b"x" * 100
#: 10 minutes into an hour bucket, so that the load target is the current bucket.
NOW_MS = 1_800_000_000_000 - 1_800_000_000_000 % HOUR_MS + 10 * 60_000


def prepare(root: Path, messages: int, current: int) -> None:
    """Write the data directory as a node would have left it: message_log, replayed, checkpointed."""
    from delayserver.replayer import Replayer
    from delayserver.storage.record import RecordType, encode_message_fields, encode_record
    from delayserver.storage.store import Store
    from delayserver.wheel.tick_manager import TickManager

    rng = random.Random(1)
    bucket = NOW_MS - NOW_MS % HOUR_MS
    store = Store.open(root)
    for first in range(0, messages, BATCH):
        batch = []
        for i in range(first, min(first + BATCH, messages)):
            hour = 0 if i < current else 1 + rng.randrange(BUCKETS - 1)
            schedule_time = bucket + hour * HOUR_MS + rng.randrange(HOUR_MS)
            batch.append(encode_record(RecordType.MESSAGE, encode_message_fields(
                f"msg-{i:012d}", "bench.wheel", BODY, schedule_time, {}, NOW_MS - HOUR_MS, i + 1)))
        store.message_log.append(b"".join(batch))
    store.message_log.sync()
    # Nothing is loaded while it replays, so everything lands in schedule_log only.
    replayer = Replayer.open(store, TickManager(store, now_ms=NOW_MS))
    replayer.checkpoint()
    try:
        from delayserver.lookup import Lookup
    except ImportError:  # a version without the per-bucket indexes
        Lookup = None
    if Lookup is not None:
        # The id index a running node would have saved beside its segments.
        import trio

        lookup = Lookup(store, root / "index")

        async def save():
            for bucket in store.schedule_log.buckets():
                await lookup.ids.ensure(bucket)
            await lookup.ids.save(every=1)

        trio.run(save)
    store.close()


def recover(root: Path) -> dict:
    """Store.open to serve-ready, and the memory the load took; run in a fresh process."""
    import gc

    import psutil

    from delayserver.replayer import Replayer
    from delayserver.storage.store import Store
    from delayserver.wheel.tick_manager import TickManager

    gc.collect()
    process = psutil.Process()
    rss_start = process.memory_info().rss
    began = time.perf_counter()
    store = Store.open(root)
    try:
        from delayserver.lookup import Lookup
    except ImportError:  # a version without the per-bucket indexes (for before/after figures)
        Lookup = None
    lookup = Lookup(store, root / "index") if Lookup is not None else None  # as the server opens it
    opened = time.perf_counter()
    ticks = TickManager(store, now_ms=NOW_MS)
    Replayer.open(store, ticks)
    replayed = time.perf_counter()
    rss_before = process.memory_info().rss
    # Each load step is one slice the event loop is held for: its thread CPU time (what a busy
    # machine does not inflate) and wall time.
    slices_cpu, slices_wall = [], []
    while True:
        c0, w0 = time.thread_time(), time.perf_counter()
        more = ticks.load_step(NOW_MS)
        slices_cpu.append(time.thread_time() - c0)
        slices_wall.append(time.perf_counter() - w0)
        if not more:
            break
    loaded = time.perf_counter()
    rss_after = process.memory_info().rss
    index = {}
    if lookup is not None:
        # The saved index was read back with the store; after serve-ready the server indexes what
        # the saved files do not cover, in slices (storage/id_index.py).
        for idx in (lookup.ids, lookup.dispatches):
            for bucket in idx.unbuilt():
                while idx.build_slice(bucket):
                    pass
        indexed = time.perf_counter()
        rss_indexed = process.memory_info().rss
        entries = lookup.ids.entries()
        index = {"index_build_s": indexed - loaded, "index_entries": entries,
                 "index_bytes_per_entry": (lookup.ids.nbytes() + lookup.dispatches.nbytes()) / max(entries, 1),
                 "index_rss_per_entry": (rss_indexed - rss_after) / max(entries, 1),
                 "rss_per_pending": (rss_indexed - rss_start) / max(entries, 1)}
    store.close()
    slices_cpu.sort()
    slices_wall.sort()
    index["load_slices"] = len(slices_cpu)
    index["load_slice_cpu_ms_max"] = slices_cpu[-1] * 1000
    index["load_slice_cpu_ms_p99"] = slices_cpu[int(0.99 * (len(slices_cpu) - 1))] * 1000
    index["load_slice_wall_ms_max"] = slices_wall[-1] * 1000
    return {**index,
        "store_open_s": opened - began,
        "replayer_open_s": replayed - opened,
        "load_s": loaded - replayed,
        "total_s": loaded - began,
        "loaded": ticks.loaded,
        "overdue": len(ticks.ready),
        "bytes_per_loaded_rss": (rss_after - rss_before) / max(ticks.loaded, 1),
    }


BUSY_PENDING = 100_000


def prepare_busy(root: Path, delivered: int) -> None:
    """The current bucket with `delivered` messages delivered and BUSY_PENDING to come."""
    from delayserver.replayer import Replayer
    from delayserver.storage.record import (
        Dispatch, RecordType, encode_dispatch, encode_message_fields, encode_record,
    )
    from delayserver.storage.store import Store
    from delayserver.wheel.tick_manager import TickManager

    bucket = NOW_MS - NOW_MS % HOUR_MS
    total = delivered + BUSY_PENDING
    store = Store.open(root)
    for first in range(0, total, BATCH):
        store.message_log.append(b"".join(
            encode_record(RecordType.MESSAGE, encode_message_fields(
                f"msg-{i:012d}", "bench.wheel", BODY,
                # the delivered ones were due in the 10 minutes before now, the others come later
                bucket + (i * 600_000 // delivered if i < delivered
                          else 1_200_000 + (i - delivered) * 1_800_000 // BUSY_PENDING), {},
                NOW_MS - HOUR_MS, i + 1))
            for i in range(first, min(first + BATCH, total))))
    store.message_log.sync()
    replayer = Replayer.open(store, TickManager(store, now_ms=NOW_MS - HOUR_MS))
    replayer.checkpoint()
    offsets = [pos for pos, rtype, _ in store.schedule_log.records(bucket) if rtype == RecordType.SCHEDULED]
    for first in range(0, delivered, BATCH):
        store.dispatch_log.append(bucket, b"".join(
            encode_record(RecordType.DISPATCH, encode_dispatch(Dispatch(offset, NOW_MS - 60_000, "default")))
            for offset in offsets[first : min(first + BATCH, delivered)]))
    store.dispatch_log.sync()
    store.close()


def recover_busy(root: Path) -> dict:
    """serve_ticks to started, and the longest a 1 ms sleeper beside it waited; in a fresh process."""
    import trio

    from bench.harness import sleep_late
    from delayserver.replayer import Replayer
    from delayserver.storage.store import Store
    from delayserver.wakeup import Wakeup
    from delayserver.wheel.service import serve_ticks
    from delayserver.wheel.tick_manager import TickManager

    class Clock:
        @staticmethod
        def now_ms() -> int:
            return NOW_MS

    store = Store.open(root)
    ticks = TickManager(store, now_ms=NOW_MS)
    Replayer.open(store, ticks)
    out = {}

    async def run():
        waits = []
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sleep_late, waits, done.is_set)
            await trio.sleep(0.01)
            began = time.perf_counter()
            await nursery.start(serve_ticks, ticks, Clock(), Wakeup().set)
            out["recover_s"] = time.perf_counter() - began
            done.set()
            await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        waits.sort()
        out["loop_wait_ms_max"] = waits[-1] * 1000
        out["loop_wait_ms_p99"] = waits[int(0.99 * (len(waits) - 1))] * 1000

    trio.run(run)
    out["loaded"] = ticks.loaded + len(ticks.ready)
    store.close()
    return out


def verdict(ok: bool, target: str) -> str:
    return f"   (target {target}: {'met' if ok else 'MISSED'})"


def main(argv: list[str]) -> None:
    from bench.timingwheel import bench_wheel

    parser = argparse.ArgumentParser(prog="ops/bench wheel", description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--current", type=int, default=100_000)
    parser.add_argument("--delivered", type=int, default=0)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.delivered:
        restart_in_a_busy_bucket(args.delivered, args.dir)
        return

    w = bench_wheel(args.entries)
    print(f"wheel: {w['entries']:,} entries over 90 min, 10 ms ticks, 8192 slots")
    print(f"  add                          {w['adds_per_s']:>12,} entries/s"
          + verdict(w["adds_per_s"] >= 500_000, ">= 500,000"))
    burst = f"add, {w['burst']:,} due in one tick"
    print(f"  {burst:<29}{w['burst_adds_per_s']:>12,} entries/s (64 at a time, in due order)")
    print(f"  advance, tick by tick        {w['advance_per_s']:>12,} entries/s "
          f"({w['advance_calls_per_s']:,} calls/s)")
    print(f"  advance, one jump            {w['jump_per_s']:>12,} entries/s")
    print(f"  memory per loaded entry      {w['bytes_per_entry_rss']:>12} bytes RSS "
          f"({w['bytes_per_entry_traced']} traced)" + verdict(w["bytes_per_entry_rss"] <= 120, "<= 120"))

    root = Path(tempfile.mkdtemp(prefix="bench-wheel-", dir=args.dir))
    try:
        began = time.perf_counter()
        prepare(root, args.messages, args.current)
        print(f"recovery: {args.messages:,} pending messages over {BUCKETS} one-hour buckets, "
              f"{args.current:,} in the current one (written and replayed in {time.perf_counter() - began:.1f} s)")
        out = subprocess.run([sys.executable, "-m", "bench.wheel", "recover", str(root)],
                             capture_output=True, check=True, text=True)
        r = json.loads(out.stdout)
        print(f"  Store.open to serve-ready    {r['total_s']:>12.3f} s" + verdict(r["total_s"] <= 2, "<= 2 s"))
        print(f"    Store.open {r['store_open_s']:.3f} s, Replayer.open {r['replayer_open_s']:.3f} s, "
              f"load {r['load_s']:.3f} s: {r['loaded']:,} messages in memory, {r['overdue']:,} overdue")
        if "load_slices" in r:
            print(f"  load slices: {r['load_slices']:,}; thread CPU per slice P99 {r['load_slice_cpu_ms_p99']:.2f} ms, "
                  f"max {r['load_slice_cpu_ms_max']:.2f} ms (wall max {r['load_slice_wall_ms_max']:.2f} ms)")
        print(f"  memory per loaded message    {r['bytes_per_loaded_rss']:>12.1f} bytes RSS "
              "(the load's RSS delta: wheel, overdue queue, tick manager)")
        if "index_build_s" in r:
            print(f"  id index: read back from its saved files at Store.open; the rest built in {r['index_build_s']:.2f} s; "
                  f"{r['index_entries']:,} records; {r['index_bytes_per_entry']:.1f} bytes of index per pending message")
            print(f"  memory per pending message   {r['rss_per_pending']:>12.1f} bytes RSS "
                  "(RSS from before Store.open to loaded and indexed, over every pending message)")
    finally:
        shutil.rmtree(root)


def restart_in_a_busy_bucket(delivered: int, directory: Path | None) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-wheel-", dir=directory))
    try:
        began = time.perf_counter()
        prepare_busy(root, delivered)
        print(f"restart in a busy bucket: {delivered:,} delivered and {BUSY_PENDING:,} to come in the current "
              f"one-hour bucket (written in {time.perf_counter() - began:.1f} s)")
        out = subprocess.run([sys.executable, "-m", "bench.wheel", "recover-busy", str(root)],
                             capture_output=True, check=True, text=True)
        r = json.loads(out.stdout)
        print(f"  serve_ticks to started       {r['recover_s']:>12.3f} s, {r['loaded']:,} messages in memory")
        print(f"  the loop held: a 1 ms sleeper beside it waited past its time at most "
              f"{r['loop_wait_ms_max']:.1f} ms (P99 {r['loop_wait_ms_p99']:.1f} ms)")
        if r["loaded"] != BUSY_PENDING:
            print(f"  WRONG: {r['loaded']:,} loaded, {BUSY_PENDING:,} expected")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    if sys.argv[1:2] == ["recover"]:
        print(json.dumps(recover(Path(sys.argv[2]))))
    elif sys.argv[1:2] == ["recover-busy"]:
        print(json.dumps(recover_busy(Path(sys.argv[2]))))
    else:
        main(sys.argv[1:])
