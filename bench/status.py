"""`ops/bench status`: status and cancel latency on a big pending bucket, and what they cost the
other producers' ingest.

- A data directory holding N pending messages (100 B bodies) in one one-hour bucket three hours
  ahead is written with the storage code (message_log, replayed into schedule_log, checkpointed),
  as a node would have left it. The real server starts on it (restart time: process start to its
  "serving" line) in its own process; then it is stopped and started again, on the files a node
  leaves when it stops (the dedupe table's journal among them), and that restart is timed too.
- The id and time indexes, the dedupe table and the schedules' state are saved beside it, as a
  running node saves them (`--no-saved-index`: not the indexes, so the node builds them from the
  segment after it starts serving). The first status asks for a message of that bucket: its
  answer waits for whatever of the bucket's index is not built yet.
- Ingest alone: `bench.ingest load` (8 producers, batches of 64 x 1 KiB) for S seconds.
- Status alone: a probe process sends status requests one after another for random pending
  messages of the big bucket for S seconds; its latencies (send to answer, over loopback, through
  the Python client). Before it, the same probe sends PING requests for S seconds: the same
  client, connection and request path with no lookup behind it, the floor this machine sets for
  any request at that moment (on a noisy machine that floor's own P99 can exceed 1 ms).
- Ingest with status: one ingest run, cut into windows of --window seconds (2 by default) after
  3 s of warm-up: the probe sends --status-rate status requests a second (200 by default) in
  every other window and none in the others (--rounds windows with statuses, 10 by default, each
  between two without). The ingest rate of each window with statuses is compared with the mean of
  the two windows around it: the rate drifts as the node fills and from other work on the
  machine, and neighbouring windows seconds apart share that drift, where whole runs minutes
  apart do not. The median of those changes is checked. A window counts the batches acknowledged
  inside it, 0.25 s from its edges left out (a batch is acknowledged some 50 ms after it is
  sent). The probe's latencies are printed too (a status waits until replay has caught up with
  what was acknowledged before it, so it includes that wait), and the server's CPU per message in
  the windows with and without statuses.
- Cancels: 1,000 cancels one after another of random pending messages; each must answer
  CANCELLED, and a status afterwards CANCELLED.

Targets (issue: at 10,000,000 pending): status P99 < 1 ms (checked on status alone); ingest
within 5% of ingest alone.
Options: --pending N (default 1,000,000), --seconds S (10), --rounds R (10), --window W (2),
--status-rate R (200), --cancels K (1000), --dir PATH.
"""
from __future__ import annotations

import argparse
import json
import random
import resource
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
                 rate: float = 0, windows: tuple[float, float, int] | None = None) -> dict:
    """With `windows` (start wall time, length, count): statuses only in the odd-numbered windows,
    until the last one ends."""
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
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = usage.ru_utime + usage.ru_stime  # from here: the requests', not the start-up's
        next_at = trio.current_time()  # paced by the clock: `rate` a second while answers are quick
        while (n < count) and (mode == "cancel" or trio.current_time() < deadline):
            if windows is not None:
                start, length, number = windows
                k = (time.time() - start) // length
                if k >= number:
                    break
                if k < 0 or k % 2 == 0:  # a window without statuses: wait for the next one
                    await trio.sleep(max(0.0, start + (k + 1) * length - time.time()))
                    next_at = trio.current_time()
                    continue
            i = picked[n] if picked is not None else rng.randrange(pending)
            handle = Handle(schedule_time(bucket, i), message_id(i))
            t0 = time.perf_counter()
            if mode == "cancel":
                ok = await prod.cancel(handle) == CancelOutcome.CANCELLED
            elif mode == "ping":  # the same request path, no lookup: the floor a status stands on
                ok = await prod.ping() == b""
            else:
                ok = (await prod.status(handle)).state == MessageState.PENDING
            lat.append((time.perf_counter() - t0) * 1000)
            wrong += not ok
            n += 1
            if rate:  # behind by over 0.1 s: no burst to catch up
                next_at = max(next_at + 1 / rate, trio.current_time() - 0.1)
                await trio.sleep_until(next_at)
        if mode == "cancel":
            for i in picked:
                wrong += (await prod.status(Handle(schedule_time(bucket, i), message_id(i)))).state \
                    != MessageState.CANCELLED
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = usage.ru_utime + usage.ru_stime - cpu
    return {"latencies_ms": lat, "wrong": wrong, "cpu_us": cpu * 1e6 / max(n, 1)}


def probe(address: str, mode: str, bucket: int, pending: int, count: int, seconds: float, rate: float = 0,
          windows: tuple[float, float, int] | None = None) -> dict:
    import trio

    return trio.run(_probe, address, mode, bucket, pending, count, seconds, rate, windows)


def _start_ingest(address: str, seconds: float) -> subprocess.Popen:
    """`bench.ingest load` (8 producers, batches of 64 x 1 KiB), with each acknowledgement's time."""
    return subprocess.Popen([sys.executable, "-m", "bench.ingest", "load", address, "8", str(seconds), "64",
                             "--timeline"], stdout=subprocess.PIPE, text=True)


def _quantiles(lat: list[float]) -> str:
    if not lat:
        return "no answers"
    s = sorted(lat)

    def q(p: float) -> float:
        return s[min(len(s) - 1, int(p * len(s)))]

    return (f"P50 {q(0.5):.2f} ms, P99 {q(0.99):.2f} ms, P999 {q(0.999):.2f} ms, max {s[-1]:.2f} ms "
            f"({len(s):,} requests)")


