"""`ops/bench storage`: records/s and MB/s of the storage hot paths, on real files.

- append: messages with 1 KiB bodies encoded (as the receiver does), framed, joined into batches
  of 256 and appended to message_log in one write per batch; without fsync, then with one fsync
  per batch (group commit). Also the append alone, of batches already encoded.
- read: a whole schedule_log segment read from its file and walked with `iter_records` (crc
  checked), each record decoded two ways: `scheduled_key` (what loading a bucket needs) and
  `decode_scheduled` (the whole message).

Targets: append >= 200,000 records/s without fsync; read and decode >= 400,000 records/s.
Each figure is the best of --repeat runs (default 3): on a shared machine the best run is the one
least disturbed by others. Options: --records N (default 131,072), --dir PATH (default a temp
directory; put it on the disk to measure).
"""
from __future__ import annotations

import argparse
import itertools
import shutil
import tempfile
import time
from pathlib import Path

from delayserver.storage.bucket_log import BucketLog
from delayserver.storage.message_log import MessageLog
from delayserver.storage.record import (
    RecordType, decode_scheduled, encode_message_fields, encode_record, encode_scheduled, iter_records, scheduled_key,
)
from delayserver.storage.segment import read_file

BATCH = 256
BODY = bytes(range(256)) * 4
BUCKET = 1_800_000_000_000
HEADERS = {"trace": "0af7651916cd43dd8448eb211c80319c"}


def encoded_batch(first: int) -> bytes:
    """One batch as the receiver builds it: encode each message, frame it, join the frames."""
    return b"".join(
        encode_record(RecordType.MESSAGE, encode_message_fields(
            f"msg-{i:012d}", "orders.created", BODY, BUCKET + i, HEADERS, BUCKET, i))
        for i in range(first, first + BATCH)
    )


def bench_append(directory: Path, records: int, *, fsync: bool, pre_encoded: bool) -> tuple[float, int]:
    """Seconds and bytes to append `records` messages in batches to a new message_log."""
    log = MessageLog.open(directory)
    batches = [encoded_batch(0)] * (records // BATCH) if pre_encoded else None
    written = 0
    began = time.perf_counter()
    for n in range(records // BATCH):
        data = batches[n] if pre_encoded else encoded_batch(n * BATCH)
        log.append(data)
        if fsync:
            log.sync()
        written += len(data)
    elapsed = time.perf_counter() - began
    log.close()
    shutil.rmtree(directory)
    return elapsed, written


def write_schedule_segment(directory: Path, records: int) -> Path:
    log = BucketLog.open(directory)
    for n in range(records // BATCH):
        log.append(BUCKET, b"".join(
            encode_record(RecordType.SCHEDULED, encode_scheduled(i * 1100, encode_message_fields(
                f"msg-{i:012d}", "orders.created", BODY, BUCKET + i, HEADERS, BUCKET, i)))
            for i in range(n * BATCH, (n + 1) * BATCH)
        ))
    log.sync()
    log.close()
    return log.path(BUCKET)


def bench_read(path: Path, decode) -> tuple[float, int, int]:
    """Seconds, records and bytes to read the whole segment and decode every record."""
    began = time.perf_counter()
    data = read_file(path)
    count = 0
    for _, _, start, stop in iter_records(data):
        decode(data, start, stop)
        count += 1
    return time.perf_counter() - began, count, len(data)


def report(name: str, records: int, seconds: float, nbytes: int, target: int | None = None) -> None:
    rate = records / seconds
    verdict = "" if target is None else f"   (target {target:,}: {'met' if rate >= target else 'MISSED'})"
    print(f"{name:<44} {rate:>12,.0f} records/s {nbytes / seconds / 1e6:>9,.1f} MB/s{verdict}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="ops/bench storage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=1 << 17)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-storage-", dir=args.dir))
    runs = itertools.count()

    def best(measure):
        return min((measure() for _ in range(args.repeat)), key=lambda figures: figures[0])

    try:
        records = args.records - args.records % BATCH
        synced = min(records, 128 * BATCH)
        print(f"{records:,} records, 1 KiB bodies, batches of {BATCH}, best of {args.repeat}, in {root}")
        for name, count, fsync, pre_encoded, target in (
            ("append: encode + write, no fsync", records, False, False, 200_000),
            ("append: write of encoded batches, no fsync", records, False, True, 200_000),
            ("append: encode + write + fsync per batch", synced, True, False, None),
        ):
            seconds, nbytes = best(lambda: bench_append(root / str(next(runs)), count, fsync=fsync,
                                                        pre_encoded=pre_encoded))
            report(name, count, seconds, nbytes, target)
        path = write_schedule_segment(root / "schedule_log", records)
        for name, decode in (
            ("read: iter_records + scheduled_key", lambda buf, start, stop: scheduled_key(buf, start)),
            ("read: iter_records + decode_scheduled", decode_scheduled),
        ):
            seconds, count, nbytes = best(lambda: bench_read(path, decode))
            report(name, count, seconds, nbytes, 400_000)
    finally:
        shutil.rmtree(root)
