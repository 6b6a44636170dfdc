"""A byte budget: how much data may be held at once, shared by tasks that wait for room.

`acquire(n)` waits until `n` more bytes fit under the limit, or nothing is held at all (so one
request bigger than the limit still goes through, alone); `release(n)` gives them back. The
connection pump takes a connection's frames from a budget of its own and from the node's total
before it starts them: while either is full it stops reading that connection, and TCP pushes back
on the producer instead of the node buffering without bound.
"""
from __future__ import annotations

import trio


class ByteBudget:
    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self._changed = trio.Event()

    def fits(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.limit

    async def acquire(self, n: int) -> None:
        while not self.fits(n):
            await self._changed.wait()
        self.used += n

    def release(self, n: int) -> None:
        self.used -= n
        self._changed.set()
        self._changed = trio.Event()
