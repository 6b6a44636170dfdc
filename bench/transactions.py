"""`ops/bench transactions`: what a transactional send costs, and what open half messages cost.

- Sends: one real server process (flush=sync); C concurrent tasks of one AsyncProducer send N
  messages one by one, then the same N as prepare + commit (two durable records and two round
  trips each), then as prepare + rollback. Figures: messages per second of each, and the ratio.
- Open half messages: H half messages held by a node's HalfMessages (as replay builds them): the
  replay checkpoint's part for them (its JSON bytes and the time to build and write it, as each
  checkpoint does), the time to restore it at start, and the Python memory per open half message
  (tracemalloc).
Options: --messages N (default 20,000), --concurrency C (64), --open H (100,000), --dir PATH.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import tracemalloc
from pathlib import Path

import trio

HOUR_MS = 3_600_000


async def _sends(address: str, n: int, concurrency: int, mode: str) -> float:
    from delayserver.client import AsyncProducer

    async with AsyncProducer(address, timeout=60) as producer:
        async def worker(count: int) -> None:
            for _ in range(count):
                if mode == "send":
                    await producer.send("bench.txn", b"x" * 100, delay=HOUR_MS)
                else:
                    handle = await producer.prepare("bench.txn", b"x" * 100, group="bench", delay=HOUR_MS)
                    await (producer.commit(handle) if mode == "commit" else producer.rollback(handle))

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(concurrency):
                nursery.start_soon(worker, n // concurrency + (i < n % concurrency))
        return n / (time.perf_counter() - started)


def bench_sends(root: Path, n: int, concurrency: int) -> dict[str, float]:
    from bench.harness import DelayServerProcess

    server = DelayServerProcess(root / "node").start()
    try:
        return {mode: trio.run(_sends, server.address, n, concurrency, mode) for mode in ("send", "commit", "rollback")}
    finally:
        server.stop()


def bench_open(h: int) -> dict[str, float]:
    from delayserver.storage.record import RecordType, encode_message_fields, encode_prepare, encode_record
    from delayserver.storage.record import iter_records
    from delayserver.transactions.state import HalfMessages

    now = time.time_ns() // 1_000_000
    buf = b"".join(encode_record(RecordType.PREPARE, encode_prepare(
        "bench", 0, encode_message_fields(f"half-{i:012d}", "bench.txn", b"x" * 100, now + HOUR_MS, {}, now)))
        for i in range(h))
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    halves = HalfMessages(HOUR_MS)
    for offset, rtype, s, e in iter_records(buf):
        halves.apply(offset, rtype, buf, s, e)
    per_half = sum(stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(before, "filename")) / h
    tracemalloc.stop()
    started = time.perf_counter()
    text = json.dumps(halves.snapshot())
    snapshot_s = time.perf_counter() - started
    started = time.perf_counter()
    HalfMessages(HOUR_MS).restore(json.loads(text))
    return {"json_bytes": len(text), "snapshot_s": snapshot_s, "restore_s": time.perf_counter() - started,
            "bytes_per_half": per_half}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="ops/bench transactions")
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--open", type=int, default=100_000)
    ap.add_argument("--dir", type=Path)
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-txn-", dir=args.dir))
    try:
        rates = bench_sends(root, args.messages, args.concurrency)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"transactions: {args.messages} messages, {args.concurrency} concurrent, flush=sync")
    print(f"  send              {rates['send']:>9,.0f} msg/s")
    print(f"  prepare + commit  {rates['commit']:>9,.0f} msg/s  ({rates['commit'] / rates['send']:.2f} of send)")
    print(f"  prepare + rollback{rates['rollback']:>9,.0f} msg/s  ({rates['rollback'] / rates['send']:.2f} of send)")
    o = bench_open(args.open)
    print(f"open half messages: {args.open}")
    print(f"  checkpoint part   {o['json_bytes'] / (1 << 20):.1f} MiB of JSON, built and encoded in {o['snapshot_s'] * 1000:.0f} ms")
    print(f"  restore at start  {o['restore_s'] * 1000:.0f} ms")
    print(f"  memory            {o['bytes_per_half']:.0f} bytes per open half message")
