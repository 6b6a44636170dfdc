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
        with trio.move_on_after(timeout_s if timeout_s is not None else float("inf")):
            await self._event.wait()
        if self._event.is_set():
            self._event = trio.Event()
