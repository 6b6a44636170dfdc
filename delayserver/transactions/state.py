"""The half messages of one node: rebuilt by the replayer from message_log, checkpointed with it.

Every node (master and slaves) applies the transactional records it replays, in message_log
order, so a promoted slave knows every half message, its checks and its resolution. The replay
checkpoint holds a `snapshot()` taken at the checkpointed offset; a restart `restore`s it and
replays the rest of message_log, as for schedule_log. An open half message keeps the message_log
segment holding its PREPARE record from the cleaner (`pinned_offset`): its body is read from
there when it is committed, checked or parked.

A half message resolved by TXN_PARK stays open, `parking`, until its PARKED record is durable in
the node's parked log (`parked_written`): a crash in between parks it again after the restart,
never loses it.
"""
from __future__ import annotations

import collections
import enum
from pathlib import Path

import attrs

from delayserver.message import TransactionState
from delayserver.storage.buckets import DEFAULT_SCALE_MS, bucket_name, bucket_start, parse_bucket_name
from delayserver.storage.checkpoint import read_checkpoint
from delayserver.storage.reader import read_records
from delayserver.storage.record import (
    TRANSACTION_TYPES, ParkReason, RecordType, decode_cancel, decode_message, decode_prepare, decode_txn_check,
    decode_txn_park,
)
from delayserver.storage.segment import read_file
from delayserver.storage.store import LAYOUT_NAME, REPLAY_CHECKPOINT
from delayserver.wakeup import Wakeup

#: Resolutions remembered for idempotent answers to a repeated COMMIT or ROLLBACK.
REMEMBERED_RESOLUTIONS = 4096

Key = tuple[int, str]  # (schedule_time, message id): a Handle's fields


class Count(enum.IntEnum):
    """Columns of the per-bucket counters (by the schedule time of the half message)."""

    PREPARED = 0
    COMMITTED = 1
    ROLLED_BACK = 2
    CHECKED = 3
    PARKED = 4


@attrs.define(eq=False)
class Half:
    """One half message not resolved yet (or parked, its PARKED record not written yet)."""

    offset: int  # of its PREPARE record in message_log
    schedule_time: int
    message_id: str
    group: str
    subject: str
    store_time: int
    check_immunity_ms: int
    checks: int = 0
    last_check_time: int = 0
    parking: int = 0  # a ParkReason once TXN_PARK is replayed

    @property
    def key(self) -> Key:
        return self.schedule_time, self.message_id

    def next_check_time(self, transaction_timeout_ms: int, check_interval_ms: int) -> int:
        """When the checker asks next: `check_immunity` (else `transaction_timeout`) after the
        prepare, then `check_interval` after each check (RocketMQ's rule)."""
        if self.checks == 0:
            return self.store_time + (self.check_immunity_ms or transaction_timeout_ms)
        return self.last_check_time + check_interval_ms


