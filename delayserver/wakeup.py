"""A level-triggered wake-up between trio tasks: `set()` never blocks, `wait()` returns once per set."""
from __future__ import annotations

import trio


class Wakeup:
    def __init__(self) -> None:
        self._event = trio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self, timeout_s: float | None = None) -> None:
        """Return when set (clearing it), or after `timeout_s` seconds."""
        if timeout_s is None or self._event.is_set():  # no deadline to keep (a cancel scope less)
            await self._event.wait()
        else:
            with trio.move_on_after(timeout_s):
                await self._event.wait()
        if self._event.is_set():
            self._event = trio.Event()
