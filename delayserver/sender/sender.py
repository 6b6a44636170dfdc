"""The sender: due messages out to broker groups, in batches, one task per group.

- The dispatcher takes due refs from the tick manager, at most `max_inflight` at a time (flow
  control: past the bound, due entries wait in the tick manager's ready queue, counted in the
  metrics, never dropped), reads each message from schedule_log, drops it if it was cancelled, and
  routes it to a broker group serving its subject, chosen by weight among healthy ones.
- Each group task sends batches of up to `send_batch_size`, waiting up to `send_wait_ms` for one to
  fill, so that a slow or dead group never holds back another.
- Per-message results: ACKED -> a dispatch_log record (then the message is settled); RETRY -> back
  to the dispatcher after a back-off, possibly to another group, without any retry limit;
  REJECTED -> parked (see `parked.py`), never blocking the others.
"""
from __future__ import annotations

import collections
import heapq
import itertools
import logging
import random

import attrs
import trio

from delayserver import failpoints
from delayserver.sender.breaker import CircuitBreaker
from delayserver.sender.parked import ParkedLog
from delayserver.sender.transport import OutboundMessage, Outcome, Transport
from delayserver.storage.record import Dispatch, Message, RecordType, encode_dispatch, encode_record
from delayserver.storage.segment import CorruptSegment, DiskFull, FsyncFailed, StorageError
from delayserver.wakeup import Wakeup

log = logging.getLogger("delayserver.sender")

MAX_BACKOFF_MS = 30_000


@attrs.define(eq=False)
class Delivery:
    ref: int
    bucket: int
    schedule_offset: int
    message: Message
    attempt: int = 1
    tried: set = attrs.field(factory=set)
    generation: int = 0


@attrs.define(eq=False)
class BrokerGroup:
    name: str
    transport: Transport
    weight: int = 1
    subjects: frozenset[str] | None = None  # None: every subject
    breaker: CircuitBreaker = attrs.field(factory=CircuitBreaker)
    queue: collections.deque = attrs.field(factory=collections.deque)
    wakeup: Wakeup = attrs.field(factory=Wakeup)
    sent: int = 0
    failed_batches: int = 0
    retried: int = 0
    parked: int = 0
    sending: int = 0  # messages handed to the transport, not settled yet
    scope: trio.CancelScope | None = None
    spec: object = None  # what the group was built from (a meta server's broker group), if anything

    def serves(self, subject: str) -> bool:
        return self.subjects is None or subject in self.subjects


def backoff_ms(attempt: int) -> int:
    """100 ms doubling per attempt up to 30 s, with jitter so that retries do not synchronise."""
    base = min(MAX_BACKOFF_MS, 100 * 2 ** min(attempt - 1, 20))
    return base // 2 + random.randrange(base // 2 + 1)


