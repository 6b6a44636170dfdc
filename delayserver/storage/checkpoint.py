"""Checkpoint files: small JSON documents written atomically and checked on read.

A checkpoint is written to a temp file, fsynced, renamed over the old one, and the directory is
fsynced, so after a crash at any point the file holds either the old or the new document, whole.
The body carries a crc32c so that `delayctl verify` can tell a damaged checkpoint from a good one.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import crc32c

from delayserver import failpoints
from delayserver.storage.errors import FsyncFailed, StorageError
from delayserver.storage.segment import fsync_dir, write_all


class CorruptCheckpoint(StorageError):
    """A checkpoint file that is not a whole checkpoint document or whose crc does not match."""

    def __init__(self, path, reason: str):
        super().__init__(f"{path}: corrupt checkpoint: {reason}")
        self.path = Path(path)


def _body(data: dict) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode("utf-8")


def write_checkpoint(path: Path, data: dict) -> None:
    """Atomically replace `path` with `data` (a JSON-able dict). Raises StorageError subtypes."""
    path = Path(path)
    body = _body(data)
    doc = json.dumps({"crc32c": crc32c.crc32c(body), "data": data}, sort_keys=True).encode("utf-8")
    tmp = path.with_name(path.name + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as e:
        raise StorageError(f"{tmp}: could not create: {e}") from e
    try:
        write_all(fd, doc, 0, tmp)
        try:
            os.fsync(fd)
        except OSError as e:
            raise FsyncFailed(f"{tmp}: fsync failed: {e}") from e
    finally:
        os.close(fd)
    failpoints.hit("checkpoint-before-rename")
    try:
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        raise StorageError(f"{path}: could not replace the checkpoint: {e}") from e


def read_checkpoint(path: Path) -> dict | None:
    """The checkpoint's data, or None when there is none yet. Raises CorruptCheckpoint."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
        data = doc["data"]
        crc = doc["crc32c"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpoint(path, f"not a checkpoint document ({e})") from None
    if not isinstance(data, dict):
        raise CorruptCheckpoint(path, "its data is not an object")
    if crc32c.crc32c(_body(data)) != crc:
        raise CorruptCheckpoint(path, "crc mismatch")
    return data
