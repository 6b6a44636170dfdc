"""The fault suite's checker: pure logic over a recorded history, no I/O.

A history holds what the producers were told (acknowledged sends and cancels, each with the node
that answered and when), what the brokers got (deliveries, each with the node that made it), who
the meta server said was master when (terms: node, epoch, from, to), and the faults the nemesis
injected (kind, node, from, to). `check` returns a `Verdict` of counts and examples per rule;
`Verdict.problems(mode)` lists the broken rules of that replication mode:

- both modes: nothing delivered that was never sent, corrupt, or before its time (the schedule
  time of the handle, and never before the time the producer asked for);
- sync mode: every acknowledged id delivered at least once (unless an acknowledged cancel took
  it, or a cancel whose answer never came may have); an acknowledged cancel honoured (the id is
  never delivered);
- both modes: an id delivered again only when its earlier delivery was in flight at a fault (it
  came within `in_flight_before_ms` before the fault began, or while the fault lasted, up to
  `in_flight_after_ms` after it began), and at most `max_per_fault` such redeliveries per fault;
  an id delivered under two epochs (by two masters) is such a redelivery too, and counted apart;
- both modes: the group takes writes again once the faults are healed (an acknowledgement after
  the last fault ended);
- async mode: the acknowledged ids that were lost are counted, and `check_quarantine` compares
  them with what the nodes quarantined.
"""
from __future__ import annotations

import bisect
import collections
from typing import Iterable

import attrs

EXAMPLES = 8


@attrs.frozen
class Ack:
    """A send the server acknowledged: the handle's schedule time, and the earliest delivery time
    the producer asked for."""

    message_id: str
    schedule_time: int
    not_before: int
    node: str
    at_ms: int


@attrs.frozen
class CancelAck:
    message_id: str
    outcome: str  # CancelOutcome name: CANCELLED, ALREADY_DELIVERED, ...
    node: str
    at_ms: int


@attrs.frozen
class Delivery:
    message_id: str
    node: str
    schedule_time: int
    dispatch_time: int
    intact: bool = True  # body and subject as sent


@attrs.frozen
class Term:
    """`node` held the master role with `epoch` from `start_ms` until `end_ms` (None: still)."""

    node: str
    epoch: int
    start_ms: int
    end_ms: int | None = None


@attrs.frozen
class Fault:
    kind: str
    node: str
    start_ms: int
    end_ms: int


@attrs.define(eq=False)
class History:
    sent: set[str] = attrs.Factory(set)  # every id a producer tried to send
    acks: dict[str, Ack] = attrs.Factory(dict)
    cancels: dict[str, CancelAck] = attrs.Factory(dict)
    cancel_unknown: set[str] = attrs.Factory(set)  # cancels sent whose answer never came
    deliveries: list[Delivery] = attrs.Factory(list)
    terms: list[Term] = attrs.Factory(list)
    faults: list[Fault] = attrs.Factory(list)


@attrs.frozen
class Bounds:
    in_flight_before_ms: int = 1500  # a delivery this long before a fault counts as in flight
    in_flight_after_ms: int = 3000  # ... and so does one up to this long into the fault
    max_per_fault: int = 2000  # redeliveries one fault may cause


@attrs.define(eq=False)
class Verdict:
    acked: int = 0
    delivered_ids: int = 0
    deliveries: int = 0
    unknown: list[str] = attrs.Factory(list)
    corrupt: list[str] = attrs.Factory(list)
    early: list[str] = attrs.Factory(list)
    lost: list[str] = attrs.Factory(list)
    cancel_violations: list[str] = attrs.Factory(list)
    redeliveries_per_fault: dict[int, int] = attrs.Factory(dict)  # fault index -> count
    unexplained_redeliveries: list[str] = attrs.Factory(list)
    cross_epoch: list[str] = attrs.Factory(list)  # ids delivered under two epochs (all of them)
    cross_epoch_unexplained: list[str] = attrs.Factory(list)
    deposed_deliveries: int = 0  # deliveries by a node while another held a newer epoch
    over_bound: list[str] = attrs.Factory(list)  # faults with more redeliveries than the bound
    acked_after_faults: int = 0  # acknowledgements after the last fault was healed
    unavailable: list[str] = attrs.Factory(list)  # the last fault, when nothing was acknowledged after it

    def problems(self, mode: str) -> list[str]:
        """The broken rules of `mode` ("sync" or "async"), each with examples."""
        rules = [("delivered but never sent", self.unknown), ("corrupt", self.corrupt),
                 ("delivered early", self.early),
                 ("redelivered with no fault in flight", self.unexplained_redeliveries),
                 ("delivered under two epochs with no fault in flight", self.cross_epoch_unexplained),
                 ("more redeliveries for one fault than the bound", self.over_bound),
                 ("nothing acknowledged after the last fault was healed", self.unavailable)]
        if mode == "sync":
            rules += [("acknowledged but never delivered", self.lost),
                      ("delivered after an acknowledged cancel", self.cancel_violations)]
        return [f"{rule} ({len(ids)}): {', '.join(map(str, ids[:EXAMPLES]))}" for rule, ids in rules if ids]

    def summary(self) -> str:
        return (f"{self.acked} acknowledged, {self.delivered_ids} ids delivered in {self.deliveries} deliveries; "
                f"lost {len(self.lost)}; cancels broken {len(self.cancel_violations)}; "
                f"redeliveries {sum(self.redeliveries_per_fault.values())} over "
                f"{len(self.redeliveries_per_fault)} faults (at most "
                f"{max(self.redeliveries_per_fault.values(), default=0)} for one); "
                f"under two epochs {len(self.cross_epoch)}; by a deposed master {self.deposed_deliveries}; "
                f"acknowledged after the last fault {self.acked_after_faults}")


