"""The SQLite meta store: schema on open, CRUD, one-transaction group saves, persistence, locking."""
from __future__ import annotations

import sqlite3

import pytest

from delayserver.meta.store import DelayGroup, Node, NodeState, Role, Route, SqliteMetaStore, StoreError, StoreLocked
from delayserver.sender.groups import BrokerGroupSpec, TransportKind


@pytest.fixture
def path(tmp_path):
    return tmp_path / "meta.sqlite3"


@pytest.fixture
def store(path):
    store = SqliteMetaStore.open(path)
    yield store
    store.close()


def test_a_new_store_is_empty_and_uses_wal_with_full_sync(store, path):
    assert store.list_groups() == []
    assert store.list_nodes() == []
    assert store.list_broker_groups() == []
    assert store.list_routes() == []
    assert store.load_group("g") == (None, [])
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    db.close()
    assert store._db.execute("PRAGMA synchronous").fetchone() == (2,)  # FULL


def test_save_group_writes_the_group_and_its_nodes(store):
    group = DelayGroup("g1", read_only=False, master_epoch=3)
    a = Node("g1", "a", "10.0.0.1:20801", Role.MASTER, NodeState.UP, 1000, 3, True, "s1")
    b = Node("g1", "b", "10.0.0.2:20801", Role.SLAVE, NodeState.DOWN, 900, 3, False, "s2")
    store.save_group(group, [b, a])
    assert store.load_group("g1") == (group, [a, b])
    assert store.list_groups() == [group]
    assert store.list_nodes("g1") == [a, b]
    assert store.list_nodes("other") == []


def test_save_group_replaces_rows_and_leaves_unnamed_nodes_alone(store):
    a = Node("g1", "a", "h:1", Role.MASTER, NodeState.UP, 1, 1, True, "s")
    b = Node("g1", "b", "h:2", Role.SLAVE, NodeState.UP, 1, 1, True, "t")
    store.save_group(DelayGroup("g1", master_epoch=1), [a, b])
    demoted = Node("g1", "a", "h:1", Role.SLAVE, NodeState.DOWN, 1, 2, True, "s")
    store.save_group(DelayGroup("g1", read_only=True, master_epoch=2), [demoted])
    assert store.load_group("g1") == (DelayGroup("g1", True, 2), [demoted, b])


def test_a_failed_group_save_changes_nothing(store):
    good = Node("g1", "a", "h:1", Role.MASTER, NodeState.UP, 1, 1, True, "s")
    store.save_group(DelayGroup("g1", master_epoch=1), [good])
    # The CHECK constraint on role fails on the second row: the epoch must not move either.
    bad = Node("g1", "b", "h:2", "boss", NodeState.UP, 1, 2, True, "t")
    with pytest.raises(StoreError):
        store.save_group(DelayGroup("g1", master_epoch=2), [good, _with_raw_role(bad)])
    assert store.load_group("g1") == (DelayGroup("g1", master_epoch=1), [good])


def _with_raw_role(node):
    class RawRole(str):
        value = "boss"

    return Node(node.group, node.node_id, node.address, RawRole("boss"), node.state, node.last_heartbeat_ms,
                node.epoch, node.eligible, node.session)


def test_broker_groups_crud(store):
    spool = BrokerGroupSpec("local", TransportKind.SPOOL, "var/spool")
    redis = BrokerGroupSpec("r1", TransportKind.REDIS, "redis://127.0.0.1:6379/0", 5, True, {"stream": "s:{subject}"})
    store.put_broker_group(redis)
    store.put_broker_group(spool)
    assert store.list_broker_groups() == [spool, redis]
    changed = BrokerGroupSpec("r1", TransportKind.HTTP, "http://h/hook", 2)
    store.put_broker_group(changed)
    assert store.list_broker_groups() == [spool, changed]
    assert store.remove_broker_group("r1") is True
    assert store.remove_broker_group("r1") is False
    assert store.list_broker_groups() == [spool]


def test_routes_crud(store):
    store.put_route(Route("orders.*", ("a", "b")))
    store.put_route(Route("audit", ("c",)))
    assert store.list_routes() == [Route("audit", ("c",)), Route("orders.*", ("a", "b"))]
    store.put_route(Route("orders.*", ("b",)))
    assert store.list_routes() == [Route("audit", ("c",)), Route("orders.*", ("b",))]
    assert store.remove_route("audit") is True
    assert store.remove_route("audit") is False
    assert store.list_routes() == [Route("orders.*", ("b",))]


def test_everything_survives_a_reopen(path):
    store = SqliteMetaStore.open(path)
    node = Node("g1", "a", "h:1", Role.MASTER, NodeState.UP, 5, 7, True, "s")
    store.save_group(DelayGroup("g1", True, 7), [node])
    store.put_broker_group(BrokerGroupSpec("b", TransportKind.SPOOL, "x", options={"k": [1, "v"]}))
    store.put_route(Route("a.?", ("b",)))
    store.close()
    store = SqliteMetaStore.open(path)
    try:
        assert store.load_group("g1") == (DelayGroup("g1", True, 7), [node])
        assert store.list_broker_groups() == [BrokerGroupSpec("b", TransportKind.SPOOL, "x", options={"k": [1, "v"]})]
        assert store.list_routes() == [Route("a.?", ("b",))]
    finally:
        store.close()


def test_a_second_open_of_the_same_store_is_refused(store, path):
    with pytest.raises(StoreLocked, match="in use by another process"):
        SqliteMetaStore.open(path)


def test_an_unopenable_store_raises_store_error(tmp_path):
    (tmp_path / "dir.sqlite3").mkdir()
    with pytest.raises(StoreError):
        SqliteMetaStore.open(tmp_path / "dir.sqlite3")


def test_json_forms_round_trip():
    spec = BrokerGroupSpec("r1", TransportKind.REDIS, "redis://h:1/0", 3, True, {"a": 1})
    assert BrokerGroupSpec.from_json(spec.to_json()) == spec
    route = Route("x.*", ("r1", "r2"))
    assert Route.from_json(route.to_json()) == route
    with pytest.raises((KeyError, TypeError, ValueError)):
        BrokerGroupSpec.from_json({"name": "x", "transport": "carrier-pigeon"})
    with pytest.raises(TypeError):
        Route.from_json({"pattern": "x", "broker_groups": "r1"})
