"""The data directory: message_log, schedule_log, dispatch_log and checkpoints, opened together.

Layout::

    DATA_DIR/message_log/00000000000000000000.log   segments by base offset
    DATA_DIR/schedule_log/202611221600.log          one per bucket (UTC start)
    DATA_DIR/dispatch_log/202611221600.log          one per bucket
    DATA_DIR/checkpoint/replay.json                 replay offset + schedule segment sizes
"""
from __future__ import annotations

import os
from pathlib import Path

import attrs

from delayserver.storage.bucket_log import BucketLog
from delayserver.storage.buckets import DEFAULT_SCALE_MS, check_scale
from delayserver.storage.checkpoint import (
    CorruptCheckpoint, read_checkpoint, remove_stale_temp_files, write_checkpoint,
)
from delayserver.storage.errors import StorageError
from delayserver.storage.message_log import DEFAULT_MAX_UNSYNCED_BYTES, DEFAULT_SEGMENT_BYTES, MessageLog
from delayserver.storage.quarantine import forget as forget_quarantines, list_quarantined, quarantine_error
from delayserver.storage.segment import forget_fsync_failures
from delayserver.storage.record import (
    Dispatch, RecordType, cancel_key, decode_dispatch, dispatch_schedule_offset, scheduled_key,
)


#: How far dispatch_log may have been written past its last completed fsync: the sender fsyncs each
#: batch's records before it settles the batch, and has at most `max_inflight` (20000 by default)
#: deliveries unsettled, each with at most one record of a few hundred bytes. A dispatch record lost
#: to a power loss only means a redelivery, never a lost message.
DISPATCH_POWER_LOSS_WINDOW = 8 << 20

#: What must stay free besides the reserve for a node to start taking messages.
RESERVE_HEADROOM = 1 << 20
#: The checkpoint that records how the data directory is laid out (its segment_scale).
LAYOUT_NAME = "layout.json"
#: The replayer's checkpoint (replayer.py); its message_log offset was durable when it was written.
REPLAY_CHECKPOINT = "replay.json"


def _replayed_offset(path: Path) -> int:
    """The message_log offset replay's checkpoint names (replay reads only what an fsync covered,
    and the checkpoint is written after it read it), or 0: none, or damaged (which the replayer
    reports when it opens)."""
    try:
        data = read_checkpoint(path) or {}
    except CorruptCheckpoint:
        return 0
    offset = data.get("message_log_offset", 0)
    return offset if isinstance(offset, int) else 0


class LayoutMismatch(StorageError):
    """The data directory was written under another segment_scale than the one configured."""


def check_layout(root: Path, segment_scale_ms: int) -> None:
    """Record `segment_scale_ms` in a data directory that has none recorded; raise LayoutMismatch
    when it records another (its schedule_log buckets are cut by that one: read under another,
    every lookup and load would miss them)."""
    path = Path(root) / "checkpoint" / LAYOUT_NAME
    recorded = (read_checkpoint(path) or {}).get("segment_scale_ms")
    if recorded is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_checkpoint(path, {"segment_scale_ms": segment_scale_ms})
    elif recorded != segment_scale_ms:
        raise LayoutMismatch(
            f"{root} was written with segment_scale = {_minutes(recorded)}, but this node is configured with "
            f"{_minutes(segment_scale_ms)}: configure segment_scale = \"{_minutes(recorded)}\" for this data "
            "directory, or give the node another one")


def _minutes(ms: int) -> str:
    return f"{ms // 60_000}m" if ms % 60_000 == 0 else f"{ms}ms"


