"""The master's record of its slaves: durable across its restart, only registered ids pin the
cleaner, a slave past max_slave_lag stops pinning, and only cluster nodes may replicate."""
from __future__ import annotations

import pytest
import trio

from delayserver import protocol as p
from delayserver.client import AsyncProducer, Message
from delayserver.message import DelayServerError, ResultCode
from delayserver.node.replication import Registry, SlaveStates, slave as slave_module, wire
from delayserver.node.server import DelayServer
from delayserver.storage.message_log import MessageLog

from tests.damage import message_record
from tests.node.replication.helpers import cfg, start, wait_until

HOUR = 3_600_000


def test_slave_offsets_are_read_back_after_a_restart(tmp_path):
    states = SlaveStates(tmp_path)
    assert states.pulled_message_log("s1", 4096, 5000)
    states.pulled_dispatch_log("s1", {1_800_000: 90, 3_600_000: 0})
    states.save()
    again = SlaveStates(tmp_path)
    [s1] = again.pinning(5000)
    assert (s1.node_id, s1.message_log_offset, s1.dispatch_sizes) == ("s1", 4096, {1_800_000: 90, 3_600_000: 0})


def test_a_new_slave_is_written_down_at_once(tmp_path):
    SlaveStates(tmp_path).pulled_message_log("s1", 10, 10)
    assert [s.node_id for s in SlaveStates(tmp_path).pinning(10)] == ["s1"]


def test_only_registered_node_ids_pin_the_cleaner(tmp_path):
    states = SlaveStates(tmp_path, registry=Registry({"s1"}))
    assert not states.pulled_message_log("made-up", 0, 10_000)
    states.pulled_dispatch_log("made-up", {0: 0})
    assert states.pulled_message_log("s1", 9_000, 10_000)
    assert [s.message_log_offset for s in states.pinning(10_000)] == [9_000]
    assert "made-up" not in states.states
    states.registry.ids = set()  # s1 left the group at the meta server
    assert states.pinning(10_000) == []


def test_a_slave_past_max_slave_lag_stops_pinning_until_it_is_back(tmp_path):
    states = SlaveStates(tmp_path, max_lag_bytes=1000)
    states.pulled_message_log("s1", 500, 1000)
    assert [s.node_id for s in states.pinning(1500)] == ["s1"]
    assert states.pinning(1501) == []  # it stopped pulling while the log ran on
    states.pulled_message_log("s1", 1400, 1501)
    assert [s.node_id for s in states.pinning(1501)] == ["s1"]


async def test_the_cleaner_keeps_what_a_slave_lacks_across_a_master_restart(tmp_path, monkeypatch, unused_port):
    master_config = cfg(tmp_path, "m", message_log_segment_bytes=4096, retention_ms=0, cleaner_interval_ms="1h",
                        checkpoint_interval_ms=10)
    async with trio.open_nursery() as nursery:
        master = await start(nursery, master_config)
        async with AsyncProducer(f"127.0.0.1:{master.port}") as prod:
            for _ in range(40):  # a segment rolls between appends
                await prod.send_many([Message("keep.q", b"x" * 64, delay=HOUR) for _ in range(10)])
        assert len(master.store.message_log.segments) > 5
        slave = await start(nursery, cfg(tmp_path, "s", replicate_from=f"127.0.0.1:{unused_port}", node_id="s1"))
        monkeypatch.setattr(slave_module, "MAX_SYNC_BYTES", 1)
        async with AsyncProducer(f"127.0.0.1:{master.port}") as conn:
            for _ in range(3):
                await slave.slave._pull_message_log(conn)
        needed = slave.store.message_log.end_offset
        nursery.cancel_scope.cancel()  # the master stops before any cleaner pass
    async with trio.open_nursery() as nursery:
        master = await start(nursery, master_config)
        end = master.store.message_log.end_offset
        await wait_until(lambda: master.replayer.checkpointed_offset == end)
        await master.clean_once()
        assert master.store.message_log.start_offset <= needed
        # The slave goes on from where it was, then the cleaner may go further.
        async with AsyncProducer(f"127.0.0.1:{master.port}") as conn:
            request = wire.MessageLogRequest(end, 0, 0, "s1")
            await conn.request(p.Command.SYNC_MESSAGE_LOG, wire.encode_message_log_request(request))
        await master.clean_once()
        assert master.store.message_log.start_offset > needed
        nursery.cancel_scope.cancel()


