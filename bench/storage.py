"""`ops/bench storage`: records/s and MB/s of the storage hot paths, on real files.

- append: messages with 1 KiB bodies encoded (as the receiver does), framed, joined into batches
  of 256 and appended to message_log in one write per batch; without fsync, then with one fsync
  per batch (group commit). Also the append alone, of batches already encoded.
- replay: those batches replayed from message_log into schedule_log (`Replayer.replay_once`, no
  fsync), taken from memory as a node replays the batches its receiver just wrote, with the id
  and time indexes following the segments as a node's do; the messages fall due an hour ahead, as
  `ops/bench ingest` sends them, so the wheel holds none of them. Then the same with 8 batches
  written at a time and replayed in one pass each, as a node replays a group commit of many
  requests.
- receive: SEND requests of 64 messages (1 KiB bodies, no headers, due in an hour, as `ops/bench
  ingest` sends them) decoded, stored by the node's receiver (`Receiver.send`, `flush = "async"`,
  the dedupe table on as by default) and answered (the response encoded), one after another in
  this process: the server's work per message before replay, without the network.
- take: messages falling due taken from the due queue as the sender's dispatch task takes them
  (`DueQueue.take` of 256 at a time: the records read ahead into memory beforehand, as
  `prefetch_due` does, decoded into messages), routed to their broker group
  (`Sender.route_taken`) and settled (`Sender._settle`): the event loop's work per delivered
  message that waits for no I/O, without the sending itself. Then the same with 40 batches in
  flight, each settled when 40 more were taken, the collector at the node's thresholds
  (`GC_THRESHOLDS`, what was there before frozen): the objects of the batches a node has in
  flight are there when the collector runs, and it walks those it tracks.
- read: a whole schedule_log segment read as the tick manager loads it (`BucketLog.read` in 4 MiB
  chunks) and walked with `iter_records` (crc checked), each record decoded two ways:
  `scheduled_key` (what loading a bucket needs) and `decode_scheduled` (the whole message).

Targets: append >= 200,000 records/s without fsync; read and decode >= 400,000 records/s.
Each figure is the best of --repeat runs (default 3): on a shared machine the best run is the one
least disturbed by others. Rates are by wall-clock time (what the targets are about), and also by
the process's CPU time, which other processes disturb less. Options: --records N (default 131,072), --dir PATH (default a temp
directory; put it on the disk to measure).
"""
from __future__ import annotations

import argparse
import collections
import gc
import itertools
import shutil
import tempfile
import time
from pathlib import Path

import attrs
import trio

from bench.harness import memory_note
from delayserver.clock import WallClock
from delayserver.config import Config
from delayserver.dedupe import DedupeTable
from delayserver.message import TimeSpec
from delayserver.node.receiver import DiskSpace, Receiver, RecentBatches
from delayserver.node.server import GC_THRESHOLDS
from delayserver.protocol import SendItem, decode_send_request, encode_send_request, encode_send_response
from delayserver.replayer import Replayer
from delayserver.sender.sender import BrokerGroup, Sender
from delayserver.storage.bucket_log import BucketLog
from delayserver.storage.id_index import IdIndex
from delayserver.storage.message_log import MessageLog
from delayserver.storage.record import (
    RecordType, decode_scheduled, encode_message_fields, encode_record, encode_scheduled, iter_records, scheduled_key,
)
from delayserver.storage.store import Store
from delayserver.storage.time_index import TimeIndex
from delayserver.wakeup import Wakeup
from delayserver.wheel.prefetch import fetch, fetch_jobs
from delayserver.wheel.tick_manager import TickManager

BATCH = 256
#: Batches of a replay pass (`replay` of passes): a group commit joins the requests that came in
#: during the fsync before it (`ops/bench ingest`: 32 producers' requests of 64 messages).
JOINED = 8
#: Batches a take waits on before settling the first (`take` with batches in flight).
IN_FLIGHT = 40
BODY = bytes(range(256)) * 4
BUCKET = 1_800_000_000_000
READ_CHUNK_BYTES = 4 << 20  # as the tick manager loads a bucket
HEADERS = {"trace": "0af7651916cd43dd8448eb211c80319c"}


def encoded_batch(first: int, schedule_time: int = BUCKET) -> bytes:
    """One batch as the receiver builds it: encode each message, frame it, join the frames."""
    return b"".join(
        encode_record(RecordType.MESSAGE, encode_message_fields(
            f"msg-{i:012d}", "orders.created", BODY, schedule_time + i, HEADERS, BUCKET, i))
        for i in range(first, first + BATCH)
    )


@attrs.frozen
class Figures:
    wall_s: float
    cpu_s: float
    records: int
    bytes: int


