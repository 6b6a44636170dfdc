"""A test-only file layer that records what the storage engine does to its files, and builds the
on-disk states a power cut could leave (in the manner of SQLite's crash VFS and ALICE).

`Recorder.install(monkeypatch)` replaces the `os` module the storage modules call with a proxy:
every call goes to the real `os` (the workload runs for real, on real files), and each write,
truncate, fsync (its start and its end), directory fsync, file creation and rename is appended to
one global, ordered event list.

`Recorder.crash_state(k, rng, root)` writes into `root` one state the disk could hold had the power
gone at event `k`:

- what an fsync that had *completed* before `k` covered (every write and truncate of that file
  recorded before the fsync *started*) is there, whole;
- every other write or truncate before `k` may be lost, kept, or (a write) torn at 512-byte sector
  boundaries, each sector kept or lost on its own, so later writes can survive where earlier ones
  did not (reordering, holes followed by valid data);
- a file created, or a rename done, without a completed fsync of its directory after it may be
  missing, or the rename undone.
"""
from __future__ import annotations

import os
import random
import stat
import threading
from pathlib import Path

import attrs

SECTOR = 512


@attrs.frozen
class Event:
    kind: str  # create, write, truncate, fsync_begin, fsync_end, dirfsync_begin, dirfsync_end, rename
    path: str
    pos: int = 0
    data: bytes = b""
    dst: str = ""


class _RecordingOS:
    """Stands in for `os` in the storage modules: delegates everything, records mutations."""

    def __init__(self, recorder: "Recorder"):
        self._r = recorder
        self._paths: dict[int, str] = {}

    def __getattr__(self, name):
        return getattr(os, name)

    def open(self, path, flags, mode=0o777, *, dir_fd=None):
        path = os.path.abspath(os.fspath(path))
        existed = os.path.exists(path)
        fd = os.open(path, flags, mode)
        self._paths[fd] = path
        if not existed and flags & os.O_CREAT:
            self._r.record(Event("create", path))
        return fd

    def _path(self, fd) -> str:
        path = self._paths.get(fd)
        return path if path is not None else os.readlink(f"/proc/self/fd/{fd}")  # opened elsewhere

    def close(self, fd):
        self._paths.pop(fd, None)  # before the real close: the number may be reused at once
        os.close(fd)

    def pwrite(self, fd, data, pos):
        n = os.pwrite(fd, data, pos)
        self._r.record(Event("write", self._path(fd), pos, bytes(memoryview(data)[:n])))
        return n

    def ftruncate(self, fd, size):
        os.ftruncate(fd, size)
        self._r.record(Event("truncate", self._path(fd), size))

    def fsync(self, fd):
        path = self._path(fd)
        kind = "dirfsync" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync"
        begin = self._r.record(Event(kind + "_begin", path))
        os.fsync(fd)
        self._r.record(Event(kind + "_end", path, begin))

    def replace(self, src, dst, **kw):
        os.replace(src, dst, **kw)
        self._r.record(Event("rename", os.path.abspath(os.fspath(src)), dst=os.path.abspath(os.fspath(dst))))


MODULES = ("delayserver.storage.segment", "delayserver.storage.bucket_log", "delayserver.storage.checkpoint")


class Recorder:
    def __init__(self, root: Path):
        self.root = os.path.abspath(root)
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def install(self, monkeypatch) -> None:
        import importlib

        proxy = _RecordingOS(self)
        for name in MODULES:
            monkeypatch.setattr(importlib.import_module(name), "os", proxy)

    def record(self, event: Event) -> int:
        if not event.path.startswith(self.root + os.sep) and event.path != self.root:
            return -1
        with self._lock:
            self.events.append(event)
            return len(self.events) - 1

    @property
    def now(self) -> int:
        """The index the next event gets: an acknowledgement seen now is covered by every crash
        state built at this index or later."""
        return len(self.events)

    # --- building a crash state ---------------------------------------------------------------

    def crash_state(self, k: int, rng: random.Random, root: Path) -> dict:
        """Write into `root` a state the disk could hold after a power cut at event `k` (see the
        module docstring); returns a few counts for the report."""
        events = self.events[:k]
        # Per file: when its fsyncs began and ended; per directory: when its fsyncs ended.
        durable_before: dict[str, int] = {}  # path -> index of the start of its last completed fsync
        dir_synced: dict[str, list[int]] = {}  # dir -> start indexes of its completed fsyncs
        for event in events:
            if event.kind == "fsync_end":
                durable_before[event.path] = max(durable_before.get(event.path, -1), event.pos)
            elif event.kind == "dirfsync_end":
                dir_synced.setdefault(event.path, []).append(event.pos)

        def dir_durable(path: str, index: int) -> bool:
            """Whether a fsync of `path`'s directory began after event `index` and completed."""
            return any(begin > index for begin in dir_synced.get(os.path.dirname(path), ()))

        # Each state leans one way, so that the states cover "everything lost" to "everything kept".
        keep_p = rng.choice((0.0, 0.3, 0.7, 1.0, rng.random()))
        torn_p = rng.choice((0.0, 0.2, 0.5))
        files: dict[str, bytearray | None] = {}
        counts = {"lost": 0, "torn": 0, "kept": 0}
        for i, event in enumerate(events):
            if event.kind == "create":
                if event.path in files and files[event.path] is not None:
                    continue
                files[event.path] = bytearray() if dir_durable(event.path, i) or rng.random() < keep_p else None
            elif event.kind in ("write", "truncate"):
                content = files.get(event.path)
                if content is None:
                    continue  # the file did not survive (or was renamed away)
                durable = i < durable_before.get(event.path, -1)
                if event.kind == "truncate":
                    if durable or rng.random() < keep_p:
                        del content[event.pos:]
                    continue
                if durable:
                    _apply(content, event.pos, event.data)
                elif rng.random() < torn_p:
                    counts["torn"] += 1
                    _apply_sectors(content, event.pos, event.data, rng)
                elif rng.random() < keep_p:
                    counts["kept"] += 1
                    _apply(content, event.pos, event.data)
                else:
                    counts["lost"] += 1
            elif event.kind == "rename":
                if dir_durable(event.dst, i) or rng.random() < keep_p:
                    files[event.dst] = files.get(event.path)
                    files[event.path] = None
        for path, content in files.items():
            if content is None:
                continue
            target = Path(root) / os.path.relpath(path, self.root)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(bytes(content))
        return counts


def _apply(content: bytearray, pos: int, data: bytes) -> None:
    if len(content) < pos:
        content.extend(bytes(pos - len(content)))
    content[pos : pos + len(data)] = data


def _apply_sectors(content: bytearray, pos: int, data: bytes, rng: random.Random) -> None:
    """Keep each 512-byte sector of the write, or not, on its own. A kept sector past the end
    extends the file (the gap reads as zeros: the lost sectors before it)."""
    end = pos + len(data)
    start = pos
    while start < end:
        stop = min(end, (start // SECTOR + 1) * SECTOR)
        if rng.random() < 0.5:
            _apply(content, start, data[start - pos : stop - pos])
        start = stop
