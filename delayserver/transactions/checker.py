"""The check-back: the master asks producer groups about half messages left unresolved.

A half message is checked `transaction_timeout` after it was prepared (or after its own
`check_immunity`), then every `check_interval`; each check is first recorded (TXN_CHECK, durable
and replicated, so the count survives a restart or a failover), then sent to one live connection
of the producer group. COMMIT and ROLLBACK answers resolve it as the producer's own requests do;
UNKNOWN, silence or an error leave it for the next check. Once checked `check_max` times, or
unresolved past retention, it is parked on `%TRANS_CHECK_MAX%<group>`. A group with no live
connection is not asked and the check is not counted: it is tried again `check_interval` later
(RocketMQ counts it all the same; retention bounds how long such a message waits).

Only a master that may deliver checks. Check requests leave `check_spacing` apart and at most
CHECKS_IN_FLIGHT are awaited at once, so a thousand half messages due together do not send a
thousand requests in one instant.
"""
from __future__ import annotations

import logging

import trio

from delayserver.message import Handle
from delayserver.message import TransactionState as TS
from delayserver.storage.errors import StorageError
from delayserver.storage.record import ParkReason
from delayserver.transactions.operations import TransactionOperations
from delayserver.transactions.sessions import ProducerSessions
from delayserver.transactions.state import Half, Key

log = logging.getLogger("delayserver.transactions")

CHECKS_IN_FLIGHT = 16


class Checker:
    def __init__(self, operations: TransactionOperations, sessions: ProducerSessions, config, clock,
                 may_check=lambda: True):
        self.operations = operations
        self.halves = operations.halves
        self.sessions = sessions
        self.config = config
        self.clock = clock
        self.may_check = may_check
        self._inflight: set[Key] = set()
        self._no_producer: dict[Key, int] = {}  # not asked (no live connection): not before this time
        self.answers = {TS.COMMIT: 0, TS.ROLLBACK: 0, TS.UNKNOWN: 0}
        self._pace_lock = trio.Lock()
        self._last_request = float("-inf")

    @property
    def scan_interval_s(self) -> float:
        c = self.config
        return max(0.01, min(1.0, c.transaction_timeout_ms / 4000, c.check_interval_ms / 4000))

    def due(self, now: int) -> list[Half]:
        """Unresolved half messages whose check time has come, oldest first."""
        c = self.config
        out = []
        if self._no_producer:
            self._no_producer = {k: t for k, t in self._no_producer.items() if k in self.halves.open}
        for half in self.halves.unresolved():
            if half.key in self._inflight or self._no_producer.get(half.key, 0) > now:
                continue
            when = half.next_check_time(c.transaction_timeout_ms, c.check_interval_ms)
            if when <= now:
                out.append((when, half))
        out.sort(key=lambda pair: pair[0])
        return [half for _, half in out]

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        limiter = trio.CapacityLimiter(CHECKS_IN_FLIGHT)
        task_status.started()
        async with trio.open_nursery() as nursery:
            while True:
                if self.may_check():
                    for half in self.due(self.clock.now_ms()):
                        if not self.may_check():
                            break
                        self._inflight.add(half.key)
                        await limiter.acquire_on_behalf_of(half.key)
                        nursery.start_soon(self._check, half, limiter)
                await trio.sleep(self.scan_interval_s)

    async def _check(self, half: Half, limiter: trio.CapacityLimiter) -> None:
        try:
            await self.check_once(half)
        except StorageError as e:
            log.error("check of half message %s failed: %s", half.message_id, e)
        finally:
            self._inflight.discard(half.key)
            limiter.release_on_behalf_of(half.key)

    async def _pace(self) -> None:
        """Return `check_spacing` after the previous request left (on trio's clock)."""
        async with self._pace_lock:
            wait = self._last_request + self.config.check_spacing_ms / 1000 - trio.current_time()
            if wait > 0:
                await trio.sleep(wait)
            self._last_request = trio.current_time()

    async def check_once(self, half: Half) -> TS | None:
        """Check `half` now: park it, or ask its group; the answer, or None when none was asked."""
        c, now = self.config, self.clock.now_ms()
        if half.checks >= c.check_max:
            await self.operations.park(half, ParkReason.CHECK_MAX)
            return None
        if now - half.store_time >= c.retention_ms:
            await self.operations.park(half, ParkReason.RETENTION)
            return None
        session = self.sessions.pick(half.group)
        if session is None:
            self._no_producer[half.key] = now + c.check_interval_ms
            log.info("half message %s: no producer of group %s is connected to ask", half.message_id, half.group)
            return None
        self._no_producer.pop(half.key, None)
        request = await self.operations.check_request(half)
        if not await self.operations.record_check(half):
            return None
        await self._pace()
        answer = await session.check(request, c.check_answer_timeout_ms / 1000)
        self.answers[answer] += 1
        handle = Handle(half.schedule_time, half.message_id)
        if answer == TS.COMMIT:
            await self.operations.commit(handle)
        elif answer == TS.ROLLBACK:
            await self.operations.rollback(handle)
        return answer
