"""A progress bar for long scans, on stderr and only when stderr is a terminal (never when piped)."""
from __future__ import annotations

import sys
import time

WIDTH = 30
REDRAW_S = 0.1


class Progress:
    """`advance(n)` by units of work out of `total`; use as a context manager to clear the line."""

    def __init__(self, total: int, label: str = "", stream=None):
        self.stream = sys.stderr if stream is None else stream
        self.enabled = total > 0 and self.stream.isatty()
        self.total = total
        self.label = label
        self.done = 0
        self._drawn_at = 0.0

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and now - self._drawn_at >= REDRAW_S:
            self._drawn_at = now
            filled = WIDTH * min(self.done, self.total) // self.total
            percent = 100 * min(self.done, self.total) // self.total
            self.stream.write(f"\r[{'#' * filled}{' ' * (WIDTH - filled)}] {percent:3d}% {self.label}")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._drawn_at:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
