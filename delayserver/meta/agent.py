"""`MetaAgent`: what a delay-server node runs to take part in its delay group.

It registers the node, heartbeats at the interval the meta server sets, and keeps the node's role
and epoch. It fetches the broker groups and routes every `refresh_interval_ms` (and after each
registration) and keeps them in memory and in a cache file, written atomically, so that delivery
can go on from them while the meta server is unreachable, and a node restarted during an outage
still has them.

The node may name several meta servers: heartbeats go to the one that last answered and move to
the next when it fails (see `MetaClient`); over a shared store any of them knows the node's
registration, so the node keeps its session, role and epoch. The session is kept in a file
beside the cache too: a node restarted within its lease registers again with it, as the same
node; anyone else is refused the node id while the node is live.

Delivery is fenced (see `may_deliver`): a node delivers only while it is master at the group's
current epoch and holds a lease, renewed by every answered heartbeat and measured on trio's
monotonic clock from the moment that heartbeat was sent. The lease (`lease_ms` in the answer) is
shorter than the meta server's failure timeout, after which it marks a node down and only then
may grant a newer epoch to another node; so the former master's lease has surely run out before
its successor is told it is master. Writes are acknowledged only under the lease (`holds_lease`),
even with `deliver_through_meta_outage`.
"""
from __future__ import annotations

import logging
import secrets
import ssl
from pathlib import Path
from typing import Callable, Sequence

import trio

from delayserver.message import ResultCode
from delayserver.meta import routing
from delayserver.meta.client import MetaClient, MetaError, MetaUnavailable
from delayserver.meta.service import lease_margin_ms
from delayserver.meta.store import Role, Route
from delayserver.sender.groups import BrokerGroupSpec
from delayserver.storage.checkpoint import read_checkpoint, write_checkpoint
from delayserver.storage.errors import StorageError

log = logging.getLogger("delayserver.meta.agent")

DEFAULT_REFRESH_INTERVAL_MS = 30_000
# Until the meta server says otherwise (it does in every registration answer).
_DEFAULT_HEARTBEAT_INTERVAL_MS = 5000
_DEFAULT_MISSED_HEARTBEATS = 3


