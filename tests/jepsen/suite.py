"""One run of the fault suite: producers and a canceller send throughout while a nemesis injects
`rounds` faults; then the cluster is left whole until every message that must be delivered was
(or `drain_s` passed since the last of them fell due), and the checker reads the history.

Sizes come from environment variables, so a bigger run is the same test with a longer command
line: ``DELAYSERVER_JEPSEN_ROUNDS=20 DELAYSERVER_JEPSEN_PRODUCERS=6 ops/test tests/jepsen``.
"""
from __future__ import annotations

import random

import attrs
import trio

from tests.faults.harness import env_int, seeded_rng
from tests.jepsen.checker import Bounds, History, Verdict, check
from tests.jepsen.cluster import Cluster, Observer, now_ms
from tests.jepsen.nemesis import Nemesis
from tests.jepsen.workload import Workload

ROUNDS = env_int("DELAYSERVER_JEPSEN_ROUNDS", 2)
PRODUCERS = env_int("DELAYSERVER_JEPSEN_PRODUCERS", 2)
MAX_DELAY_MS = env_int("DELAYSERVER_JEPSEN_MAX_DELAY_MS", 3000)


@attrs.frozen
class Run:
    history: History
    workload: Workload
    verdict: Verdict
    stuck: str | None = None  # why the rounds stopped early: the group did not recover in time

    def report(self, name: str) -> str:
        w = self.workload
        faults = ", ".join(f"{f.kind} {f.node} {f.end_ms - f.start_ms} ms" for f in self.history.faults)
        terms = ", ".join(f"{t.node}@{t.epoch}" for t in self.history.terms)
        return (f"{name}: {self.verdict.summary()}; sent {len(self.history.sent)}, unanswered {w.unanswered}, "
                f"refused {w.refused}; cancels {len(self.history.cancels)} answered, "
                f"{len(self.history.cancel_unknown)} unanswered; faults: {faults}; masters: {terms}"
                + (f"; STUCK: {self.stuck}" if self.stuck else ""))


def bounds_for(cluster: Cluster) -> Bounds:
    """A delivery is in flight at a fault if it came up to two slave pulls (and a lease, for the
    load) before it, or while the fault and its lease ran. One fault may cause as many
    redeliveries as this workload delivers in about three seconds (its producers send a few
    hundred messages a second): what the old master delivered in its last lease and since its
    slave last pulled dispatch_log."""
    lease = cluster.timing.lease_ms
    return Bounds(in_flight_before_ms=1000 + lease, in_flight_after_ms=2 * lease + 1000,
                  max_per_fault=1000 * PRODUCERS // 2)


async def _run(cluster: Cluster, nemesis: Nemesis, rounds: int, rng: random.Random, drain_s: float) -> Run:
    history = History()
    stuck = None
    observer = Observer(cluster)
    workload = Workload(history, observer, rng, max_delay_ms=MAX_DELAY_MS)
    async with trio.open_nursery() as nursery:
        await nursery.start(observer.run)
        stop = trio.Event()
        async with trio.open_nursery() as clients:
            for _ in range(PRODUCERS):
                clients.start_soon(workload.produce, stop)
            clients.start_soon(workload.cancel, stop)
            for i in range(rounds):
                await trio.sleep(1.5)
                try:
                    await nemesis(cluster, observer, history)
                    await observer.wait_all_up(120)
                except trio.TooSlowError:
                    stuck = (f"round {i + 1} of {nemesis.__name__}: the group did not recover in time "
                             f"(meta server says {observer.states}, master terms {observer.terms})")
                    break
            await _writes_again(history, timeout_s=30)
            await trio.sleep(1.5)
            stop.set()
        # Everything is healed and up: what is due goes out within moments, so the wait ends
        # `drain_s` after the last acknowledged message fell due (what is lost by then is lost).
        last_due = max((a.schedule_time for a in history.acks.values()), default=now_ms())
        while now_ms() < last_due + drain_s * 1000 and not workload.expected() <= {
                d.message_id for d in await trio.to_thread.run_sync(workload.deliveries, cluster)}:
            await trio.sleep(0.5)
        await trio.sleep(1.0)  # late duplicates, if any, are counted too
        nursery.cancel_scope.cancel()
    history.terms = list(observer.terms)
    history.deliveries = workload.deliveries(cluster)
    return Run(history, workload, check(history, bounds_for(cluster)), stuck)


async def _writes_again(history: History, timeout_s: float) -> None:
    """Wait (up to `timeout_s`) for an acknowledgement after the last fault was healed: a slave
    may have to catch up first. The checker says if none came."""
    healed = max((f.end_ms for f in history.faults), default=0)
    with trio.move_on_after(timeout_s):
        while not any(a.at_ms > healed for a in list(history.acks.values())[-50:]):
            await trio.sleep(0.1)


def run_rounds(cluster: Cluster, nemesis: Nemesis, rounds: int = ROUNDS, drain_s: float = 20.0) -> Run:
    """Run the workload against `cluster` through `rounds` of `nemesis` (blocking)."""
    _, rng = seeded_rng("DELAYSERVER_JEPSEN_SEED")
    return trio.run(_run, cluster, nemesis, rounds, rng, drain_s)
