"""What the HTTP API needs from a node, as one narrow protocol, and its adapter for DelayServer.

The app (`app.py`) only ever calls a `NodeOps`; `ServerOps` is the one place that knows the
node's insides (receiver, tick manager, sender, meta agent, replication).
"""
from __future__ import annotations

import logging
from typing import Protocol

from delayserver.meta.client import MetaClient, MetaError, MetaUnavailable
from delayserver.protocol import CancelResult, Handle, SendItem, SendResult, StatusResult, TimeSpec
from delayserver.sender.parked import iter_parked, redriven_offset, set_redriven_offset

log = logging.getLogger("delayserver.http")


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
    """NodeOps over a running DelayServer."""

    def __init__(self, server):
        self.server = server
        # Readiness, once reached, is not lost at a bucket boundary (the loader catches up then).
        self._replay_target = server.receiver.durable_offset
        self._replayed = False
        self._loaded = False

    async def send(self, items: list[SendItem]) -> list[SendResult]:
        return await self.server.send_items(items, api="http")

    async def status(self, handle: Handle) -> StatusResult:
        return await self.server.status(handle)

    async def cancel(self, handle: Handle) -> CancelResult:
        return await self.server.cancel(handle)

    # --- role, health, readiness --------------------------------------------------------------

    def role(self) -> str:
        s = self.server
        if s._is_master():
            return "master"
        if s._is_slave():
            return "slave"
        return "none"

    def node(self) -> dict:
        s, c = self.server, self.server.config
        agent = s.meta_agent
        info = {
            "node_id": c.node_id or f"{c.listen[0]}:{s.port}",
            "group": c.group,
            "role": self.role(),
            "epoch": agent.epoch if agent is not None else 0,
            "master": s._master_address() or "",
            "meta": c.meta or "",
            "read_only": bool(s.receiver.read_only_reason) or bool(agent is not None and agent.read_only),
            "read_only_reason": s.receiver.read_only_reason,
            "disk_full": bool(s.receiver.disk_full),
            "may_deliver": bool(s._may_deliver()),
            "message_log": {"end_offset": s.store.message_log.end_offset,
                            "durable_offset": s.receiver.durable_offset,
                            "replay_offset": s.replayer.offset},
            "loading_cursor": {"bucket": s.ticks.loading_bucket or 0, "end_offset": s.ticks.loading_end,
                               "loaded_offset": s.ticks.loaded_offset},
            "replication": self._replication(),
        }
        return info

    def _replication(self) -> dict:
        s = self.server
        durable = s.receiver.durable_offset
        slaves = [{"node_id": node, "offset": offset, "lag_bytes": max(0, durable - offset)}
                  for node, offset in sorted(s.master.message_log_offsets.items())]
        out: dict = {"slaves": slaves}
        if s.slave is not None and s._is_slave():
            out["from_master"] = {"master": s._master_address() or "", "pulled_bytes": s.slave.pulled,
                                  "lag_bytes": s.slave.lag_bytes, "lag_seconds": round(s.slave.lag_seconds(), 3),
                                  "stopped_reason": s.slave.stopped_reason}
        return out

    def health_problems(self) -> list[str]:
        s = self.server
        problems = []
        if s.receiver.read_only_reason:
            problems.append(f"read-only: {s.receiver.read_only_reason}")
        if s.slave is not None and s.slave.stopped_reason:
            problems.append(f"replication stopped: {s.slave.stopped_reason}")
        return problems

    def readiness_problems(self) -> list[str]:
        s = self.server
        problems = self.health_problems()
        if s.port is None:
            problems.append("not listening yet")
        self._replayed = self._replayed or s.replayer.offset >= self._replay_target
        if not self._replayed:
            problems.append(f"replaying: at {s.replayer.offset} of {self._replay_target}")
        ticks = s.ticks
        self._loaded = self._loaded or (ticks.loading_bucket is not None and ticks.loaded_offset >= ticks.loading_end
                                        and ticks.loading_bucket >= ticks.load_target(s.clock.now_ms()))
        role = self.role()
        if not self._loaded and role == "master":  # only a master loads its schedule into the wheel
            problems.append("loading the schedule")
        if role == "none":
            problems.append("no role yet (the meta server has not answered)")
        elif role == "slave" and (s.slave is None or not s.slave.in_sync):
            behind = f"by {s.slave.lag_bytes} bytes" if s.slave is not None and s.slave.lag_bytes else "(not synced yet)"
            problems.append(f"slave behind its master {behind}")
        return problems

    # --- delivery -----------------------------------------------------------------------------

    def broker_groups(self) -> list[dict]:
        s = self.server
        out = []
        for g in list(s.sender.groups.values()):
            spec = g.spec
            transport = getattr(spec, "transport", None)
            if isinstance(spec, tuple):
                transport = spec[1].transport
            transport = getattr(transport, "value", transport)
            out.append({"name": g.name, "transport": str(transport or ""), "weight": g.weight,
                        "subjects": sorted(g.subjects) if g.subjects is not None else None,
                        "breaker": g.breaker.state, "queued": len(g.queue), "inflight": len(g.queue) + g.sending,
                        "delivered": g.sent, "retried": g.retried, "parked": g.parked,
                        "failed_batches": g.failed_batches})
        return out

    def delivery(self) -> dict:
        s = self.server
        return {"delivered": s.sender.delivered, "retried": s.sender.retried, "parked": s.sender.parked_count,
                "inflight": len(s.ticks.inflight), "due_waiting": len(s.ticks.ready),
                "wheel_entries": len(s.ticks.wheel), "received": s.receiver.appended,
                "connections": s.connections}

    # --- parked -------------------------------------------------------------------------------

    def _parked_dir(self):
        return self.server.config.data_dir / "parked"

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
        s, c = self.server, self.server.config
        if not c.meta:
            return [{"node_id": self.node()["node_id"], "group": c.group, "role": self.role(),
                     "address": c.advertised_address or f"{c.listen[0]}:{s.port}", "alive": True, "epoch": 0,
                     "source": "local"}]
        try:
            async with MetaClient(c.meta, timeout_s=3) as client:
                reply = await client.request("list_nodes", group=c.group)
        except (MetaUnavailable, MetaError, OSError) as e:
            log.warning("cannot list the group's nodes: %s", e)
            return []
        return [{**n, "source": "meta"} for n in reply.get("nodes", [])]
