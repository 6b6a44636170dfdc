"""Membership of a delay group through a real meta server (in-process, real sockets): the node's
role follows the meta server's word and its sender takes the meta server's broker groups, or its
own configured ones when the meta server lists none."""
from __future__ import annotations

import functools

import pytest
import trio

from delayserver.client import AsyncProducer
from delayserver.clock import WallClock
from delayserver.config import Config
from delayserver.message import DelayServerError, ResultCode
from delayserver.meta.client import MetaClient
from delayserver.meta.server import serve_meta
from delayserver.meta.store import SqliteMetaStore
from delayserver.node.role import RoleState
from delayserver.node.server import DelayServer
from delayserver.sender.spool import iter_spool


@pytest.fixture
async def meta(tmp_path, nursery):
    store = SqliteMetaStore.open(tmp_path / "meta.sqlite3")
    port = await nursery.start(functools.partial(serve_meta, store, "127.0.0.1", 0, clock=WallClock(),
                                                 heartbeat_interval_ms=300))
    yield f"127.0.0.1:{port}"
    store.close()


async def start_node(nursery, tmp_path, meta, name: str) -> DelayServer:
    config = Config.from_dict({"data_dir": str(tmp_path / name), "listen": "127.0.0.1:0", "meta": meta,
                               "group": "g1", "node_id": name, "send_wait_ms": 1,
                               "broker_group": [{"name": "local-spool"}]})
    server = DelayServer(config)
    await nursery.start(server.serve)
    return server


async def wait_until(predicate, timeout_s: float = 20) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():
            await trio.sleep(0.02)


async def test_a_node_delivers_through_the_meta_servers_broker_groups(tmp_path, nursery, meta):
    async with MetaClient(meta) as c:
        await c.request("add_broker_group", name="meta-spool", transport="spool", address="spool")
    server = await start_node(nursery, tmp_path, meta, "a")
    await wait_until(lambda: server.role.state is RoleState.MASTER and server.role.may_deliver())
    assert set(server.sender.groups) == {"meta-spool"}
    async with AsyncProducer(f"127.0.0.1:{server.port}") as producer:
        await producer.send("orders.q", b"through meta", delay=0)
    await wait_until(lambda: server.sender.delivered == 1)
    assert [m.body for *_, m in iter_spool(tmp_path / "a", "orders.q")] == [b"through meta"]


async def test_without_broker_groups_from_meta_a_node_keeps_its_own(tmp_path, nursery, meta):
    server = await start_node(nursery, tmp_path, meta, "a")
    await wait_until(lambda: server.role.is_master())
    assert set(server.sender.groups) == {"local-spool"}


async def test_the_second_node_of_a_group_is_a_slave_that_refuses_writes(tmp_path, nursery, meta):
    master = await start_node(nursery, tmp_path, meta, "a")
    await wait_until(lambda: master.role.is_master())
    slave = await start_node(nursery, tmp_path, meta, "b")
    await wait_until(lambda: slave.role.is_slave() and slave.role.master_address() is not None)
    assert slave.role.master_address() == f"127.0.0.1:{master.port}"
    async with AsyncProducer(f"127.0.0.1:{slave.port}") as producer:
        with pytest.raises(DelayServerError) as info:
            await producer.send("orders.q", b"x", delay=0)
    assert info.value.code == ResultCode.NOT_MASTER
