"""The segment directory of a log: a SortedDict from base offset (or bucket start) to segment."""
from __future__ import annotations

from typing import Generic, TypeVar

from sortedcontainers import SortedDict

V = TypeVar("V")


class SegmentDirectory(Generic[V]):
    """Sorted by key; locate, lower and higher are bisects."""

    def __init__(self) -> None:
        self._d: SortedDict = SortedDict()

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: int) -> bool:
        return key in self._d

    def __getitem__(self, key: int) -> V:
        return self._d[key]

    def __setitem__(self, key: int, value: V) -> None:
        self._d[key] = value

    def pop(self, key: int) -> V:
        return self._d.pop(key)

    def keys(self) -> list[int]:
        return list(self._d.keys())

    def items(self):
        return list(self._d.items())

    def locate(self, key: int) -> int | None:
        """The greatest key <= `key` (the segment that would hold offset `key`), or None."""
        i = self._d.bisect_right(key)
        return self._d.keys()[i - 1] if i else None

    def lower(self, key: int) -> int | None:
        """The greatest key < `key`, or None."""
        i = self._d.bisect_left(key)
        return self._d.keys()[i - 1] if i else None

    def higher(self, key: int) -> int | None:
        """The smallest key > `key`, or None."""
        i = self._d.bisect_right(key)
        return self._d.keys()[i] if i < len(self._d) else None

    def first(self) -> int | None:
        return self._d.keys()[0] if self._d else None

    def last(self) -> int | None:
        return self._d.keys()[-1] if self._d else None
