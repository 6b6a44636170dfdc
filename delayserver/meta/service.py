"""The meta server's operations: a JSON request in, a JSON response out, no sockets.

A request is an object ``{"op": NAME, ...arguments}``; the response is ``{"code": ResultCode,
"message": text, ...results}``. The operations, their arguments and results are in `OPS` and the
docstrings of the `op_*` methods. An argument the operation does not take, a missing one, or one
of the wrong type or out of its range is BAD_REQUEST; naming a group, node, broker group or route
that does not exist is NOT_FOUND; a request that needs the cluster secret on a connection that
has not given it is UNAUTHORIZED; a database that cannot be reached is UNAVAILABLE (ask another
meta server); any other store failure is INTERNAL. The message says which and why.

Several meta servers may serve one store (PostgreSQL). Every change to a delay group is read,
decided by the pure rules of `roles`, and written back compare-and-set in one call into the
store; when another meta server wrote the group in between (`Conflict`), it is read and decided
again. Times of heartbeats and lease deadlines come from the store's clock when it has one (the
database server's), so that every meta server measures leases on one clock.
"""
from __future__ import annotations

import json
import logging
import re
import secrets
from typing import Any, Callable

import attrs
import trio

from delayserver.message import SUBJECT_RE, DelayServerError, ResultCode, parse_address
from delayserver.meta import roles, routing
from delayserver.meta.store import (
    Conflict, DelayGroup, MetaStore, Node, NodeState, Role, Route, StoreError, StoreUnavailable,
)
from delayserver.sender.groups import BrokerGroupSpec, TransportKind
from delayserver.sender.transport import check_options

log = logging.getLogger("delayserver.meta")

_NAME_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
MAX_WEIGHT = 1_000_000
MAX_BROKER_ADDRESS = 1024
MAX_OPTIONS_JSON = 16 * 1024
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_SESSION_RE = re.compile(r"[0-9a-f]{32}")
#: What a connection that has not given the cluster secret may ask: producers find delay groups.
OPEN_OPS = frozenset({"live_delay_groups"})
#: Reads and decisions again after this many Conflicts in a row, then gives up with INTERNAL.
MAX_CONFLICTS = 20


class BadRequest(DelayServerError):
    code = ResultCode.BAD_REQUEST


class NotFound(DelayServerError):
    code = ResultCode.NOT_FOUND


class _Changes(Exception):
    """Raised inside a group update to return a result without writing (nothing changed)."""


@attrs.define
class _Args:
    """The arguments of one request; each getter raises BadRequest naming the argument."""

    op: str
    values: dict
    _taken: set = attrs.field(factory=set, init=False)

    def get(self, key: str, kind: type | tuple, default: Any = ..., what: str = "") -> Any:
        self._taken.add(key)
        if key not in self.values:
            if default is ...:
                raise BadRequest(f"{self.op}: argument {key!r} is missing")
            return default
        value = self.values[key]
        # bool is an int in Python; a JSON true must not pass for a number.
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            raise BadRequest(f"{self.op}: argument {key!r} must be {what or _kind_name(kind)}, not {value!r}")
        return value

    def name(self, key: str, default: Any = ...) -> str:
        value = self.get(key, str, default, "a name")
        if value is not default and not _NAME_RE.fullmatch(value):
            raise BadRequest(f"{self.op}: {key} {value!r} must be 1 to 128 characters of [A-Za-z0-9._:-]")
        return value

    def finish(self) -> None:
        unknown = sorted(set(self.values) - self._taken)
        if unknown:
            raise BadRequest(f"{self.op}: unknown arguments {', '.join(map(repr, unknown))}")


