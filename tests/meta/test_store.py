"""The meta stores, SQLite and PostgreSQL, against one contract: schema created and migrated on
open, CRUD, one-transaction compare-and-set group saves, the epoch history, persistence; and what
each adds (SQLite's lock file, PostgreSQL's reconnect)."""
from __future__ import annotations

import sqlite3
import threading

import attrs
import pytest

from delayserver.meta.store import (
    SCHEMA_VERSION, Conflict, DelayGroup, Node, NodeState, Role, Route, SchemaTooNew, SqliteMetaStore,
    StoreError, StoreLocked, StoreUnavailable,
)
from delayserver.sender.groups import BrokerGroupSpec, TransportKind


def master(node_id="a", epoch=1, heartbeat=1000, session="s1"):
    return Node("g1", node_id, f"10.0.0.1:{20800 + ord(node_id[0])}", Role.MASTER, NodeState.UP, heartbeat, epoch,
                True, session)


def slave(node_id="b", epoch=1, heartbeat=900, session="s2"):
    return Node("g1", node_id, f"10.0.0.2:{20800 + ord(node_id[0])}", Role.SLAVE, NodeState.UP, heartbeat, epoch,
                True, session)


def test_a_new_store_is_empty_at_the_current_schema_version(any_store):
    assert any_store.schema_version() == SCHEMA_VERSION
    assert any_store.list_groups() == []
    assert any_store.list_nodes() == []
    assert any_store.list_broker_groups() == []
    assert any_store.list_routes() == []
    assert any_store.load_group("g") == (None, [])


def test_save_group_writes_the_group_and_its_nodes_and_bumps_the_version(any_store):
    group = DelayGroup("g1", read_only=False, master_epoch=3, lease_expires_ms=4000)
    a, b = master(epoch=3), slave(epoch=3)
    saved = any_store.save_group(group, [b, a])
    assert saved.version == 1
    loaded, nodes = any_store.load_group("g1")
    assert (loaded, nodes) == (group, [a, b]) and loaded.version == 1
    assert any_store.list_groups() == [group]
    assert any_store.list_nodes("g1") == [a, b]
    assert any_store.list_nodes("other") == []


def test_save_group_replaces_rows_and_leaves_unnamed_nodes_alone(any_store):
    a, b = master(), slave()
    saved = any_store.save_group(DelayGroup("g1", master_epoch=1), [a, b])
    demoted = Node("g1", "a", a.address, Role.SLAVE, NodeState.DOWN, 1, 2, True, "s1")
    promoted = Node("g1", "b", b.address, Role.MASTER, NodeState.UP, 950, 2, True, "s2")
    any_store.save_group(DelayGroup("g1", read_only=True, master_epoch=2, version=saved.version), [demoted, promoted])
    assert any_store.load_group("g1") == (DelayGroup("g1", True, 2), [demoted, promoted])


def test_a_save_from_a_stale_read_is_a_conflict_and_writes_nothing(any_store):
    first = any_store.save_group(DelayGroup("g1", master_epoch=1), [master()])
    with pytest.raises(Conflict):
        any_store.save_group(DelayGroup("g1", master_epoch=1), [master(heartbeat=5)])  # "new", but it exists
    second = any_store.save_group(DelayGroup("g1", master_epoch=2, version=first.version),
                                  [slave("a", epoch=2), master("b", epoch=2)])
    # A writer that read version 1 lost the race to the one above: nothing of it lands.
    with pytest.raises(Conflict, match="changed since it was read"):
        any_store.save_group(DelayGroup("g1", master_epoch=2, version=first.version), [master("c", epoch=2)])
    group, nodes = any_store.load_group("g1")
    assert group.version == second.version and [n.node_id for n in nodes] == ["a", "b"]
    assert any_store.list_epochs("g1") == [(1, "a", 1000), (2, "b", 1000)]


def test_every_grant_is_in_the_epoch_history_once(any_store):
    saved = any_store.save_group(DelayGroup("g1", master_epoch=1), [master("a", epoch=1, heartbeat=10)])
    saved = any_store.save_group(saved, [master("a", epoch=1, heartbeat=20)])  # a heartbeat: no grant
    saved = any_store.save_group(attrs.evolve(saved, master_epoch=2), [master("b", epoch=2, heartbeat=30)])
    assert any_store.list_epochs("g1") == [(1, "a", 10), (2, "b", 30)]
    assert any_store.list_epochs("other") == []


def test_a_failed_group_save_changes_nothing(any_store):
    good = master()
    saved = any_store.save_group(DelayGroup("g1", master_epoch=1), [good])
    # The CHECK constraint on role fails on the second row: the epoch must not move either.
    bad = Node("g1", "b", "h:2", "boss", NodeState.UP, 1, 2, True, "t")
    with pytest.raises(StoreError):
        any_store.save_group(DelayGroup("g1", master_epoch=1, version=saved.version), [good, _with_raw_role(bad)])
    assert any_store.load_group("g1") == (DelayGroup("g1", master_epoch=1), [good])
    assert any_store.load_group("g1")[0].version == saved.version


