"""The schedule requests a node answers (protocol command SCHEDULE, JSON both ways)::

    {"op": "put", "schedule": {...}}          create or replace (spec.py says what a schedule is)
    {"op": "pause" | "resume" | "delete", "name": n}
    {"op": "get", "name": n}    {"op": "list"}

Each answer is ``{"schedules": [<view>, ...]}`` (a change answers the schedule as it is now; a
delete answers an empty list). A view is the definition plus ``paused``, ``emitted`` (occurrences
sent since the definition), ``last`` (the latest occurrence sent, or null) and ``next`` (the next
occurrence, or null when the schedule is finished).

A change is one SCHEDULE record appended to message_log (durable and replicated like a message),
answered once replay has applied it. Pausing, replacing or deleting a schedule first cancels its
occurrence already sent and not yet due, so nothing of the old definition fires afterwards.
Changes go one at a time, and never while the emitter is sending (registry.lock).
"""
from __future__ import annotations

from delayserver.message import DelayServerError, Handle, ResultCode
from delayserver.schedules.emitter import plan
from delayserver.schedules.registry import Registry, ScheduleState
from delayserver.schedules.spec import NAME_RE, BadSchedule, ScheduleSpec, occurrence_id


def view(state: ScheduleState, now: int) -> dict:
    upcoming = plan(ScheduleState(state.spec, state.anchor, state.cursor, state.emitted), now)
    started = state.cursor >= state.anchor
    nxt = None if state.paused else state.cursor if state.cursor > now else (upcoming[-1] if upcoming else None)
    return {**state.spec.to_json(), "paused": state.paused, "emitted": state.emitted,
            "last": state.cursor if started else None, "next": nxt}


class ScheduleService:
    def __init__(self, registry: Registry, operations, clock, max_body_bytes: int):
        self.registry = registry
        self.operations = operations
        self.clock = clock
        self.max_body_bytes = max_body_bytes

    async def handle(self, request) -> dict:
        """The answer to one request; raises DelayServerError (BAD_REQUEST, NOT_FOUND, a refusal)."""
        if not isinstance(request, dict) or request.get("op") not in ("put", "pause", "resume", "delete", "get",
                                                                       "list"):
            raise BadSchedule('a schedule request is {"op": "put" | "pause" | "resume" | "delete" | "get" | "list"}')
        op = request["op"]
        if op == "list":
            now = self.clock.now_ms()
            return {"schedules": [view(s, now) for _, s in sorted(self.registry.schedules.items())]}
        if op == "put":
            spec = ScheduleSpec.from_json(request.get("schedule"), self.max_body_bytes)
            name = spec.name
        else:
            name = request.get("name")
            if not isinstance(name, str) or not NAME_RE.fullmatch(name):
                raise BadSchedule("name: 1 to 64 of [A-Za-z0-9._-]")
            if name not in self.registry.schedules:
                raise DelayServerError(f"no schedule named {name!r}", code=ResultCode.NOT_FOUND)
        if op == "get":
            return {"schedules": [view(self.registry.schedules[name], self.clock.now_ms())]}
        refusal = self.operations.role.write_refusal()
        if refusal is not None:
            raise DelayServerError(refusal.description, code=refusal)
        async with self.registry.lock:
            return await self._change(op, name, spec if op == "put" else None)

    async def _change(self, op: str, name: str, spec: ScheduleSpec | None) -> dict:
        state = self.registry.schedules.get(name)
        if state is None and op != "put":
            raise DelayServerError(f"no schedule named {name!r}", code=ResultCode.NOT_FOUND)
        if state is not None and op in ("put", "pause", "delete"):
            await self._cancel_pending(state)
        now = self.clock.now_ms()
        change = {"op": op, "name": name}
        if op == "put":
            change = {"op": "put", "schedule": spec.to_json(), "from": now}
        elif op == "resume":
            change["from"] = now
        code, message, end = await self.operations.receiver.append_schedule_change(change)
        if code != ResultCode.OK:
            raise DelayServerError(message, code=code)
        await self.operations.replayed_past(end)
        state = self.registry.schedules.get(name)
        return {"schedules": [] if state is None else [view(state, self.clock.now_ms())]}

    async def _cancel_pending(self, state: ScheduleState) -> None:
        """Cancel the occurrence sent and not due yet, if any (its handle is its time)."""
        if state.cursor >= state.anchor and state.cursor > self.clock.now_ms():
            handle = Handle(state.cursor, occurrence_id(state.spec.name, state.cursor))
            result = await self.operations.cancel(handle)
            if result.code != ResultCode.OK:
                raise DelayServerError(result.message, code=result.code)
