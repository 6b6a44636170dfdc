"""dispatch_log shipping cannot mark the wrong message delivered: a slave whose message_log copy
lags behind its dispatch_log pull applies only the records of messages it holds, so once promoted
its new messages, which take the schedule offsets the master's lost ones had, are pending,
cancellable and delivered (the issue's failover scenario)."""
from __future__ import annotations

import trio

from delayserver.client import AsyncProducer, Message
from delayserver.node.replication import Slave, slave as slave_module
from delayserver.storage.record import (
    Dispatch, Message as RecordMessage, RecordType, decode_dispatch, encode_dispatch, encode_message, encode_record,
    encode_scheduled,
)
from delayserver.storage.store import Store

from tests.node.replication.helpers import cfg, spooled_ids, start, wait_until


def dispatches(server) -> list:
    store = server.store
    return [decode_dispatch(payload) for bucket in store.dispatch_log.buckets()
            for _, rtype, payload in store.dispatch_log.records(bucket) if rtype == RecordType.DISPATCH]


async def test_a_promoted_slave_delivers_new_messages_at_offsets_its_master_had_delivered(
        tmp_path, monkeypatch, unused_port):
    async with trio.open_nursery() as nursery:
        master = await start(nursery, cfg(tmp_path, "m"))
        async with AsyncProducer(f"127.0.0.1:{master.port}") as prod:
            await prod.send_many([Message("ship.q", f"old{i}".encode(), delay=0) for i in range(40)])
        await wait_until(lambda: len(spooled_ids(master, "ship.q")) == 40 and len(dispatches(master)) == 40)
        assert all(d.message_log_offset >= 0 for d in dispatches(master))  # each names its message
        # A slave whose own pulling goes nowhere: this test pulls for it, message_log one record at
        # a time (as a slave far behind pulls a bounded chunk per round), dispatch_log whole.
        slave = await start(nursery, cfg(tmp_path, "s", replicate_from=f"127.0.0.1:{unused_port}"))
        monkeypatch.setattr(slave_module, "MAX_SYNC_BYTES", 1)
        async with AsyncProducer(f"127.0.0.1:{master.port}") as conn:
            for _ in range(5):
                await slave.slave._pull_message_log(conn)
            await wait_until(lambda: slave.replayer.offset == slave.store.message_log.end_offset)
            await slave.slave._pull_dispatch_log(conn)
        (bucket,) = slave.store.schedule_log.buckets()
        held = slave.store.schedule_log.size(bucket)
        applied = dispatches(slave)
        assert len(applied) == 5
        assert all(d.schedule_offset < held for d in applied)
        assert slave.slave.dispatch_held_back > 0
        nursery.cancel_scope.cancel()  # the master is lost with the 35 the slave never got
    async with trio.open_nursery() as nursery:
        promoted = await start(nursery, cfg(tmp_path, "s"))
        async with AsyncProducer(f"127.0.0.1:{promoted.port}") as prod:
            new = await prod.send_many([Message("ship.q", f"new{i}".encode(), delay=1500) for i in range(10)])
            # Before it is due, each is pending, and a cancel wins (not "already delivered").
            for h in new:
                assert (await prod.status(h)).state.name == "PENDING"
            assert (await prod.cancel(new[0])).name == "CANCELLED"
        await wait_until(lambda: len(spooled_ids(promoted, "ship.q")) == 9)
        await trio.sleep(0.3)
        nursery.cancel_scope.cancel()
    assert sorted(spooled_ids(promoted, "ship.q")) == sorted(h.message_id for h in new[1:])


T = 1_795_449_600_000


def scheduled(message_log_offset: int, message_id: str) -> bytes:
    payload = encode_message(RecordMessage(message_id, "s.q", b"x", T))
    return encode_record(RecordType.SCHEDULED, encode_scheduled(message_log_offset, payload))


def dispatch(schedule_offset: int, message_log_offset: int = -1) -> bytes:
    return encode_record(RecordType.DISPATCH, encode_dispatch(Dispatch(schedule_offset, T, "g", message_log_offset)))


def test_dispatch_records_apply_up_to_the_first_message_not_held_or_not_the_same(tmp_path):
    store = Store.open(tmp_path, segment_scale_ms=3_600_000)
    bucket = T - T % 3_600_000
    first, second = scheduled(0, "a"), scheduled(100, "b")
    store.schedule_log.append(bucket, first + second)
    slave = Slave(store, None, None, "s1")
    held = [dispatch(0, 0), dispatch(len(first), 100)]
    # Held, named right: all applied; the old format (no message_log offset) by its offset alone.
    assert slave._applicable(bucket, b"".join(held), 0) == len(b"".join(held))
    assert slave._applicable(bucket, dispatch(0), 0) == len(dispatch(0))
    # Not replayed here yet: applied up to it, the rest next round.
    later = dispatch(len(first + second), 200)
    assert slave._applicable(bucket, held[0] + later + held[1], 0) == len(held[0])
    # Another message at that offset (forked histories), or no record starting there: not applied.
    assert slave._applicable(bucket, held[0] + dispatch(len(first), 999), 0) == len(held[0])
    assert bucket in slave._forked
    assert Slave(store, None, None, "s1")._applicable(bucket, dispatch(3, 0), 0) == 0
    store.close()
