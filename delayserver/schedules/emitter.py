"""Which occurrences of a schedule to send now (`plan`, pure, time passed in), and the master's
task that sends them as ordinary messages (`serve`).

A schedule keeps one occurrence ahead: as soon as its latest occurrence has come due, the next
one is sent, due at its time, so it waits in the wheel like any delayed message and goes out on
time. Occurrences that fell due meanwhile without being sent (the node was down, or not master,
or the start lies in the past) are missed: the catch-up policy says whether to send none of them
(`skip`), the latest (`one`) or all of them, at most MAX_CATCH_UP (`all`), each due at once.

Each occurrence's id is ``schedule:<name>:<time>``: sent twice (a crash between the send and the
cursor reaching the saved registry), dedupe answers the first handle, and the registry counts it
once.
"""
from __future__ import annotations

import logging

import trio

from delayserver.message import ResultCode, TimeSpec
from delayserver.protocol import SendItem
from delayserver.schedules.registry import Registry, ScheduleState
from delayserver.schedules.spec import MAX_CATCH_UP, occurrence_id

log = logging.getLogger("delayserver.schedules")

MAX_SLEEP_S = 1.0


def plan(state: ScheduleState, now: int) -> list[int]:
    """The occurrence times to send now, in order (the last one, if any, is the next future one)."""
    spec = state.spec
    if state.paused or state.cursor > now:
        return []  # paused, or its latest occurrence is not due yet
    left = None if spec.count is None else spec.count - state.emitted
    rule = state.rule
    missed: list[int] = []
    t = rule.next_after(state.cursor)
    while t <= now and (spec.end is None or t < spec.end):
        missed.append(t)
        if len(missed) > MAX_CATCH_UP:
            missed.pop(0)
        t = rule.next_after(t)
    if spec.catch_up == "all":
        out = missed
    elif spec.catch_up == "one":
        out = missed[-1:]
    else:
        out = []
    if spec.end is None or t < spec.end:
        out.append(t)
    return out if left is None else out[: max(left, 0)]


def next_wake(registry: Registry, now: int) -> int | None:
    """When a schedule's latest occurrence comes due next (then its next one is sent)."""
    due = [s.cursor for s in registry.schedules.values() if not s.paused and s.cursor > now]
    return min(due, default=None)


async def serve(registry: Registry, operations, clock, is_master, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """While this node is master: send what `plan` says for every schedule, then sleep until the
    next one comes due, a change, or MAX_SLEEP_S (a wall-clock step is noticed within that)."""
    task_status.started()
    while True:
        now = clock.now_ms()
        if is_master():
            for state in list(registry.schedules.values()):
                async with registry.lock:
                    await _send_due(registry, operations, state, now)
        wake = next_wake(registry, now)
        timeout = MAX_SLEEP_S if wake is None else min(MAX_SLEEP_S, max(0, wake - now) / 1000)
        await registry.changed.wait(timeout)


async def _send_due(registry: Registry, operations, state: ScheduleState, now: int) -> None:
    spec = state.spec
    for when in plan(state, now):
        if registry.schedules.get(spec.name) is not state:
            return  # changed or deleted meanwhile
        headers = {**spec.headers, "schedule": spec.name, "occurrence": str(when)}
        item = SendItem(occurrence_id(spec.name, when), spec.subject, TimeSpec.at(when), spec.body, headers)
        [result] = await operations.send([item], api="schedule")
        if result.code not in (ResultCode.OK, ResultCode.DUPLICATE):
            log.error("schedule %s: occurrence %d not sent: %s (will try again)", spec.name, when, result.message)
            return
        registry.advance(spec.name, when)
