"""What the HTTP API needs from a node, as one narrow protocol, and its adapter for DelayServer.

The app (`app.py`) only ever calls a `NodeOps`; `ServerOps` is the one place that knows the
node's insides (message operations, role, receiver, tick manager, sender, replication), through
the `NodeView` the node hands it.
"""
from __future__ import annotations

import logging
import ssl
from typing import Protocol

from delayserver.message import Handle, TimeSpec
from delayserver.meta.client import MetaClient, MetaError, MetaUnavailable
from delayserver.node.role import RoleState
from delayserver.node.view import NodeView
from delayserver.protocol import CancelResult, SendItem, SendResult, StatusResult
from delayserver.sender.groups import BrokerGroupSpec
from delayserver.sender.parked import iter_parked, redriven_offset, set_redriven_offset

log = logging.getLogger("delayserver.http")

_ROLE_NAMES = {RoleState.MASTER: "master", RoleState.SLAVE: "slave", RoleState.FENCED: "none"}


class NodeOps(Protocol):
    async def send(self, items: list[SendItem]) -> list[SendResult]: ...
    async def status(self, handle: Handle) -> StatusResult: ...
    async def cancel(self, handle: Handle) -> CancelResult: ...
    def node(self) -> dict: ...
    def health_problems(self) -> list[str]: ...
    def readiness_problems(self) -> list[str]: ...
    def broker_groups(self) -> list[dict]: ...
    def parked(self, include_redriven: bool) -> list[dict]: ...
    async def redrive(self) -> dict: ...
    async def group_nodes(self) -> list[dict]: ...
    def delivery(self) -> dict: ...


