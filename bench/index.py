"""`ops/bench index --records N`: what saving a growing bucket's id and time indexes costs.

N SCHEDULED records are appended to one one-hour bucket of a real schedule_log (the storage writer,
batches of 4,096), with the id index and the time index following it and saved under
`DATA_DIR/index/` as a node saves them: after every 65,536 records (`SAVE_EVERY`), one save of
each. For each million records the benchmark prints the CPU time the saves took (a save's work
runs in a worker thread while this process waits for it) and the bytes they wrote (`wchar`), per
record; then the time to open both indexes again from what was saved.

    ops/bench index --records 10000000
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import trio

from delayserver.storage.bucket_log import BucketLog
from delayserver.storage.id_index import SAVE_EVERY, IdIndex
from delayserver.storage.record import RecordType, encode_message_fields, encode_record, encode_scheduled
from delayserver.storage.time_index import TimeIndex

HOUR_MS = 3_600_000
BUCKET = 1_800_000_000_000 - 1_800_000_000_000 % HOUR_MS
BATCH = 4096
REPORT_EVERY = 1_000_000


def written_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


def records(first: int, count: int) -> bytes:
    out = []
    for i in range(first, first + count):
        at = BUCKET + (i * 7919) % HOUR_MS
        out.append(encode_record(RecordType.SCHEDULED, encode_scheduled(i * 256, encode_message_fields(
            f"msg-{i:012d}", "bench.index", b"x" * 100, at, {}, at - 60_000, i + 1))))
    return b"".join(out)


async def run(root: Path, n: int) -> None:
    log = BucketLog.open(root / "schedule_log")
    ids = IdIndex(log, root / "index" / "id")
    times = TimeIndex(log, HOUR_MS, root / "index" / "time")
    save_cpu = save_wall = 0.0
    save_bytes = 0
    since = (0.0, 0, 0)
    print(f"{'records':>12} {'save CPU per record':>20} {'bytes written per record':>25} {'save wall per save':>19}")
    saves = 0
    next_report = REPORT_EVERY
    for first in range(0, n, BATCH):
        log.append(BUCKET, records(first, min(BATCH, n - first)))
        done = min(first + BATCH, n)
        if len(ids.buckets[BUCKET].runs) - ids.buckets[BUCKET].saved >= SAVE_EVERY:
            c, w, b = time.process_time(), time.perf_counter(), written_bytes()
            await ids.save()
            await times.save()
            save_cpu += time.process_time() - c
            save_wall += time.perf_counter() - w
            save_bytes += written_bytes() - b
            saves += 1
        if done >= next_report or done == n:
            next_report += REPORT_EVERY
            cpu, wrote, count = save_cpu - since[0], save_bytes - since[1], done - since[2]
            print(f"{done:>12,} {cpu / count * 1e6:>17.2f} us {wrote / count:>23,.0f} B "
                  f"{save_wall / max(saves, 1) * 1e3:>16.1f} ms")
            since = (save_cpu, save_bytes, done)
    log.sync()
    log.close()
    print(f"all saves: {save_cpu:.2f} s CPU, {save_bytes / 2**20:,.0f} MiB written for {n:,} records "
          f"({save_cpu / n * 1e6:.2f} us and {save_bytes / n:,.0f} B per record)")
    started = time.perf_counter()
    log = BucketLog.open(root / "schedule_log")
    again_ids = IdIndex(log, root / "index" / "id")
    again_times = TimeIndex(log, HOUR_MS, root / "index" / "time")
    opened = time.perf_counter() - started
    left = log.size(BUCKET) - again_ids.buckets[BUCKET].covered
    print(f"open again from what was saved: {opened:.2f} s ({len(again_ids.buckets[BUCKET].runs):,} and "
          f"{len(again_times.buckets[BUCKET].runs):,} keys read back; {left:,} bytes of segment left to parse)")
    log.close()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="ops/bench index", description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000_000)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="delayserver-bench-index-", dir=args.dir))
    try:
        trio.run(run, root, args.records)
    finally:
        shutil.rmtree(root, ignore_errors=True)
