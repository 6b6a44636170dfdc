"""The replayer: message_log -> schedule_log segments, then into the wheel when `can_add` says so.

The checkpoint (checkpoint/replay.json) holds the message_log offset replay has reached and the
schedule segment sizes at that moment, written only after those segments are fsynced. On open,
every schedule segment is truncated back to its checkpointed size and replay resumes from the
checkpointed offset. Each bucket's segment is its records in message_log order, so re-replaying
rebuilds the same bytes at the same offsets: a message is never scheduled twice, and dispatch_log
records of offsets past the checkpoint stay valid (tests/test_replayer.py).

Open replays all that message_log holds past the checkpoint before the tick manager has loaded
anything. Otherwise a loader that pinned a segment's end at its truncated size would leave the
re-replayed records to `can_add`, which puts them straight into the wheel: a record delivered
before the crash (its dispatch_log entry unread) would fire again, and a message whose cancel
was acknowledged before the crash could fire before the cancel is replayed again.

Within a pass, appends to several buckets are all-or-nothing: if one fails (a full disk), the
buckets written in that pass are truncated back and the pass is retried later from the same cursor.
"""
from __future__ import annotations

import logging
from typing import Callable

import trio

from delayserver import failpoints
from delayserver.storage.buckets import bucket_name, parse_bucket_name
from delayserver.storage.checkpoint import read_checkpoint, write_checkpoint
from delayserver.storage.errors import CorruptSegment, DiskFull, StorageError
from delayserver.storage.record import (
    T_CANCEL, T_COMMIT, T_EPOCH, T_MESSAGE, T_SCHEDULE, TRANSACTION_TYPES, RecordError, RecordType,
    iter_checked_records, message_log_head, schedule_change_sequence, scheduled_record_head,
)
from delayserver.storage.segment import give_back_pages
from delayserver.storage.store import REPLAY_CHECKPOINT, Store
from delayserver.transactions.state import HalfMessages
from delayserver.wakeup import Wakeup

log = logging.getLogger("delayserver.replayer")

CHECKPOINT_NAME = REPLAY_CHECKPOINT


try:  # the compiled walk (delayserver/native/records.pyx), when the install built it
    from delayserver.native.records import walk as _native_walk
except ImportError:
    _native_walk = None


