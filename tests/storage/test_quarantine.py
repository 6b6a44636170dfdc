"""Quarantine, not crash: a damaged record in one bucket stops that bucket only.

A node (in this process, real sockets, real files, the spool broker) stores messages for two
buckets and stops. A record in the middle of the first bucket's schedule segment is damaged. The
node restarts after both buckets are due: it delivers everything of the second bucket and what the
first held before the damage, shows the first as QUARANTINED (log with file and offset, metric,
`delayctl buckets`, `delayctl verify`), and stays up. `delayctl salvage` then rebuilds the damaged
records from message_log and lifts the quarantine; the next start delivers the rest, each message
once. A second test salvages a bucket whose message_log was cleaned: the lost ids are reported
exactly, and every intact record is still delivered.
"""
from __future__ import annotations

import json
import logging
import time

import trio

from delayserver.client import AsyncProducer, Message
from delayserver.clock import TrioClock
from delayserver.config import Config
from delayserver.node.server import DelayServer
from delayserver.storage.buckets import bucket_name
from delayserver.storage.record import iter_records
from delayserver.storage.salvage import salvage
from tests.faults.harness import delayctl
from tests.pipeline_node import SCALE_MS, START_MS, Node
from tests.procs import spooled

MINUTE = 60_000


def config(root) -> Config:
    return Config.from_dict(dict(data_dir=str(root), listen="127.0.0.1:0", segment_scale="1m", max_delay="1d",
                                 reserve_bytes=0, checkpoint_interval_ms=20))


async def run_node(root, epoch_ms: int, body) -> DelayServer:
    """Start a node whose clock reads `epoch_ms` now, run `body(server)`, stop it."""
    server = DelayServer(config(root), clock=TrioClock(epoch_ms - int(trio.current_time() * 1000)))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        await body(server)
        nursery.cancel_scope.cancel()
    return server


def delivered_ids(root) -> list[str]:
    return [m.message_id for _, _, m in spooled(root)]


async def wait_delivered(root, ids: set[str], timeout: float = 30) -> None:
    with trio.fail_after(timeout):  # a real node delivering: generous on a loaded machine
        while not ids <= set(delivered_ids(root)):
            await trio.sleep(0.05)


async def test_a_damaged_bucket_is_quarantined_the_rest_delivered_and_salvage_recovers_it(tmp_path, caplog):
    root = tmp_path / "node"
    now = time.time_ns() // 1_000_000
    first = now - now % MINUTE + 5 * MINUTE  # two whole buckets ahead: nothing is due yet
    second = first + MINUTE
    a_ids = [f"a-{i}" for i in range(10)]
    b_ids = [f"b-{i}" for i in range(10)]

    async def send(server):
        async with AsyncProducer(f"127.0.0.1:{server.port}") as p:
            for mid in a_ids:  # one batch each, so that each is its own record in the segment
                await p.send("q.a", mid.encode(), deliver_at=first + 1000, message_id=mid)
            await p.send_many([Message("q.b", m.encode(), deliver_at=second + 1000, message_id=m) for m in b_ids])
        await server.drain()

    await run_node(root, now, send)
    segment = root / "schedule_log" / f"{bucket_name(first)}.log"
    offsets = [pos for pos, *_ in iter_records(segment.read_bytes())]
    assert len(offsets) == 10
    raw = bytearray(segment.read_bytes())
    raw[offsets[4] + 30] ^= 0xFF  # inside the fifth record: a-4 is damaged, a-5..a-9 follow
    segment.write_bytes(bytes(raw))

    caplog.set_level(logging.ERROR, logger="delayserver.storage")

    async def deliver(server):
        await wait_delivered(root, set(a_ids[:4]) | set(b_ids))
        assert server.metrics.registry.get_sample_value("delayserver_quarantined_buckets") == 1
        async with AsyncProducer(f"127.0.0.1:{server.port}") as p:  # still serving
            assert await p.ping(b"up") == b"up"

    await run_node(root, second + 2 * MINUTE, deliver)
    assert set(delivered_ids(root)) == set(a_ids[:4]) | set(b_ids), "nothing past the damage was delivered"
    assert any("QUARANTINED" in r.getMessage() and str(segment) in r.getMessage()
               and f"offset {offsets[4]}" in r.getMessage() for r in caplog.records)

    buckets = delayctl("buckets", root, "--json")
    assert buckets.returncode == 1
    rows = {r["bucket"]: r for r in map(json.loads, buckets.stdout.splitlines())}
    assert rows[bucket_name(first)]["state"] == "QUARANTINED"
    assert rows[bucket_name(first)]["quarantine"]["offset"] == offsets[4]
    assert "state" not in rows[bucket_name(second)]
    verify = delayctl("verify", root)
    assert verify.returncode == 1 and f"bucket {bucket_name(first)} QUARANTINED" in verify.stdout

    result = delayctl("salvage", root, bucket_name(first), "--segment-scale", "1m", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["recovered_ids"] == ["a-4"] and report["lost_ids"] == [] and report["intact"] == 9
    assert delayctl("verify", root).returncode == 0

    async def rest(server):
        await wait_delivered(root, set(a_ids) | set(b_ids))
        assert server.metrics.registry.get_sample_value("delayserver_quarantined_buckets") == 0

    await run_node(root, second + 3 * MINUTE, rest)
    ids = delivered_ids(root)
    assert sorted(ids) == sorted(a_ids + b_ids), "each message delivered once"


def test_salvage_after_message_log_was_cleaned_names_exactly_the_lost_ids(tmp_path):
    node = Node(tmp_path, START_MS, segment_bytes=120)  # a segment per message: cleanable
    bucket = START_MS - START_MS % SCALE_MS + SCALE_MS
    ids = [f"m-{i}" for i in range(8)]
    for mid in ids:
        node.send([(mid, bucket + 100)])
    node.send([("later", bucket + 2 * SCALE_MS)])
    node.replay_all()
    node.replayer.checkpoint()
    deleted = node.store.message_log.delete_before(node.replayer.offset)
    assert deleted, "the test needs message_log cleaned"
    node.store.close()
    path = node.store.schedule_log.path(bucket)
    offsets = [pos for pos, *_ in iter_records(path.read_bytes())]
    raw = bytearray(path.read_bytes())
    for i in (2, 5):
        raw[offsets[i + 1] - 3] ^= 0x55  # the end of a body: crc fails, the id stays legible
    path.write_bytes(bytes(raw))

    report = salvage(tmp_path, bucket, segment_scale_ms=SCALE_MS)
    assert sorted(report.lost_ids) == ["m-2", "m-5"]
    assert report.intact == 6 and report.rewritten

    node = Node(tmp_path, bucket + 10 * SCALE_MS)
    node.load_all()
    fired = {f.message.message_id for f in node.take()}
    assert fired == set(ids) - {"m-2", "m-5"} | {"later"}
