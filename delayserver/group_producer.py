"""A producer that finds its delay groups through the meta server and spreads sends over them.

    async with AsyncGroupProducer(meta="10.0.0.1:20800,10.0.0.2:20800") as producer:
        handle = await producer.send("orders.expire", b"...", delay=30_000)

`meta` names one meta server or several; the group list comes from the first that answers.

Sends go round-robin to the masters of the live, writable delay groups. A group that fails a
request (connection lost, timeout, NOT_MASTER, FENCED, READ_ONLY, DISK_FULL, BUSY,
NOT_ENOUGH_REPLICAS) is skipped for a cool-down and the request goes to the next one, so a dead
delay group only costs a retry; the group list is refreshed from the meta server periodically and
after a failure. A message sent to a group whose answer was lost may be stored twice (at least
once; the id travels with it).
`cancel` and `status` ask every live group, since a handle does not name its group.
"""
from __future__ import annotations

import ssl
from typing import Iterable

import trio

from delayserver.client import AsyncProducer, Message, Rescheduled, Status
from delayserver.message import CancelOutcome, DelayServerError, Handle, MessageState, ResultCode
from delayserver.meta.client import MetaError, MetaUnavailable, discover_delay_groups
from delayserver.trio_util import BackgroundTasks

COOL_DOWN_S = 5.0
REFRESH_S = 10.0
#: Answers of a node whose role is changing: the group is asked again after ROLE_CHANGE_WAIT_S.
_ROLE_CHANGING = {ResultCode.NOT_MASTER, ResultCode.FENCED}
ROLE_CHANGE_WAIT_S = 1.0
#: Codes that say "not this group now": try another.
_GROUP_FAILURES = {ResultCode.NOT_MASTER, ResultCode.FENCED, ResultCode.READ_ONLY, ResultCode.DISK_FULL,
                   ResultCode.BUSY, ResultCode.NOT_ENOUGH_REPLICAS}


class NoDelayGroup(ConnectionError):
    """No live delay group could take the request."""


class AsyncGroupProducer(BackgroundTasks):
    def __init__(self, meta: str, *, timeout: float = 10.0, meta_tls: ssl.SSLContext | None = None, **options):
        """`meta`: ``HOST:PORT[,HOST:PORT...]``. `meta_tls`: TLS to the meta servers, checking
        their certificates with this context. `options` go to each delay group's connection."""
        self.meta = meta
        self.meta_tls = meta_tls
        self.timeout = timeout
        self.options = options  # for each delay group's connection (secret, tls)
        self._members: dict[str, AsyncProducer] = {}
        self._groups: list[tuple[str, str]] = []
        self._down_until: dict[str, float] = {}
        self._next = 0
        self._refreshed_at = float("-inf")

    async def _hold(self, address: str, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with AsyncProducer(address, timeout=self.timeout, **self.options) as member:
            task_status.started(member)
            await trio.sleep_forever()

    async def _refresh(self, force: bool = False) -> None:
        now = trio.current_time()
        if not force and now - self._refreshed_at < REFRESH_S and self._groups:
            return
        try:
            self._groups = await discover_delay_groups(self.meta, timeout_s=self.timeout, tls=self.meta_tls)
            self._refreshed_at = now
        except (MetaUnavailable, MetaError):
            if not self._groups:
                raise NoDelayGroup(f"meta servers {self.meta} are unreachable and no delay group is known") from None

    async def _member(self, address: str) -> AsyncProducer:
        member = self._members.get(address)
        if member is None:
            member = await self._nursery.start(self._hold, address)
            self._members[address] = member
        return member

    def _candidates(self) -> list[str]:
        now = trio.current_time()
        live = [addr for _, addr in self._groups if self._down_until.get(addr, 0) <= now]
        if not live:
            return []
        start = self._next % len(live)
        self._next += 1
        return live[start:] + live[:start]

    def _mark_down(self, address: str) -> None:
        self._down_until[address] = trio.current_time() + COOL_DOWN_S
        self._refreshed_at = float("-inf")

    async def _each_group(self, call):
        """Run `call(member)` on the groups in turn until one takes it; raise if none does."""
        await self._refresh()
        last: Exception | None = None
        for attempt in range(2):
            changing = False
            for address in self._candidates():
                try:
                    return await call(await self._member(address))
                except (ConnectionError, TimeoutError) as e:
                    last = e
                except DelayServerError as e:
                    if e.code not in _GROUP_FAILURES:
                        raise
                    last = e
                    if e.code in _ROLE_CHANGING:
                        # Reachable, its role changing (a lease being renewed, a master being
                        # chosen): asked again after a short wait, not set aside.
                        changing = True
                        continue
                self._mark_down(address)
            await self._refresh(force=True)
            if changing and attempt == 0:
                await trio.sleep(ROLE_CHANGE_WAIT_S)
        raise NoDelayGroup(f"no delay group took the request (last error: {last})")

    async def send(self, subject: str, body: bytes, **kw) -> Handle:
        return await self._each_group(lambda m: m.send(subject, body, **kw))

    async def send_many(self, messages: Iterable[Message], *, batch: int = 256) -> list:
        messages = list(messages)
        out: list = []
        for start in range(0, len(messages), batch):
            chunk = messages[start : start + batch]

            async def one(member, chunk=chunk):
                results = await member.send_many(chunk, batch=batch)
                failed = [r for r in results if isinstance(r, (ConnectionError, TimeoutError))
                          or (isinstance(r, DelayServerError) and r.code in _GROUP_FAILURES)]
                if failed and len(failed) == len(results):
                    raise failed[0]
                return results

            out.extend(await self._each_group(one))
        return out

    async def _ask_all(self, call):
        await self._refresh()
        answers = []
        for _, address in self._groups:
            try:
                answers.append(await call(await self._member(address)))
            except (ConnectionError, TimeoutError, DelayServerError):
                self._mark_down(address)
        return answers

    async def cancel(self, handle: Handle | str) -> CancelOutcome:
        answers = await self._ask_all(lambda m: m.cancel(handle))
        known = [a for a in answers if a != CancelOutcome.UNKNOWN]
        return known[0] if known else CancelOutcome.UNKNOWN

    async def status(self, handle: Handle | str) -> Status:
        answers = await self._ask_all(lambda m: m.status(handle))
        known = [a for a in answers if a.state != MessageState.UNKNOWN]
        return known[0] if known else Status(MessageState.UNKNOWN)

    async def reschedule(self, handle: Handle | str, **kw):
        """Asked of every group: the one holding the message answers who won."""
        answers = await self._ask_all(lambda m: m.reschedule(handle, **kw))
        known = [a for a in answers if a.outcome != CancelOutcome.UNKNOWN]
        return known[0] if known else answers[0] if answers else Rescheduled(CancelOutcome.UNKNOWN)

    async def promote(self, handle: Handle | str):
        return await self.reschedule(handle, delay=0)
