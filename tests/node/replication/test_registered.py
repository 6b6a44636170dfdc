"""With a meta server, only the group's registered nodes count as slaves: they pin the cleaner and
acknowledge sync writes; an id the meta server does not list does neither (real meta server and
nodes in-process, real sockets)."""
from __future__ import annotations

import functools

import pytest

from delayserver import protocol as p
from delayserver.client import AsyncProducer
from delayserver.clock import WallClock
from delayserver.meta.server import serve_meta
from delayserver.meta.store import SqliteMetaStore
from delayserver.node.replication import wire
from delayserver.node.role import RoleState

from tests.node.replication.helpers import cfg, start, wait_until

HOUR = 3_600_000


@pytest.fixture
async def meta(tmp_path, nursery):
    store = SqliteMetaStore.open(tmp_path / "meta.sqlite3")
    port = await nursery.start(functools.partial(serve_meta, store, "127.0.0.1", 0, clock=WallClock(),
                                                 heartbeat_interval_ms=300))
    yield f"127.0.0.1:{port}"
    store.close()


def node(tmp_path, meta, name):
    return cfg(tmp_path, name, meta=meta, group="g1", node_id=name, replication="sync", sync_timeout_ms="30s")


async def test_only_the_groups_registered_nodes_count_as_slaves(tmp_path, nursery, meta):
    master = await start(nursery, node(tmp_path, meta, "n1"))
    await wait_until(lambda: master.role.state is RoleState.MASTER)
    # A client with a made-up id pulls: it is answered, but neither pins nor acknowledges.
    async with AsyncProducer(f"127.0.0.1:{master.port}") as conn:
        request = wire.MessageLogRequest(0, 1 << 20, 0, "made-up")
        await conn.request(p.Command.SYNC_MESSAGE_LOG, wire.encode_message_log_request(request))
    assert master.master.slaves.states == {} and master.master.insync.closed
    slave = await start(nursery, node(tmp_path, meta, "n2"))
    await wait_until(lambda: slave.role.state is RoleState.SLAVE)
    await wait_until(lambda: not master.master.insync.closed)
    assert set(master.master.slaves.states) == {"n2"}
    async with AsyncProducer(f"127.0.0.1:{master.port}") as prod:
        await prod.send("reg.q", b"acknowledged by n2", delay=HOUR)
    assert slave.receiver.durable_offset == master.receiver.durable_offset