class Sender:
    def __init__(self, ticks, store, groups: list[BrokerGroup], clock, *, send_batch_size: int = 256,
                 send_wait_ms: int = 2, max_inflight: int = 20_000, batches_in_flight: int = 2,
                 parked: ParkedLog | None = None,
                 may_deliver=lambda: True, resolve=None, on_disk_full=lambda: None):
        self.ticks = ticks
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
        self.ready = Wakeup()
        self.retry_wakeup = Wakeup()
        self._retries: list = []
        self._seq = itertools.count()
        self.delivered = 0
        self.parked_count = 0
        self.retried = 0
        self.no_route = 0
        self.lateness_ms: collections.deque[int] = collections.deque(maxlen=100_000)
        # (broker group name, lateness in ms of each message it acknowledged): the metrics' hook.
        self.on_delivered = lambda group, lateness_ms: None
        self._settled_wakeup = Wakeup()

    # --- routing ------------------------------------------------------------------------------

    def _candidates(self, subject: str) -> list[BrokerGroup]:
        if self.resolve is not None:
            names = self.resolve(subject)
            return [self.groups[n] for n in names if n in self.groups]
        return [g for g in self.groups.values() if g.serves(subject)]

    def pick(self, d: Delivery, now: int) -> BrokerGroup | None:
        """A group serving the subject, by weight among those whose breaker lets traffic through;
        groups already tried for this message are avoided while another healthy one exists."""
        serving = self._candidates(d.message.subject)
        healthy = [g for g in serving if g.breaker.allows(now)]
        fresh = [g for g in healthy if g.name not in d.tried] or healthy
        if len(fresh) <= 1:
            return fresh[0] if fresh else None
        return random.choices(fresh, weights=[max(g.weight, 0) or 1 for g in fresh])[0]

    def route(self, d: Delivery, now: int) -> None:
        if d.generation != self.ticks.generation:
            return  # the tick manager was reset (a change of role): the reload owns it now
        group = self.pick(d, now)
        if group is None:
            if not self._candidates(d.message.subject):
                self.no_route += 1
            self._retry_later(d, now)
            return
        group.queue.append(d)
        group.wakeup.set()

    def _retry_later(self, d: Delivery, now: int) -> None:
        heapq.heappush(self._retries, (now + backoff_ms(d.attempt), next(self._seq), d))
        self.retry_wakeup.set()

    # --- tasks --------------------------------------------------------------------------------

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for group in self.groups.values():
                self._start_group(group)
            nursery.start_soon(self._retry_task)
            task_status.started()
            await self._dispatch_task()

    def _start_group(self, group: BrokerGroup) -> None:
        group.scope = trio.CancelScope()
        self._nursery.start_soon(self._run_group, group)

    async def _run_group(self, group: BrokerGroup) -> None:
        # Several batches in flight per group, so that one batch's round trip and dispatch_log
        # fsync do not cap the group's rate.
        with group.scope:
            async with trio.open_nursery() as nursery:
                for _ in range(self.batches_in_flight):
                    nursery.start_soon(self._group_task, group)

    async def replace_groups(self, groups: list[BrokerGroup]) -> None:
        """Swap in a new set of broker groups (the meta server changed them).

        A group whose name stays keeps its task and queue when its transport is unchanged; a
        removed or rebuilt group's queued messages go back to routing. Nothing is dropped; a batch
        already handed to a removed group's transport finishes first.
        """
        now = self.clock.now_ms()
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
            group.queue.clear()
            if group.scope is not None:
                group.scope.cancel()
            await group.transport.aclose()
        self.groups = new
        for group in new.values():
            if group.scope is None:
                self._start_group(group)
        for d in orphans:
            self.route(d, now)

    async def _dispatch_task(self) -> None:
        while True:
            room = self.max_inflight - len(self.ticks.inflight)
            if not self.ticks.ready or room <= 0 or not self.may_deliver():
                with trio.move_on_after(0.05 if self.ticks.ready else 1):
                    await (self._settled_wakeup if self.ticks.ready else self.ready).wait()
                continue
            now = self.clock.now_ms()
            for ref in self.ticks.take(min(room, self.batch_size * 4)):
                try:
                    bucket, offset, _mlo, message = self.ticks.read_message(ref)
                except CorruptSegment as e:
                    # Quarantine its bucket (storage/quarantine.py), settle it in memory and go on.
                    self.store.quarantine(self.ticks.split(ref)[0], e)
                    self.ticks.on_dispatched(ref)
                    continue
                if self.ticks.is_cancelled(bucket, offset, message.schedule_time, message.message_id):
                    self.ticks.drop_cancelled(ref)
                    continue
                self.route(Delivery(ref, bucket, offset, message, generation=self.ticks.generation), now)
            await trio.lowlevel.checkpoint()

    async def _retry_task(self) -> None:
        while True:
            now = self.clock.now_ms()
            while self._retries and self._retries[0][0] <= now:
                _, _, d = heapq.heappop(self._retries)
                self.route(d, now)
            timeout = 1.0 if not self._retries else max(0, self._retries[0][0] - now) / 1000
            await self.retry_wakeup.wait(timeout)

    async def _group_task(self, group: BrokerGroup) -> None:
        while True:
            if not group.queue:
                await group.wakeup.wait()
                continue
            if len(group.queue) < self.batch_size and self.wait_ms:
                await trio.sleep(self.wait_ms / 1000)
            batch = [group.queue.popleft() for _ in range(min(self.batch_size, len(group.queue)))]
            # Once handed to the transport a batch must finish (acked or requeued), even if the
            # group is being removed: shield it from that cancellation.
            with trio.CancelScope(shield=True):
                group.sending += len(batch)
                try:
                    await self._send(group, batch)
                finally:
                    group.sending -= len(batch)

    async def _send(self, group: BrokerGroup, batch: list[Delivery]) -> None:
        batch = [d for d in batch if d.generation == self.ticks.generation]
        if not batch:
            return
        if not self.may_deliver():
            # Fenced (a newer master epoch exists): hand the messages back, deliver nothing.
            now = self.clock.now_ms()
            for d in batch:
                self._retry_later(d, now)
            return
        now = self.clock.now_ms()
        out = [
            OutboundMessage(d.message.message_id, d.message.subject, d.message.body, d.message.headers,
                            d.message.schedule_time, now, d.attempt)
            for d in batch
        ]
        results = await group.transport.send_batch(out)
        acked, failed = [], 0
        for d, result in zip(batch, results):
            if result.outcome is Outcome.ACKED:
                acked.append(d)
            elif result.outcome is Outcome.REJECTED:
                await self._park(d, group, result.detail, now)
            else:
                failed += 1
                d.attempt += 1
                d.tried.add(group.name)
                self.retried += 1
                group.retried += 1
                self._retry_later(d, now)
        if failed == len(batch):
            group.failed_batches += 1
            group.breaker.record_failure(now)
            log.warning("broker group %s failed a batch of %d: %s", group.name, len(batch),
                        results[0].detail if results else "")
        else:
            group.breaker.record_success(now)
        if acked:
            failpoints.hit("after-broker-ack")
            await self._record_dispatch(acked, group, now)

    async def _record_dispatch(self, acked: list[Delivery], group: BrokerGroup, now: int) -> None:
        per_bucket: dict[int, list[bytes]] = {}
        for d in acked:
            rec = encode_record(RecordType.DISPATCH, encode_dispatch(Dispatch(d.schedule_offset, now, group.name)))
            per_bucket.setdefault(d.bucket, []).append(rec)
        dispatch_log = self.store.dispatch_log
        while True:
            try:
                for bucket, recs in per_bucket.items():
                    dispatch_log.append(bucket, b"".join(recs))
                paths, new_files = dispatch_log.take_dirty()
                await trio.to_thread.run_sync(dispatch_log.sync_paths, paths, new_files)
                break
            except FsyncFailed as e:
                # Never retried (fsyncgate): the records are not durable, so these messages go out
                # again after a restart; settle them in memory rather than deliver again now.
                log.error("dispatch_log not durable, a restart delivers these %d again: %s", len(acked), e)
                break
            except StorageError as e:
                # The broker has them: a lost dispatch record only means a redelivery after a
                # restart, so keep trying rather than give up or deliver again now.
                log.error("dispatch_log write failed, retrying: %s", e)
                if isinstance(e, DiskFull):
                    self.on_disk_full()  # releases the reserve: the retry finds room
                await trio.sleep(0.5)
        lateness = [now - d.message.schedule_time for d in acked]
        for d in acked:
            self.ticks.on_dispatched(d.ref)
        self.lateness_ms.extend(lateness)
        self.on_delivered(group.name, lateness)
        group.sent += len(acked)
        self.delivered += len(acked)
        self._settled_wakeup.set()

    async def _park(self, d: Delivery, group: BrokerGroup, reason: str, now: int) -> None:
        log.warning("broker group %s rejected message %s for good: %s (parked)", group.name,
                    d.message.message_id, reason)
        if self.parked is not None:
            await self.parked.park(d, f"{group.name}: {reason}", now)
        self.parked_count += 1
        group.parked += 1
        self.ticks.on_dispatched(d.ref)
        self._settled_wakeup.set()

    async def aclose(self) -> None:
        for group in self.groups.values():
            await group.transport.aclose()

    def metrics(self) -> dict[str, float]:
        return {
            "delayserver_delivered_total": self.delivered,
            "delayserver_retries_total": self.retried,
            "delayserver_parked_total": self.parked_count,
            "delayserver_inflight": len(self.ticks.inflight),
            "delayserver_due_waiting": len(self.ticks.ready),
            "delayserver_retry_waiting": len(self._retries),
        }
