"""replication = "sync" over real sockets: an acknowledgement means the slave has fsynced the record;
no in-sync slave means NOT_ENOUGH_REPLICAS, and nothing further is stored until one catches up."""
from __future__ import annotations

import pytest
import trio

from delayserver.client import AsyncProducer, Message
from delayserver.message import DelayServerError, ResultCode

from tests.node.replication.helpers import cfg, start, wait_until

HOUR = 3_600_000


async def test_every_acknowledgement_waits_for_the_slave_to_fsync_the_record(tmp_path, nursery):
    master = await start(nursery, cfg(tmp_path, "m", replication="sync", sync_timeout_ms="60s"))
    slave = await start(nursery, cfg(tmp_path, "s", replicate_from=f"127.0.0.1:{master.port}"))
    await wait_until(lambda: not master.master.insync.closed)
    async with AsyncProducer(f"127.0.0.1:{master.port}") as prod:
        handles = []
        for i in range(20):
            handles.append(await prod.send("sync.q", f"m{i}".encode(), delay=HOUR))
            # Acknowledged: the slave holds it fsynced (its durable offset moves only after fsync).
            assert slave.receiver.durable_offset == master.receiver.durable_offset
        batch = await prod.send_many([Message("sync.q", b"batch", delay=HOUR) for _ in range(50)])
        assert all(not isinstance(h, Exception) for h in batch)
        assert slave.receiver.durable_offset == master.receiver.durable_offset
        await prod.cancel(handles[0])
        assert slave.receiver.durable_offset == master.receiver.durable_offset
    assert master.master.insync.timeouts == 0


async def test_a_master_without_an_in_sync_slave_refuses_and_stores_nothing(tmp_path, nursery):
    master = await start(nursery, cfg(tmp_path, "m", replication="sync", sync_timeout_ms="60s"))
    async with AsyncProducer(f"127.0.0.1:{master.port}") as prod:
        with pytest.raises(DelayServerError) as err:
            await prod.send("sync.q", b"x", delay=HOUR)
    assert err.value.code == ResultCode.NOT_ENOUGH_REPLICAS
    assert master.store.message_log.end_offset == 0


async def test_a_lost_slave_times_out_writes_until_it_catches_up_again(tmp_path, nursery):
    master = await start(nursery, cfg(tmp_path, "m", replication="sync", sync_timeout_ms="300ms"))
    slave_config = cfg(tmp_path, "s", replicate_from=f"127.0.0.1:{master.port}")
    async with trio.open_nursery() as slave_nursery:
        await start(slave_nursery, slave_config)
        await wait_until(lambda: not master.master.insync.closed)
        async with AsyncProducer(f"127.0.0.1:{master.port}") as prod:
            kept = await prod.send("sync.q", b"replicated", delay=HOUR)
        slave_nursery.cancel_scope.cancel()
    async with AsyncProducer(f"127.0.0.1:{master.port}") as prod:
        with pytest.raises(DelayServerError) as err:
            await prod.send("sync.q", b"not replicated", delay=HOUR)
        assert err.value.code == ResultCode.NOT_ENOUGH_REPLICAS
        assert "sync_timeout_ms" in str(err.value)
        end = master.store.message_log.end_offset
        # The gate is closed: nothing further is stored, cancels included.
        with pytest.raises(DelayServerError) as err:
            await prod.send("sync.q", b"refused", delay=HOUR)
        assert err.value.code == ResultCode.NOT_ENOUGH_REPLICAS
        with pytest.raises(DelayServerError) as err:
            await prod.cancel(kept)
        assert err.value.code == ResultCode.NOT_ENOUGH_REPLICAS
        assert master.store.message_log.end_offset == end
        assert master.master.insync.timeouts == 1
        slave = await start(nursery, slave_config)
        await wait_until(lambda: not master.master.insync.closed)
        assert slave.receiver.durable_offset >= end
        await prod.send("sync.q", b"accepted again", delay=HOUR)
        assert (await prod.cancel(kept)).name == "CANCELLED"
    assert slave.receiver.durable_offset == master.receiver.durable_offset


async def test_min_insync_replicas_counts_slaves(tmp_path, nursery):
    master = await start(nursery, cfg(tmp_path, "m", replication="sync", sync_timeout_ms="300ms",
                                      min_insync_replicas=2))
    await start(nursery, cfg(tmp_path, "s1", replicate_from=f"127.0.0.1:{master.port}", node_id="s1"))
    await wait_until(lambda: master.master.insync.in_sync(0) == 1)
    async with AsyncProducer(f"127.0.0.1:{master.port}") as prod:
        with pytest.raises(DelayServerError) as err:
            await prod.send("sync.q", b"one slave is not enough", delay=HOUR)
        assert err.value.code == ResultCode.NOT_ENOUGH_REPLICAS
        await start(nursery, cfg(tmp_path, "s2", replicate_from=f"127.0.0.1:{master.port}", node_id="s2"))
        await wait_until(lambda: not master.master.insync.closed)
        await prod.send("sync.q", b"two are", delay=HOUR)


async def test_the_http_api_shows_the_sync_state(tmp_path, nursery):
    import httpx

    master = await start(nursery, cfg(tmp_path, "m", replication="sync", http_listen="127.0.0.1:0"))
    await start(nursery, cfg(tmp_path, "s", replicate_from=f"127.0.0.1:{master.port}", node_id="s1"))
    await wait_until(lambda: not master.master.insync.closed)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{master.http_port}", timeout=30) as api:
        replication = (await api.get("/v1/node")).json()["replication"]
    assert replication["mode"] == "sync"
    assert replication["sync"] == {"accepting_writes": True, "in_sync_slaves": 1, "min_insync_replicas": 1,
                                   "timeouts": 0}
    assert [(s["node_id"], s["pinning"]) for s in replication["slaves"]] == [("s1", True)]


async def test_an_acknowledgement_from_a_slave_long_silent_does_not_count(autojump_clock):
    from delayserver.node.replication import InSync

    insync = InSync(min_insync_replicas=1, timeout_s=1.0, durable_end=lambda: 100)
    insync.acknowledged("s1", 100)
    assert not insync.closed and insync.in_sync(100) == 1
    await trio.sleep(12)  # past a long poll and the timeout: s1 is gone, or this node was demoted meanwhile
    assert insync.in_sync(100) == 0
    assert not await insync.replicated(100)
    assert insync.closed and insync.timeouts == 1
    insync.acknowledged("s1", 100)
    assert not insync.closed
