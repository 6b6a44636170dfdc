"""The meta server's store: delay groups and their nodes, broker groups, subject routes.

`MetaStore` is the small interface the meta server needs. Two implementations:
`SqliteMetaStore`, the embedded default (one SQLite file, WAL journal, synchronous=FULL, so that
a committed change survives kill -9 and power loss; one meta server at a time), and
`PostgresMetaStore` (`delayserver.meta.pgstore`), which several meta servers share.

Each store creates and migrates its own schema when opened: the schema carries a version
(`SCHEMA_VERSION`), the migrations up to it run in order, each in a transaction, and a store
newer than this code is refused.

Changes to a delay group are compare-and-set: every group row carries a `version`, `save_group`
writes only if the row still has the version the caller read (and bumps it), and raises
`Conflict` otherwise, so the caller reads again and decides again. Two meta servers deciding at
once on one group can therefore never both commit: one of them sees the other's decision first.
Every grant of mastership is also recorded in `epochs`, whose key (group, epoch) makes a second
grant of one epoch impossible in the database itself.

Methods are blocking and may be called from a worker thread, one at a time per store object.
Every method raises StoreError (and nothing else) when the database fails; `StoreUnavailable`
when it cannot be reached at all (another meta server may still reach it).
"""
from __future__ import annotations

import abc
import enum
import fcntl
import json
import os
import sqlite3
from pathlib import Path
from typing import Any, Iterable, Mapping

import attrs

from delayserver.sender.groups import BrokerGroupSpec, TransportKind


class Role(str, enum.Enum):
    MASTER = "master"
    SLAVE = "slave"


class NodeState(str, enum.Enum):
    UP = "up"
    DOWN = "down"


class StoreError(Exception):
    """The store could not read or write; the change asked for did not happen."""


class StoreUnavailable(StoreError):
    """The database cannot be reached (connection refused or lost); the change did not happen."""


class Conflict(StoreError):
    """The delay group changed since it was read (another meta server wrote it): read again."""


#: The schema this code reads and writes; `migrations` of each store lead up to it.
SCHEMA_VERSION = 3


@attrs.frozen
class DelayGroup:
    """A delay group; `master_epoch` is the epoch of the latest grant of mastership (0: none yet).

    `lease_expires_ms`: when the master's lease ends on the store's clock, as the meta servers
    last saw it (its last heartbeat plus a lease; 0: no master yet). `version` is the row's
    compare-and-set token (0: not stored yet); it is not part of the group's value.
    """

    name: str
    read_only: bool = False
    master_epoch: int = 0
    lease_expires_ms: int = 0
    version: int = attrs.field(default=0, eq=False)


@attrs.frozen
class Node:
    """A delay-server node of a group.

    `eligible` is False for a node that registered wanting to stay a slave: it is never made
    master. `session` names the registration; heartbeats from an earlier one are refused.
    `epoch` is, for the master, the epoch it holds; for a slave, the group's current epoch.
    """

    group: str
    node_id: str
    address: str
    role: Role = Role.SLAVE
    state: NodeState = NodeState.UP
    last_heartbeat_ms: int = 0
    epoch: int = 0
    eligible: bool = True
    session: str = ""