async def test_with_a_cluster_secret_only_cluster_nodes_replicate(tmp_path, nursery):
    master = await start(nursery, cfg(tmp_path, "m", auth_secret="producers", cluster_secret="cluster"))
    request = wire.encode_message_log_request(wire.MessageLogRequest(0, 1 << 20, 0, "intruder"))
    async with AsyncProducer(f"127.0.0.1:{master.port}", secret="producers") as prod:
        await prod.send("c.q", b"x", delay=HOUR)
        with pytest.raises(DelayServerError) as err:
            await prod.request(p.Command.SYNC_MESSAGE_LOG, request)
        assert err.value.code == ResultCode.UNAUTHORIZED
    assert master.master.slaves.states == {}
    slave = await start(nursery, cfg(tmp_path, "s", replicate_from=f"127.0.0.1:{master.port}",
                                     cluster_secret="cluster", node_id="s1"))
    await wait_until(lambda: slave.store.message_log.end_offset == master.store.message_log.end_offset)
    assert list(master.master.slaves.states) == ["s1"]


async def test_a_slave_behind_the_masters_retention_takes_a_snapshot_instead_of_looping(tmp_path, nursery):
    master = await start(nursery, cfg(tmp_path, "m", message_log_segment_bytes=4096, retention_ms=0,
                                      cleaner_interval_ms="1h", checkpoint_interval_ms=10))
    async with AsyncProducer(f"127.0.0.1:{master.port}") as prod:
        for _ in range(20):
            await prod.send_many([Message("gone.q", b"x" * 64, delay=HOUR) for _ in range(10)])
    end = master.store.message_log.end_offset
    await wait_until(lambda: master.replayer.checkpointed_offset == end)
    await master.clean_once()
    assert master.store.message_log.start_offset > 0
    async with trio.open_nursery() as slave_nursery:
        slave = await start(slave_nursery, cfg(tmp_path, "s", replicate_from=f"127.0.0.1:{master.port}"))
        await wait_until(lambda: slave.restart_requested)
    assert slave.slave.stopped_reason == "restarting to install a snapshot of the master"
    assert (tmp_path / "s" / "snapshot" / "manifest.json").is_file()
    assert slave.store.message_log.end_offset == 0


async def test_a_slave_past_max_slave_lag_is_told_to_resync_and_does_from_a_snapshot(tmp_path, nursery):
    master = await start(nursery, cfg(tmp_path, "m", max_slave_lag=2000, checkpoint_interval_ms=10))
    async with AsyncProducer(f"127.0.0.1:{master.port}") as prod:
        handles = await prod.send_many([Message("lag.q", b"x" * 64, delay=HOUR) for _ in range(100)])
    slave_config = cfg(tmp_path, "s", replicate_from=f"127.0.0.1:{master.port}", node_id="s1")
    async with trio.open_nursery() as slave_nursery:
        slave = await start(slave_nursery, slave_config)
        await wait_until(lambda: slave.restart_requested)  # it stops itself to install the snapshot
    assert slave.store.message_log.end_offset == 0  # it never pulled the log it was too far behind on
    assert (tmp_path / "s" / "snapshot").is_dir()
    slave = await start(nursery, slave_config)
    assert not (tmp_path / "s" / "snapshot").exists()
    async with AsyncProducer(f"127.0.0.1:{master.port}") as prod:
        handles += await prod.send_many([Message("lag.q", b"after", delay=HOUR) for _ in range(5)])
    await wait_until(lambda: slave.store.message_log.end_offset == master.store.message_log.end_offset)
    assert slave.store.message_log.start_offset > 0
    await wait_until(lambda: master.master.slaves.states["s1"].message_log_offset == slave.store.message_log.end_offset)
    assert master.master.slaves.states["s1"].pinning
    async with AsyncProducer(f"127.0.0.1:{slave.port}") as prod:
        assert {(await prod.status(h)).state.name for h in handles} == {"PENDING"}


