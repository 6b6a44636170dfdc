"""`ops/bench reconcile N`: the Spark reconciliation over N messages' logs; records/s and peak memory.

The logs are written directly with the storage writer (`BucketLog.append` of encoded SCHEDULED and
DISPATCH records, as the replayer and the sender write them), no server: N messages spread over
`--nodes` data directories and `--buckets` one-hour buckets each, bodies of `--body-bytes`, three
subjects, two broker groups. Every message is dispatched once, 1 in 1,000 twice and 1 in 10,000 not
at all (missing); lateness is `i % 500` ms. Generated logs are kept under --dir and reused.

Then `python spark/reconcile.py` runs on them with its defaults (plus any options after `--`), and
the benchmark checks its totals against what was written and prints wall time, records/s and the
peak resident memory of the driver (the JVM, which holds the executors in local mode) and of the
Python workers together, sampled every 0.2 s.

    ops/bench reconcile 500000                  # 1M records
    ops/bench reconcile 5000000 --nodes 10      # 10M records
    ops/bench reconcile 1000000 -- --out /tmp/reconcile-out --split-bytes 16777216
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from delayserver.storage.bucket_log import BucketLog
from delayserver.storage.record import (
    Dispatch, RecordType, encode_dispatch, encode_message_fields, encode_record, encode_scheduled,
)

ROOT = Path(__file__).resolve().parent.parent
HOUR_MS = 3_600_000
START_MS = 1_800_000_000_000 - 1_800_000_000_000 % HOUR_MS
SUBJECTS = ("orders.created", "payments.settled", "mail.reminder")
GROUPS = ("brokers-a", "brokers-b")
BATCH = 4096


def expected(n: int) -> dict[str, int]:
    """The totals a reconciliation of `generate(n, ...)` must find."""
    missing = len(range(0, n, 10_000))
    duplicated = sum(1 for i in range(0, n, 1_000) if i % 10_000)
    return {"scheduled": n, "dispatched": n - missing, "missing": missing, "duplicated": duplicated,
            "cancelled": 0, "early": 0, "orphan_dispatches": 0}


def generate(root: Path, n: int, nodes: int, buckets: int, body_bytes: int) -> list[str]:
    """Write n messages' schedule_log and dispatch_log into `nodes` data directories under `root`."""
    dirs = [root / f"node{k}" for k in range(nodes)]
    body = bytes(range(256)) * (body_bytes // 256) + bytes(body_bytes % 256)
    for k, data_dir in enumerate(dirs):
        schedule = BucketLog.open(data_dir / "schedule_log")
        dispatch = BucketLog.open(data_dir / "dispatch_log")
        mine = range(k, n, nodes)
        per_bucket = -(-len(mine) // buckets)
        for b in range(buckets):
            bucket = START_MS + b * HOUR_MS
            ids = mine[b * per_bucket:(b + 1) * per_bucket]
            for first in range(0, len(ids), BATCH):
                _write_batch(schedule, dispatch, bucket, ids[first:first + BATCH], body)
        schedule.sync()
        dispatch.sync()
        schedule.close()
        dispatch.close()
    return [str(d) for d in dirs]


def _write_batch(schedule: BucketLog, dispatch: BucketLog, bucket: int, ids: range, body: bytes) -> None:
    records, sizes = [], []
    for i in ids:
        at = bucket + (i * 7919) % HOUR_MS
        payload = encode_scheduled(i * 512, encode_message_fields(
            f"msg-{i:012d}", SUBJECTS[i % len(SUBJECTS)], body, at, {}, at - 60_000, i + 1))
        records.append(encode_record(RecordType.SCHEDULED, payload))
        sizes.append(len(records[-1]))
    base = schedule.append(bucket, b"".join(records))
    dispatches = []
    offset = base
    for i, size in zip(ids, sizes):
        at = bucket + (i * 7919) % HOUR_MS
        if i % 10_000:
            for repeat in range(2 if i % 1_000 == 0 else 1):
                dispatches.append(encode_record(RecordType.DISPATCH, encode_dispatch(
                    Dispatch(offset, at + i % 500 + repeat * 1_000, GROUPS[(i + repeat) % len(GROUPS)]))))
        offset += size
    dispatch.append(bucket, b"".join(dispatches))


class PeakMemory:
    """Samples the resident memory of a process tree, the JVM(s) and the Python processes apart,
    and the CPU time each process of it used (its last sample: a short-lived one may be missed)."""

    def __init__(self, pid: int, every: float = 0.2):
        self.pid, self.every = pid, every
        self.jvm = self.python = 0
        self.cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        root = psutil.Process(self.pid)
        while not self._stop.wait(self.every):
            jvm = python = 0
            try:
                procs = [root] + root.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for p in procs:
                try:
                    rss, name, cpu = p.memory_info().rss, p.name(), p.cpu_times()
                except psutil.Error:
                    continue
                self.cpu[p.pid] = cpu.user + cpu.system
                if name == "java":
                    jvm += rss
                elif p.pid != self.pid:
                    python += rss
            self.jvm, self.python = max(self.jvm, jvm), max(self.python, python)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_job(data_dirs: list[str], extra: list[str]) -> tuple[dict, float, PeakMemory]:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        process = subprocess.Popen([sys.executable, str(ROOT / "spark" / "reconcile.py"), *data_dirs, "--json",
                                    "--as-of", str(START_MS + 10_000 * HOUR_MS), *extra],
                                   stdout=out, stderr=err, env=env, cwd=ROOT)
        memory = PeakMemory(process.pid)
        status = process.wait()
        elapsed = time.perf_counter() - started
        memory.stop()
        out.seek(0)
        err.seek(0)
        if status not in (0, 1):
            raise SystemExit(f"reconcile exited {status}:\n{err.read()[-5000:]}")
        return json.loads(out.read()), elapsed, memory


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="ops/bench reconcile", description=__doc__.splitlines()[0])
    parser.add_argument("messages", type=int)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--buckets", type=int, default=4)
    parser.add_argument("--body-bytes", type=int, default=256)
    parser.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "delayserver-bench-reconcile"),
                        help="where the generated logs are kept and reused")
    parser.epilog = "Options for spark/reconcile.py follow a --."
    # Split by hand: argparse gives a trailing nargs="*" positional its (empty) share at once, and
    # then refuses what follows a "--" after other options.
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.extra = extra
    n = args.messages
    root = Path(args.dir) / f"n{n}-nodes{args.nodes}-buckets{args.buckets}-body{args.body_bytes}"
    done = root / "complete"
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        started = time.perf_counter()
        generate(root, n, args.nodes, args.buckets, args.body_bytes)
        done.write_text(json.dumps({"messages": n}))
        print(f"generated {n:,} messages in {time.perf_counter() - started:.1f} s under {root}")
    data_dirs = [str(root / f"node{k}") for k in range(args.nodes)]
    size = sum(f.stat().st_size for d in data_dirs for f in Path(d).rglob("*.log"))
    records = n + expected(n)["dispatched"] + expected(n)["duplicated"]
    report, elapsed, memory = run_job(data_dirs, args.extra)
    got = {k: report["total"][k] for k in expected(n)}
    if got != expected(n):
        raise SystemExit(f"wrong totals: {got}, expected {expected(n)}")
    load = os.getloadavg()
    print(f"reconcile: {n:,} messages, {records:,} records, {size / 2**20:,.0f} MiB in {args.nodes} data "
          f"director{'y' if args.nodes == 1 else 'ies'}: {elapsed:.1f} s wall (start-up included), "
          f"{records / elapsed:,.0f} records/s; totals exact")
    print(f"  CPU time of the job's processes: {sum(memory.cpu.values()):,.0f} s "
          f"({records / sum(memory.cpu.values()):,.0f} records per CPU second)")
    print(f"  peak resident memory: driver JVM {memory.jvm / 2**20:,.0f} MiB, Python workers (all) "
          f"{memory.python / 2**20:,.0f} MiB; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
          f"on {os.cpu_count()} cores")