class ServerOps:
    """NodeOps over a running node's services (`NodeView`): its message operations, role,
    receiver, replayer, tick manager, sender and replication."""

    def __init__(self, node: NodeView):
        self._node = node
        # Readiness, once reached, is not lost at a bucket boundary (the loader catches up then).
        self._replay_target = node.receiver.durable_offset
        self._replayed = False
        self._loaded = False

    async def send(self, items: list[SendItem]) -> list[SendResult]:
        return await self._node.operations.send(items, api="http")

    async def status(self, handle: Handle) -> StatusResult:
        return await self._node.operations.status(handle)

    async def cancel(self, handle: Handle) -> CancelResult:
        return await self._node.operations.cancel(handle)

    # --- role, health, readiness --------------------------------------------------------------

    def role(self) -> str:
        """master, slave, or none (fenced: no word from the meta server yet, or no role in it)."""
        return _ROLE_NAMES[self._node.role.state]

    def node(self) -> dict:
        n, c = self._node, self._node.config
        agent = n.role.agent
        info = {
            "node_id": n.node_id,
            "group": c.group,
            "role": self.role(),
            "epoch": agent.epoch if agent is not None else 0,
            "master": n.role.master_address() or "",
            "meta": c.meta or "",
            "read_only": bool(n.receiver.read_only_reason) or bool(agent is not None and agent.read_only),
            "read_only_reason": n.receiver.read_only_reason,
            "disk_full": bool(n.disk.full),
            "may_deliver": bool(n.role.may_deliver()),
            "message_log": {"end_offset": n.store.message_log.end_offset,
                            "durable_offset": n.receiver.durable_offset,
                            "replay_offset": n.replayer.offset},
            "loading_cursor": {"bucket": n.ticks.loading_bucket or 0, "end_offset": n.ticks.loading_end,
                               "loaded_offset": n.ticks.loaded_offset},
            "replication": self._replication(),
        }
        return info

    def _replication(self) -> dict:
        n = self._node
        durable = n.receiver.durable_offset
        slaves = [{"node_id": s.node_id, "offset": s.message_log_offset,
                   "lag_bytes": max(0, durable - s.message_log_offset), "pinning": s.pinning}
                  for s in sorted(n.master.slaves.states.values(), key=lambda s: s.node_id)]
        out: dict = {"mode": n.config.replication, "slaves": slaves}
        insync = n.master.insync
        if insync is not None:
            out["sync"] = {"accepting_writes": not insync.closed, "in_sync_slaves": insync.in_sync(durable),
                           "min_insync_replicas": insync.min_insync_replicas, "timeouts": insync.timeouts}
        if n.slave is not None and n.role.is_slave():
            out["from_master"] = {"master": n.role.master_address() or "", "pulled_bytes": n.slave.pulled,
                                  "lag_bytes": n.slave.lag_bytes, "lag_seconds": round(n.slave.lag_seconds(), 3),
                                  "stopped_reason": n.slave.stopped_reason}
        return out

    def health_problems(self) -> list[str]:
        n = self._node
        problems = []
        if n.receiver.read_only_reason:
            problems.append(f"read-only: {n.receiver.read_only_reason}")
        if n.slave is not None and n.slave.stopped_reason:
            problems.append(f"replication stopped: {n.slave.stopped_reason}")
        return problems

    def readiness_problems(self) -> list[str]:
        n = self._node
        problems = self.health_problems()
        self._replayed = self._replayed or n.replayer.offset >= self._replay_target
        if not self._replayed:
            problems.append(f"replaying: at {n.replayer.offset} of {self._replay_target}")
        ticks = n.ticks
        self._loaded = self._loaded or (ticks.loading_bucket is not None and ticks.loaded_offset >= ticks.loading_end
                                        and ticks.loading_bucket >= ticks.load_target(n.clock.now_ms()))
        role = self.role()
        if not self._loaded and role == "master":  # only a master loads its schedule into the wheel
            problems.append("loading the schedule")
        if role == "none":
            problems.append("no role yet (the meta server has not answered)")
        elif role == "slave" and (n.slave is None or not n.slave.in_sync):
            behind = f"by {n.slave.lag_bytes} bytes" if n.slave is not None and n.slave.lag_bytes else "(not synced yet)"
            problems.append(f"slave behind its master {behind}")
        return problems

    # --- delivery -----------------------------------------------------------------------------

    def broker_groups(self) -> list[dict]:
        out = []
        for g in list(self._node.sender.groups.values()):
            spec: BrokerGroupSpec | None = g.spec
            out.append({"name": g.name, "transport": spec.transport.value if spec is not None else "",
                        "weight": g.weight,
                        "subjects": sorted(g.subjects) if g.subjects is not None else None,
                        "breaker": g.breaker.state, "queued": len(g.queue), "inflight": g.inflight,
                        "delivered": g.sent, "retried": g.retried, "parked": g.parked,
                        "failed_batches": g.failed_batches})
        return out

    def delivery(self) -> dict:
        n = self._node
        return {"delivered": n.sender.delivered, "retried": n.sender.retried, "parked": n.sender.parked_count,
                "inflight": len(n.ticks.inflight), "due_waiting": len(n.ticks.ready),
                "wheel_entries": len(n.ticks.wheel), "received": n.receiver.appended,
                "connections": n.connections()}

    # --- parked -------------------------------------------------------------------------------

    def _parked_dir(self):
        return self._node.config.data_dir / "parked"

    def parked(self, include_redriven: bool) -> list[dict]:
        directory = self._parked_dir()
        start = 0 if include_redriven else redriven_offset(directory)
        done = redriven_offset(directory)
        out = []
        for offset, p in iter_parked(directory, start):
            m = p.message
            out.append({"offset": offset, "id": m.message_id, "subject": m.subject,
                        "handle": str(Handle(m.schedule_time, m.message_id)), "schedule_time": m.schedule_time,
                        "parked_time": p.parked_time, "attempt": p.attempt, "reason": p.reason,
                        "body_bytes": len(m.body), "redriven": offset < done})
        return out

    async def redrive(self) -> dict:
        """Send every parked message not yet redriven again, due at once (as `delayctl redrive`)."""
        directory = self._parked_dir()
        start = redriven_offset(directory)
        todo = list(iter_parked(directory, start))
        end, sent, failed = start, 0, None
        for offset, p in todo:
            m = p.message
            headers = {**m.headers, "redriven-from": str(Handle(m.schedule_time, m.message_id))}
            [result] = await self.send([SendItem(m.message_id, m.subject, TimeSpec.delay(0), m.body, headers)])
            if result.code != 0:
                failed = result
                break
            end, sent = offset + 1, sent + 1
        if end > start:
            set_redriven_offset(directory, end)
        out = {"redriven": sent, "remaining": len(todo) - sent}
        if failed is not None:
            out["error"] = {"code": int(failed.code), "message": failed.message}
        return out

    # --- the delay group ----------------------------------------------------------------------

    async def group_nodes(self) -> list[dict]:
        """The delay group's nodes and roles from the meta server (this node alone without one)."""
        n, c = self._node, self._node.config
        if not c.meta:
            return [{"node_id": n.node_id, "group": c.group, "role": self.role(),
                     "address": c.advertised_address or f"{c.listen[0]}:{n.port}", "alive": True, "epoch": 0,
                     "source": "local"}]
        try:
            tls = ssl.create_default_context(cafile=c.meta_tls_ca) if c.meta_tls_ca else None
            async with MetaClient(c.meta, timeout_s=3, secret=c.cluster_secret, tls=tls) as client:
                reply = await client.request("list_nodes", group=c.group)
        except (MetaUnavailable, MetaError, OSError) as e:
            log.warning("cannot list the group's nodes: %s", e)
            return []
        return [{**n, "source": "meta"} for n in reply.get("nodes", [])]