class HalfMessages:
    def __init__(self, segment_scale_ms: int):
        self.segment_scale_ms = segment_scale_ms
        self.open: dict[Key, Half] = {}
        self.resolved: collections.OrderedDict[Key, TransactionState] = collections.OrderedDict()
        self.counts: dict[int, list[int]] = {}
        #: Parked half messages whose PARKED record is not written yet; the park writer takes them.
        self.to_park: list[Half] = []
        self.park_wakeup = Wakeup()
        self._checkpointed_min = None
        # The last snapshot and the version it was taken at: a checkpoint with nothing changed
        # since reuses it (building one is O(open half messages) on the trio thread).
        self._version = 0
        self._snapshot: tuple[int, dict] | None = None

    # --- replay -------------------------------------------------------------------------------

    def apply(self, offset: int, rtype: int, buf, start: int, end: int) -> None:
        """Apply the transactional record at message_log `offset` (RecordError if it does not decode)."""
        self._version += 1
        if rtype == RecordType.PREPARE:
            prepare = decode_prepare(buf, start, end)
            m = prepare.message
            key = (m.schedule_time, m.message_id)
            if key not in self.open:
                self.open[key] = Half(offset, m.schedule_time, m.message_id, prepare.group, m.subject, m.store_time,
                                      prepare.check_immunity_ms)
                self._count(m.schedule_time, Count.PREPARED)
        elif rtype == RecordType.COMMIT:
            m = decode_message(buf, start, end)
            self._resolve((m.schedule_time, m.message_id), TransactionState.COMMIT, Count.COMMITTED)
        elif rtype == RecordType.ROLLBACK:
            c = decode_cancel(buf, start, end)
            self._resolve((c.schedule_time, c.message_id), TransactionState.ROLLBACK, Count.ROLLED_BACK)
        elif rtype == RecordType.TXN_CHECK:
            c = decode_txn_check(buf, start, end)
            half = self.open.get((c.schedule_time, c.message_id))
            if half is not None and not half.parking:
                half.checks = max(half.checks, c.checks)
                half.last_check_time = max(half.last_check_time, c.store_time)
                self._count(c.schedule_time, Count.CHECKED)
        elif rtype == RecordType.TXN_PARK:
            t = decode_txn_park(buf, start, end)
            half = self.open.get((t.schedule_time, t.message_id))
            if half is not None and not half.parking:
                half.parking = t.reason
                self._remember(half.key, TransactionState.PARKED)
                self._count(t.schedule_time, Count.PARKED)
                self.to_park.append(half)
                self.park_wakeup.set()

    def _resolve(self, key: Key, state: TransactionState, column: Count) -> None:
        half = self.open.get(key)
        if half is None or half.parking:
            return
        del self.open[key]
        self._remember(key, state)
        self._count(key[0], column)

    def _remember(self, key: Key, state: TransactionState) -> None:
        self.resolved[key] = state
        self.resolved.move_to_end(key)
        while len(self.resolved) > REMEMBERED_RESOLUTIONS:
            self.resolved.popitem(last=False)

    def _count(self, schedule_time: int, column: Count) -> None:
        bucket = bucket_start(schedule_time, self.segment_scale_ms)
        row = self.counts.get(bucket)
        if row is None:
            row = self.counts[bucket] = [0] * len(Count)
        row[column] += 1

    def parked_written(self, half: Half) -> None:
        """The PARKED record of `half` is durable: it is no longer open."""
        if self.open.get(half.key) is half:
            del self.open[half.key]
            self._version += 1

    # --- queries ------------------------------------------------------------------------------

    def outcome(self, key: Key) -> TransactionState | None:
        """How a half message no longer open was resolved, if this node remembers it."""
        return self.resolved.get(key)

    def unresolved(self) -> list[Half]:
        return [h for h in self.open.values() if not h.parking]

    def totals(self) -> list[int]:
        out = [0] * len(Count)
        for row in self.counts.values():
            for i, v in enumerate(row):
                out[i] += v
        return out

    @property
    def pinned_offset(self) -> int | None:
        """The lowest message_log offset an open half message (now or in the last checkpoint)
        needs; None when none does. The cleaner keeps every segment from there on."""
        live = min((h.offset for h in self.open.values()), default=None)
        if self._checkpointed_min is None:
            return live
        return self._checkpointed_min if live is None else min(live, self._checkpointed_min)

    # --- checkpoint ---------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """The state as JSON-ready values (not to be changed by the caller)."""
        if self._snapshot is not None and self._snapshot[0] == self._version:
            return self._snapshot[1]
        snapshot = {
            "open": [[h.offset, h.schedule_time, h.message_id, h.group, h.subject, h.store_time,
                      h.check_immunity_ms, h.checks, h.last_check_time, int(h.parking)] for h in self.open.values()],
            "resolved": [[k[0], k[1], int(v)] for k, v in self.resolved.items()],
            "counts": {bucket_name(b): list(row) for b, row in sorted(self.counts.items())},
        }
        self._snapshot = (self._version, snapshot)
        return snapshot

    def checkpointed(self, snapshot: dict) -> None:
        """`snapshot` is durable now (the cleaner may drop what only older checkpoints needed)."""
        self._checkpointed_min = min((row[0] for row in snapshot["open"]), default=None)

    def restore(self, snapshot: dict | None) -> None:
        """Take the state a checkpoint holds (None: a fresh node)."""
        snapshot = snapshot or {}
        self.open = {}
        for row in snapshot.get("open", []):
            half = Half(*row[:9], parking=row[9])
            self.open[half.key] = half
            if half.parking:
                half.parking = ParkReason(half.parking)
                self.to_park.append(half)
        self.resolved = collections.OrderedDict(((s, i), TransactionState(v)) for s, i, v in snapshot.get("resolved", []))
        self.counts = {parse_bucket_name(name): list(row) for name, row in snapshot.get("counts", {}).items()}
        self._version += 1
        self.checkpointed(self.snapshot())
        if self.to_park:
            self.park_wakeup.set()


def read_half_messages(data_dir) -> HalfMessages:
    """The half messages of a data directory, read-only, as its node rebuilds them at start: the
    replay checkpoint's, then the transactional records of message_log past it (tools use this).
    Raises CorruptSegment for damage in message_log past the checkpoint."""
    root = Path(data_dir)
    layout = read_checkpoint(root / "checkpoint" / LAYOUT_NAME) or {}
    halves = HalfMessages(layout.get("segment_scale_ms", DEFAULT_SCALE_MS))
    cp = read_checkpoint(root / "checkpoint" / REPLAY_CHECKPOINT) or {}
    halves.restore(cp.get("transactions"))
    halves.to_park.clear()
    offset = cp.get("message_log_offset", 0)
    for path in sorted((root / "message_log").glob("*.log")):
        base = int(path.stem)
        data = read_file(path)
        if base + len(data) <= offset:
            continue
        for pos, rtype, s, e in read_records(data, path, start=max(0, offset - base)):
            if rtype in TRANSACTION_TYPES:
                halves.apply(base + pos, rtype, data, s, e)
    halves.to_park.clear()
    return halves
