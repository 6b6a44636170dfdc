"""The storage engine's failures: I/O translated into a few types at the edge."""
from __future__ import annotations

from pathlib import Path


class StorageError(Exception):
    """An I/O failure of the storage engine."""


class DiskFull(StorageError):
    """No space left: the write was rolled back, nothing stored was damaged."""


class FsyncFailed(StorageError):
    """fsync failed: what was written since the last good fsync may be lost (never ack it)."""


class CorruptSegment(StorageError):
    """A damaged record inside data that was once whole."""

    def __init__(self, path, offset: int, reason: str):
        super().__init__(f"{path}: corrupt record at offset {offset}: {reason}")
        self.path = Path(path) if path is not None else None
        self.offset = offset
        self.reason = reason