class Stopwatch:
    """Wall-clock and CPU seconds since it was made."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def figures(self, records: int, nbytes: int) -> Figures:
        return Figures(time.perf_counter() - self.wall, time.process_time() - self.cpu, records, nbytes)


def bench_append(directory: Path, records: int, *, fsync: bool, pre_encoded: bool) -> Figures:
    """Append `records` messages in batches to a new message_log."""
    log = MessageLog.open(directory)
    batches = [encoded_batch(0)] * (records // BATCH) if pre_encoded else None
    written = 0
    watch = Stopwatch()
    for n in range(records // BATCH):
        data = batches[n] if pre_encoded else encoded_batch(n * BATCH)
        log.append(data)
        if fsync:
            log.sync()
        written += len(data)
    figures = watch.figures(records, written)
    log.close()
    shutil.rmtree(directory)
    return figures


def bench_replay(directory: Path, records: int, joined: int = 1) -> Figures:
    """Replay `records` messages, written to a new message_log beforehand, into schedule_log:
    `joined` batches to a write (a group commit of that many), each write replayed in one pass."""
    store = Store.open(directory)
    written = {}  # message_log offset -> the batch written there, as the receiver keeps them
    for n in range(0, records // BATCH, joined):
        data = b"".join(encoded_batch(k * BATCH, schedule_time=BUCKET + 3_600_000)
                        for k in range(n, min(n + joined, records // BATCH)))
        written[store.message_log.append(data)] = data
    ticks = TickManager(store, now_ms=BUCKET)
    index = IdIndex(store.schedule_log)
    times = TimeIndex(store.schedule_log, store.segment_scale_ms)
    replayer = Replayer(store, ticks, recent_batch=lambda offset: (written[offset], offset))
    end = store.message_log.end_offset
    watch = Stopwatch()
    count = 0
    while replayed := replayer.replay_once(BUCKET, end):
        count += replayed
    figures = watch.figures(count, end)
    assert count == records and index.entries() == times.entries() == records, (count, index.entries())
    store.close()
    shutil.rmtree(directory)
    return figures


REQUEST_BATCH = 64  # messages per SEND request, as ops/bench ingest's producers send them


def send_request(n: int, batch: int = REQUEST_BATCH) -> bytes:
    """SEND request `n`: `batch` messages of BODY due in an hour, ids `msg-<n>-<i>`."""
    return encode_send_request([SendItem(f"msg-{n:08d}-{i:04d}", "bench.ingest", TimeSpec.delay(3_600_000), BODY)
                                for i in range(batch)])


def bench_receive(directory: Path, records: int) -> Figures:
    """Decode, store and answer `records` messages in SEND requests of REQUEST_BATCH."""
    requests = [send_request(n) for n in range(records // REQUEST_BATCH)]
    store = Store.open(directory)
    config = Config.from_dict({"flush": "async"})
    receiver = Receiver(store, WallClock(), config, recent=RecentBatches(), disk=DiskSpace(store, 0),
                        on_durable=Wakeup(), sequence_floor=lambda: 1, dedupe=DedupeTable(config.dedupe_window_ms))

    async def run() -> Figures:
        async with trio.open_nursery() as nursery:
            await nursery.start(receiver.serve)
            watch = Stopwatch()
            for request in requests:
                encode_send_response(await receiver.send(decode_send_request(request)))
            figures = watch.figures(len(requests) * REQUEST_BATCH, sum(map(len, requests)))
            nursery.cancel_scope.cancel()
        return figures

    try:
        figures = trio.run(run)
        assert receiver.appended == figures.records, (receiver.appended, figures.records)
        return figures
    finally:
        store.close()
        shutil.rmtree(directory)


def bench_take(directory: Path, records: int, in_flight: int = 0) -> Figures:
    """Take `records` due messages 256 at a time, route each batch to a broker group and settle it;
    with `in_flight`, each batch settled once that many more were taken after it (as a node's
    batches are, sent and settled after their dispatch records' fsync), the collector at the
    node's thresholds with what was there before frozen (as the node serves): the objects of the
    batches in flight are there when it collects."""
    store = Store.open(directory)
    ticks = TickManager(store, now_ms=BUCKET - 1_000, slots=1 << 14)
    replayer = Replayer.open(store, ticks)
    for n in range(records // BATCH):
        store.message_log.append(encoded_batch(n * BATCH))
    while replayer.replay_once(BUCKET - 1_000, store.message_log.end_offset, 8 << 20):
        pass
    while ticks.load_step(BUCKET - 1_000):
        pass
    ticks.ahead.max_bytes = 1 << 40
    for bucket, held in fetch(fetch_jobs(ticks, BUCKET - 1_000, BUCKET + records), ticks.ahead.room):
        ticks.ahead.put(bucket, held, ticks.ahead.epoch)
    for now in range(BUCKET, BUCKET + records + 1_000, 1_000):  # all due, a second at a time
        ticks.advance(now)
    sender = Sender(ticks, store, [BrokerGroup("spool", transport=None)], clock=WallClock(),
                    max_inflight=1 << 30)
    group = sender.groups["spool"]

    async def take_all() -> int:
        count = 0
        flying: collections.deque = collections.deque()
        while sender.due.waiting or flying:
            if sender.due.waiting:
                batch = await sender.due.take(BATCH)
                sender.route_taken(batch, 0)
                group.queue.clear()
                flying.append(batch)
            if len(flying) > in_flight or not sender.due.waiting:
                batch = flying.popleft()
                sender._settle(batch, group, 0)  # its budget freed, its refs settled in the wheel
                count += len(batch)
        return count

    held_bytes = ticks.ahead.held_bytes  # the records taken, as read ahead
    thresholds = gc.get_threshold()
    if in_flight:
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
    try:
        watch = Stopwatch()
        count = trio.run(take_all)
        figures = watch.figures(count, held_bytes)
    finally:
        if in_flight:
            gc.set_threshold(*thresholds)
            gc.unfreeze()
    assert count == records and not ticks.inflight, (count, len(ticks.inflight))
    store.close()
    shutil.rmtree(directory)
    return figures


def write_schedule_segment(directory: Path, records: int) -> None:
    log = BucketLog.open(directory)
    for n in range(records // BATCH):
        log.append(BUCKET, b"".join(
            encode_record(RecordType.SCHEDULED, encode_scheduled(i * 1100, encode_message_fields(
                f"msg-{i:012d}", "orders.created", BODY, BUCKET + i, HEADERS, BUCKET, i)))
            for i in range(n * BATCH, (n + 1) * BATCH)
        ))
    log.sync()
    log.close()


def bench_read(directory: Path, decode) -> Figures:
    """Read the whole segment chunk by chunk and decode every record."""
    log = BucketLog.open(directory, readonly=True)
    size = log.size(BUCKET)
    watch = Stopwatch()
    pos = count = 0
    while pos < size:
        data = log.read(BUCKET, pos, pos + READ_CHUNK_BYTES)
        end = 0
        for _, _, start, end in iter_records(data):
            decode(data, start, end)
            count += 1
        pos += end
    figures = watch.figures(count, size)
    log.close()
    return figures


def report(name: str, f: Figures, target: int | None = None) -> None:
    rate = f.records / f.wall_s
    verdict = "" if target is None else f"  target {target:,}: {'met' if rate >= target else 'MISSED'}"
    print(f"{name:<44} {rate:>11,.0f} records/s {f.bytes / f.wall_s / 1e6:>8,.1f} MB/s"
          f"  (cpu {f.records / f.cpu_s:>11,.0f} records/s){verdict}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="ops/bench storage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=1 << 17)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-storage-", dir=args.dir))
    runs = itertools.count()

    def best(measure) -> Figures:
        return min((measure() for _ in range(args.repeat)), key=lambda figures: figures.wall_s)

    try:
        records = args.records - args.records % BATCH
        synced = min(records, 128 * BATCH)
        print(f"{records:,} records, 1 KiB bodies, batches of {BATCH}, best of {args.repeat}, in {root}; "
              f"{memory_note(str(root))}")
        for name, count, fsync, pre_encoded, target in (
            ("append: encode + write, no fsync", records, False, False, 200_000),
            ("append: write of encoded batches, no fsync", records, False, True, 200_000),
            ("append: encode + write + fsync per batch", synced, True, False, None),
        ):
            report(name, best(lambda: bench_append(root / str(next(runs)), count, fsync=fsync,
                                                   pre_encoded=pre_encoded)), target)
        report("receive: decode, store, answer SEND", best(lambda: bench_receive(
            root / str(next(runs)), records)))
        report("replay: into schedule_log, indexes following", best(lambda: bench_replay(root / str(next(runs)),
                                                                                          records)))
        report(f"replay: the same, passes of {JOINED * BATCH:,} records", best(lambda: bench_replay(
            root / str(next(runs)), records, JOINED)))
        report("take: due queue take, route, settle", best(lambda: bench_take(root / str(next(runs)), records)))
        report(f"take: the same, {IN_FLIGHT} batches in flight", best(lambda: bench_take(
            root / str(next(runs)), records, IN_FLIGHT)))
        write_schedule_segment(root / "schedule_log", records)
        for name, decode in (
            ("read: iter_records + scheduled_key", lambda buf, start, stop: scheduled_key(buf, start)),
            ("read: iter_records + decode_scheduled", decode_scheduled),
        ):
            report(name, best(lambda: bench_read(root / "schedule_log", decode)), 400_000)
    finally:
        shutil.rmtree(root)