def _run_probe(address: str, mode: str, bucket: int, pending: int, count: int, seconds: float,
               rate: float = 0, windows: tuple[float, float, int] | None = None) -> subprocess.Popen:
    extra = [] if windows is None else [repr(x) for x in windows]
    return subprocess.Popen([sys.executable, "-m", "bench.status", "probe", address, mode, str(bucket),
                             str(pending), str(count), str(seconds), str(rate), *extra],
                            stdout=subprocess.PIPE, text=True)


WARM_UP_S = 3.0
EDGE_S = 0.25


def window_changes(acks: list, start: float, length: float, number: int) -> tuple[list[float], list[float]]:
    """Ingest rate (msg/s) of each window from (wall time, messages) acknowledgements, `EDGE_S`
    at each edge left out; and for each odd window (statuses), its change against the mean of
    the two windows around it."""
    counted = [0] * number
    for t, n in acks:
        k = int((t - start) // length)
        if 0 <= k < number and EDGE_S <= t - start - k * length < length - EDGE_S:
            counted[k] += n
    rates = [c / (length - 2 * EDGE_S) for c in counted]
    changes = [rates[k] / max((rates[k - 1] + rates[k + 1]) / 2, 1) - 1 for k in range(1, number - 1, 2)]
    return rates, changes


def main(argv: list[str]) -> None:
    from bench.harness import DelayServerProcess, cpu_seconds, environment_note

    parser = argparse.ArgumentParser(prog="ops/bench status", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pending", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--cancels", type=int, default=1000)
    parser.add_argument("--status-rate", type=float, default=200, help="status requests/s beside ingest")
    parser.add_argument("--rounds", type=int, default=10, help="ingest windows with statuses, each between two without")
    parser.add_argument("--window", type=float, default=2.0, help="seconds per ingest window")
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
        server.stop()  # as a running node leaves its files: the dedupe table's journal among them
        began = time.perf_counter()
        server.start(timeout=3600)
        print(f"  again, after it ran and stopped       {time.perf_counter() - began:.2f} s", flush=True)
        first = probe(server.address, "status", bucket, args.pending, 1, 3600)
        print(f"  first status (waits for the bucket's index): {first['latencies_ms'][0]:.0f} ms", flush=True)
        cpu = cpu_seconds(server.process)
        pings = probe(server.address, "ping", bucket, args.pending, 10 ** 9, args.seconds)
        cpu, used = cpu_seconds(server.process), cpu_seconds(server.process) - cpu
        print(f"  PING latency, the same client and server, no lookup (this machine's floor for a "
              f"request): {_quantiles(pings['latencies_ms'])}; server CPU "
              f"{used * 1e6 / max(len(pings['latencies_ms']), 1):.0f} us per ping", flush=True)
        quiet = probe(server.address, "status", bucket, args.pending, 10 ** 9, args.seconds)
        cpu, used = cpu_seconds(server.process), cpu_seconds(server.process) - cpu
        print(f"  status latency, no other traffic: {_quantiles(quiet['latencies_ms'])}; "
              f"wrong answers {quiet['wrong']}; server CPU {used * 1e6 / max(len(quiet['latencies_ms']), 1):.0f} us "
              "per status", flush=True)
        if args.rounds:  # --rounds 0: statuses and cancels alone
            # One ingest run; statuses in every other window of it, each such window compared with
            # the two around it (the module docstring says why).
            number = 2 * args.rounds + 1
            start = time.time() + WARM_UP_S
            windows = (start, args.window, number)
            ingest = _start_ingest(server.address, WARM_UP_S + number * args.window + 0.5)
            prober = _run_probe(server.address, "status", bucket, args.pending, 10 ** 9,
                                WARM_UP_S + number * args.window + 60, args.status_rate, windows)
            cpu_at = []
            for k in range(number + 1):
                time.sleep(max(0.0, start + k * args.window - time.time()))
                cpu_at.append(cpu_seconds(server.process))
            load, statuses = json.loads(ingest.communicate()[0]), json.loads(prober.communicate()[0])
            rates, changes = window_changes(load["acks"], *windows)
            used = [cpu_at[k + 1] - cpu_at[k] for k in range(number)]
            cpu_us = [used[k] * 1e6 / max(rates[k] * args.window, 1) for k in range(number)]
            print(f"  ingest in {number} windows of {args.window:g} s, statuses in every other one "
                  f"({args.status_rate:g}/s): " + ", ".join(f"{r:,.0f}{'*' if k % 2 else ''}" for k, r in enumerate(rates))
                  + " msg/s (* with statuses)")
            print("  server CPU per message, without / with statuses (theirs included): "
                  f"{statistics.median(cpu_us[0::2]):.1f} / {statistics.median(cpu_us[1::2]):.1f} us; the server's "
                  f"CPU use {statistics.median(used[0::2]) / args.window:.0%} / {statistics.median(used[1::2]) / args.window:.0%}"
                  f" of a core (medians); the status client's CPU {statuses['cpu_us']:.0f} us per status")
            if changes:
                change = statistics.median(changes)
                print("  beside statuses, against the windows around each: "
                      + ", ".join(f"{c:+.1%}" for c in changes) + f"; median {change:+.1%}"
                      + f"   (target within 5%: {'met' if change >= -0.05 else 'MISSED'})")
            print(f"  status latency beside ingest: {_quantiles(statuses['latencies_ms'])}; "
                  f"wrong answers {statuses['wrong']}")
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
        windows = (float(sys.argv[9]), float(sys.argv[10]), int(sys.argv[11])) if len(sys.argv) > 9 else None
        print(json.dumps(probe(address, mode, bucket, pending, count, seconds, float(sys.argv[8]), windows)))
    else:
        main(sys.argv[1:])
