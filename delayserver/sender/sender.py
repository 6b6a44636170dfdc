"""The sender: due messages out to broker groups, in batches, one task per group.

It sees the wheel only through the due queue (wheel/due_queue.py): take, settle, drop, retry later,
generation.

- Each broker group has its own in-flight budget (`max_inflight` deliveries: queued for it, being
  sent, or waiting to retry after it failed them). A dead or slow group holds only its own budget:
  the dispatcher takes due messages while any healthy group has room, and a message whose groups
  are all full or open waits in a backlog of its group (without its body: it is read again when it
  leaves), so healthy groups deliver at full rate beside a dead one.
- Each group's task forms batches of up to `send_batch_size`, waiting up to `send_wait_ms` for one
  to fill (not at all when nothing else falls due within that time: a lone message goes at once),
  so that a slow or dead group never holds back another, and starts each batch's send
  with up to `batches_in_flight` under way: a batch does not wait for the acknowledgement of the
  one before it, so a broker slow to acknowledge for a moment holds back no hand-over.
- Per-message results: ACKED -> a dispatch_log record, appended at once; the message is settled
  once an fsync covers it. The fsyncs run in one task of their own, each covering every record
  appended while the one before ran (group commit across batches and groups): a group task hands
  over its records and sends its next batch, so a slow fsync of our disk never holds back the
  messages falling due behind it. The records not yet fsynced belong to unsettled deliveries, at
  most `max_inflight` per group (the bound `DISPATCH_POWER_LOSS_WINDOW` relies on). A round
  gathers for `DISPATCH_SYNC_LINGER_S` first (sooner once a quarter of a group's budget waits).
  RETRY -> back to routing after a back-off, possibly to another group, without any retry limit;
  REJECTED -> parked (see `parked.py`), never blocking the others. A transport that raises instead of
  answering (a bug, or a broker's reply its client library did not expect) counts as RETRY for
  the whole batch, logged with its traceback: nothing a broker sends stops the node.
- Poison isolation: a batch the broker refuses whole (every message REJECTED, as an HTTP 4xx
  does) is split in halves and sent again at once, down to the one message that causes it, which
  alone is parked with the broker's reason. A batch failing whole (every message RETRY) while
  its group is otherwise healthy is retried as one unit, and split in halves when it fails again,
  so one message that makes a broker fail gets retried alone while the others go through.
- Intervals (back-off, breakers) run on trio's monotonic clock: a wall-clock step never freezes
  retries or keeps a breaker open. The wall clock only stamps dispatch times.
"""
from __future__ import annotations

import array
import collections
import itertools
import logging
import operator
import random

import attrs
import trio

from delayserver import failpoints
from delayserver.sender.breaker import CLOSED, OPEN, CircuitBreaker
from delayserver.sender.groups import (
    DEFAULT_BATCHES_IN_FLIGHT, DEFAULT_MAX_INFLIGHT, DEFAULT_SEND_BATCH_SIZE, DEFAULT_SEND_WAIT_MS,
)
from delayserver.sender.parked import ParkedLog
from delayserver.sender.transport import ACKED, DeliveryResult, OutboundMessage, Outcome, Transport
from delayserver.storage.errors import DiskFull, FsyncFailed, StorageError
from delayserver.storage.record import Message, encode_dispatch_data, encode_dispatch_records
from delayserver.storage.threads import run_disk
from delayserver.wakeup import Wakeup
from delayserver.wheel.due_queue import Due, DueQueue

try:
    from delayserver.native.wheel import dispatch_fields as _native_dispatch_fields
    from delayserver.native.wheel import outbound_of as _native_outbound_of, settled as _native_settled
    from delayserver.native.wheel import set_group as _native_set_group, untried_subject as _native_untried_subject
except ImportError:  # not built: the list comprehension of `_send`, `_settled_py`, `_dispatch_fields_py`, ...
    _native_dispatch_fields = _native_outbound_of = _native_settled = None
    _native_set_group = _native_untried_subject = None

log = logging.getLogger("delayserver.sender")

MAX_BACKOFF_MS = 30_000
#: How long the dispatch_log fsync task gathers acknowledged batches before an fsync: off the send
#: path, this only delays when a delivery counts as settled (never when it is sent), and saves
#: fsyncs and thread hops: an fsync costs about 100 us of CPU however little it covers. A round
#: starts sooner once a quarter of a group's in-flight budget waits for it (`_sync_early_at`), so
#: a small budget never fills with deliveries that only wait for the linger.
DISPATCH_SYNC_LINGER_S = 0.02