def _with_raw_role(node):
    class RawRole(str):
        value = "boss"

    return Node(node.group, node.node_id, node.address, RawRole("boss"), node.state, node.last_heartbeat_ms,
                node.epoch, node.eligible, node.session)


def test_broker_groups_crud(any_store):
    spool = BrokerGroupSpec("local", TransportKind.SPOOL, "var/spool")
    redis = BrokerGroupSpec("r1", TransportKind.REDIS, "redis://127.0.0.1:6379/0", 5, True, {"stream": "s:{subject}"})
    any_store.put_broker_group(redis)
    any_store.put_broker_group(spool)
    assert any_store.list_broker_groups() == [spool, redis]
    changed = BrokerGroupSpec("r1", TransportKind.HTTP, "http://h/hook", 2)
    any_store.put_broker_group(changed)
    assert any_store.list_broker_groups() == [spool, changed]
    assert any_store.remove_broker_group("r1") is True
    assert any_store.remove_broker_group("r1") is False
    assert any_store.list_broker_groups() == [spool]


def test_routes_crud(any_store):
    any_store.put_route(Route("orders.*", ("a", "b")))
    any_store.put_route(Route("audit", ("c",)))
    assert any_store.list_routes() == [Route("audit", ("c",)), Route("orders.*", ("a", "b"))]
    any_store.put_route(Route("orders.*", ("b",)))
    assert any_store.list_routes() == [Route("audit", ("c",)), Route("orders.*", ("b",))]
    assert any_store.remove_route("audit") is True
    assert any_store.remove_route("audit") is False
    assert any_store.list_routes() == [Route("orders.*", ("b",))]


def test_everything_survives_a_reopen(open_store):
    store = open_store()
    node = master(epoch=7, heartbeat=5)
    store.save_group(DelayGroup("g1", True, 7, 3005), [node])
    store.put_broker_group(BrokerGroupSpec("b", TransportKind.SPOOL, "x", options={"k": [1, "v"]}))
    store.put_route(Route("a.?", ("b",)))
    store.close()
    store = open_store()
    assert store.load_group("g1") == (DelayGroup("g1", True, 7, 3005), [node])
    assert store.list_broker_groups() == [BrokerGroupSpec("b", TransportKind.SPOOL, "x", options={"k": [1, "v"]})]
    assert store.list_routes() == [Route("a.?", ("b",))]
    assert store.list_epochs("g1") == [(7, "a", 5)]


# --- SQLite ------------------------------------------------------------------------------------

@pytest.fixture
def path(tmp_path):
    return tmp_path / "meta.sqlite3"


@pytest.fixture
def store(path):
    store = SqliteMetaStore.open(path)
    yield store
    store.close()


def test_sqlite_uses_wal_with_full_sync(store, path):
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    db.close()
    assert store._db.execute("PRAGMA synchronous").fetchone() == (2,)  # FULL


