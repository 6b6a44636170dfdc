"""A circuit breaker per broker group: closed -> open -> half-open -> closed.

It opens after `failure_threshold` consecutive failed batches; while open, the group gets no
traffic (its messages go to another group serving the subject, or wait). After the cool-down it is
half-open: traffic is let through again, and `success_threshold` successes close it, while one
failure opens it again with a doubled cool-down (up to `max_cooldown_ms`).
"""
from __future__ import annotations

import attrs

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


@attrs.define
class CircuitBreaker:
    failure_threshold: int = 3
    success_threshold: int = 2
    cooldown_ms: int = 1000
    max_cooldown_ms: int = 30_000
    state: str = CLOSED
    failures: int = 0
    successes: int = 0
    open_until: int = 0
    _current_cooldown: int = 0

    def allows(self, now: int) -> bool:
        if self.state == OPEN and now >= self.open_until:
            self.state = HALF_OPEN
            self.successes = 0
        return self.state != OPEN

    def record_success(self, now: int) -> None:
        self.failures = 0
        if self.state == HALF_OPEN:
            self.successes += 1
            if self.successes >= self.success_threshold:
                self.state = CLOSED
                self._current_cooldown = 0

    def record_failure(self, now: int) -> None:
        self.failures += 1
        if self.state == HALF_OPEN or self.failures >= self.failure_threshold:
            self._current_cooldown = min(self.max_cooldown_ms, (self._current_cooldown * 2) or self.cooldown_ms)
            self.state = OPEN
            self.open_until = now + self._current_cooldown