#: The sender's name for a due message it holds.
Delivery = Due

# C-level field reads over a batch (`map`), without a Python-level step per message.
_SCHEDULE_OFFSET = operator.attrgetter("schedule_offset")
_MESSAGE_LOG_OFFSET = operator.attrgetter("message_log_offset")
_BUCKET = operator.attrgetter("bucket")
_GENERATION = operator.attrgetter("generation")
_GROUP = operator.attrgetter("group")
_TRIED = operator.attrgetter("tried")
_SUBJECT = operator.attrgetter("message.subject")


def _settled_py(batch: list[Delivery], now: int, group, generation: int) -> tuple[list[int], list[int], int, list[Delivery]]:
    """`Sender._settle`'s pass over a batch whose dispatch records are durable: (per due, in order,
    `now` minus its message's schedule time; the refs of the dues of `generation`; how many were
    counted against `group`, their group now None; the dues counted against another group, left
    to the caller). The reference of the compiled `settled`, and what runs where it is not built."""
    lateness, refs, freed, others = [], [], 0, []
    for d in batch:
        lateness.append(now - d.message.schedule_time)
        if d.generation == generation:
            refs.append(d.ref)
        if d.group is group:
            d.group = None
            freed += 1
        elif d.group is not None:
            others.append(d)
    return lateness, refs, freed, others


def _dispatch_fields_py(batch: list[Delivery]) -> tuple[int, array.array, array.array] | None:
    """`Sender._record_dispatch`'s pass over an acknowledged batch: (the bucket of its dues, their
    schedule offsets in an array "Q", their message_log offsets in an array "q"), in order, when
    they are all of one bucket, each with both offsets (none below zero); else None. The reference
    of the compiled `dispatch_fields` (which also takes only its own compiled dues)."""
    if not batch or len(set(map(_BUCKET, batch))) != 1:
        return None
    schedule_offsets, message_log_offsets = list(map(_SCHEDULE_OFFSET, batch)), list(map(_MESSAGE_LOG_OFFSET, batch))
    if not all(type(x) is int and 0 <= x < 2**63 for x in schedule_offsets + message_log_offsets):
        return None
    return batch[0].bucket, array.array("Q", schedule_offsets), array.array("q", message_log_offsets)


_dispatch_fields = _native_dispatch_fields or _dispatch_fields_py


def _untried_subject_py(batch: list[Delivery]) -> str | None:
    """The subject of a taken batch's messages when they are all of one subject, in no group and
    never tried (`route_taken` queues those in bulk); else None. The reference of the compiled
    `untried_subject`, which answers None for dues other than its own (they go one by one)."""
    subjects = set(map(_SUBJECT, batch))
    if len(subjects) == 1 and set(map(_GROUP, batch)) == {None} and not any(map(_TRIED, batch)):
        return subjects.pop()
    return None


if _native_untried_subject is not None:
    def _untried_subject(batch: list[Delivery]) -> str | None:
        return _native_untried_subject(batch, Message)

    _set_group = _native_set_group
else:  # pragma: no cover - a build without a C compiler
    _untried_subject = _untried_subject_py

    def _set_group(batch: list[Delivery], group) -> None:
        _set_each(batch, "group", group)


def _set_each(deliveries: list[Delivery], name: str, value) -> None:
    """`setattr(d, name, value)` of each of `deliveries`, in one C-level pass."""
    collections.deque(map(setattr, deliveries, itertools.repeat(name), itertools.repeat(value)), maxlen=0)


