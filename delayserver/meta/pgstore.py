"""`PostgresMetaStore`: the meta store in PostgreSQL, shared by several meta servers (psycopg 3).

Any number of meta servers open the same database; each holds one connection and opens it again
after the database restarts or the network drops it (the call that met the failure raises
StoreUnavailable; the next one reconnects). Group changes are compare-and-set on the group row's
`version` under READ COMMITTED: of two meta servers writing one group from the same version, the
second's `SELECT ... FOR UPDATE` waits for the first's row lock, then finds a newer version and
raises Conflict. A group, its nodes and the clock are read by one statement: one snapshot, one
round trip. `clock_ms` is the database server's clock, so heartbeat times and lease deadlines
written by different meta servers are on one clock.

The schema is created and migrated on open under a transaction-scoped advisory lock, so meta
servers starting together migrate it once; its version is the row of `schema_version`.
"""
from __future__ import annotations

import json
from typing import Iterable

import attrs
import psycopg
from psycopg import errors as pg_errors

from delayserver.meta.store import (
    _GROUP_COLUMNS, _NODE_COLUMNS, SCHEMA_VERSION, BrokerGroupSpec, Conflict, DelayGroup, MetaStore, Node,
    Route, SchemaTooNew, StoreError, StoreUnavailable, _broker_group, _delay_group, _grant_of, _node,
)

#: Connection options added to the URL unless it sets them: give up on a dead server or network
#: in seconds, not in the minutes the kernel's TCP defaults take.
CONNECT_DEFAULTS = {
    "connect_timeout": "5",
    "keepalives": "1",
    "keepalives_idle": "5",
    "keepalives_interval": "2",
    "keepalives_count": "3",
    "tcp_user_timeout": "10000",
    "application_name": "delayserver-meta",
}
# Bounds how long one statement may wait on a lock held by a stuck peer.
_STATEMENT_TIMEOUT_MS = 10_000
_MIGRATION_LOCK = 20800  # pg_advisory_xact_lock key: the meta server's port

PG_MIGRATIONS = [
    """
    CREATE TABLE delay_groups (
        name TEXT PRIMARY KEY,
        read_only BOOLEAN NOT NULL DEFAULT FALSE,
        master_epoch BIGINT NOT NULL DEFAULT 0
    );
    CREATE TABLE nodes (
        group_name TEXT NOT NULL REFERENCES delay_groups(name),
        node_id TEXT NOT NULL,
        address TEXT NOT NULL,
        role TEXT NOT NULL CHECK (role IN ('master', 'slave')),
        state TEXT NOT NULL CHECK (state IN ('up', 'down')),
        last_heartbeat_ms BIGINT NOT NULL,
        epoch BIGINT NOT NULL,
        eligible BOOLEAN NOT NULL,
        session TEXT NOT NULL,
        PRIMARY KEY (group_name, node_id)
    );
    CREATE TABLE broker_groups (
        name TEXT PRIMARY KEY,
        transport TEXT NOT NULL CHECK (transport IN ('spool', 'redis', 'http')),
        address TEXT NOT NULL,
        weight INTEGER NOT NULL,
        read_only BOOLEAN NOT NULL,
        options JSONB NOT NULL
    );
    CREATE TABLE routes (
        pattern TEXT PRIMARY KEY,
        broker_groups JSONB NOT NULL
    )
    """,
    """
    ALTER TABLE delay_groups ADD COLUMN lease_expires_ms BIGINT NOT NULL DEFAULT 0;
    ALTER TABLE delay_groups ADD COLUMN version BIGINT NOT NULL DEFAULT 1;
    CREATE TABLE epochs (
        group_name TEXT NOT NULL REFERENCES delay_groups(name),
        epoch BIGINT NOT NULL,
        node_id TEXT NOT NULL,
        granted_ms BIGINT NOT NULL,
        PRIMARY KEY (group_name, epoch)
    )
    """,
    """
    ALTER TABLE broker_groups DROP CONSTRAINT broker_groups_transport_check;
    ALTER TABLE broker_groups ADD CONSTRAINT broker_groups_transport_check
        CHECK (transport IN ('spool', 'redis', 'http', 'rabbitmq', 'nats'))
    """,
]
assert len(PG_MIGRATIONS) == SCHEMA_VERSION