def test_a_store_of_the_first_release_is_migrated_with_its_data(path):
    # What the first release wrote: schema version 0 (unversioned), no version/lease/epochs.
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE delay_groups (name TEXT PRIMARY KEY, read_only INTEGER NOT NULL DEFAULT 0,
                                   master_epoch INTEGER NOT NULL DEFAULT 0);
        CREATE TABLE nodes (group_name TEXT NOT NULL REFERENCES delay_groups(name), node_id TEXT NOT NULL,
            address TEXT NOT NULL, role TEXT NOT NULL CHECK (role IN ('master', 'slave')),
            state TEXT NOT NULL CHECK (state IN ('up', 'down')), last_heartbeat_ms INTEGER NOT NULL,
            epoch INTEGER NOT NULL, eligible INTEGER NOT NULL, session TEXT NOT NULL,
            PRIMARY KEY (group_name, node_id));
        CREATE TABLE broker_groups (name TEXT PRIMARY KEY, transport TEXT NOT NULL, address TEXT NOT NULL,
            weight INTEGER NOT NULL, read_only INTEGER NOT NULL, options TEXT NOT NULL);
        CREATE TABLE routes (pattern TEXT PRIMARY KEY, broker_groups TEXT NOT NULL);
        INSERT INTO delay_groups VALUES ('g1', 0, 4);
        INSERT INTO nodes VALUES ('g1', 'a', 'h:1', 'master', 'up', 77, 4, 1, 'old-session');
        INSERT INTO routes VALUES ('x.*', '["b"]');
    """)
    db.close()
    store = SqliteMetaStore.open(path)
    try:
        assert store.schema_version() == SCHEMA_VERSION
        group, nodes = store.load_group("g1")
        assert group == DelayGroup("g1", False, 4, 0) and group.version == 1
        assert nodes == [Node("g1", "a", "h:1", Role.MASTER, NodeState.UP, 77, 4, True, "old-session")]
        assert store.list_routes() == [Route("x.*", ("b",))]
        store.save_group(attrs.evolve(group, master_epoch=5), [attrs.evolve(nodes[0], epoch=5)])
        assert store.list_epochs("g1") == [(5, "a", 77)]
    finally:
        store.close()


def test_a_store_of_a_newer_meta_server_is_refused(path):
    SqliteMetaStore.open(path).close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(SchemaTooNew, match="newer than this meta server"):
        SqliteMetaStore.open(path)
    # The lock was released: once the version is one this code knows, the store opens.
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    db.close()
    SqliteMetaStore.open(path).close()


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


# --- PostgreSQL --------------------------------------------------------------------------------

def test_meta_servers_opening_a_new_database_together_migrate_it_once(postgres_url):
    from delayserver.meta.pgstore import PostgresMetaStore

    stores, errors = [], []

    def open_one():
        try:
            stores.append(PostgresMetaStore.open(postgres_url))
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == [] and len(stores) == 4
        assert stores[0]._read("SELECT count(*) FROM schema_version") == [(1,)]
        assert {s.schema_version() for s in stores} == {SCHEMA_VERSION}
    finally:
        for s in stores:
            s.close()


def test_a_postgres_schema_of_a_newer_meta_server_is_refused(postgres_url):
    from delayserver.meta.pgstore import PostgresMetaStore

    store = PostgresMetaStore.open(postgres_url)
    with store._transaction() as cur:
        cur.execute("UPDATE schema_version SET version = %s", (SCHEMA_VERSION + 1,))
    store.close()
    with pytest.raises(SchemaTooNew, match="newer than this meta server"):
        PostgresMetaStore.open(postgres_url)


def test_concurrent_writers_of_one_group_on_two_connections_never_both_win(postgres_url):
    from delayserver.meta.pgstore import PostgresMetaStore

    one, two = PostgresMetaStore.open(postgres_url), PostgresMetaStore.open(postgres_url)
    try:
        base = one.save_group(DelayGroup("g1", master_epoch=1), [master("a", epoch=1)])
        results = []
        barrier = threading.Barrier(2)

        def promote(store, node_id):
            barrier.wait()
            try:
                store.save_group(attrs.evolve(base, master_epoch=2), [master(node_id, epoch=2)])
                results.append(node_id)
            except Conflict:
                results.append("conflict")

        threads = [threading.Thread(target=promote, args=(s, n)) for s, n in ((one, "b"), (two, "c"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) in (["b", "conflict"], ["c", "conflict"])
        assert [e for e, _, _ in one.list_epochs("g1")] == [1, 2]
    finally:
        one.close()
        two.close()


def test_the_store_reconnects_after_postgres_restarts(own_postgres):
    from delayserver.meta.pgstore import PostgresMetaStore

    store = PostgresMetaStore.open(own_postgres.url())
    try:
        store.put_route(Route("a", ("b",)))
        own_postgres.stop()
        with pytest.raises(StoreUnavailable):
            store.list_routes()
        with pytest.raises(StoreUnavailable, match="cannot connect"):
            store.list_routes()
        own_postgres.start()
        assert store.list_routes() == [Route("a", ("b",))]
        assert store.clock_ms() > 1_700_000_000_000
    finally:
        store.close()


def test_every_transport_kind_can_be_stored(any_store):
    for kind in TransportKind:
        any_store.put_broker_group(BrokerGroupSpec(f"g-{kind.value}", kind, "127.0.0.1:1"))
    assert {g.transport for g in any_store.list_broker_groups()} == set(TransportKind)


def test_a_postgres_store_of_schema_2_takes_the_rabbitmq_and_nats_kinds_after_migration(postgres_url):
    from delayserver.meta.pgstore import PostgresMetaStore

    store = PostgresMetaStore.open(postgres_url)
    try:  # put the database back to schema 2: the transport CHECK of before rabbitmq and nats
        store.put_broker_group(BrokerGroupSpec("r", TransportKind.REDIS, "127.0.0.1:6379", 2))
        with store._transaction() as cur:
            cur.execute("ALTER TABLE broker_groups DROP CONSTRAINT broker_groups_transport_check")
            cur.execute("ALTER TABLE broker_groups ADD CONSTRAINT broker_groups_transport_check "
                        "CHECK (transport IN ('spool', 'redis', 'http'))")
            cur.execute("UPDATE schema_version SET version = 2")
    finally:
        store.close()
    store = PostgresMetaStore.open(postgres_url)
    try:
        assert store.schema_version() == SCHEMA_VERSION
        store.put_broker_group(BrokerGroupSpec("js", TransportKind.NATS, "127.0.0.1:4222"))
        assert [g.name for g in store.list_broker_groups()] == ["js", "r"]
    finally:
        store.close()