@attrs.define(eq=False)
class BrokerGroup:
    name: str
    transport: Transport
    weight: int = 1
    subjects: frozenset[str] | None = None  # None: every subject
    breaker: CircuitBreaker = attrs.field(factory=CircuitBreaker)
    queue: collections.deque = attrs.field(factory=collections.deque)
    # Batches to send as they are (the halves of a split batch), before `queue`.
    batches: collections.deque = attrs.field(factory=collections.deque)
    # Messages routed here while the group was full or open, waiting for room.
    backlog: collections.deque = attrs.field(factory=collections.deque)
    wakeup: Wakeup = attrs.field(factory=Wakeup)  # queue or batches gained messages: the group task's
    # The backlog gained messages or the group room: the backlog task's (not woken per batch routed).
    backlog_wakeup: Wakeup = attrs.field(factory=Wakeup)
    inflight: int = 0
    sent: int = 0
    failed_batches: int = 0
    split_batches: int = 0
    retried: int = 0
    parked: int = 0
    sending: int = 0  # messages handed to the transport, not answered yet
    scope: trio.CancelScope | None = None
    spec: object = None  # what the group was built from (a meta server's broker group), if anything

    def serves(self, subject: str) -> bool:
        return self.subjects is None or subject in self.subjects


def backoff_ms(attempt: int) -> int:
    """100 ms doubling per attempt up to 30 s, with jitter so that retries do not synchronise."""
    base = min(MAX_BACKOFF_MS, 100 * 2 ** min(attempt - 1, 20))
    return base // 2 + random.randrange(base // 2 + 1)


def monotonic_ms() -> int:
    """Milliseconds on trio's monotonic clock (MockClock in tests): what intervals are measured on."""
    return int(trio.current_time() * 1000)