class MetaAgent:
    """A node's link to the meta server. Read `role`, `epoch`, `master_address`, `read_only`;
    call `may_deliver()`, `broker_groups()`, `resolve(subject)`; wait on `changed`.

    `changed` is a trio.Event set when the role, epoch, master, read-only flag, `may_deliver()`,
    broker groups or routes change, and then replaced by a fresh one: take ``agent.changed``,
    await its ``wait()``, read the agent, repeat.
    """

    def __init__(
        self, meta_address: str | Sequence[str], group: str, node_id: str, advertised_address: str, clock,
        cache_path: str | Path, *, want_role: str = "master",
        refresh_interval_ms: int = DEFAULT_REFRESH_INTERVAL_MS,
        deliver_through_meta_outage: bool = False,
        cluster_secret: str = "", tls: ssl.SSLContext | None = None,
        run_blocking: Callable = trio.to_thread.run_sync,
    ):
        """`want_role` "slave" registers a node that is never made master. `meta_address`: one
        meta server or several (``a,b,c``). `cluster_secret` and `tls` go to each connection
        to them (see MetaClient). The session is kept in `<cache name>.session.json` beside
        `cache_path`.

        `deliver_through_meta_outage`: by default a master stops delivering when its lease runs
        out, which a meta server outage longer than the lease causes too. With True, a master that
        cannot reach the meta server (connection refused or timed out) goes on delivering until it
        hears otherwise. That keeps delivery going through a meta outage, at a price: if the
        node is cut off from the meta server while its slave is not, the slave is promoted and both
        deliver (duplicates) until the node hears from the meta server again.

        `run_blocking` runs the cache file I/O (a worker thread; tests under MockClock's autojump
        run it inline). Raises ValueError for a meta address list that is not HOST:PORT[,...].
        """
        self.group = group
        self.node_id = node_id
        self.advertised_address = advertised_address
        self.want_role = want_role
        self.clock = clock
        self.cache_path = Path(cache_path)
        self.refresh_interval_ms = refresh_interval_ms
        self.deliver_through_meta_outage = deliver_through_meta_outage
        self.run_blocking = run_blocking
        self.session_path = self.cache_path.with_name(self.cache_path.stem + ".session.json")
        self._client = MetaClient(meta_address, secret=cluster_secret, tls=tls)
        self._previous_session: str | None = None
        self._proposed_session: str | None = None

        self.role: Role | None = None
        self.epoch = 0
        self.master_address: str | None = None
        self.read_only = False
        self.changed = trio.Event()
        self._session: str | None = None
        self._interval_ms = _DEFAULT_HEARTBEAT_INTERVAL_MS
        self._missed = _DEFAULT_MISSED_HEARTBEATS
        self._lease_until = float("-inf")  # trio time
        self._reachable = False
        self._broker_groups: list[BrokerGroupSpec] = []
        self._routes: list[Route] = []
        self._published: tuple = ()

    # --- what the node asks -------------------------------------------------------------------

    def may_deliver(self) -> bool:
        """True only while this node is master at its group's current epoch and its lease holds
        (or, with `deliver_through_meta_outage`, while the meta server is unreachable). False from
        the moment an answer says the node is not master."""
        if self.role is not Role.MASTER:
            return False
        if trio.current_time() < self._lease_until:
            return True
        return self.deliver_through_meta_outage and not self._reachable

    def holds_lease(self) -> bool:
        """True only while this node is master at its group's current epoch under an unexpired
        lease: what acknowledging a write needs, whatever `deliver_through_meta_outage` says."""
        return self.role is Role.MASTER and trio.current_time() < self._lease_until

    def broker_groups(self) -> list[BrokerGroupSpec]:
        """Every broker group, as last fetched or cached (read-only ones included)."""
        return list(self._broker_groups)

    def routes(self) -> list[Route]:
        return list(self._routes)

    def resolve(self, subject: str) -> list[BrokerGroupSpec]:
        """The broker groups serving `subject`, by the rule in `routing`, from the cache."""
        return routing.resolve(subject, self._routes, self._broker_groups)[1]

    # --- the task -----------------------------------------------------------------------------

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Load the cache, register, then heartbeat and refresh until cancelled.

        Reports started after the first registration attempt, whether or not the meta server
        answered: a node must come up during a meta outage.
        """
        await self._load_cache()
        async with self._client:
            next_beat = trio.current_time()
            next_refresh = float("inf")
            while True:
                if trio.current_time() >= next_beat:
                    if await self._beat():
                        next_refresh = trio.current_time()  # a new registration: fetch routes now
                    next_beat = trio.current_time() + self._interval_ms / 1000
                if self._reachable and trio.current_time() >= next_refresh:
                    await self._refresh()
                    next_refresh = trio.current_time() + self.refresh_interval_ms / 1000
                self._publish()
                if task_status is not trio.TASK_STATUS_IGNORED:
                    task_status.started()
                    task_status = trio.TASK_STATUS_IGNORED
                await trio.sleep_until(self._wake_time(next_beat, next_refresh))

    def _wake_time(self, next_beat: float, next_refresh: float) -> float:
        wake = min(next_beat, next_refresh) if self._reachable else next_beat
        if self.may_deliver() and self._lease_until > trio.current_time():
            wake = min(wake, self._lease_until)  # to publish the lease running out
        return wake

    async def _beat(self) -> bool:
        """Heartbeat, or register when not registered (or told to register again); True when a
        new registration was made."""
        if self._session is not None:
            sent = trio.current_time()
            reply = await self._ask("heartbeat", group=self.group, node_id=self.node_id, session=self._session)
            if reply is not None:
                self._apply(reply, sent)
            if self._session is not None:
                return False
        sent = trio.current_time()
        previous = {"previous_session": self._previous_session} if self._previous_session else {}
        # Kept until an answer comes: a retry after a lost answer is the same registration.
        self._proposed_session = self._proposed_session or secrets.token_hex(16)
        reply = await self._ask("register", group=self.group, node_id=self.node_id, session=self._proposed_session,
                                address=self.advertised_address, want_role=self.want_role, **previous)
        if reply is None:
            return False
        self._session = self._previous_session = reply["session"]
        self._proposed_session = None
        self._apply(reply, sent)
        try:
            await self.run_blocking(write_checkpoint, self.session_path,
                                    {"group": self.group, "node_id": self.node_id, "session": self._session})
        except StorageError as exc:
            # Only a restart within the lease needs it: that restart then waits the lease out.
            log.error("cannot keep the meta session in %s: %s", self.session_path, exc)
        return True

    async def _ask(self, op: str, **args) -> dict | None:
        """The answer to a register or heartbeat; None when there is none, after stopping
        delivery at once if the meta server no longer knows this registration (NOT_FOUND). Any
        other refusal (NODE_ID_TAKEN, BUSY, UNAUTHORIZED, INTERNAL) renews nothing: the lease
        runs out unless a later answer renews it."""
        try:
            reply = await self._client.request(op, timeout_s=self._interval_ms / 1000, **args)
        except MetaUnavailable as exc:
            if self._reachable:
                log.warning("meta server unreachable: %s", exc)
            self._reachable = False
            return None
        except MetaError as exc:
            self._reachable = True
            if exc.code is ResultCode.NOT_FOUND:
                self.role = None
                self._lease_until = float("-inf")
                self._session = None
                log.warning("meta server refused %s of node %s: %s", op, self.node_id, exc)
            else:
                log.error("meta server refused %s of node %s: %s", op, self.node_id, exc)
            return None
        if not self._reachable:
            log.info("meta server reachable")
        self._reachable = True
        return reply

    def _apply(self, reply: dict, sent: float) -> None:
        self._interval_ms = reply["heartbeat_interval_ms"]
        self._missed = reply["missed_heartbeats"]
        role = Role(reply["role"])
        if role != self.role or reply["epoch"] != self.epoch:
            log.warning("node %s of group %s: %s at epoch %d", self.node_id, self.group, role.value, reply["epoch"])
        self.role = role
        self.epoch = reply["epoch"]
        self.read_only = reply["read_only"]
        master = reply["master"]
        self.master_address = master["address"] if master else None
        # Measured from the send: the meta server heard from us no earlier than that; and shorter
        # than its failure timeout (an older meta server names no lease: the same margin here).
        lease_ms = reply.get("lease_ms") or self._interval_ms * self._missed - lease_margin_ms(
            self._interval_ms * self._missed)
        self._lease_until = sent + lease_ms / 1000 if role is Role.MASTER else float("-inf")

    async def _refresh(self) -> None:
        try:
            specs = await self._client.request("list_broker_groups")
            routes = await self._client.request("list_routes")
            broker_groups = [BrokerGroupSpec.from_json(s) for s in specs["broker_groups"]]
            route_list = [Route.from_json(r) for r in routes["routes"]]
        except (MetaUnavailable, MetaError, KeyError, TypeError, ValueError) as exc:
            log.warning("cannot refresh broker groups and routes: %s", exc)
            return
        if (broker_groups, route_list) == (self._broker_groups, self._routes):
            return
        self._broker_groups, self._routes = broker_groups, route_list
        log.info("broker groups and routes changed: %d groups, %d routes", len(broker_groups), len(route_list))
        data = {
            "fetched_at_ms": self.clock.now_ms(),
            "broker_groups": [s.to_json() for s in broker_groups],
            "routes": [r.to_json() for r in route_list],
        }
        try:
            await self.run_blocking(write_checkpoint, self.cache_path, data)
        except StorageError as exc:
            # The routes in memory are fresh; only a restart during a meta outage would miss them.
            log.error("cannot write the route cache: %s", exc)

    async def _load_cache(self) -> None:
        try:
            kept = await self.run_blocking(read_checkpoint, self.session_path)
            if kept and kept.get("group") == self.group and kept.get("node_id") == self.node_id:
                self._previous_session = str(kept["session"])
        except (OSError, StorageError, KeyError, TypeError, ValueError) as exc:
            log.error("ignoring the kept meta session %s: %s", self.session_path, exc)
        try:
            data = await self.run_blocking(read_checkpoint, self.cache_path)
            if data is None:
                return
            self._broker_groups = [BrokerGroupSpec.from_json(s) for s in data["broker_groups"]]
            self._routes = [Route.from_json(r) for r in data["routes"]]
        except (OSError, StorageError, KeyError, TypeError, ValueError) as exc:
            log.error("ignoring the route cache %s: %s", self.cache_path, exc)
            return
        log.info("loaded %d broker groups and %d routes from %s (fetched at %s ms)",
                 len(self._broker_groups), len(self._routes), self.cache_path, data.get("fetched_at_ms"))

    def _publish(self) -> None:
        state = (self.role, self.epoch, self.master_address, self.read_only, self.may_deliver(),
                 self._broker_groups, self._routes)
        if state != self._published:
            self._published = state
            self.changed.set()
            self.changed = trio.Event()
