"""Checkpoint files: small JSON documents written atomically and checked on read.

A checkpoint is written to a temp file, fsynced, renamed over the old one, and the directory is
fsynced, so after a crash at any point the file holds either the old or the new document, whole.
The body carries a crc32c so that `delayctl verify` can tell a damaged checkpoint from a good one.

Every write uses a temp file of its own (`.NAME.<pid>.<n>.tmp`, created exclusively), so two
writers can never rename each other's half-written file into place; callers still serialize the
writers of one checkpoint (the replayer holds a lock), so that an older snapshot never replaces a
newer one. Temp files left by a crash are removed when the data directory is opened.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
from pathlib import Path

import crc32c

from delayserver import failpoints
from delayserver.storage.errors import StorageError
from delayserver.storage.segment import fsync_dir, fsync_fd, note_io_error, write_all

log = logging.getLogger("delayserver.storage")
_serial = itertools.count()
TEMP_SUFFIX = ".tmp"


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
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{next(_serial)}{TEMP_SUFFIX}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as e:
        raise StorageError(f"{tmp}: could not create: {e}") from e
    try:
        try:
            write_all(fd, doc, 0, tmp)
            fsync_fd(fd, tmp)
        finally:
            os.close(fd)
        failpoints.hit("checkpoint-before-rename")
        try:
            failpoints.io("rename", path)
            os.replace(tmp, path)
        except OSError as e:
            note_io_error(path, e)
            raise StorageError(f"{path}: could not replace the checkpoint: {e}") from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # A failed directory fsync leaves the rename maybe undone by a crash: the caller must not rely
    # on the new checkpoint (FsyncFailed), though the file now holds it.
    fsync_dir(path.parent)


def remove_stale_temp_files(directory: Path) -> None:
    """Delete the temp files of checkpoint writes a crash interrupted (never renamed into place)."""
    for tmp in Path(directory).glob(f"*{TEMP_SUFFIX}"):
        log.info("%s: removing the temp file of an interrupted checkpoint write", tmp)
        tmp.unlink(missing_ok=True)


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