class Sender:
    def __init__(self, ticks, store, groups: list[BrokerGroup], clock, *,
                 send_batch_size: int = DEFAULT_SEND_BATCH_SIZE, send_wait_ms: int = DEFAULT_SEND_WAIT_MS,
                 max_inflight: int = DEFAULT_MAX_INFLIGHT, batches_in_flight: int = DEFAULT_BATCHES_IN_FLIGHT,
                 parked: ParkedLog | None = None,
                 may_deliver=lambda: True, resolve=None, on_disk_full=lambda: None):
        """`max_inflight` is each broker group's in-flight budget."""
        self.due = DueQueue(ticks, on_corrupt=store.quarantine) if ticks is not None else None
        self.store = store
        self.groups = {g.name: g for g in groups}
        self.clock = clock
        self.batch_size = send_batch_size
        self.wait_ms = send_wait_ms
        self.max_inflight = max_inflight
        self.batches_in_flight = batches_in_flight
        self.parked = parked
        self.may_deliver = may_deliver
        self.resolve = resolve  # optional: subject -> group names (from the meta server)
        self.on_disk_full = on_disk_full  # a dispatch_log write found the disk full
        self.delivered = 0
        self.parked_count = 0
        self.retried = 0
        self.no_route = 0
        self.lateness_ms: collections.deque[int] = collections.deque(maxlen=100_000)
        self._room = Wakeup()
        # Batches whose dispatch records are appended and await the fsync that settles them:
        # (acknowledged deliveries, their group, dispatch time).
        self._unsynced: list[tuple[list[Delivery], BrokerGroup, int]] = []
        self._unsynced_count = 0  # the deliveries in `_unsynced` (checked per batch: not summed each time)
        # Enough deliveries wait for an fsync to start a round before the linger is over.
        self._sync_early_at = max(1, max_inflight // 4)
        # `_unsynced` gained its first batch, or `_sync_early_at` deliveries: the fsync task's.
        self._unsynced_wakeup = Wakeup()
        self.dispatch_fsyncs = 0
        # (broker group name, lateness in ms of each message it acknowledged): the metrics' hook.
        self.on_delivered = lambda group, lateness_ms: None

    def dispatch_now(self) -> None:
        """Messages fell due (the tick task's `fell_due`), or the node's role changed: take and
        route a batch of them in the caller's task step (the tick task's, which has just advanced
        the wheel) when their records are in memory and a healthy group has room; what is left (more
        than a batch, no room, records to read from disk, a fenced node) wakes the dispatch task. At
        tens of thousands of messages a second that saves the dispatch task's wake-up, a task step,
        per tick."""
        due = self.due
        if due.waiting and self.may_deliver():
            room = self._room_now()
            if room > 0:
                dues = due.take_now(min(room, self.batch_size))
                if dues:
                    self.route_taken(dues, monotonic_ms())
        if due.waiting:
            due.ready.set()

    # --- routing ------------------------------------------------------------------------------

    def _candidates(self, subject: str) -> list[BrokerGroup]:
        if self.resolve is not None:
            names = self.resolve(subject)
            return [self.groups[n] for n in names if n in self.groups]
        return [g for g in self.groups.values() if g.serves(subject)]

    def _weighted(self, d: Delivery, groups: list[BrokerGroup]) -> BrokerGroup | None:
        fresh = [g for g in groups if g.name not in d.tried] or groups
        if len(fresh) <= 1:
            return fresh[0] if fresh else None
        return random.choices(fresh, weights=[max(g.weight, 0) or 1 for g in fresh])[0]

    def pick(self, d: Delivery, now: int) -> BrokerGroup | None:
        """A group serving the subject, by weight among those whose breaker lets traffic through
        (`now`: monotonic ms); groups already tried for this message are avoided while another
        healthy one exists."""
        serving = self._candidates(d.message.subject)
        return self._weighted(d, [g for g in serving if g.breaker.allows(now)])

    def _has_room(self, group: BrokerGroup) -> bool:
        return group.inflight < self.max_inflight

    def _assign(self, d: Delivery, group: BrokerGroup | None) -> None:
        """Count `d` against `group`'s budget (and no longer against the one it had)."""
        old = d.group
        if old is group:
            return
        if old is not None:
            old.inflight -= 1
            if old.backlog:
                old.backlog_wakeup.set()
            self._room.set()
        d.group = group
        if group is not None:
            group.inflight += 1

    def route(self, d: Delivery, now: int | None = None) -> None:
        """Queue `d` on a healthy group with room; else in the backlog of the group it would go to."""
        if not self.due.is_current(d):
            self._assign(d, None)
            return  # the tick manager was reset (a change of role): the reload owns it now
        now = monotonic_ms() if now is None else now
        if d.message is None and self.due.reread(d) is None:
            self._assign(d, None)
            return  # its record is damaged: its bucket is quarantined
        serving = self._candidates(d.message.subject)
        if not serving:
            self.no_route += 1
            self._assign(d, None)
            self.due.retry_later(d, backoff_ms(d.attempt))
            return
        healthy = [g for g in serving if g.breaker.allows(now)]
        with_room = [g for g in healthy if g is d.group or self._has_room(g)]
        group = self._weighted(d, with_room)
        if group is not None:
            self._assign(d, group)
            group.queue.append(d)
            group.wakeup.set()
            return
        # Every group that could take it is full or open: wait in the backlog of the group it
        # would go to, without its body, holding no budget.
        waiting_for = self._weighted(d, healthy or serving)
        self._assign(d, None)
        d.message = None
        waiting_for.backlog.append(d)
        waiting_for.backlog_wakeup.set()

    def route_taken(self, batch: list[Delivery], now: int) -> None:
        """`route` of each of a batch just taken from the due queue (current, read, in no group,
        never tried), with a subject's groups looked up once a batch: a message whose subject has
        one healthy group, with room, is queued there as `route` would queue it; any other goes
        through `route`."""
        limit = self.max_inflight
        subject = _untried_subject(batch)
        if subject is not None:  # most batches: one subject's; when its one healthy group has room for all, in bulk
            healthy = [g for g in self._candidates(subject) if g.breaker.allows(now)]
            if len(healthy) == 1 and healthy[0].inflight + len(batch) <= limit:
                group = healthy[0]
                _set_group(batch, group)
                group.inflight += len(batch)
                group.queue.extend(batch)
                group.wakeup.set()
                return
        healthy_of: dict[str, list[BrokerGroup]] = {}
        woken = []
        for d in batch:
            subject = d.message.subject
            healthy = healthy_of.get(subject)
            if healthy is None:
                healthy = healthy_of[subject] = [g for g in self._candidates(subject) if g.breaker.allows(now)]
            if len(healthy) != 1 or healthy[0].inflight >= limit or d.group is not None or d.tried:
                self.route(d, now)
                continue
            group = healthy[0]
            d.group = group
            group.inflight += 1
            group.queue.append(d)
            if not woken or woken[-1] is not group:
                woken.append(group)
        for group in woken:
            group.wakeup.set()

    def _retry_later(self, item, delay_ms: int) -> None:
        self.due.retry_later(item, delay_ms)

    # --- tasks --------------------------------------------------------------------------------

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for group in self.groups.values():
                self._start_group(group)
            nursery.start_soon(self._retry_task)
            nursery.start_soon(self._sync_task)
            task_status.started()
            await self._dispatch_task()

    def _start_group(self, group: BrokerGroup) -> None:
        group.scope = trio.CancelScope()
        self._nursery.start_soon(self._run_group, group)

    async def _run_group(self, group: BrokerGroup) -> None:
        with group.scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._backlog_task, group)
                nursery.start_soon(self._group_task, group, nursery)

    async def replace_groups(self, groups: list[BrokerGroup]) -> None:
        """Swap in a new set of broker groups (the meta server changed them).

        A group whose name stays keeps its task and queue when its transport is unchanged; a
        removed or rebuilt group's queued messages go back to routing. Nothing is dropped; a batch
        already handed to a removed group's transport finishes first.
        """
        old, new = self.groups, {g.name: g for g in groups}
        orphans: list[Delivery] = []
        for name, group in old.items():
            keep = new.get(name)
            if keep is not None and keep.spec == group.spec:
                group.weight, group.subjects = keep.weight, keep.subjects
                new[name] = group
                await keep.transport.aclose()
                continue
            orphans.extend(group.queue)
            orphans.extend(d for batch in group.batches for d in batch)
            orphans.extend(group.backlog)
            group.queue.clear()
            group.batches.clear()
            group.backlog.clear()
            if group.scope is not None:
                group.scope.cancel()
            await group.transport.aclose()
        self.groups = new
        for group in new.values():
            if group.scope is None:
                self._start_group(group)
        for d in orphans:
            self._assign(d, None)
            self.route(d)

    @staticmethod
    def _until_a_breaker_half_opens(groups) -> float:
        """Seconds until the first open breaker among `groups` lets traffic through again (at most
        1 s); room freed by a settled delivery wakes its waiters anyway."""
        now = monotonic_ms()
        opens = [g.breaker.open_until - now for g in groups if g.breaker.state == OPEN and g.breaker.open_until > now]
        return max(0.001, min(opens) / 1000) if opens else 1.0

    def _room_now(self) -> int:
        """How many due messages healthy groups could take now."""
        now = monotonic_ms()
        room = sum(max(0, self.max_inflight - g.inflight) for g in self.groups.values() if g.breaker.allows(now))
        if not self.groups:
            room = self.batch_size  # they wait for a route (counted in no_route)
        return room

    async def _dispatch_task(self) -> None:
        due = self.due
        while True:
            room = self._room_now()
            if not due.waiting or room <= 0 or not self.may_deliver():
                # Woken by messages falling due, a settled delivery, or a breaker's cool-down.
                timeout = 1.0
                if due.waiting and room <= 0:
                    timeout = self._until_a_breaker_half_opens(self.groups.values())
                await (self._room if due.waiting else due.ready).wait(timeout)
                continue
            self.route_taken(await due.take(min(room, self.batch_size)), monotonic_ms())
            if due.waiting:  # more to take: let the others run first (else the wait above does)
                await trio.lowlevel.checkpoint()

    async def _retry_task(self) -> None:
        due = self.due
        while True:
            for item in due.due_retries():
                if isinstance(item, list):
                    self._resend_batch(item)
                else:
                    self.route(item)
            await due.retry_wakeup.wait(due.next_retry_in() if due.retrying else 1.0)

    def _resend_batch(self, batch: list[Delivery]) -> None:
        """A batch held as one unit (after failing whole) goes back to its group as it is, or, if
        that group is open now, its messages are routed one by one."""
        batch = [d for d in batch if self.due.is_current(d)]
        if not batch:
            return
        group = batch[0].group
        if group is not None and group.name in self.groups and self.groups[group.name] is group \
                and group.breaker.allows(monotonic_ms()):
            group.batches.append(batch)
            group.wakeup.set()
        else:
            for d in batch:
                self.route(d)

    async def _backlog_task(self, group: BrokerGroup) -> None:
        """Move backlogged messages back to routing as the group gets room (or its breaker lets
        traffic through again)."""
        while True:
            now = monotonic_ms()
            if group.backlog and self._has_room(group) and group.breaker.allows(now):
                for _ in range(min(len(group.backlog), self.max_inflight - group.inflight, self.batch_size)):
                    self.route(group.backlog.popleft(), now)
                await trio.lowlevel.checkpoint()
                continue
            await group.backlog_wakeup.wait(self._until_a_breaker_half_opens([group]) if group.backlog else None)

    async def _group_task(self, group: BrokerGroup, nursery: trio.Nursery) -> None:
        """Form the group's batches and start each one's send, with up to `batches_in_flight`
        sends under way at once: a batch does not wait for the acknowledgement of the batch before
        it, so a broker that is slow to acknowledge for a moment (a stalled fsync of its disk)
        delays its acknowledgements, not the hand-over of the messages falling due meanwhile."""
        slots = trio.Semaphore(self.batches_in_flight)
        while True:
            if slots.value:
                slots.acquire_nowait()  # no trip through the scheduler while there is room (as the pump)
            else:
                await slots.acquire()
            batch = await self._next_batch(group)
            group.sending += len(batch)
            nursery.start_soon(self._send_released, group, batch, slots)

    async def _next_batch(self, group: BrokerGroup) -> list[Delivery]:
        """The group's next batch: one held back as a unit, or up to `send_batch_size` queued
        messages, after waiting up to `send_wait_ms` for the batch to fill when anything more
        falls due within that time (for any group: the wheel does not know which)."""
        while True:
            if group.batches:
                return group.batches.popleft()
            if group.queue:
                if len(group.queue) < self.batch_size and self.wait_ms and self._more_falls_due_within(self.wait_ms):
                    await trio.sleep(self.wait_ms / 1000)
                queue = group.queue
                if not queue:  # taken meanwhile (a group replaced)
                    continue
                if len(queue) <= self.batch_size:  # all of it (no Python-level step per message)
                    batch = list(queue)
                    queue.clear()
                    return batch
                return list(map(operator.call, itertools.repeat(queue.popleft, self.batch_size)))
            await group.wakeup.wait()

    def _more_falls_due_within(self, ms: int) -> bool:
        """Whether a batch waiting `ms` to fill could gain a message: one is due and not taken
        yet, or falls due within `ms`. (Without a wheel, as in a sender built alone: it waits.)"""
        return self.due is None or self.due.falls_due_within(self.clock.now_ms(), ms)

    async def _send_released(self, group: BrokerGroup, batch: list[Delivery], slots: trio.Semaphore) -> None:
        """Send one batch (counted in `group.sending` by its starter), then free its slot."""
        # Once handed to the transport a batch must finish (acked or requeued), even if the
        # group is being removed: shield it from that cancellation.
        with trio.CancelScope(shield=True):
            try:
                await self._send(group, batch)
            finally:
                group.sending -= len(batch)
                slots.release()

    async def _send(self, group: BrokerGroup, batch: list[Delivery]) -> None:
        generation = self.due.generation  # `due.is_current` of each, in one C-level pass
        if set(map(_GENERATION, batch)) != {generation}:
            for d in batch:
                if d.generation != generation:
                    self._assign(d, None)
            batch = [d for d in batch if d.generation == generation]
            if not batch:
                return
        if not self.may_deliver():
            # Fenced (a newer master epoch exists): hand the messages back, deliver nothing.
            for d in batch:
                self._retry_later(d, backoff_ms(d.attempt))
            return
        now = self.clock.now_ms()  # wall clock: the dispatch time the message carries
        # As OutboundMessage(...) makes each, without the named tuple's Python-level constructor.
        out = None if _native_outbound_of is None else _native_outbound_of(batch, now, OutboundMessage, Message)
        if out is None:  # (not built, or a due of another shape: tests' own)
            new, cls = tuple.__new__, OutboundMessage
            out = [
                new(cls, ((m := d.message).message_id, m.subject, m.body, m.headers, m.schedule_time, now, d.attempt))
                for d in batch
            ]
        group_fine = group.breaker.state == CLOSED and group.breaker.failures == 0
        try:
            results = await group.transport.send_batch(out)
        except Exception as e:  # noqa: BLE001 - see the module docstring: never the node's end
            log.exception("broker group %s: its transport raised on a batch of %d; will retry", group.name, len(batch))
            results = [DeliveryResult(Outcome.RETRY, f"transport raised {type(e).__name__}: {e}")] * len(batch)
        mono = monotonic_ms()
        if len(results) == len(batch) and results.count(ACKED) == len(batch):  # most batches: acked whole
            acked, failed = batch, []
        else:
            outcomes = {r.outcome for r in results}
            if len(batch) > 1 and outcomes == {Outcome.REJECTED}:
                # Refused whole: most likely one message's doing. Split and send the halves at once.
                self._split(group, batch, results[0].detail, at_once=True)
                return
            if len(batch) > 1 and outcomes == {Outcome.RETRY} and all(d.suspect for d in batch) \
                    and group.breaker.state == CLOSED:
                # Failed whole a second time while the group is not failing otherwise: split it.
                self._split(group, batch, results[0].detail, at_once=False)
                return
            acked, failed = await self._sort_results(group, batch, results, now)
        if len(failed) == len(batch):
            group.failed_batches += 1
            group.breaker.record_failure(mono)
            log.warning("broker group %s failed a batch of %d: %s", group.name, len(batch),
                        results[0].detail if results else "")
            if len(batch) > 1 and group_fine:
                # The group delivered the batch before this one: retry this one as a unit, and
                # split it if it fails whole again (a message in it may be what the broker fails on).
                for d in failed:
                    d.suspect = True
                self._retry_later(failed, backoff_ms(1))
            else:
                for d in failed:
                    self._retry_later(d, backoff_ms(d.attempt))
        else:
            group.breaker.record_success(mono)
            for d in failed:
                self._retry_later(d, backoff_ms(d.attempt))
        if acked:
            failpoints.hit("after-broker-ack")
            await self._record_dispatch(acked, group, now)

    async def _sort_results(self, group: BrokerGroup, batch: list[Delivery], results: list,
                            now: int) -> tuple[list[Delivery], list[Delivery]]:
        """(acknowledged, failed) of a batch's results; the refused ones are parked here."""
        acked, failed = [], []
        ok, refused = Outcome.ACKED, Outcome.REJECTED  # (an enum member's lookup, once a batch)
        for d, result in zip(batch, results):
            if result.outcome is ok:
                acked.append(d)
            elif result.outcome is refused:
                await self._park(d, group, result.detail, now)
            else:
                failed.append(d)
                d.attempt += 1
                if group.name not in d.tried:
                    d.tried += (group.name,)
                self.retried += 1
                group.retried += 1
        return acked, failed

    def _split(self, group: BrokerGroup, batch: list[Delivery], detail: str, *, at_once: bool) -> None:
        group.split_batches += 1
        half = len(batch) // 2
        log.warning("broker group %s failed a batch of %d whole (%s): sending it again in halves",
                    group.name, len(batch), detail)
        for part in (batch[:half], batch[half:]):
            if at_once:
                group.batches.append(part)
            else:
                for d in part:
                    d.suspect = True
                self._retry_later(part, backoff_ms(1))
        group.wakeup.set()

    async def _record_dispatch(self, acked: list[Delivery], group: BrokerGroup, now: int) -> None:
        """Append the dispatch records of `acked` and hand them to the fsync task, which settles them."""
        # Per bucket: its records and their schedule offsets (for the dispatch index, when the
        # records are all of one length: then it need not parse them).
        fields = _dispatch_fields(acked)
        if fields is not None:  # most batches: one bucket's, its records made in one piece
            bucket, offsets, message_log_offsets = fields
            per_bucket = {bucket: (encode_dispatch_data(now, group.name, offsets, message_log_offsets), offsets)}
        else:
            offsets = list(map(_SCHEDULE_OFFSET, acked))
            records = encode_dispatch_records(now, group.name, list(zip(offsets, map(_MESSAGE_LOG_OFFSET, acked))))
            one_length = len(set(map(len, records))) == 1
            pieces: dict[int, tuple[list[bytes], list[int]]] = {}
            for d, rec in zip(acked, records):
                recs, offs = pieces.setdefault(d.bucket, ([], []))
                recs.append(rec)
                offs.append(d.schedule_offset)
            per_bucket = {bucket: (b"".join(recs), offs if one_length else None)
                          for bucket, (recs, offs) in pieces.items()}
        dispatch_log = self.store.dispatch_log
        while per_bucket:
            bucket = next(iter(per_bucket))
            data, offs = per_bucket[bucket]
            try:
                dispatch_log.append(bucket, data, offs)
            except StorageError as e:
                # The broker has them: a lost dispatch record only means a redelivery after a
                # restart, so keep trying rather than give up or deliver again now. A failed
                # append leaves the segment as it was: only this bucket's records are written again.
                log.error("dispatch_log write failed, retrying: %s", e)
                if isinstance(e, DiskFull):
                    self.on_disk_full()  # releases the reserve: the retry finds room
                await trio.sleep(0.5)
                continue
            del per_bucket[bucket]
        self._unsynced.append((acked, group, now))
        self._unsynced_count += len(acked)
        if len(self._unsynced) == 1 or self._unsynced_count >= self._sync_early_at:
            self._unsynced_wakeup.set()

    async def _sync_task(self) -> None:
        """fsync dispatch_log for every batch appended since the last round, then settle them."""
        while True:
            if not self._unsynced:
                await self._unsynced_wakeup.wait()
                continue
            deadline = trio.current_time() + DISPATCH_SYNC_LINGER_S
            while self._unsynced_count < self._sync_early_at and trio.current_time() < deadline:
                await self._unsynced_wakeup.wait(deadline - trio.current_time())
            # Shielded: a round that began settles what it covers, even when the sender stops.
            with trio.CancelScope(shield=True):
                await self._sync_round()

    async def _sync_round(self) -> None:
        # Taken together, with no checkpoint between: the fsync covers every record of `taken`.
        taken, self._unsynced, self._unsynced_count = self._unsynced, [], 0
        dispatch_log = self.store.dispatch_log
        while True:
            paths, new_files = dispatch_log.take_dirty()
            try:
                await run_disk(dispatch_log.sync_paths, paths, new_files)
                self.dispatch_fsyncs += 1
                break
            except FsyncFailed as e:
                # Never retried (fsyncgate): the records are not durable, so these messages go out
                # again after a restart; settle them in memory rather than deliver again now.
                n = sum(len(acked) for acked, _, _ in taken)
                log.error("dispatch_log not durable, a restart delivers these %d again: %s", n, e)
                break
            except StorageError as e:
                log.error("dispatch_log fsync failed, retrying: %s", e)
                dispatch_log.mark_dirty(paths)
                await trio.sleep(0.5)
        for acked, group, now in taken:
            self._settle(acked, group, now)

    def _settle(self, acked: list[Delivery], group: BrokerGroup, now: int) -> None:
        # One pass over the batch (compiled where built): the dues are cold by now, and each pass
        # over them was a cache miss per message.
        got = None if _native_settled is None else _native_settled(acked, now, group, self.due.generation)
        lateness, refs, freed, others = got or _settled_py(acked, now, group, self.due.generation)
        self.due.settle_refs(refs)
        for d in others:  # counted against another group
            self._assign(d, None)
        # `_assign(d, None)` of those counted against `group`, the room they free announced once.
        if freed:
            group.inflight -= freed
            if group.backlog:
                group.backlog_wakeup.set()
            self._room.set()
        self.lateness_ms.extend(lateness)
        self.on_delivered(group.name, lateness)
        group.sent += len(acked)
        self.delivered += len(acked)

    async def _park(self, d: Delivery, group: BrokerGroup, reason: str, now: int) -> None:
        log.warning("broker group %s rejected message %s for good: %s (parked)", group.name,
                    d.message.message_id, reason)
        if self.parked is not None:
            await self.parked.park(d, f"{group.name}: {reason}", now)
        self.parked_count += 1
        group.parked += 1
        self.due.settle(d)
        self._assign(d, None)

    async def aclose(self) -> None:
        if self._unsynced:  # appended after the fsync task stopped: make them durable too
            try:
                self.store.dispatch_log.sync()
            except StorageError as e:
                log.error("dispatch_log not durable at stop, a restart delivers %d again: %s",
                          sum(len(acked) for acked, _, _ in self._unsynced), e)
            self._unsynced, self._unsynced_count = [], 0
        for group in self.groups.values():
            await group.transport.aclose()

    def metrics(self) -> dict[str, float]:
        return {
            "delayserver_delivered_total": self.delivered,
            "delayserver_retries_total": self.retried,
            "delayserver_parked_total": self.parked_count,
            "delayserver_inflight": sum(g.inflight for g in self.groups.values()),
            "delayserver_due_waiting": self.due.waiting + sum(len(g.backlog) for g in self.groups.values()),
            "delayserver_retry_waiting": self.due.retrying,
        }
