"""A node that delivered as a master and returns as a slave holds dispatch_log records its new
master never had: its dispatch_log is compared bucket by bucket (SYNC_DISPATCH_DIGEST) on each
connection, and a bucket that differs is quarantined, cut and pulled again whole. A slave whose
dispatch_log is longer than its master's is told DIVERGED, not refused for good (live servers)."""
from __future__ import annotations

import crc32c
import pytest
import trio

from delayserver import protocol as p
from delayserver.client import AsyncProducer, Message
from delayserver.message import DelayServerError, ResultCode
from delayserver.node.divergence import DIRECTORY
from delayserver.node.replication import wire
from delayserver.node.replication.master import prefix_crc
from delayserver.storage.bucket_log import BucketLog
from delayserver.storage.record import Dispatch, RecordType, encode_dispatch, encode_record

from tests.node.replication.helpers import cfg, spooled_ids, start, wait_until


def dispatch_bytes(server) -> dict[int, bytes]:
    log = server.store.dispatch_log
    return {b: log.read(b) for b in log.buckets() if log.size(b)}


async def delivered_pair(tmp_path, nursery):
    master = await start(nursery, cfg(tmp_path, "m"))
    async with AsyncProducer(f"127.0.0.1:{master.port}") as prod:
        await prod.send_many([Message("div.q", f"m{i}".encode(), delay=0) for i in range(20)])
    await wait_until(lambda: len(spooled_ids(master, "div.q")) == 20)
    await wait_until(lambda: sum(len(v) for v in dispatch_bytes(master).values()) > 0)
    slave = await start(nursery, cfg(tmp_path, "s", replicate_from=f"127.0.0.1:{master.port}"))
    await wait_until(lambda: dispatch_bytes(slave) == dispatch_bytes(master) and dispatch_bytes(slave))
    return master, slave


def own_delivery(bucket: int, schedule_offset: int, when: int) -> bytes:
    """A dispatch record this node would have written as a master."""
    return encode_record(RecordType.DISPATCH, encode_dispatch(Dispatch(schedule_offset, when, "local", 0)))


async def test_a_bucket_that_differs_at_the_same_size_is_quarantined_cut_and_pulled_again(tmp_path, nursery):
    master, slave = await delivered_pair(tmp_path, nursery)
    (bucket, theirs), = dispatch_bytes(master).items()
    log = slave.store.dispatch_log
    # Same size, other bytes: the last record says another delivery time (a forked history that
    # pulling by size alone would never notice).
    last = own_delivery(bucket, 0, 1)
    log.truncate(bucket, len(theirs) - len(last))
    log.append(bucket, own_delivery(bucket, 0, 2)[: len(last)])
    log.sync()
    assert log.size(bucket) == len(theirs) and log.read(bucket) != theirs
    async with AsyncProducer(f"127.0.0.1:{master.port}") as conn:
        await slave.slave.realign(conn, f"127.0.0.1:{master.port}")
    assert slave.slave.realign.dispatch_truncations == 1
    (copy,) = (tmp_path / "s" / DIRECTORY / "dispatch").iterdir()
    assert copy.read_bytes()[-len(last):] != theirs[-len(last):]
    await wait_until(lambda: dispatch_bytes(slave) == dispatch_bytes(master))


async def test_agreeing_buckets_are_left_alone(tmp_path, nursery):
    master, slave = await delivered_pair(tmp_path, nursery)
    before = dispatch_bytes(slave)
    async with AsyncProducer(f"127.0.0.1:{master.port}") as conn:
        await slave.slave.realign(conn, f"127.0.0.1:{master.port}")
    assert slave.slave.realign.dispatch_truncations == 0
    assert dispatch_bytes(slave) == before
    assert not (tmp_path / "s" / DIRECTORY / "dispatch").exists()


async def test_a_longer_dispatch_log_is_answered_diverged_and_the_slave_realigns(tmp_path, nursery):
    master, slave = await delivered_pair(tmp_path, nursery)
    (bucket, theirs), = dispatch_bytes(master).items()
    # Records this node wrote as a master that the master never had: its size is past the master's.
    extra = own_delivery(bucket, 0, 3)
    slave.store.dispatch_log.append(bucket, extra)
    slave.store.dispatch_log.sync()
    async with AsyncProducer(f"127.0.0.1:{master.port}") as conn:
        request = wire.encode_dispatch_log_request(wire.DispatchLogRequest("probe", {bucket: len(theirs) + len(extra)}))
        try:
            await conn.request(p.Command.SYNC_DISPATCH_LOG, request)
        except DelayServerError as e:
            assert e.code == ResultCode.DIVERGED
        else:
            raise AssertionError("a size past the master's was accepted")
    # The slave's own pulls meet the same answer: it connects again, realigns and catches up.
    await wait_until(lambda: dispatch_bytes(slave) == dispatch_bytes(master))
    assert slave.slave.realign.dispatch_truncations == 1
    assert not slave.slave.stopped_reason
    with trio.fail_after(5):
        async with AsyncProducer(f"127.0.0.1:{master.port}") as prod:
            await prod.send_many([Message("div.q", b"after", delay=0)])
    await wait_until(lambda: dispatch_bytes(slave) == dispatch_bytes(master))


def test_the_digest_request_round_trips_and_refuses_what_does_not_add_up():
    request = wire.DispatchDigestRequest("s1", {1_800_000: (90, 7), -5: (0, 0)})
    payload = wire.encode_dispatch_digest_request(request)
    assert wire.decode_dispatch_digest_request(payload) == request
    for bad in (payload[:-1], payload + b"x", payload[:2]):
        with pytest.raises(p.RemoteProtocolError):
            wire.decode_dispatch_digest_request(bad)
    assert wire.decode_buckets(wire.encode_buckets([3, -4])) == [3, -4]
    with pytest.raises(p.RemoteProtocolError):
        wire.decode_buckets(wire.encode_buckets([3]) + b"x")


def test_a_digest_reads_through_a_descriptor_of_its_own_and_never_revives_a_cleaned_bucket(tmp_path):
    """Digests are computed in worker threads. A read through the log's own descriptor cache
    there would close a descriptor the event loop may be writing through (the cache holds few)
    and would create again the file of a bucket the cleaner has just removed."""
    log = BucketLog.open(tmp_path / "dispatch_log", max_open=1)
    hour = 3_600_000
    records = {k * hour: own_delivery(k * hour, 0, k * hour + 1) * k for k in (1, 2, 3)}
    for bucket, data in records.items():
        log.append(bucket, data)
    held = dict(log._fds)  # what the event loop has open (the last bucket written)
    assert len(held) == 1
    for bucket, data in records.items():
        assert prefix_crc(log, bucket, len(data)) == crc32c.crc32c(data)
        assert prefix_crc(log, bucket, len(data) // 2, chunk=7) == crc32c.crc32c(data[: len(data) // 2])
    assert dict(log._fds) == held  # none closed, none opened
    log.remove(hour)  # as the cleaner does
    assert prefix_crc(log, hour, len(records[hour])) is None
    assert not log.path(hour).exists() and hour not in log.buckets()
    log.close()
