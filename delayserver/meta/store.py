"""The meta server's store: delay groups and their nodes, broker groups, subject routes.

`MetaStore` is the small interface the meta server needs; `SqliteMetaStore` is the embedded
default (one SQLite file, WAL journal, synchronous=FULL, so that a committed change survives
kill -9 and power loss). Another database can be added behind the same interface.

Methods are blocking. The store assumes one caller at a time: the meta server serializes its
calls under a lock and runs them in a worker thread, so every read-modify-write it makes (a
registration, a promotion) is atomic without database-level locking. `save_group` is the one
write that touches several rows; it commits them in one transaction, so a crash never leaves a
group's epoch and its master's role out of step.

Every method raises StoreError (and nothing else) when the database fails.
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


@attrs.frozen
class DelayGroup:
    """A delay group; `master_epoch` is the epoch of the latest grant of mastership (0: none yet)."""

    name: str
    read_only: bool = False
    master_epoch: int = 0


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
    def save_group(self, group: DelayGroup, nodes: Iterable[Node]) -> None:
        """Insert or replace the group and the given nodes of it, in one transaction."""

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


_SCHEMA = """
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
"""


class StoreLocked(StoreError):
    """Another process holds the store open; two meta servers on one store could hand out one
    epoch twice."""


class SqliteMetaStore(MetaStore):
    def __init__(self, connection: sqlite3.Connection, lock_fd: int):
        self._db = connection
        self._lock_fd = lock_fd

    @classmethod
    def open(cls, path: str | os.PathLike) -> SqliteMetaStore:
        """Open (creating file and schema if needed) the store at `path`.

        Takes an exclusive lock on `<path>.lock` for as long as the store is open; raises
        StoreLocked if another process has it, StoreError if the database cannot be opened.
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
                db.executescript(_SCHEMA)
            except sqlite3.Error:
                db.close()
                raise
        except sqlite3.Error as exc:
            os.close(lock_fd)
            raise StoreError(f"{path}: cannot open the meta store: {exc}") from exc
        return cls(db, lock_fd)

    def close(self) -> None:
        self._db.close()
        os.close(self._lock_fd)

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        try:
            return self._db.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"meta store read failed: {exc}") from exc

    def _write(self, statements: Iterable[tuple[str, tuple]]) -> int:
        """Run the statements in one transaction; the number of rows they changed."""
        changed = 0
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
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
        rows = self._query("SELECT name, read_only, master_epoch FROM delay_groups WHERE name = ?", (name,))
        if not rows:
            return None, []
        return _delay_group(rows[0]), self.list_nodes(name)

    def save_group(self, group: DelayGroup, nodes: Iterable[Node]) -> None:
        statements = [(
            "INSERT INTO delay_groups (name, read_only, master_epoch) VALUES (?, ?, ?) "
            "ON CONFLICT (name) DO UPDATE SET read_only = excluded.read_only, "
            "master_epoch = excluded.master_epoch",
            (group.name, int(group.read_only), group.master_epoch),
        )]
        for node in nodes:
            assert node.group == group.name, (node, group)
            statements.append((
                "INSERT OR REPLACE INTO nodes (group_name, node_id, address, role, state, "
                "last_heartbeat_ms, epoch, eligible, session) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (node.group, node.node_id, node.address, node.role.value, node.state.value,
                 node.last_heartbeat_ms, node.epoch, int(node.eligible), node.session),
            ))
        self._write(statements)

    def list_groups(self) -> list[DelayGroup]:
        rows = self._query("SELECT name, read_only, master_epoch FROM delay_groups ORDER BY name")
        return [_delay_group(row) for row in rows]

    def list_nodes(self, group: str | None = None) -> list[Node]:
        columns = ("SELECT group_name, node_id, address, role, state, last_heartbeat_ms, epoch, "
                   "eligible, session FROM nodes")
        if group is None:
            rows = self._query(columns + " ORDER BY group_name, node_id")
        else:
            rows = self._query(columns + " WHERE group_name = ? ORDER BY node_id", (group,))
        return [_node(row) for row in rows]

    def list_broker_groups(self) -> list[BrokerGroupSpec]:
        rows = self._query(
            "SELECT name, transport, address, weight, read_only, options FROM broker_groups ORDER BY name"
        )
        return [
            BrokerGroupSpec(name, TransportKind(transport), address, weight, bool(read_only), json.loads(options))
            for name, transport, address, weight, read_only, options in rows
        ]

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
    name, read_only, master_epoch = row
    return DelayGroup(name, bool(read_only), master_epoch)


def _node(row: tuple) -> Node:
    group, node_id, address, role, state, last_heartbeat_ms, epoch, eligible, session = row
    return Node(group, node_id, address, Role(role), NodeState(state), last_heartbeat_ms, epoch,
                bool(eligible), session)
