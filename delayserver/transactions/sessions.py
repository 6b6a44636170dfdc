"""Producer connections by producer group, and the TXN_CHECK requests the server sends over them.

A producer that can answer checks registers its group on its connection (PRODUCER_REGISTER); the
checker asks any live connection of the group, taking them in turn. A connection that closes
answers UNKNOWN for the checks it still owed, and is forgotten.
"""
from __future__ import annotations

import itertools
import logging
from typing import Awaitable, Callable

import trio

from delayserver import protocol as p
from delayserver.message import TransactionState

log = logging.getLogger("delayserver.transactions")


class ProducerSession:
    """One connection of the delay server, as the checker sees it."""

    def __init__(self, registry: "ProducerSessions", peer: str = "a producer"):
        self.registry = registry
        self.peer = peer
        self.groups: set[str] = set()
        self.send: Callable[[bytes], Awaitable[None]] | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, list] = {}
        self.closed = False

    def register(self, group: str) -> None:
        if not self.closed:
            self.groups.add(group)
            self.registry.add(group, self)

    def on_response(self, frame: p.Frame) -> bool:
        """Take the answer to a request this server sent; False if none is waiting for it."""
        box = self._waiting.get(frame.request_id)
        if box is None:
            return False
        box.append(frame)
        box[0].set()
        return True

    async def check(self, request: p.CheckRequest, timeout_s: float) -> TransactionState:
        """Ask this producer; UNKNOWN when it does not answer in time, answers with an error or
        goes away (the checker asks again later)."""
        if self.send is None or self.closed:
            return TransactionState.UNKNOWN
        rid = next(self._ids) & 0xFFFFFFFF
        box: list = [trio.Event()]
        self._waiting[rid] = box
        try:
            await self.send(p.encode(p.Frame(p.Command.TXN_CHECK, rid, p.encode_check_request(request))))
            with trio.move_on_after(timeout_s):
                await box[0].wait()
        finally:
            self._waiting.pop(rid, None)
        if len(box) < 2:
            log.info("no answer from %s to the check of %s within %.1f s", self.peer, request.item.message_id,
                     timeout_s)
            return TransactionState.UNKNOWN
        frame = box[1]
        try:
            if frame.command == p.Command.ERROR:
                error = p.decode_error(frame.payload)
                log.warning("%s answered the check of %s with an error: %s", self.peer, request.item.message_id,
                            error.message)
                return TransactionState.UNKNOWN
            return p.decode_check_response(frame.payload)
        except p.RemoteProtocolError as e:
            log.warning("%s answered a check with a bad payload: %s", self.peer, e)
            return TransactionState.UNKNOWN

    def close(self) -> None:
        self.closed = True
        self.registry.remove(self)
        for box in self._waiting.values():
            box[0].set()
        self._waiting.clear()


class ProducerSessions:
    def __init__(self):
        self._by_group: dict[str, list[ProducerSession]] = {}
        self._turn = itertools.count()

    def open(self, peer: str = "a producer") -> ProducerSession:
        return ProducerSession(self, peer)

    def add(self, group: str, session: ProducerSession) -> None:
        sessions = self._by_group.setdefault(group, [])
        if session not in sessions:
            sessions.append(session)

    def remove(self, session: ProducerSession) -> None:
        for group in session.groups:
            sessions = self._by_group.get(group, [])
            if session in sessions:
                sessions.remove(session)
            if not sessions:
                self._by_group.pop(group, None)

    def pick(self, group: str) -> ProducerSession | None:
        """A live connection of `group`, taken in turn; None when the group has none."""
        sessions = self._by_group.get(group)
        if not sessions:
            return None
        return sessions[next(self._turn) % len(sessions)]

    def count(self, group: str) -> int:
        return len(self._by_group.get(group, ()))