@attrs.frozen
class Route:
    """Subjects matching `pattern` (an exact subject or a glob) go to these broker groups."""

    pattern: str
    broker_groups: tuple[str, ...]

    def to_json(self) -> dict:
        return {"pattern": self.pattern, "broker_groups": list(self.broker_groups)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Route:
        """Raises KeyError, TypeError or ValueError for an object not made by `to_json`."""
        groups = obj["broker_groups"]
        if not isinstance(groups, list):
            raise TypeError("broker_groups must be a list")
        return cls(str(obj["pattern"]), tuple(str(g) for g in groups))


class MetaStore(abc.ABC):
    """What the meta server keeps. Lists are sorted by name (nodes: by group, then node id)."""

    @abc.abstractmethod
    def load_group(self, name: str) -> tuple[DelayGroup | None, list[Node]]:
        """The group (None if unknown) and all its nodes."""

    @abc.abstractmethod
    def save_group(self, group: DelayGroup, nodes: Iterable[Node], *, now_ms: int = 0) -> DelayGroup:
        """Insert or replace the group and the given nodes of it, in one transaction, if the
        stored group still has `group.version` (0: there is none yet); the group as saved, with
        its new version. Raises Conflict otherwise. A `master_epoch` above the stored one is a
        grant: it is recorded in the epoch history with the node of `nodes` that holds it, at
        `now_ms` (the time of the decision; 0: that node's last heartbeat)."""

    @abc.abstractmethod
    def list_epochs(self, group: str) -> list[tuple[int, str, int]]:
        """(epoch, node_id, granted_ms) of every grant of mastership in `group`, oldest first."""

    def load_group_at(self, name: str) -> tuple[DelayGroup | None, list[Node], int | None]:
        """`load_group(name)` and `clock_ms()`, read together (in one round trip where the
        database allows)."""
        now = self.clock_ms()
        group, nodes = self.load_group(name)
        return group, nodes, now

    def clock_ms(self) -> int | None:
        """Epoch milliseconds on a clock every meta server on this store shares (the database
        server's); None when the store has none and each meta server uses its own."""
        return None

    @abc.abstractmethod
    def list_groups(self) -> list[DelayGroup]: ...

    @abc.abstractmethod
    def list_nodes(self, group: str | None = None) -> list[Node]:
        """The nodes of `group`, or of every group."""

    @abc.abstractmethod
    def list_broker_groups(self) -> list[BrokerGroupSpec]: ...

    @abc.abstractmethod
    def put_broker_group(self, spec: BrokerGroupSpec) -> None:
        """Insert or replace the broker group named `spec.name`."""

    @abc.abstractmethod
    def remove_broker_group(self, name: str) -> bool:
        """Remove it; False if there was none."""

    @abc.abstractmethod
    def list_routes(self) -> list[Route]: ...

    @abc.abstractmethod
    def put_route(self, route: Route) -> None:
        """Insert or replace the route of `route.pattern`."""

    @abc.abstractmethod
    def remove_route(self, pattern: str) -> bool:
        """Remove it; False if there was none."""

    @abc.abstractmethod
    def close(self) -> None: ...


# Each entry takes the schema from its index to the next version. Version 1 is the schema of
# the first release, created with IF NOT EXISTS: a store made before versioning is at version 0
# with those tables already there.
SQLITE_MIGRATIONS = [
    """
    CREATE TABLE IF NOT EXISTS delay_groups (
        name TEXT PRIMARY KEY,
        read_only INTEGER NOT NULL DEFAULT 0,
        master_epoch INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE IF NOT EXISTS nodes (
        group_name TEXT NOT NULL REFERENCES delay_groups(name),
        node_id TEXT NOT NULL,
        address TEXT NOT NULL,
        role TEXT NOT NULL CHECK (role IN ('master', 'slave')),
        state TEXT NOT NULL CHECK (state IN ('up', 'down')),
        last_heartbeat_ms INTEGER NOT NULL,
        epoch INTEGER NOT NULL,
        eligible INTEGER NOT NULL,
        session TEXT NOT NULL,
        PRIMARY KEY (group_name, node_id)
    );
    CREATE TABLE IF NOT EXISTS broker_groups (
        name TEXT PRIMARY KEY,
        transport TEXT NOT NULL CHECK (transport IN ('spool', 'redis', 'http')),
        address TEXT NOT NULL,
        weight INTEGER NOT NULL,
        read_only INTEGER NOT NULL,
        options TEXT NOT NULL
    );
    CREATE TABLE IF NOT EXISTS routes (
        pattern TEXT PRIMARY KEY,
        broker_groups TEXT NOT NULL
    );
    """,
    """
    ALTER TABLE delay_groups ADD COLUMN lease_expires_ms INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE delay_groups ADD COLUMN version INTEGER NOT NULL DEFAULT 1;
    CREATE TABLE epochs (
        group_name TEXT NOT NULL REFERENCES delay_groups(name),
        epoch INTEGER NOT NULL,
        node_id TEXT NOT NULL,
        granted_ms INTEGER NOT NULL,
        PRIMARY KEY (group_name, epoch)
    );
    """,
    # Version 3: the rabbitmq and nats transports. SQLite cannot change a CHECK in place: the table
    # is rebuilt with its rows, in the migration's one transaction.
    """
    CREATE TABLE broker_groups_v3 (
        name TEXT PRIMARY KEY,
        transport TEXT NOT NULL CHECK (transport IN ('spool', 'redis', 'http', 'rabbitmq', 'nats')),
        address TEXT NOT NULL,
        weight INTEGER NOT NULL,
        read_only INTEGER NOT NULL,
        options TEXT NOT NULL
    );
    INSERT INTO broker_groups_v3 (name, transport, address, weight, read_only, options)
        SELECT name, transport, address, weight, read_only, options FROM broker_groups;
    DROP TABLE broker_groups;
    ALTER TABLE broker_groups_v3 RENAME TO broker_groups
    """,
]
assert len(SQLITE_MIGRATIONS) == SCHEMA_VERSION


class SchemaTooNew(StoreError):
    """The store was migrated by a newer meta server; this one cannot read it safely."""



class StoreLocked(StoreError):
    """Another process holds the store open; two meta servers on one store could hand out one
    epoch twice."""


class SqliteMetaStore(MetaStore):
    def __init__(self, connection: sqlite3.Connection, lock_fd: int):
        self._db = connection
        self._lock_fd = lock_fd

    @classmethod
    def open(cls, path: str | os.PathLike) -> SqliteMetaStore:
        """Open (creating the file and migrating the schema if needed) the store at `path`.

        Takes an exclusive lock on `<path>.lock` for as long as the store is open; raises
        StoreLocked if another process has it, SchemaTooNew for a store of a newer meta server,
        StoreError if the database cannot be opened.
        """
        path = Path(path)
        lock_fd = _lock(path.with_name(path.name + ".lock"))
        try:
            # The connection is made here and used from worker threads, one at a time.
            db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=FULL")
                db.execute("PRAGMA foreign_keys=ON")
                _migrate_sqlite(db, path)
            except BaseException:
                db.close()
                raise
        except sqlite3.Error as exc:
            os.close(lock_fd)
            raise StoreError(f"{path}: cannot open the meta store: {exc}") from exc
        except BaseException:
            os.close(lock_fd)
            raise
        return cls(db, lock_fd)

    def close(self) -> None:
        """Close the database and release the lock; closing again does nothing."""
        if self._lock_fd < 0:
            return
        self._db.close()
        os.close(self._lock_fd)
        self._lock_fd = -1

    def schema_version(self) -> int:
        return self._query("PRAGMA user_version")[0][0]

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        try:
            return self._db.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"meta store read failed: {exc}") from exc

    def _write(self, statements: Iterable[tuple[str, tuple]], check=None) -> int:
        """Run the statements in one transaction, after `check()` (which may raise to write
        nothing); the number of rows they changed."""
        changed = 0
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if check is not None:
                    check()
                for sql, args in statements:
                    changed += self._db.execute(sql, args).rowcount
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise StoreError(f"meta store write failed: {exc}") from exc
        return changed

    def load_group(self, name: str) -> tuple[DelayGroup | None, list[Node]]:
        rows = self._query(f"SELECT {_GROUP_COLUMNS} FROM delay_groups WHERE name = ?", (name,))
        if not rows:
            return None, []
        return _delay_group(rows[0]), self.list_nodes(name)

    def save_group(self, group: DelayGroup, nodes: Iterable[Node], *, now_ms: int = 0) -> DelayGroup:
        nodes = list(nodes)
        stored_epoch = 0

        def check():
            nonlocal stored_epoch
            rows = self._db.execute("SELECT version, master_epoch FROM delay_groups WHERE name = ?",
                                    (group.name,)).fetchall()
            stored_version, stored_epoch = rows[0] if rows else (0, 0)
            if stored_version != group.version:
                raise Conflict(f"delay group {group.name!r} changed since it was read "
                               f"(version {stored_version}, not {group.version})")
            grant = _grant_of(group, nodes, stored_epoch, now_ms)
            if grant is not None:
                statements.append(("INSERT INTO epochs (group_name, epoch, node_id, granted_ms) "
                                   "VALUES (?, ?, ?, ?)", grant))

        statements = [(
            "INSERT INTO delay_groups (name, read_only, master_epoch, lease_expires_ms, version) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET read_only = excluded.read_only, "
            "master_epoch = excluded.master_epoch, lease_expires_ms = excluded.lease_expires_ms, "
            "version = excluded.version",
            (group.name, int(group.read_only), group.master_epoch, group.lease_expires_ms, group.version + 1),
        )]
        for node in nodes:
            assert node.group == group.name, (node, group)
            statements.append((
                "INSERT OR REPLACE INTO nodes (group_name, node_id, address, role, state, "
                "last_heartbeat_ms, epoch, eligible, session) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (node.group, node.node_id, node.address, node.role.value, node.state.value,
                 node.last_heartbeat_ms, node.epoch, int(node.eligible), node.session),
            ))
        self._write(statements, check)
        return attrs.evolve(group, version=group.version + 1)

    def list_epochs(self, group: str) -> list[tuple[int, str, int]]:
        rows = self._query("SELECT epoch, node_id, granted_ms FROM epochs WHERE group_name = ? ORDER BY epoch",
                           (group,))
        return [tuple(row) for row in rows]

    def list_groups(self) -> list[DelayGroup]:
        rows = self._query(f"SELECT {_GROUP_COLUMNS} FROM delay_groups ORDER BY name")
        return [_delay_group(row) for row in rows]

    def list_nodes(self, group: str | None = None) -> list[Node]:
        columns = f"SELECT {_NODE_COLUMNS} FROM nodes"
        if group is None:
            rows = self._query(columns + " ORDER BY group_name, node_id")
        else:
            rows = self._query(columns + " WHERE group_name = ? ORDER BY node_id", (group,))
        return [_node(row) for row in rows]

    def list_broker_groups(self) -> list[BrokerGroupSpec]:
        rows = self._query(
            "SELECT name, transport, address, weight, read_only, options FROM broker_groups ORDER BY name"
        )
        return [_broker_group(row) for row in rows]

    def put_broker_group(self, spec: BrokerGroupSpec) -> None:
        self._write([(
            "INSERT OR REPLACE INTO broker_groups (name, transport, address, weight, read_only, options) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (spec.name, spec.transport.value, spec.address, spec.weight, int(spec.read_only),
             json.dumps(dict(spec.options), sort_keys=True)),
        )])

    def remove_broker_group(self, name: str) -> bool:
        return self._write([("DELETE FROM broker_groups WHERE name = ?", (name,))]) > 0

    def list_routes(self) -> list[Route]:
        rows = self._query("SELECT pattern, broker_groups FROM routes ORDER BY pattern")
        return [Route(pattern, tuple(json.loads(groups))) for pattern, groups in rows]

    def put_route(self, route: Route) -> None:
        self._write([(
            "INSERT OR REPLACE INTO routes (pattern, broker_groups) VALUES (?, ?)",
            (route.pattern, json.dumps(list(route.broker_groups))),
        )])

    def remove_route(self, pattern: str) -> bool:
        return self._write([("DELETE FROM routes WHERE pattern = ?", (pattern,))]) > 0