@attrs.define(eq=False)
class Store:
    root: Path
    segment_scale_ms: int
    message_log: MessageLog
    schedule_log: BucketLog
    dispatch_log: BucketLog

    @classmethod
    def open(cls, root: Path, *, segment_scale_ms: int = DEFAULT_SCALE_MS,
             message_log_segment_bytes: int = DEFAULT_SEGMENT_BYTES,
             max_unsynced_bytes: int = DEFAULT_MAX_UNSYNCED_BYTES) -> "Store":
        """Open the data directory at `root`; raises LayoutMismatch when it was written under
        another segment_scale (see `check_layout`)."""
        root = Path(root)
        check_scale(segment_scale_ms)
        # Recovery trusts only what is on disk: a restart within one process starts afresh.
        forget_fsync_failures(root)
        forget_quarantines(root)
        (root / "checkpoint").mkdir(parents=True, exist_ok=True)
        remove_stale_temp_files(root / "checkpoint")
        check_layout(root, segment_scale_ms)
        return cls(
            root,
            segment_scale_ms,
            MessageLog.open(root / "message_log", message_log_segment_bytes, max_unsynced_bytes,
                            durable_to=_replayed_offset(root / "checkpoint" / REPLAY_CHECKPOINT)),
            BucketLog.open(root / "schedule_log"),
            BucketLog.open(root / "dispatch_log", power_loss_window=DISPATCH_POWER_LOSS_WINDOW),
        )

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "checkpoint"

    def quarantine(self, bucket: int, error) -> None:
        """Set a bucket aside after a CorruptSegment in its segments (storage/quarantine.py)."""
        quarantine_error(self.root, bucket, error)

    def quarantined(self) -> dict:
        return list_quarantined(self.root)

    def dispatched(self, bucket: int) -> dict[int, Dispatch]:
        """schedule_log offset -> its first dispatch record, after recovering a torn tail."""
        self.dispatch_log.recover_tail(bucket)
        out: dict[int, Dispatch] = {}
        for _, rtype, payload in self.dispatch_log.records(bucket):
            if rtype == RecordType.DISPATCH:
                d = decode_dispatch(payload)
                out.setdefault(d.schedule_offset, d)
        return out

    def dispatched_reader(self, bucket: int):
        """`dispatched`'s offsets, for a worker thread: a function returning (the scan of the
        bucket's dispatch_log, its CorruptSegment, or None when there is none; the schedule_log
        offsets it records as delivered, as an `array("q")` in record order, repeats included).
        The caller cuts a torn tail on the event loop (`dispatch_log.cut_tail`). Only for a bucket
        nothing is dispatched from meanwhile."""
        return self.dispatch_log.offsets_reader(bucket, RecordType.DISPATCH, dispatch_schedule_offset)

    # --- the disk-space reserve ---------------------------------------------------------------
    # A ballast file set aside at start. When an append finds the disk full, the receiver releases
    # it, so that the records that keep due messages flowing (schedule appends, dispatch_log,
    # checkpoints) still have room while new messages are refused with DISK_FULL.

    @property
    def reserve_path(self) -> Path:
        return self.root / "reserve"

    def ensure_reserve(self, size: int) -> bool:
        """Create the reserve file of `size` bytes if missing; False when there is no room for it."""
        path = self.reserve_path
        if size <= 0 or (path.exists() and path.stat().st_size >= size):
            return True
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.posix_fallocate(fd, 0, size)
            os.fsync(fd)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            return False
        os.close(fd)
        return True

    def take_reserve_at_start(self, size: int) -> bool:
        """Keep or take the reserve if RESERVE_HEADROOM stays free besides it; otherwise release it
        and return False: the node stopped on a full disk and starts in disk-full mode, since a
        reserve taken back now would leave replay, dispatch_log and checkpoints no room at all."""
        try:
            held = self.reserve_path.stat().st_size
        except FileNotFoundError:
            held = 0
        if size > 0 and self.free_bytes() + held - size < RESERVE_HEADROOM:
            self.release_reserve()
            return False
        return self.ensure_reserve(size)

    def release_reserve(self) -> bool:
        """Delete the reserve file; True if there was one to free."""
        try:
            self.reserve_path.unlink()
        except FileNotFoundError:
            return False
        return True

    def free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def close(self) -> None:
        self.message_log.close()
        self.schedule_log.close()
        self.dispatch_log.close()


@attrs.frozen
class BucketStats:
    bucket: int
    scheduled: int
    dispatched: int
    cancelled: int
    pending: int
    duplicate_dispatches: int


def bucket_stats(schedule_log: BucketLog, dispatch_log: BucketLog, bucket: int) -> BucketStats:
    """Count one bucket from its segments (raises CorruptSegment on damage).

    A message is cancelled when a cancel for its (id, schedule time) follows it and it was never
    dispatched; dispatched when its offset has a dispatch record; pending otherwise.
    """
    offsets_by_key: dict[tuple[int, str], list[int]] = {}
    scheduled = 0
    cancelled_offsets: set[int] = set()
    for offset, rtype, payload in schedule_log.records(bucket):
        if rtype == RecordType.SCHEDULED:
            _, sched, _, mid = scheduled_key(payload, 0)
            offsets_by_key.setdefault((sched, mid), []).append(offset)
            scheduled += 1
        elif rtype == RecordType.SCHEDULED_CANCEL:
            cancelled_offsets.update(offsets_by_key.get(cancel_key(payload), ()))
    dispatch_count = 0
    dispatched: set[int] = set()
    for _, rtype, payload in dispatch_log.records(bucket):
        if rtype == RecordType.DISPATCH:
            dispatched.add(dispatch_schedule_offset(payload))
            dispatch_count += 1
    cancelled = len(cancelled_offsets - dispatched)
    return BucketStats(bucket, scheduled, len(dispatched), cancelled,
                       scheduled - len(dispatched) - cancelled, dispatch_count - len(dispatched))
