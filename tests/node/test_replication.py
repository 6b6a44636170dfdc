"""Master/slave replication over real sockets: the slave's copy, fencing of writes, promotion."""
from __future__ import annotations

import pytest
import trio

from delayserver.client import AsyncProducer, Message
from delayserver.config import Config
from delayserver.message import DelayServerError, MessageState, ResultCode
from delayserver.node.divergence import list_diverged
from delayserver.node.server import DelayServer
from delayserver.sender.spool import iter_spool
from delayserver.storage.store import bucket_stats


def cfg(tmp_path, name, **kw) -> Config:
    return Config.from_dict({"data_dir": str(tmp_path / name), "listen": "127.0.0.1:0", **kw})


async def wait_until(predicate, timeout_s: float = 10) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():
            await trio.sleep(0.02)


def stats(server):
    s = server.store
    return {b: bucket_stats(s.schedule_log, s.dispatch_log, b) for b in s.schedule_log.buckets()}


def spooled_ids(server, subject):
    return [m.message_id for _, _, _, m in iter_spool(server.config.data_dir, subject)]


async def test_the_slave_holds_the_masters_logs_and_neither_takes_writes_nor_delivers(tmp_path, nursery):
    master = DelayServer(cfg(tmp_path, "m"))
    await nursery.start(master.serve)
    slave = DelayServer(cfg(tmp_path, "s", replicate_from=f"127.0.0.1:{master.port}"))
    await nursery.start(slave.serve)
    async with AsyncProducer(f"127.0.0.1:{master.port}") as prod:
        now_ids = await prod.send_many([Message("r.q", f"now{i}".encode(), delay=0) for i in range(50)])
        later = await prod.send_many([Message("r.q", b"later", delay=3_600_000) for _ in range(50)])
        cancelled = later[0]
        await prod.cancel(cancelled)
    await wait_until(lambda: len(spooled_ids(master, "r.q")) == 50)
    end = master.store.message_log.end_offset
    await wait_until(lambda: slave.store.message_log.end_offset == end and slave.replayer.offset == end)
    assert list(slave.store.message_log.iter_from(0)) == list(master.store.message_log.iter_from(0))
    await wait_until(lambda: stats(slave) == stats(master))
    assert sum(s.dispatched for s in stats(slave).values()) == 50
    assert sum(s.cancelled for s in stats(slave).values()) == 1
    assert spooled_ids(slave, "r.q") == []  # only the master delivers
    async with AsyncProducer(f"127.0.0.1:{slave.port}") as prod:
        with pytest.raises(DelayServerError) as err:
            await prod.send("r.q", b"x", delay=0)
        assert err.value.code == ResultCode.NOT_MASTER
        assert (await prod.status(later[1])).state == MessageState.PENDING
        assert (await prod.status(now_ids[0])).state == MessageState.DELIVERED


async def test_a_promoted_slave_delivers_what_is_due_and_skips_what_the_master_delivered(tmp_path):
    async with trio.open_nursery() as nursery:
        master = DelayServer(cfg(tmp_path, "m"))
        await nursery.start(master.serve)
        slave = DelayServer(cfg(tmp_path, "s", replicate_from=f"127.0.0.1:{master.port}"))
        await nursery.start(slave.serve)
        async with AsyncProducer(f"127.0.0.1:{master.port}") as prod:
            early = await prod.send_many([Message("p.q", b"early", delay=0) for _ in range(30)])
            late = await prod.send_many([Message("p.q", b"late", delay=1500) for _ in range(30)])
        await wait_until(lambda: len(spooled_ids(master, "p.q")) == 30)
        await wait_until(lambda: sum(s.dispatched for s in stats(slave).values()) == 30
                         and slave.store.message_log.end_offset == master.store.message_log.end_offset)
        nursery.cancel_scope.cancel()  # the master is lost before the late ones come due
    promoted = DelayServer(cfg(tmp_path, "s"))
    async with trio.open_nursery() as nursery:
        await nursery.start(promoted.serve)
        await wait_until(lambda: len(spooled_ids(promoted, "p.q")) >= 30)
        await trio.sleep(0.3)
        assert sorted(spooled_ids(promoted, "p.q")) == sorted(h.message_id for h in late)
        async with AsyncProducer(f"127.0.0.1:{promoted.port}") as prod:
            h = await prod.send("p.q", b"after", delay=0)
        assert h.message_id
        nursery.cancel_scope.cancel()
    assert not set(spooled_ids(promoted, "p.q")) & {h.message_id for h in early}


async def test_a_slave_holding_records_its_master_never_had_quarantines_them_and_goes_on(tmp_path, nursery):
    rogue = DelayServer(cfg(tmp_path, "s"))
    async with trio.open_nursery() as inner:
        await inner.start(rogue.serve)
        async with AsyncProducer(f"127.0.0.1:{rogue.port}") as prod:
            only_here = await prod.send("x.q", b"only here", delay=3_600_000)
        await wait_until(lambda: rogue.replayer.offset == rogue.store.message_log.end_offset)
        inner.cancel_scope.cancel()
    master = DelayServer(cfg(tmp_path, "m"))
    await nursery.start(master.serve)
    slave = DelayServer(cfg(tmp_path, "s", replicate_from=f"127.0.0.1:{master.port}"))
    await nursery.start(slave.serve)
    await wait_until(lambda: slave.slave.realign.truncations == 1)
    [diverged] = list_diverged(tmp_path / "s")
    assert [m["message_id"] for m in diverged["messages"]] == [only_here.message_id]
    async with AsyncProducer(f"127.0.0.1:{master.port}") as prod:
        kept = await prod.send("x.q", b"from the master", delay=3_600_000)
    end = master.store.message_log.end_offset
    await wait_until(lambda: slave.store.message_log.end_offset == end and slave.replayer.offset == end)
    assert list(slave.store.message_log.iter_from(0)) == list(master.store.message_log.iter_from(0))
    assert not slave.slave.stopped_reason
    # What was replayed from the cut part is gone from the schedule too: only the master's message.
    await wait_until(lambda: stats(slave) == stats(master))
    async with AsyncProducer(f"127.0.0.1:{slave.port}") as prod:
        assert (await prod.status(kept)).state == MessageState.PENDING
