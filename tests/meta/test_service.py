"""MetaService rules that protect leases across meta servers and store outages (SQLite store,
trio's MockClock; the outage is a store whose calls are made to fail)."""
from __future__ import annotations

import attrs
import pytest
import trio

from delayserver.clock import TrioClock
from delayserver.message import ResultCode
from delayserver.meta.service import MetaService
from delayserver.meta.store import DelayGroup, Node, NodeState, Role, SqliteMetaStore, StoreUnavailable

INTERVAL_MS = 1000
LEASE_MS = 3 * INTERVAL_MS
EPOCH_MS = 1_700_000_000_000


async def inline(fn, *args):
    return fn(*args)


class FlakyStore:
    """A store whose every call raises StoreUnavailable while `down` is set."""

    def __init__(self, store):
        self.store = store
        self.down = False

    def __getattr__(self, name):
        attr = getattr(self.store, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            if self.down:
                raise StoreUnavailable("the database is down (test)")
            return attr(*args, **kwargs)

        return call


@pytest.fixture
def store(tmp_path):
    store = SqliteMetaStore.open(tmp_path / "meta.sqlite3")
    yield store
    store.close()


def service(store) -> MetaService:
    return MetaService(store, TrioClock(EPOCH_MS), INTERVAL_MS, 3, run_blocking=inline)


async def test_no_promotion_while_the_lease_in_the_group_row_runs(store, autojump_clock):
    # As another meta server might have left it: the master marked down, its lease still running.
    now = EPOCH_MS
    a = Node("g", "a", "h:1", Role.MASTER, NodeState.DOWN, now - 100, 1, True, "sa")
    store.save_group(DelayGroup("g", master_epoch=1, lease_expires_ms=now + 2000), [a])
    meta = service(store)
    await meta.start()
    reply = await meta.handle({"op": "register", "group": "g", "node_id": "b", "address": "h:2"})
    assert reply["code"] == ResultCode.BUSY and "no promotion before it ends" in reply["message"]
    assert store.load_group("g")[0].master_epoch == 1 and [e for e, _, _ in store.list_epochs("g")] == [1]
    await trio.sleep(2.001)
    reply = await meta.handle({"op": "register", "group": "g", "node_id": "b", "address": "h:2"})
    assert (reply["code"], reply["role"], reply["epoch"]) == (ResultCode.OK, "master", 2)


async def test_the_reaper_meets_the_same_refusal_and_goes_on(store, autojump_clock, caplog):
    now = EPOCH_MS
    a = Node("g", "a", "h:1", Role.MASTER, NodeState.DOWN, now - 100, 1, True, "sa")
    b = Node("g", "b", "h:2", Role.SLAVE, NodeState.UP, now + 3500, 1, True, "sb")  # a writer's clock ahead
    store.save_group(DelayGroup("g", master_epoch=1, lease_expires_ms=now + 10_000), [a, b])
    meta = service(store)
    await meta.start()
    await trio.sleep(3.1)
    await meta.reap()
    assert "no promotion before it ends" in caplog.text
    assert store.load_group("g")[0].master_epoch == 1
    await trio.sleep(7)
    await meta.handle({"op": "heartbeat", "group": "g", "node_id": "b", "session": "sb"})
    assert [(e, n) for e, n, _ in store.list_epochs("g")] == [(1, "a"), (2, "b")]


async def test_after_a_store_outage_no_node_is_marked_down_for_a_lease(store, autojump_clock):
    flaky = FlakyStore(store)
    meta = service(flaky)
    await meta.start()
    a = await meta.handle({"op": "register", "group": "g", "node_id": "a", "address": "h:1"})
    b = await meta.handle({"op": "register", "group": "g", "node_id": "b", "address": "h:2"})
    flaky.down = True
    for _ in range(10):  # the database is away for 10 s: nobody can heartbeat
        await trio.sleep(1)
        with pytest.raises(StoreUnavailable):
            await meta.reap()
        reply = await meta.handle({"op": "heartbeat", "group": "g", "node_id": "a", "session": a["session"]})
        assert reply["code"] == ResultCode.UNAVAILABLE
    flaky.down = False
    await meta.reap()
    # Back: both nodes have a lease to heartbeat before anything is decided; the master keeps its role.
    await trio.sleep(LEASE_MS / 2000)
    await meta.reap()
    for node, session in (("b", b["session"]), ("a", a["session"])):  # the slave first
        reply = await meta.handle({"op": "heartbeat", "group": "g", "node_id": node, "session": session})
        assert reply["code"] == ResultCode.OK
    await trio.sleep(LEASE_MS / 2000 + 1)
    await meta.reap()
    group, nodes = store.load_group("g")
    assert group.master_epoch == 1
    assert [(n.node_id, n.role, n.state) for n in nodes] == [("a", Role.MASTER, NodeState.UP),
                                                              ("b", Role.SLAVE, NodeState.UP)]
    # Without the grace the same outage promotes b: a silent master is still replaced in time.
    for _ in range(4):
        await trio.sleep(1)
        await meta.handle({"op": "heartbeat", "group": "g", "node_id": "b", "session": b["session"]})
        await meta.reap()
    assert [(e, n) for e, n, _ in store.list_epochs("g")] == [(1, "a"), (2, "b")]


async def test_a_conflicting_write_is_decided_again_from_a_fresh_read(store, autojump_clock):
    meta = service(store)
    await meta.start()
    a = await meta.handle({"op": "register", "group": "g", "node_id": "a", "address": "h:1"})
    real_load = store.load_group
    interleaved = []

    def load_then_race(name):
        group, nodes = real_load(name)
        if not interleaved:  # another meta server writes between this read and its write
            interleaved.append(store.save_group(attrs.evolve(group, read_only=True), []))
        return group, nodes

    store.load_group = load_then_race
    try:
        reply = await meta.handle({"op": "heartbeat", "group": "g", "node_id": "a", "session": a["session"]})
    finally:
        del store.load_group
    assert reply["code"] == ResultCode.OK and reply["read_only"] is True  # the other writer's change kept
    assert store.load_group("g")[0].version == interleaved[0].version + 1