async def test_a_slave_is_in_sync_only_once_the_pulled_bytes_are_stored_here(tmp_path, nursery, monkeypatch):
    """A pull that brings the master's whole log leaves the slave in sync (ready, lag 0) only once
    those bytes are appended and synced here: not while they are still being written (the HTTP
    API's /readyz said ready with 0 bytes pulled)."""
    master = await start(nursery, cfg(tmp_path, "m"))
    async with AsyncProducer(f"127.0.0.1:{master.port}") as producer:
        await producer.send("r.x", b"x", delay=HOUR)
    slave_dir = tmp_path / "s"
    entered, release = trio.Event(), trio.Event()
    token = trio.lowlevel.current_trio_token()
    original = MessageLog.sync

    def held_sync(self):  # the slave's first sync of pulled bytes waits until the test lets it go
        if self.directory.is_relative_to(slave_dir) and self.end_offset and not release.is_set():
            trio.from_thread.run_sync(entered.set, trio_token=token)
            trio.from_thread.run(release.wait, trio_token=token)
        return original(self)

    monkeypatch.setattr(MessageLog, "sync", held_sync)
    slave = DelayServer(cfg(tmp_path, "s", replicate_from=f"127.0.0.1:{master.port}"))
    nursery.start_soon(slave.serve)  # its start waits for its first pull, held below
    try:
        with trio.fail_after(30):
            await entered.wait()
        seen = (slave.slave.pulled, slave.slave.in_sync)  # the pull held in its sync
    finally:
        release.set()
    assert seen == (0, False), "in sync before the pulled bytes were stored"
    await wait_until(lambda: slave.slave.in_sync)
    assert slave.slave.pulled == master.store.message_log.end_offset and slave.slave.lag_bytes == 0


async def test_a_pull_counts_durable_only_what_it_appended_and_synced(tmp_path, nursery, monkeypatch):
    """A node promoted while its last pull is in its fsync may append its first batch as master
    before the pull finishes: the pull then counts durable up to what it appended and synced
    itself, never the log's end (that batch waits for its own fsync)."""
    master = await start(nursery, cfg(tmp_path, "m"))
    async with AsyncProducer(f"127.0.0.1:{master.port}") as producer:
        await producer.send("r.x", b"x", delay=HOUR)
    slave_dir = tmp_path / "s"
    token = trio.lowlevel.current_trio_token()
    original = MessageLog.sync
    written_meanwhile = []

    def sync_while_appended_to(self):  # the first sync of pulled bytes: the log grows meanwhile
        if self.directory.is_relative_to(slave_dir) and self.end_offset and not written_meanwhile:
            record = message_record(7)
            trio.from_thread.run_sync(lambda: written_meanwhile.append(self.append(record)), trio_token=token)
        return original(self)

    monkeypatch.setattr(MessageLog, "sync", sync_while_appended_to)
    slave = DelayServer(cfg(tmp_path, "s", replicate_from=f"127.0.0.1:{master.port}"))
    nursery.start_soon(slave.serve)
    pulled_end = master.store.message_log.end_offset
    await wait_until(lambda: hasattr(slave, "receiver") and slave.receiver.durable_offset >= pulled_end)
    assert written_meanwhile == [pulled_end]  # appended right after the pulled bytes
    assert slave.receiver.durable_offset == pulled_end < slave.store.message_log.end_offset