def walk(data, base: int, limit: int, end: int, scale: int, sizes_of: Callable[[int], int],
         change_sequence: Callable[[object, int], int], max_sequence: int, follow_prefix: bytes | None = None):
    """One replay pass over `data`, message_log records checked already (MessageLog.read, or a
    batch this node wrote) starting at message_log offset `base`, up to offset `limit`: what to
    append to schedule_log and what to tell about it, without changing anything.

    `end`: the cursor before the pass; `scale`: the bucket width; `sizes_of(bucket)`: a bucket's
    schedule_log size now; `change_sequence(data, start)`: the sequence of a SCHEDULE payload;
    `max_sequence`: the highest sequence seen before; `follow_prefix`: which records `followed`
    lists (below). Returns ``(per_bucket, ids, runs, txn_notes, followed, end, max_sequence,
    changes)``:

    - per_bucket: bucket -> its schedule_log records, one buffer to append;
    - ids: bucket -> ``(offset within that buffer, schedule_log type, schedule_time, message id
      bytes)`` of each record, the keys the indexes take instead of parsing the records again;
    - runs: what the tick manager is told, in log order: for each run of scheduled MESSAGE and
      COMMIT records a dict bucket -> ``(offset in the bucket, schedule_time)`` of the run's records
      in that bucket, and for each CANCEL ``(bucket, offset in the bucket, schedule_time, message
      id)`` between them;
    - txn_notes: ``(message_log offset, type, payload start, payload end)`` of transactional records;
    - followed: ``(type, payload start, payload end)`` of each MESSAGE, CANCEL, COMMIT and SCHEDULE
      record (what `on_records` gets); with a `follow_prefix`, of each SCHEDULE record and each
      MESSAGE whose id starts with it only;
    - end: the message_log offset after the last record taken; max_sequence: the highest sequence
      then; changes: how many SCHEDULE records (followed, not scheduled).

    Raises RecordError at the offset within `data` of a record it cannot take. The compiled
    `delayserver.native.records.walk` does the same, or answers None and leaves the pass to this.
    """
    view = memoryview(data)
    per_bucket: dict[int, list] = {}
    ids: dict[int, list[tuple[int, int, int, memoryview]]] = {}
    starts: dict[int, int] = {}
    sizes: dict[int, int] = {}
    runs: list = []
    run: dict[int, list[tuple[int, int]]] | None = None
    txn_notes = []
    followed: list[tuple[int, int, int]] = []
    changes = 0
    for pos, rtype, s, e in iter_checked_records(data):
        off = base + pos
        if off >= limit:
            break
        if rtype == T_SCHEDULE:  # a schedule change: followed (on_records), not scheduled
            max_sequence = max(max_sequence, change_sequence(data, s))
            followed.append((rtype, s, e))
            changes += 1
            end = base + e
            continue
        if rtype == T_EPOCH:  # a batch's frame: nothing to schedule
            end = base + e
            continue
        try:
            sched, seq, id_at, id_end = message_log_head(data, s, rtype)
        except RecordError as err:
            raise RecordError(pos, err.reason) from None
        if rtype in TRANSACTION_TYPES:
            txn_notes.append((off, rtype, s, e))
            if rtype != T_COMMIT:  # a COMMIT is scheduled as a MESSAGE is, below
                max_sequence = max(max_sequence, seq)
                end = base + e
                continue
        bucket = sched - sched % scale
        # The schedule record is a head then the message_log payload as it is: no copy.
        payload = view[s:e]
        size, head, kind = scheduled_record_head(off, rtype, payload)
        recs = per_bucket.get(bucket)
        if recs is None:
            recs = per_bucket[bucket] = []
            ids[bucket] = []
            sizes[bucket] = starts[bucket] = sizes_of(bucket)
        at = sizes[bucket]
        mid = view[id_at : min(id_end, e)]
        ids[bucket].append((at - starts[bucket], kind, sched, mid))
        if rtype == T_CANCEL:
            try:
                runs.append((bucket, at, sched, str(mid, "utf-8")))
            except UnicodeDecodeError:
                raise RecordError(pos, "message id is not UTF-8") from None
            run = None
        else:
            if run is None:
                run = {}
                runs.append(run)
            run.setdefault(bucket, []).append((at, sched))
        sizes[bucket] = at + size
        recs += (head, payload)
        if seq > max_sequence:
            max_sequence = seq
        if follow_prefix is None or rtype == T_MESSAGE and mid[:len(follow_prefix)] == follow_prefix:
            followed.append((rtype, s, e))
        end = base + e
    return ({b: b"".join(recs) for b, recs in per_bucket.items()}, ids, runs, txn_notes, followed, end,
            max_sequence, changes)