def _kind_name(kind: type | tuple) -> str:
    names = {str: "a string", int: "an integer", bool: "true or false", dict: "an object", list: "a list"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


@attrs.define(eq=False)
class MetaService:
    """The operations over one store. Store calls run one at a time, in a worker thread."""

    store: MetaStore
    clock: Any  # has now_ms(); used when the store has no clock of its own
    heartbeat_interval_ms: int = 5000
    missed_heartbeats: int = 3
    # How blocking store calls run. Tests under MockClock's autojump run them inline: the mock
    # clock would jump ahead while a worker thread works.
    run_blocking: Callable = trio.to_thread.run_sync
    _lock: trio.Lock = attrs.field(factory=trio.Lock, init=False)
    # When this meta server last began to reach its store (start, or the end of an outage), on the
    # store's clock; None while it cannot. Nodes could not heartbeat through it before then.
    _reachable_since_ms: int | None = attrs.field(default=None, init=False)
    _store_down: bool | None = attrs.field(default=None, init=False)  # None: not tried yet

    @property
    def lease_ms(self) -> int:
        """The failure timeout: a node not heard from for this long is marked down, and only then
        may another node be granted a newer epoch."""
        return self.heartbeat_interval_ms * self.missed_heartbeats

    @property
    def node_lease_ms(self) -> int:
        """The lease a master holds from the send of an answered heartbeat: shorter than the
        failure timeout by `lease_margin_ms`, so that it has surely run out on the node's
        monotonic clock before the meta server, on its own, marks the node down (clock rates,
        scheduling delays)."""
        return self.lease_ms - lease_margin_ms(self.lease_ms)

    async def handle(self, request: Any, *, authenticated: bool = True) -> dict:
        """The response to one decoded request; never raises for a bad request. A connection
        that has not given the cluster secret (`authenticated` False) may ask `OPEN_OPS` only."""
        try:
            if not isinstance(request, dict):
                raise BadRequest("a meta request must be a JSON object with an 'op'")
            op = request.get("op")
            method = OPS.get(op) if isinstance(op, str) else None
            if method is None:
                raise BadRequest(f"unknown op {op!r}; known ops: {', '.join(sorted(OPS))}")
            if not authenticated and op not in OPEN_OPS:
                raise DelayServerError(f"{op} needs the cluster secret: authenticate first (AUTH)",
                                       code=ResultCode.UNAUTHORIZED)
            args = _Args(op, {k: v for k, v in request.items() if k != "op"})
            result = await method(self, args)
            return {"code": int(ResultCode.OK), "message": result.pop("message", "ok"), **result}
        except DelayServerError as exc:
            return {"code": int(exc.code), "message": exc.message}
        except StoreUnavailable as exc:  # logged once by _call
            return {"code": int(ResultCode.UNAVAILABLE), "message": str(exc)}
        except StoreError as exc:
            log.error("meta store failed: %s", exc)
            return {"code": int(ResultCode.INTERNAL), "message": str(exc)}
        except Exception as exc:  # a bug must cost one request, not the server
            log.exception("meta request %r failed", request)
            return {"code": int(ResultCode.INTERNAL), "message": f"internal error: {exc!r}"}

    async def _call(self, fn: Callable, *args: Any) -> Any:
        """`fn(*args)` in a worker thread, one at a time; keeps track of the store's reachability."""
        async with self._lock:
            fallback_ms = self.clock.now_ms()
            try:
                result = await self.run_blocking(fn, *args)
            except StoreUnavailable as exc:
                if not self._store_down:
                    log.error("meta store unreachable (answering UNAVAILABLE until it is back): %s", exc)
                self._store_down = True
                self._reachable_since_ms = None
                raise
            if self._store_down is not False:
                if self._store_down:
                    log.warning("meta store reachable again; no node is marked down for a lease")
                self._store_down = False
                self._reachable_since_ms = await self.run_blocking(self._now_ms, fallback_ms)
            return result

    def _now_ms(self, fallback_ms: int) -> int:
        """The store's clock, or `fallback_ms` (this meta server's) when it has none. Blocking."""
        now = self.store.clock_ms()
        return fallback_ms if now is None else now

    async def _update_group(self, name: str, change: Callable) -> tuple[list[Node], DelayGroup, list[Node]]:
        """Read group `name`, decide `change(group | None, nodes, now_ms) -> (group, nodes)` and
        write the result compare-and-set, again from a fresh read after each Conflict; the nodes
        before, and the group and nodes as written. `change` may raise to write nothing."""
        fallback_ms = self.clock.now_ms()

        def update():
            for _ in range(MAX_CONFLICTS):
                group, nodes, now = self.store.load_group_at(name)
                now = fallback_ms if now is None else now
                new_group, new_nodes = change(group, nodes, now)
                new_group = self._with_lease(group, nodes, new_group, new_nodes, now)
                try:
                    saved = self.store.save_group(new_group, _changed_nodes(nodes, new_nodes), now_ms=now)
                except Conflict:
                    log.info("delay group %s changed under us (another meta server): deciding again", name)
                    continue
                return nodes, saved, new_nodes
            raise StoreError(f"delay group {name!r} kept changing under {MAX_CONFLICTS} attempts")

        return await self._call(update)

    def _with_lease(self, old: DelayGroup | None, old_nodes: list[Node], group: DelayGroup, nodes: list[Node],
                    now: int) -> DelayGroup:
        """`group` with the lease of its master (its last heartbeat plus a lease).

        Refuses (BUSY, nothing written) a grant of a newer epoch to another node while the
        former master's lease in the group row runs: by `roles` that cannot happen, since a
        master is marked down only a lease after its last heartbeat; this keeps it so whatever
        wrote the row.
        """
        master = roles.master_of(nodes)
        if old is not None and group.master_epoch > old.master_epoch and master is not None:
            former = roles.master_of(old_nodes)
            if former is not None and former.node_id != master.node_id and old.lease_expires_ms > now:
                raise DelayServerError(
                    f"delay group {group.name!r}: the lease of master {former.node_id} runs "
                    f"{old.lease_expires_ms - now} ms more; no promotion before it ends", code=ResultCode.BUSY)
        if master is None or master.state is not NodeState.UP:
            return group
        return attrs.evolve(group, lease_expires_ms=master.last_heartbeat_ms + self.lease_ms)

    async def start(self) -> None:
        """Note when this meta server began to reach its store (see `reap`); never raises."""
        try:
            await self._call(self.store.list_groups)
        except StoreError:
            pass  # logged by _call

    # --- nodes --------------------------------------------------------------------------------

    async def op_register(self, args: _Args) -> dict:
        """register(group, node_id, address, want_role="master"|"slave", previous_session=None,
        session=None) -> role, epoch, session, heartbeat_interval_ms, missed_heartbeats,
        read_only, master. A node wanting "slave" is never made master. NODE_ID_TAKEN while a
        live node holds `node_id` under a session other than `previous_session`. `session`, 32
        random hex digits the node proposes, makes a retry idempotent: registering again with it
        answers the registration already made (default: the meta server draws one)."""
        name, node_id = args.name("group"), args.name("node_id")
        address = _node_address(args)
        want = args.get("want_role", str, "master")
        if want not in (Role.MASTER.value, Role.SLAVE.value):
            raise BadRequest(f"register: want_role must be 'master' or 'slave', not {want!r}")
        previous = args.get("previous_session", str, None)
        session = args.get("session", str, None)
        if session is not None and not _SESSION_RE.fullmatch(session):
            raise BadRequest("register: session must be 32 hex digits, drawn at random by the node")
        args.finish()
        session = session or secrets.token_hex(16)

        def register(group, nodes, now):
            try:
                return roles.register(
                    group, nodes, name=name, node_id=node_id, address=address,
                    eligible=want == Role.MASTER.value, session=session, now_ms=now,
                    previous_session=previous, live_after_ms=now - self.lease_ms,
                )
            except roles.NodeIdTaken as exc:
                raise DelayServerError(str(exc), code=ResultCode.NODE_ID_TAKEN) from None

        old_nodes, group, nodes = await self._update_group(name, register)
        _log_changes(old_nodes, group, nodes)
        reply = self._node_reply(group, nodes, node_id)
        log.info("registered node=%s group=%s address=%s role=%s epoch=%d",
                 node_id, name, address, reply["role"], reply["epoch"])
        return {**reply, "session": session}

    async def op_heartbeat(self, args: _Args) -> dict:
        """heartbeat(group, node_id, session) -> role, epoch, heartbeat_interval_ms,
        missed_heartbeats, lease_ms, read_only, master. NOT_FOUND: register again. A master's
        lease runs `lease_ms` from the moment it sent this heartbeat."""
        name, node_id = args.name("group"), args.name("node_id")
        session = args.get("session", str)
        args.finish()

        def heartbeat(group, nodes, now):
            try:
                return roles.heartbeat(group, nodes, node_id=node_id, session=session, now_ms=now)
            except roles.NotRegistered as exc:
                raise NotFound(str(exc)) from None

        old_nodes, group, nodes = await self._update_group(name, heartbeat)
        _log_changes(old_nodes, group, nodes)
        return self._node_reply(group, nodes, node_id)

    def _node_reply(self, group: DelayGroup, nodes: list[Node], node_id: str) -> dict:
        node = next(n for n in nodes if n.node_id == node_id)
        master = roles.master_of(nodes)
        return {
            "role": roles.role_of(group, node).value,
            "epoch": group.master_epoch,
            "heartbeat_interval_ms": self.heartbeat_interval_ms,
            "missed_heartbeats": self.missed_heartbeats,
            "lease_ms": self.node_lease_ms,
            "read_only": group.read_only,
            "master": _master_json(master),
        }

    async def reap(self) -> None:
        """Mark down the nodes not heard from for a whole lease, and promote where that is due.

        Nothing is marked down until this meta server has reached its store for a whole lease
        (after its start, or after a store outage): a node could not heartbeat through it before,
        and is given that time before it loses its role.
        """
        if self._reachable_since_ms is None:
            await self._call(self.store.list_groups)  # to learn when the store is back
            return
        names = [g.name for g in await self._call(self.store.list_groups)]
        for name in names:
            if self._reachable_since_ms is None:
                return

            def expire(group, nodes, now):
                deadline = now - self.lease_ms
                if group is None or deadline <= (self._reachable_since_ms or now):
                    raise _Changes()
                new_group, new_nodes = roles.expire(group, nodes, deadline_ms=deadline)
                if (new_group, new_nodes) == (group, nodes):
                    raise _Changes()
                return new_group, new_nodes

            try:
                _log_changes(*await self._update_group(name, expire))
            except _Changes:
                pass
            except DelayServerError as exc:  # a promotion that must wait (BUSY): the next round tries again
                log.warning("delay group %s: %s", name, exc)

    async def op_epoch_history(self, args: _Args) -> dict:
        """epoch_history(group) -> epochs: [{epoch, node_id, granted_ms}]: every grant of
        mastership in the group, oldest first."""
        name = args.name("group")
        args.finish()
        rows = await self._call(self.store.list_epochs, name)
        return {"epochs": [{"epoch": e, "node_id": n, "granted_ms": t} for e, n, t in rows]}

    async def op_list_groups(self, args: _Args) -> dict:
        """list_groups() -> groups: [{name, read_only, master_epoch, lease_expires_ms, master}]."""
        args.finish()
        groups, nodes = await self._call(lambda: (self.store.list_groups(), self.store.list_nodes()))
        return {"groups": [
            {"name": g.name, "read_only": g.read_only, "master_epoch": g.master_epoch,
             "lease_expires_ms": g.lease_expires_ms,
             "master": _master_json(roles.master_of([n for n in nodes if n.group == g.name]))}
            for g in groups
        ]}

    async def op_list_nodes(self, args: _Args) -> dict:
        """list_nodes(group=None) -> nodes: [{group, node_id, address, role, state,
        last_heartbeat_ms, epoch, want_role}] of one group or all."""
        group = args.name("group", None)
        args.finish()
        nodes = await self._call(self.store.list_nodes, group)
        return {"nodes": [_node_json(n) for n in nodes]}

    async def op_set_group_read_only(self, args: _Args) -> dict:
        """set_group_read_only(group, read_only) -> group. A read-only group is left out of
        live_delay_groups, so producers stop sending to it; its nodes learn it by heartbeat."""
        name = args.name("group")
        read_only = args.get("read_only", bool)
        args.finish()

        def set_read_only(group, nodes, now):
            if group is None:
                raise NotFound(f"no delay group {name!r}")
            return attrs.evolve(group, read_only=read_only), nodes

        _, group, _ = await self._update_group(name, set_read_only)
        log.info("delay group %s read_only=%s", name, read_only)
        state = "read-only" if read_only else "writable"
        return {"message": f"delay group {name!r} is {state}",
                "group": {"name": group.name, "read_only": group.read_only, "master_epoch": group.master_epoch}}

    async def op_live_delay_groups(self, args: _Args) -> dict:
        """live_delay_groups() -> delay_groups: [{group, node_id, address, epoch}]: the groups that
        are not read-only and have a master that is up, for producers to send to."""
        args.finish()
        groups, nodes = await self._call(lambda: (self.store.list_groups(), self.store.list_nodes()))
        live = []
        for g in groups:
            master = roles.master_of([n for n in nodes if n.group == g.name])
            if not g.read_only and master is not None and master.state is NodeState.UP:
                live.append({"group": g.name, "node_id": master.node_id, "address": master.address,
                             "epoch": g.master_epoch})
        return {"delay_groups": live}

    # --- broker groups and routes ---------------------------------------------------------------

    async def op_list_broker_groups(self, args: _Args) -> dict:
        """list_broker_groups() -> broker_groups: [{name, transport, address, weight, read_only, options}]."""
        args.finish()
        specs = await self._call(self.store.list_broker_groups)
        return {"broker_groups": [s.to_json() for s in specs]}

    async def op_add_broker_group(self, args: _Args) -> dict:
        """add_broker_group(name, transport, address, weight=1, read_only=false, options={})
        -> broker_group. BAD_REQUEST if the name is taken."""
        spec = BrokerGroupSpec(
            name=args.name("name"),
            transport=_transport(args.get("transport", str)),
            address=_broker_address(args.get("address", str)),
            weight=_weight(args.get("weight", int, 1)),
            read_only=args.get("read_only", bool, False),
            options=_options(args.get("options", dict, {})),
        )
        args.finish()
        _check_transport_options(spec)

        def add():
            if any(s.name == spec.name for s in self.store.list_broker_groups()):
                raise BadRequest(f"broker group {spec.name!r} exists already; update it instead")
            self.store.put_broker_group(spec)

        await self._call(add)
        log.info("broker group added: %s", spec.to_json())
        return {"message": f"broker group {spec.name!r} added", "broker_group": spec.to_json()}

    async def op_update_broker_group(self, args: _Args) -> dict:
        """update_broker_group(name, transport?, address?, weight?, read_only?, options?)
        -> broker_group. `options` is merged into the present ones; a null value removes a key."""
        name = args.name("name")
        changes = {}
        if "transport" in args.values:
            changes["transport"] = _transport(args.get("transport", str))
        if "address" in args.values:
            changes["address"] = _broker_address(args.get("address", str))
        if "weight" in args.values:
            changes["weight"] = _weight(args.get("weight", int))
        if "read_only" in args.values:
            changes["read_only"] = args.get("read_only", bool)
        patch = args.get("options", dict, {})
        args.finish()

        def update():
            spec = next((s for s in self.store.list_broker_groups() if s.name == name), None)
            if spec is None:
                raise NotFound(f"no broker group {name!r}")
            options = {k: v for k, v in {**spec.options, **patch}.items() if v is not None}
            spec = attrs.evolve(spec, options=_options(options), **changes)
            _check_transport_options(spec)
            self.store.put_broker_group(spec)
            return spec

        spec = await self._call(update)
        log.info("broker group updated: %s", spec.to_json())
        return {"message": f"broker group {name!r} updated", "broker_group": spec.to_json()}

    async def op_remove_broker_group(self, args: _Args) -> dict:
        """remove_broker_group(name). BAD_REQUEST while a route names it."""
        name = args.name("name")
        args.finish()

        def remove():
            users = [r.pattern for r in self.store.list_routes() if name in r.broker_groups]
            if users:
                raise BadRequest(f"broker group {name!r} is used by routes {', '.join(users)}; "
                                 "remove or change them first")
            if not self.store.remove_broker_group(name):
                raise NotFound(f"no broker group {name!r}")

        await self._call(remove)
        log.info("broker group removed: %s", name)
        return {"message": f"broker group {name!r} removed"}

    async def op_list_routes(self, args: _Args) -> dict:
        """list_routes() -> routes: [{pattern, broker_groups}]."""
        args.finish()
        routes = await self._call(self.store.list_routes)
        return {"routes": [r.to_json() for r in routes]}

    async def op_add_route(self, args: _Args) -> dict:
        """add_route(pattern, broker_groups) -> route. Replaces the groups of an existing pattern;
        every group named must exist (NOT_FOUND)."""
        pattern = args.get("pattern", str)
        try:
            routing.check_pattern(pattern)
        except ValueError as exc:
            raise BadRequest(f"add_route: {exc}") from None
        names = args.get("broker_groups", list)
        if not names or len(set(names)) != len(names):
            raise BadRequest("add_route: broker_groups must be a non-empty list of distinct names")
        for value in names:
            if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
                raise BadRequest(f"add_route: {value!r} is not a broker group name")
        args.finish()
        route = Route(pattern, tuple(names))

        def add():
            known = {s.name for s in self.store.list_broker_groups()}
            missing = [n for n in names if n not in known]
            if missing:
                raise NotFound(f"no broker group {', '.join(map(repr, missing))}; add it first")
            replaced = any(r.pattern == pattern for r in self.store.list_routes())
            self.store.put_route(route)
            return replaced

        replaced = await self._call(add)
        log.info("route %s: %s -> %s", "replaced" if replaced else "added", pattern, ", ".join(names))
        return {"message": "route replaced" if replaced else "route added", "route": route.to_json()}

    async def op_remove_route(self, args: _Args) -> dict:
        """remove_route(pattern)."""
        pattern = args.get("pattern", str)
        args.finish()
        if not await self._call(self.store.remove_route, pattern):
            raise NotFound(f"no route {pattern!r}")
        log.info("route removed: %s", pattern)
        return {"message": f"route {pattern!r} removed"}

    async def op_resolve(self, args: _Args) -> dict:
        """resolve(subject) -> route (the deciding pattern, or null), broker_groups: the groups
        serving `subject` by the rule in `routing`."""
        subject = args.get("subject", str)
        if not SUBJECT_RE.match(subject.encode("utf-8", "replace")):
            raise DelayServerError(f"resolve: bad subject {subject!r}: 1 to 255 bytes of [A-Za-z0-9._:%|-]",
                                   code=ResultCode.BAD_SUBJECT)
        args.finish()
        routes, specs = await self._call(lambda: (self.store.list_routes(), self.store.list_broker_groups()))
        route, chosen = routing.resolve(subject, routes, specs)
        return {"route": route.pattern if route else None, "broker_groups": [s.to_json() for s in chosen]}


def lease_margin_ms(failure_timeout_ms: int) -> int:
    """How much shorter a master's lease is than the failure timeout: a tenth of it, at least
    100 ms (and never all of it)."""
    return min(max(failure_timeout_ms // 10, 100), failure_timeout_ms // 2)


OPS: dict[str, Callable] = {
    name[len("op_"):]: method for name, method in vars(MetaService).items() if name.startswith("op_")
}


def _node_address(args: _Args) -> str:
    address = args.get("address", str)
    try:
        parse_address(address)
    except ValueError as exc:
        raise BadRequest(f"{args.op}: {exc}") from None
    return address


def _transport(value: str) -> TransportKind:
    try:
        return TransportKind(value)
    except ValueError:
        raise BadRequest(f"transport must be one of {', '.join(t.value for t in TransportKind)}, "
                         f"not {value!r}") from None


def _broker_address(value: str) -> str:
    if not value or len(value) > MAX_BROKER_ADDRESS or _CONTROL_RE.search(value):
        raise BadRequest(f"a broker group address must be 1 to {MAX_BROKER_ADDRESS} printable characters")
    return value


def _weight(value: int) -> int:
    if not 1 <= value <= MAX_WEIGHT:
        raise BadRequest(f"weight must be 1 to {MAX_WEIGHT}, not {value}")
    return value


def _options(value: dict) -> dict:
    if len(json.dumps(value)) > MAX_OPTIONS_JSON:
        raise BadRequest(f"options are over {MAX_OPTIONS_JSON} bytes of JSON")
    return value


def _check_transport_options(spec: BrokerGroupSpec) -> None:
    """BAD_REQUEST naming the field when the group's address or options cannot work."""
    try:
        check_options(spec)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def _master_json(master: Node | None) -> dict | None:
    if master is None:
        return None
    return {"node_id": master.node_id, "address": master.address, "state": master.state.value}


def _changed_nodes(before: list[Node], after: list[Node]) -> list[Node]:
    old = {n.node_id: n for n in before}
    return [n for n in after if old.get(n.node_id) != n]


def _node_json(node: Node) -> dict:
    return {
        "group": node.group, "node_id": node.node_id, "address": node.address,
        "role": node.role.value, "state": node.state.value,
        "last_heartbeat_ms": node.last_heartbeat_ms, "epoch": node.epoch,
        "want_role": (Role.MASTER if node.eligible else Role.SLAVE).value,
    }


def _log_changes(old_nodes: list[Node], group: DelayGroup, nodes: list[Node]) -> None:
    before = {n.node_id: n for n in old_nodes}
    for node in nodes:
        old = before.get(node.node_id)
        if old is not None and old.state is not node.state:
            log.warning("node %s of group %s is %s", node.node_id, group.name, node.state.value)
        if node.role is Role.MASTER and (old is None or old.role is not Role.MASTER):
            log.warning("node %s is master of group %s with epoch %d", node.node_id, group.name, node.epoch)
