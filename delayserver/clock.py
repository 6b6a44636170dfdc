"""The clock: epoch milliseconds, UTC, injectable.

`WallClock` reads the system time; `TrioClock` derives epoch time from trio's clock, so tests that
run under `trio.testing.MockClock(autojump_threshold=0)` see hours pass in milliseconds and never
sleep for real. Everything that reads the time takes a clock.
"""
from __future__ import annotations

import time

import trio


class _Clock:
    def now_ms(self) -> int:
        raise NotImplementedError


class WallClock(_Clock):
    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


class TrioClock(_Clock):
    """Epoch ms = `epoch_ms` + trio.current_time(); `step_ms` models a wall-clock step."""

    def __init__(self, epoch_ms: int):
        self.epoch_ms = epoch_ms

    def now_ms(self) -> int:
        return self.epoch_ms + int(trio.current_time() * 1000)

    def step(self, delta_ms: int) -> None:
        self.epoch_ms += delta_ms