def _migrate_sqlite(db: sqlite3.Connection, path: Path) -> None:
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise SchemaTooNew(f"{path}: the meta store has schema version {version}, newer than this meta "
                           f"server's {SCHEMA_VERSION}: run a newer meta server")
    for target in range(version + 1, SCHEMA_VERSION + 1):
        db.execute("BEGIN IMMEDIATE")
        try:
            for statement in SQLITE_MIGRATIONS[target - 1].split(";"):
                if statement.strip():
                    db.execute(statement)
            db.execute(f"PRAGMA user_version = {target}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise


def _grant_of(group: DelayGroup, nodes: list[Node], stored_epoch: int, now_ms: int) -> tuple | None:
    """The epochs row for a grant `group` makes over the stored epoch, if it makes one."""
    if group.master_epoch <= stored_epoch:
        return None
    holder = next((n for n in nodes if n.role is Role.MASTER and n.epoch == group.master_epoch), None)
    assert holder is not None, (group, nodes)  # a new epoch is always granted to a node
    return group.name, group.master_epoch, holder.node_id, now_ms or holder.last_heartbeat_ms


_GROUP_COLUMNS = "name, read_only, master_epoch, lease_expires_ms, version"
_NODE_COLUMNS = "group_name, node_id, address, role, state, last_heartbeat_ms, epoch, eligible, session"


def _lock(path: Path) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise StoreError(f"{path}: cannot create the lock file: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        raise StoreLocked(f"{path}: the meta store is in use by another process ({exc.strerror})") from exc
    return fd


def _delay_group(row: tuple) -> DelayGroup:
    name, read_only, master_epoch, lease_expires_ms, version = row
    return DelayGroup(name, bool(read_only), master_epoch, lease_expires_ms, version)


def _broker_group(row: tuple) -> BrokerGroupSpec:
    name, transport, address, weight, read_only, options = row
    if isinstance(options, str):
        options = json.loads(options)
    return BrokerGroupSpec(name, TransportKind(transport), address, weight, bool(read_only), options)


def _node(row: tuple) -> Node:
    group, node_id, address, role, state, last_heartbeat_ms, epoch, eligible, session = row
    return Node(group, node_id, address, Role(role), NodeState(state), last_heartbeat_ms, epoch,
                bool(eligible), session)
