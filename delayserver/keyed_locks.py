"""One holder at a time per key, with no lock kept for a key nobody holds or waits for."""
from __future__ import annotations

import contextlib
from typing import AsyncIterator, Hashable

import trio


class KeyedLocks:
    def __init__(self):
        self._locks: dict[Hashable, list] = {}  # key -> [lock, holders and waiters]

    @contextlib.asynccontextmanager
    async def hold(self, key: Hashable) -> AsyncIterator[None]:
        entry = self._locks.setdefault(key, [trio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._locks[key]

    def __len__(self) -> int:
        return len(self._locks)