class Replayer:
    def __init__(self, store: Store, ticks, *, offset: int = 0, max_sequence: int = 0,
                 recent_batch: Callable[[int], tuple[bytes, int] | None] = lambda offset: None,
                 on_disk_full: Callable[[], None] = lambda: None,
                 on_records: Callable[[bytes, list[tuple[int, int, int]], bool], None] | None = None,
                 follow_prefix: Callable[[bool], bytes | None] = lambda own: None,
                 transactions: HalfMessages | None = None):
        """`recent_batch(offset)`: the batch written at that message_log offset, if the writer still
        holds it (the replayer takes it instead of reading the log back). `on_disk_full`: called
        when a schedule append or a checkpoint finds the disk full (the node releases its disk
        reserve and refuses new messages, so that replay and delivery go on). `on_records(data,
        records, own)`: called once per replay pass that appended, with ``(type, payload_start,
        payload_end)`` of each MESSAGE, CANCEL, COMMIT and SCHEDULE record of `data` it replayed,
        in log order (the dedupe table, the schedules follow them); `own` is true for a batch this
        node's receiver wrote (taken from `recent_batch`). `follow_prefix(own)`: None when
        `on_records` needs all those records of the pass, else an id prefix: it needs only the
        SCHEDULE records and the MESSAGE records whose id starts with it (see `walk`)."""
        self.store = store
        self.on_records = on_records
        self.follow_prefix = follow_prefix
        self.ticks = ticks
        self.offset = offset
        self.max_sequence = max_sequence
        self.checkpointed_offset = offset
        self.replayed = 0
        self.caught_up = Wakeup()
        self.recent_batch = recent_batch
        self.on_disk_full = on_disk_full
        # Half messages: transactional records are applied to them, and they are checkpointed here.
        self.transactions = transactions if transactions is not None else HalfMessages(store.segment_scale_ms)
        # One checkpoint writer at a time (replay loop, cleaner, drain): snapshot, fsync, rename.
        self._checkpoint_lock = trio.Lock()

    @property
    def checkpoint_path(self):
        return self.store.checkpoint_dir / CHECKPOINT_NAME

    @classmethod
    def open(cls, store: Store, ticks, *, max_bytes: int = 8 << 20,
             recent_batch: Callable[[int], tuple[bytes, int] | None] = lambda offset: None,
             on_disk_full: Callable[[], None] = lambda: None,
             on_records: Callable[[bytes, list[tuple[int, int, int]], bool], None] | None = None,
             follow_prefix: Callable[[bool], bytes | None] = lambda own: None,
             transactions: HalfMessages | None = None) -> "Replayer":
        """Restore the checkpoint (truncate schedule segments to it), then replay the rest of
        message_log; `max_sequence` is then the highest sequence message_log holds.

        Call it before the tick manager loads anything (module docstring). Raises StorageError if a
        segment is shorter than its checkpointed size (fsynced data went missing) or the checkpoint
        points past the end of message_log, CorruptSegment for damage in message_log, DiskFull when
        the replay cannot append. `recent_batch`, `on_disk_full`, `on_records` and `follow_prefix`
        are the constructor's.
        """
        assert ticks.loading_bucket is None, (
            "test_dispatch_records_of_offsets_past_the_checkpoint_stay_valid_after_a_restart"
        )
        cp = read_checkpoint(store.checkpoint_dir / CHECKPOINT_NAME) or {}
        offset = cp.get("message_log_offset", store.message_log.start_offset)
        sizes = {parse_bucket_name(k): v for k, v in cp.get("schedule_sizes", {}).items()}
        if offset > store.message_log.end_offset:
            raise StorageError(
                f"replay checkpoint offset {offset} is past the end of message_log ({store.message_log.end_offset})"
            )
        schedule_log = store.schedule_log
        for bucket in schedule_log.buckets():
            kept = sizes.get(bucket, 0)
            actual = schedule_log.size(bucket)
            if actual < kept:
                raise StorageError(
                    f"{schedule_log.path(bucket)} holds {actual} bytes but the replay checkpoint says {kept}"
                )
            if actual > kept:
                log.info("%s: truncating %d bytes replayed after the checkpoint", schedule_log.path(bucket), actual - kept)
                schedule_log.truncate(bucket, kept)
        schedule_log.sync()
        self = cls(store, ticks, offset=offset, max_sequence=cp.get("max_sequence", 0),
                   recent_batch=recent_batch, on_disk_full=on_disk_full, on_records=on_records,
                   follow_prefix=follow_prefix, transactions=transactions)
        self.transactions.restore(cp.get("transactions"))
        end = store.message_log.end_offset
        # Nothing is loaded, so can_add refuses every record and the time passed is never used.
        while self.replay_once(ticks.last_now, end, max_bytes):
            pass
        return self

    def replay_once(self, now: int, limit: int, max_bytes: int = 1 << 20) -> int:
        """Replay whole records from the cursor up to message_log offset `limit`; returns how many.

        Raises CorruptSegment for damage in message_log, StorageError (DiskFull) when a schedule
        append fails (the pass is rolled back; call again later).
        """
        if self.offset >= limit:
            return 0
        # A batch this node has just written comes from memory; anything else from the log. Either
        # way every record is whole and checked (we built it, or MessageLog.read checked it).
        recent = self.recent_batch(self.offset)
        data, base = recent if recent is not None else self.store.message_log.read(self.offset, max_bytes)
        own = recent is not None
        schedule_log = self.store.schedule_log
        follow = None if self.on_records is None else self.follow_prefix(own)
        args = (data, base, limit, self.offset, self.store.segment_scale_ms, schedule_log.size,
                schedule_change_sequence, self.max_sequence, follow)
        walked = _native_walk(*args) if _native_walk is not None else None
        if walked is None:
            try:
                walked = walk(*args)
            except RecordError as err:
                raise CorruptSegment(self.store.message_log.directory, base + err.offset, err.reason) from None
        per_bucket, ids, runs, txn_notes, followed, end, max_sequence, changes = walked
        self.max_sequence = max_sequence
        self._append_all(per_bucket, ids)
        if self.on_records is not None and followed:
            self.on_records(data, followed, own)
        for off, rtype, s, e in txn_notes:
            try:
                self.transactions.apply(off, rtype, data, s, e)
            except RecordError as err:
                raise CorruptSegment(self.store.message_log.directory, off, err.reason) from None
        self._tell_ticks(runs, now)
        self.offset = end
        scheduled = sum(map(len, ids.values()))  # one id per scheduled record
        count = scheduled + len(txn_notes) - sum(1 for n in txn_notes if n[1] == RecordType.COMMIT)
        self.replayed += count
        return count + changes

    def _tell_ticks(self, runs: list, now: int) -> None:
        """Tell the tick manager what was appended, in log order (`walk`'s runs): a run of MESSAGE
        and COMMIT records (no cancel among them) in bulk, one call per bucket (the order of a run's
        entries between buckets does not matter, within a bucket it is kept), then a CANCEL."""
        ticks = self.ticks
        for item in runs:
            if type(item) is dict:
                for bucket, entries in item.items():
                    ticks.on_replayed_many(bucket, entries, now)
            else:
                ticks.on_cancel(*item)

    def _append_all(self, per_bucket: dict[int, bytes], ids: dict[int, list]) -> None:
        schedule_log = self.store.schedule_log
        done: list[tuple[int, int]] = []
        try:
            for bucket, recs in per_bucket.items():
                before = schedule_log.size(bucket)
                schedule_log.append(bucket, recs, ids[bucket])
                done.append((bucket, before))
        except StorageError:
            for bucket, before in done:
                schedule_log.truncate(bucket, before)
            raise

    def checkpoint(self) -> None:
        """fsync the schedule segments, then record the offset and sizes atomically."""
        self._write_checkpoint(self._snapshot())

    def _snapshot(self):
        schedule_log = self.store.schedule_log
        # The pages of the buckets the wheel has not begun to load go back to the kernel once this
        # fsync covers them: nothing reads them until their bucket loads, load_ahead before it
        # begins (from the disk, in worker threads), and kept they fill the page cache with every
        # message pending beyond it. A loaded bucket's are kept for the deliveries reading them.
        later = [b for b in schedule_log.dirty_buckets() if self.ticks.loads_later(b)]
        give_back = schedule_log.pages_to_give_back(later)
        paths, new_files = schedule_log.take_dirty()
        data = {
            "message_log_offset": self.offset,
            "max_sequence": self.max_sequence,
            "schedule_sizes": {bucket_name(b): s for b, s in self.store.schedule_log.sizes.items()},
            "transactions": self.transactions.snapshot(),
        }
        return paths, new_files, data, give_back

    def _write_checkpoint(self, snapshot) -> None:
        paths, new_files, data, give_back = snapshot
        self.store.schedule_log.sync_paths(paths, new_files)
        give_back_pages(give_back)
        failpoints.hit("schedule-before-checkpoint")
        write_checkpoint(self.checkpoint_path, data)
        self.checkpointed_offset = data["message_log_offset"]
        self.transactions.checkpointed(data["transactions"])

    async def checkpoint_async(self) -> None:
        """`checkpoint` with the fsyncs in a worker thread (the snapshot is taken on the trio thread).

        Serialized: a second caller waits, then snapshots afresh, so no checkpoint names sizes whose
        fsync another writer still has in progress, and none replaces a newer one.
        """
        async with self._checkpoint_lock:
            snapshot = self._snapshot()
            try:
                await trio.to_thread.run_sync(self._write_checkpoint, snapshot)
            except StorageError:
                self.store.schedule_log.mark_dirty(snapshot[0])
                raise

    async def serve(self, clock, durable_offset, new_data: Wakeup, *, checkpoint_interval_ms: int = 1000,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Replay forever: whenever `new_data` is set, up to `durable_offset()`.

        A failed pass (full disk) is logged and retried after a pause, never skipped.
        """
        task_status.started()
        # The checkpoint interval runs on the monotonic clock: a wall-clock step never stops it.
        last_checkpoint = trio.current_time() * 1000
        while True:
            try:
                n = self.replay_once(clock.now_ms(), durable_offset())
            except StorageError as e:
                if isinstance(e, CorruptSegment):
                    raise
                if isinstance(e, DiskFull):
                    self.on_disk_full()
                log.error("replay pass failed, will retry: %s", e)
                await trio.sleep(0.5)
                continue
            if n:
                self.caught_up.set()
            now = trio.current_time() * 1000
            if self.offset != self.checkpointed_offset and now - last_checkpoint >= checkpoint_interval_ms:
                try:
                    await self.checkpoint_async()
                except StorageError as e:
                    if isinstance(e, DiskFull):
                        self.on_disk_full()
                    log.error("replay checkpoint failed, will retry: %s", e)
                last_checkpoint = now
            if n == 0:
                await new_data.wait(checkpoint_interval_ms / 1000)
            else:
                await trio.lowlevel.checkpoint()
