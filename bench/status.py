"""`ops/bench status`: status and cancel latency on a big pending bucket, and what they cost the
other producers' ingest.

- A data directory holding N pending messages (100 B bodies) in one one-hour bucket three hours
  ahead is written with the storage code (message_log, replayed into schedule_log, checkpointed),
  as a node would have left it. The real server starts on it (restart time: process start to its
  "serving" line) in its own process.
- The id and time indexes, the dedupe table and the schedules' state are saved beside it, as a
  running node saves them (`--no-saved-index`: not the indexes, so the node builds them from the
  segment after it starts serving). The first status asks for a message of that bucket: its
  answer waits for whatever of the bucket's index is not built yet.
- Ingest alone: `bench.ingest load` (8 producers, batches of 64 x 1 KiB) for S seconds.
- Status alone: a probe process sends status requests one after another for random pending
  messages of the big bucket for S seconds; its latencies (send to answer, over loopback, through
  the Python client).
- Ingest with status: ingest again, while the probe sends --status-rate status requests a second
  (200 by default); the ingest rate beside it, and the probe's latencies (a status waits until
  replay has caught up with what was acknowledged before it, so it includes that wait). Runs
  beside statuses alternate with runs alone (--rounds of each, and one more alone at the end):
  each run beside is compared with the mean of the runs alone just before and after it, since the
  rate drifts as the node fills, and the median of those changes is checked. The server's CPU
  time per status and per message is printed for each run.
- Cancels: 1,000 cancels one after another of random pending messages; each must answer
  CANCELLED, and a status afterwards CANCELLED.

Targets (issue: at 10,000,000 pending): status P99 < 1 ms (checked on status alone); ingest
within 5% of ingest alone.
Options: --pending N (default 1,000,000), --seconds S (10), --rounds R (3), --cancels K (1000), --dir PATH.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOUR_MS = 3_600_000
BATCH = 4096
BODY = b"x" * 100
SUBJECT = "bench.status"


def bucket_now() -> int:
    now = time.time_ns() // 1_000_000
    return now - now % HOUR_MS + 3 * HOUR_MS


def schedule_time(bucket: int, i: int) -> int:
    return bucket + (i * 7919) % HOUR_MS


def message_id(i: int) -> str:
    return f"msg-{i:012d}"


def prepare(root: Path, pending: int, bucket: int, save_index: bool = True) -> None:
    from delayserver.replayer import Replayer
    from delayserver.storage.record import RecordType, encode_message_fields, encode_record
    from delayserver.storage.store import Store
    from delayserver.wheel.tick_manager import TickManager

    store = Store.open(root)
    now = time.time_ns() // 1_000_000
    for first in range(0, pending, BATCH):
        store.message_log.append(b"".join(
            encode_record(RecordType.MESSAGE, encode_message_fields(
                message_id(i), SUBJECT, BODY, schedule_time(bucket, i), {}, now, i + 1))
            for i in range(first, min(first + BATCH, pending))))
    store.message_log.sync()
    replayer = Replayer.open(store, TickManager(store, now_ms=now))
    replayer.checkpoint()
    if save_index:
        from bench.deliver import save_index as save

        save(store, root)
    from bench.deliver import save_followers

    save_followers(store, now)
    store.close()


async def _probe(address: str, mode: str, bucket: int, pending: int, count: int, seconds: float,
                 rate: float = 0) -> dict:
    import trio

    from delayserver.client import AsyncProducer
    from delayserver.message import CancelOutcome, Handle, MessageState

    rng = random.Random(mode)
    lat: list[float] = []
    wrong = 0
    async with AsyncProducer(address, timeout=600) as prod:
        deadline = trio.current_time() + seconds
        picked = rng.sample(range(pending), min(count, pending)) if mode == "cancel" else None
        n = 0
        while (n < count) and (mode == "cancel" or trio.current_time() < deadline):
            i = picked[n] if picked is not None else rng.randrange(pending)
            handle = Handle(schedule_time(bucket, i), message_id(i))
            t0 = time.perf_counter()
            if mode == "cancel":
                ok = await prod.cancel(handle) == CancelOutcome.CANCELLED
            else:
                ok = (await prod.status(handle)).state == MessageState.PENDING
            lat.append((time.perf_counter() - t0) * 1000)
            wrong += not ok
            n += 1
            if rate:
                await trio.sleep(max(0.0, 1 / rate - (time.perf_counter() - t0)))
        if mode == "cancel":
            for i in picked:
                wrong += (await prod.status(Handle(schedule_time(bucket, i), message_id(i)))).state \
                    != MessageState.CANCELLED
    return {"latencies_ms": lat, "wrong": wrong}


def probe(address: str, mode: str, bucket: int, pending: int, count: int, seconds: float, rate: float = 0) -> dict:
    import trio

    return trio.run(_probe, address, mode, bucket, pending, count, seconds, rate)


def _ingest(address: str, seconds: float) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.ingest", "load", address, "8", str(seconds), "64"],
                         capture_output=True, check=True, text=True)
    return json.loads(out.stdout)


def _quantiles(lat: list[float]) -> str:
    if not lat:
        return "no answers"
    s = sorted(lat)

    def q(p: float) -> float:
        return s[min(len(s) - 1, int(p * len(s)))]

    return (f"P50 {q(0.5):.2f} ms, P99 {q(0.99):.2f} ms, P999 {q(0.999):.2f} ms, max {s[-1]:.2f} ms "
            f"({len(s):,} requests)")


def _run_probe(address: str, mode: str, bucket: int, pending: int, count: int, seconds: float,
               rate: float = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "bench.status", "probe", address, mode, str(bucket),
                             str(pending), str(count), str(seconds), str(rate)], stdout=subprocess.PIPE, text=True)


def main(argv: list[str]) -> None:
    from bench.harness import DelayServerProcess, cpu_seconds, environment_note

    parser = argparse.ArgumentParser(prog="ops/bench status", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pending", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--cancels", type=int, default=1000)
    parser.add_argument("--status-rate", type=float, default=200, help="status requests/s beside ingest")
    parser.add_argument("--rounds", type=int, default=3, help="ingest runs beside statuses, alternated with runs alone")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--no-saved-index", action="store_true",
                        help="start without the id index a running node saves (it is built from the segment)")
    args = parser.parse_args(argv)

    print(f"status benchmark on {environment_note()}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-status-", dir=args.dir))
    server = None
    try:
        bucket = bucket_now()
        began = time.perf_counter()
        prepare(root / "data", args.pending, bucket, not args.no_saved_index)
        print(f"{args.pending:,} pending messages in one one-hour bucket, written and replayed in "
              f"{time.perf_counter() - began:.1f} s", flush=True)
        server = DelayServerProcess(root / "data")
        began = time.perf_counter()
        server.start(timeout=3600)
        print(f"  restart: process start to serving     {time.perf_counter() - began:.2f} s", flush=True)
        first = probe(server.address, "status", bucket, args.pending, 1, 3600)
        print(f"  first status (waits for the bucket's index): {first['latencies_ms'][0]:.0f} ms", flush=True)
        cpu = cpu_seconds(server.process)
        quiet = probe(server.address, "status", bucket, args.pending, 10 ** 9, args.seconds)
        cpu, used = cpu_seconds(server.process), cpu_seconds(server.process) - cpu
        print(f"  status latency, no other traffic: {_quantiles(quiet['latencies_ms'])}; "
              f"wrong answers {quiet['wrong']}; server CPU {used * 1e6 / max(len(quiet['latencies_ms']), 1):.0f} us "
              "per status", flush=True)
        # Ingest alone and beside statuses, alternated --rounds times, then alone once more: each
        # run beside is compared with the mean of the runs alone just before and after it (the
        # rate drifts as the node fills, and single runs on this machine differ by 10% and more).
        def ingest_run(with_statuses: bool):
            nonlocal cpu
            prober = None
            if with_statuses:
                prober = _run_probe(server.address, "status", bucket, args.pending, 10 ** 9, args.seconds + 2,
                                    args.status_rate)
                time.sleep(1)
            cpu = cpu_seconds(server.process)
            r = _ingest(server.address, args.seconds)
            r["cpu_us"] = (cpu_seconds(server.process) - cpu) * 1e6 / max(r["acked"], 1)
            if prober is not None:
                r["statuses"] = json.loads(prober.communicate()[0])
            return r

        alone, beside = [ingest_run(False)], []
        for _ in range(args.rounds):
            beside.append(ingest_run(True))
            alone.append(ingest_run(False))
        changes = [b["msgs_per_s"] / max((a0["msgs_per_s"] + a1["msgs_per_s"]) / 2, 1) - 1
                   for b, a0, a1 in zip(beside, alone, alone[1:])]
        print("  ingest alone                          " + ", ".join(f"{a['msgs_per_s']:,.0f}" for a in alone)
              + " msg/s; server CPU " + ", ".join(f"{a['cpu_us']:.1f}" for a in alone) + " us per message")
        print("  ingest beside status requests         " + ", ".join(f"{b['msgs_per_s']:,.0f}" for b in beside)
              + " msg/s; server CPU " + ", ".join(f"{b['cpu_us']:.1f}" for b in beside)
              + " us per message, statuses included")
        if changes:
            change = statistics.median(changes)
            print("  beside statuses, against the runs alone around each: "
                  + ", ".join(f"{c:+.1%}" for c in changes) + f"; median {change:+.1%}"
                  + f"   (target within 5%: {'met' if change >= -0.05 else 'MISSED'})")
            statuses = [x for b in beside for x in b["statuses"]["latencies_ms"]]
            print(f"  status latency beside ingest ({args.status_rate:g}/s): {_quantiles(statuses)}; "
                  f"wrong answers {sum(b['statuses']['wrong'] for b in beside)}")
        cancels = json.loads(_run_probe(server.address, "cancel", bucket, args.pending, args.cancels,
                                        0).communicate()[0])
        print(f"  cancel latency: {_quantiles(cancels['latencies_ms'])}; wrong answers {cancels['wrong']}")
        lat = sorted(quiet["latencies_ms"])
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("inf")
        print(f"  target status P99 < 1 ms: {'met' if p99 < 1 else 'MISSED'} ({p99:.2f} ms)")
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root)


if __name__ == "__main__":
    if sys.argv[1:2] == ["probe"]:
        address, mode = sys.argv[2], sys.argv[3]
        bucket, pending, count, seconds = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7])
        print(json.dumps(probe(address, mode, bucket, pending, count, seconds, float(sys.argv[8]))))
    else:
        main(sys.argv[1:])
