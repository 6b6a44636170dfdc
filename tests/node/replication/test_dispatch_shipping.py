"""dispatch_log shipping cannot mark the wrong message delivered: a slave whose message_log copy
lags behind its dispatch_log pull applies only the records of messages it holds, so once promoted
its new messages, which take the schedule offsets the master's lost ones had, are delivered."""
from __future__ import annotations

import trio

from delayserver.client import AsyncProducer, Message
from delayserver.node.replication import slave as slave_module
from delayserver.storage.record import RecordType, decode_dispatch

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
    promoted = None
    async with trio.open_nursery() as nursery:
        promoted = await start(nursery, cfg(tmp_path, "s"))
        async with AsyncProducer(f"127.0.0.1:{promoted.port}") as prod:
            new = await prod.send_many([Message("ship.q", f"new{i}".encode(), delay=0) for i in range(10)])
        await wait_until(lambda: len(spooled_ids(promoted, "ship.q")) == 10)
        for h in new:
            assert (await _status(promoted, h)).name == "DELIVERED"
        nursery.cancel_scope.cancel()
    assert sorted(spooled_ids(promoted, "ship.q")) == sorted(h.message_id for h in new)


async def _status(server, handle):
    async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
        return (await prod.status(handle)).state