def check(history: History, bounds: Bounds = Bounds()) -> Verdict:
    """Apply every rule of the module docstring to `history`."""
    v = Verdict(acked=len(history.acks), deliveries=len(history.deliveries))
    by_id: dict[str, list[Delivery]] = collections.defaultdict(list)
    for d in history.deliveries:
        by_id[d.message_id].append(d)
        if d.message_id not in history.sent:
            v.unknown.append(d.message_id)
            continue
        if not d.intact:
            v.corrupt.append(d.message_id)
        ack = history.acks.get(d.message_id)
        if d.dispatch_time < d.schedule_time or (ack is not None and (
                d.schedule_time != ack.schedule_time or d.schedule_time < ack.not_before)):
            v.early.append(f"{d.message_id}@{d.node}: dispatched {d.dispatch_time}, scheduled {d.schedule_time}"
                           + (f", acknowledged for {ack.schedule_time}" if ack else ""))
    v.delivered_ids = len(by_id)
    cancelled = {i for i, c in history.cancels.items() if c.outcome in ("CANCELLED", "ALREADY_CANCELLED")}
    v.lost = sorted(set(history.acks) - set(by_id) - cancelled - history.cancel_unknown)
    v.cancel_violations = sorted(cancelled & set(by_id))
    epochs = _EpochOf(history.terms)
    v.deposed_deliveries = sum(1 for d in history.deliveries if epochs.deposed(d.node, d.dispatch_time))
    per_fault: collections.Counter[int] = collections.Counter()
    for message_id, ds in by_id.items():
        if len(ds) == 1:
            continue
        ds = sorted(ds, key=lambda d: d.dispatch_time)
        two_epochs = len({epochs.of(d.node, d.dispatch_time) for d in ds}) > 1
        if two_epochs:
            v.cross_epoch.append(message_id)
        for first, again in zip(ds, ds[1:]):
            fault = _fault_in_flight(history.faults, first.dispatch_time, again.dispatch_time, bounds)
            if fault is None:
                v.unexplained_redeliveries.append(
                    f"{message_id}: {first.node}@{first.dispatch_time}, {again.node}@{again.dispatch_time}")
                if two_epochs:
                    v.cross_epoch_unexplained.append(message_id)
            else:
                per_fault[fault] += 1
    v.redeliveries_per_fault = dict(per_fault)
    if history.faults:
        last = max(history.faults, key=lambda f: f.end_ms)
        v.acked_after_faults = sum(1 for a in history.acks.values() if a.at_ms > last.end_ms)
        if not v.acked_after_faults:
            v.unavailable = [f"{last.kind}@{last.start_ms}-{last.end_ms}"]
    v.over_bound = [f"{history.faults[i].kind}@{history.faults[i].start_ms}: {n}"
                    for i, n in sorted(per_fault.items()) if n > bounds.max_per_fault]
    return v


def check_quarantine(lost: Iterable[str], quarantined: Iterable[str], history: History) -> dict[str, list[str]]:
    """Async mode: every lost acknowledged id must be in a quarantine file, and a quarantine file
    may name only ids a producer sent. Returns the offenders by rule (empty: all is well)."""
    quarantined = set(quarantined)
    out = {"lost but not quarantined": sorted(set(lost) - quarantined),
           "quarantined but never sent": sorted(quarantined - history.sent)}
    return {rule: ids for rule, ids in out.items() if ids}


def _fault_in_flight(faults: list[Fault], first_ms: int, again_ms: int, bounds: Bounds) -> int | None:
    """The index of a fault at which a delivery made at `first_ms` was in flight, and which began
    before the redelivery at `again_ms`; None when there is none."""
    for i, f in enumerate(faults):
        if f.start_ms > again_ms:
            continue
        if f.start_ms - bounds.in_flight_before_ms <= first_ms <= max(f.end_ms, f.start_ms + bounds.in_flight_after_ms):
            return i
    return None


class _EpochOf:
    """Which epoch a node delivered under, from the master terms the meta server reported."""

    def __init__(self, terms: list[Term]):
        self.by_node: dict[str, list[Term]] = collections.defaultdict(list)
        for t in sorted(terms, key=lambda t: t.start_ms):
            self.by_node[t.node].append(t)
        self.starts = sorted((t.start_ms, t.epoch) for t in terms)

    def of(self, node: str, at_ms: int) -> tuple[str, int]:
        """The node's latest term begun at or before `at_ms` (epoch 0: none yet)."""
        terms = [t for t in self.by_node.get(node, ()) if t.start_ms <= at_ms]
        return (node, terms[-1].epoch if terms else 0)

    def deposed(self, node: str, at_ms: int) -> bool:
        """True when a newer epoch than the node's own had begun by `at_ms`."""
        _, epoch = self.of(node, at_ms)
        i = bisect.bisect_right(self.starts, (at_ms, float("inf")))
        return any(e > epoch for _, e in self.starts[:i])