class PostgresMetaStore(MetaStore):
    def __init__(self, url: str):
        self.url = url
        self._conn: psycopg.Connection | None = None

    @classmethod
    def open(cls, url: str) -> PostgresMetaStore:
        """Connect to the database at `url` (``postgresql://user@host:port/dbname``), creating or
        migrating the schema. Raises StoreUnavailable if it cannot be reached, SchemaTooNew for a
        schema of a newer meta server, StoreError for any other failure."""
        store = cls(url)
        try:
            with store._transaction() as cur:
                cur.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
                cur.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
                cur.execute("SELECT version FROM schema_version")
                row = cur.fetchone()
                version = row[0] if row else 0
                if version > SCHEMA_VERSION:
                    raise SchemaTooNew(f"the meta store has schema version {version}, newer than this meta "
                                       f"server's {SCHEMA_VERSION}: run a newer meta server")
                for target in range(version + 1, SCHEMA_VERSION + 1):
                    for statement in PG_MIGRATIONS[target - 1].split(";"):
                        if statement.strip():
                            cur.execute(statement)
                if row is None:
                    cur.execute("INSERT INTO schema_version (version) VALUES (%s)", (SCHEMA_VERSION,))
                elif version < SCHEMA_VERSION:
                    cur.execute("UPDATE schema_version SET version = %s", (SCHEMA_VERSION,))
        except BaseException:
            store.close()
            raise
        return store

    def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            conn.close()

    def schema_version(self) -> int:
        return self._read("SELECT version FROM schema_version")[0][0]

    # --- connection and transactions ------------------------------------------------------------

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            try:
                params = psycopg.conninfo.conninfo_to_dict(self.url)
            except psycopg.ProgrammingError as exc:
                raise StoreError(f"bad PostgreSQL URL: {exc}") from None
            params = {**CONNECT_DEFAULTS, **params}
            params.setdefault("options", f"-c statement_timeout={_STATEMENT_TIMEOUT_MS}")
            try:
                self._conn = psycopg.connect(autocommit=True, **params)
            except psycopg.OperationalError as exc:
                raise StoreUnavailable(f"cannot connect to the meta store database: {_first_line(exc)}") from None
        return self._conn

    def _transaction(self):
        return _Transaction(self)

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        """The rows of one statement, outside any transaction: one round trip, one snapshot."""
        conn = self._connection()
        try:
            with conn.cursor() as cur:
                cur.execute(sql, args)
                return cur.fetchall()
        except psycopg.Error as exc:
            raise self._failed(exc) from None

    def _failed(self, exc: Exception) -> StoreError:
        """The StoreError for a psycopg error; drops a connection that is no longer usable."""
        if isinstance(exc, psycopg.OperationalError) and not isinstance(exc, pg_errors.QueryCanceled):
            self.close()
            return StoreUnavailable(f"lost the meta store database: {_first_line(exc)}")
        if self._conn is not None and self._conn.broken:
            self.close()
        return StoreError(f"meta store database error: {_first_line(exc)}")

    def clock_ms(self) -> int:
        return self._read("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint")[0][0]

    # --- groups and nodes ---------------------------------------------------------------------

    def load_group(self, name: str) -> tuple[DelayGroup | None, list[Node]]:
        group, nodes, _ = self.load_group_at(name)
        return group, nodes

    def load_group_at(self, name: str) -> tuple[DelayGroup | None, list[Node], int]:
        # One statement: the group, its nodes and the clock from one snapshot, in one round trip.
        group_columns = ", ".join(f"g.{c.strip()}" for c in _GROUP_COLUMNS.split(","))
        node_columns = ", ".join(f"n.{c.strip()}" for c in _NODE_COLUMNS.split(","))
        rows = self._read(
            f"SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint, {group_columns}, {node_columns} "
            "FROM (SELECT 1) AS one LEFT JOIN delay_groups AS g ON g.name = %s "
            "LEFT JOIN nodes AS n ON n.group_name = g.name ORDER BY n.node_id",
            (name,),
        )
        now, width = rows[0][0], len(_GROUP_COLUMNS.split(","))
        if rows[0][1] is None:
            return None, [], now
        nodes = [_node(row[1 + width:]) for row in rows if row[1 + width] is not None]
        return _delay_group(rows[0][1:1 + width]), nodes, now

    def save_group(self, group: DelayGroup, nodes: Iterable[Node], *, now_ms: int = 0) -> DelayGroup:
        nodes = list(nodes)
        with self._transaction() as cur:
            if group.version == 0:
                cur.execute(
                    "INSERT INTO delay_groups (name, read_only, master_epoch, lease_expires_ms, version) "
                    "VALUES (%s, %s, %s, %s, 1) ON CONFLICT (name) DO NOTHING RETURNING 0",
                    (group.name, group.read_only, group.master_epoch, group.lease_expires_ms),
                )
                row = cur.fetchone()
            else:
                # The compare-and-set, under the row's lock: a writer that got there first has
                # committed a newer version by the time this one's FOR UPDATE gets the row, and
                # the row no longer matches (READ COMMITTED re-checks it). The stored epoch comes
                # back, to tell a grant.
                cur.execute(
                    "WITH old AS (SELECT master_epoch FROM delay_groups WHERE name = %s AND version = %s "
                    "FOR UPDATE) UPDATE delay_groups AS g SET read_only = %s, master_epoch = %s, "
                    "lease_expires_ms = %s, version = g.version + 1 FROM old WHERE g.name = %s "
                    "RETURNING old.master_epoch",
                    (group.name, group.version, group.read_only, group.master_epoch, group.lease_expires_ms,
                     group.name),
                )
                row = cur.fetchone()
            if row is None:
                raise Conflict(f"delay group {group.name!r} changed since it was read (version {group.version})")
            grant = _grant_of(group, nodes, row[0], now_ms)
            if grant is not None:
                cur.execute("INSERT INTO epochs (group_name, epoch, node_id, granted_ms) "
                            "VALUES (%s, %s, %s, %s)", grant)
            for node in nodes:
                assert node.group == group.name, (node, group)
            if nodes:
                cur.executemany(
                    "INSERT INTO nodes (group_name, node_id, address, role, state, last_heartbeat_ms, epoch, "
                    "eligible, session) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) "
                    "ON CONFLICT (group_name, node_id) DO UPDATE SET address = excluded.address, "
                    "role = excluded.role, state = excluded.state, "
                    "last_heartbeat_ms = excluded.last_heartbeat_ms, epoch = excluded.epoch, "
                    "eligible = excluded.eligible, session = excluded.session",
                    [(n.group, n.node_id, n.address, n.role.value, n.state.value, n.last_heartbeat_ms, n.epoch,
                      n.eligible, n.session) for n in nodes],
                )
        return attrs.evolve(group, version=group.version + 1)

    def list_epochs(self, group: str) -> list[tuple[int, str, int]]:
        rows = self._read("SELECT epoch, node_id, granted_ms FROM epochs WHERE group_name = %s ORDER BY epoch",
                          (group,))
        return [tuple(row) for row in rows]

    def list_groups(self) -> list[DelayGroup]:
        return [_delay_group(row) for row in self._read(f"SELECT {_GROUP_COLUMNS} FROM delay_groups ORDER BY name")]

    def list_nodes(self, group: str | None = None) -> list[Node]:
        if group is None:
            rows = self._read(f"SELECT {_NODE_COLUMNS} FROM nodes ORDER BY group_name, node_id")
        else:
            rows = self._read(f"SELECT {_NODE_COLUMNS} FROM nodes WHERE group_name = %s ORDER BY node_id", (group,))
        return [_node(row) for row in rows]

    # --- broker groups and routes -------------------------------------------------------------

    def list_broker_groups(self) -> list[BrokerGroupSpec]:
        rows = self._read("SELECT name, transport, address, weight, read_only, options FROM broker_groups "
                          "ORDER BY name")
        return [_broker_group(row) for row in rows]

    def put_broker_group(self, spec: BrokerGroupSpec) -> None:
        with self._transaction() as cur:
            cur.execute(
                "INSERT INTO broker_groups (name, transport, address, weight, read_only, options) "
                "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (name) DO UPDATE SET "
                "transport = excluded.transport, address = excluded.address, weight = excluded.weight, "
                "read_only = excluded.read_only, options = excluded.options",
                (spec.name, spec.transport.value, spec.address, spec.weight, spec.read_only,
                 json.dumps(dict(spec.options), sort_keys=True)),
            )

    def remove_broker_group(self, name: str) -> bool:
        with self._transaction() as cur:
            cur.execute("DELETE FROM broker_groups WHERE name = %s", (name,))
            return cur.rowcount > 0

    def list_routes(self) -> list[Route]:
        rows = self._read("SELECT pattern, broker_groups FROM routes ORDER BY pattern")
        return [Route(pattern, tuple(groups)) for pattern, groups in rows]

    def put_route(self, route: Route) -> None:
        with self._transaction() as cur:
            cur.execute(
                "INSERT INTO routes (pattern, broker_groups) VALUES (%s, %s) "
                "ON CONFLICT (pattern) DO UPDATE SET broker_groups = excluded.broker_groups",
                (route.pattern, json.dumps(list(route.broker_groups))),
            )

    def remove_route(self, pattern: str) -> bool:
        with self._transaction() as cur:
            cur.execute("DELETE FROM routes WHERE pattern = %s", (pattern,))
            return cur.rowcount > 0


class _Transaction:
    """``with store._transaction() as cur``: one database transaction; psycopg errors leave as
    StoreError (StoreUnavailable when the connection is gone)."""

    def __init__(self, store: PostgresMetaStore):
        self.store = store
        self._tx = None
        self._cur = None

    def __enter__(self) -> psycopg.Cursor:
        conn = self.store._connection()
        try:
            self._tx = conn.transaction()
            self._tx.__enter__()
            self._cur = conn.cursor()
        except psycopg.Error as exc:
            raise self.store._failed(exc) from None
        return self._cur

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self._cur.close()
            self._tx.__exit__(exc_type, exc, tb)
        except psycopg.Error as commit_exc:
            raise self.store._failed(commit_exc) from None
        if isinstance(exc, psycopg.Error):
            raise self.store._failed(exc) from None
        return False


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
