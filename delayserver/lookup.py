"""Status of one message by its handle, from the per-bucket indexes (storage/id_index.py).

A handle (schedule time, id) names every record of that id in that bucket; a producer that sent
the same id twice for the same time has two messages and sees the state of the most advanced one.

A lookup bisects the bucket's id index for the key's hash and reads the records it names (the
message, its cancels, and the rare record whose key shares the hash) and then the dispatch index:
O(log n) in the bucket's size and a few reads, never a scan, so a status or cancel costs the same
on a bucket of ten messages or ten million and holds the event loop for microseconds.
"""
from __future__ import annotations

import attrs
import trio

from delayserver.message import MessageState
from delayserver.storage.buckets import bucket_start
from delayserver.storage.id_index import DispatchIndex, IdIndex, SliceRead
from delayserver.storage.record import RecordType, cancel_key, decode_dispatch, scheduled_key

READ_GUESS_BYTES = 512


@attrs.frozen
class Found:
    state: MessageState
    dispatch_time: int = 0
    broker_group: str = ""
    offsets: tuple[int, ...] = ()


class Lookup:
    """Both indexes of a store, and the lookups they answer."""

    def __init__(self, store, index_dir=None):
        """`index_dir`: where the id index is saved (DATA_DIR/index), or None to keep it in memory."""
        self.store = store
        self.ids = IdIndex(store.schedule_log, index_dir)
        self.dispatches = DispatchIndex(store.dispatch_log)

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Index the buckets present at start (in slices), then keep the indexes compact."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.ids.serve)
            await nursery.start(self.dispatches.serve)
            task_status.started()

    async def find(self, schedule_time: int, message_id: str) -> Found:
        """What the logs say of a message. Raises CorruptSegment on damage.

        The records it needs are read from the page cache on the event loop; those that are not in
        memory (a big bucket's cold part) are read in a worker thread, so that a lookup never holds
        the loop, and every other connection with it, while the disk seeks."""
        got: dict = {}
        while True:
            step = self._find(schedule_time, message_id, got)
            if type(step) is Found:
                return step
            if step is None:  # a slice of an index built: let the loop run
                await trio.lowlevel.checkpoint()
                continue
            try:
                if type(step) is SliceRead:  # a slice of an index to build, not in the page cache
                    await step.index.read_slice(step)
                    continue
                log, bucket, offsets = step
                await _read_from_disk(log, bucket, offsets, got)
            except FileNotFoundError:
                if bucket_start(schedule_time, self.store.segment_scale_ms) in self.store.schedule_log.sizes:
                    raise
                # the cleaner took the bucket meanwhile: ask again (UNKNOWN)

    def find_now(self, schedule_time: int, message_id: str) -> Found | None:
        """`find`'s answer when it needs no wait, or None: while an index of the bucket does not
        cover its segment yet (this call builds one slice of it), or while a record it needs is
        not in the page cache."""
        step = self._find(schedule_time, message_id, {})
        return step if type(step) is Found else None

    def _find(self, schedule_time: int, message_id: str, got: dict):
        """The Found; None when it built a slice of an index instead; or (log, bucket, offsets):
        records to read from the disk first, into `got` (see `_records`)."""
        store = self.store
        bucket = bucket_start(schedule_time, store.segment_scale_ms)
        if bucket not in store.schedule_log.sizes:
            return Found(MessageState.UNKNOWN)
        built = self.ids.build_slice(bucket, cached_only=True)
        if built:
            return None if built is True else built
        candidates = self.ids.candidates(bucket, schedule_time, message_id)
        records, missing = _records(store.schedule_log, bucket, candidates, got)
        if missing:
            return store.schedule_log, bucket, missing
        offsets: list[int] = []
        cancels: list[int] = []
        for offset, (rtype, data, s, e) in zip(candidates, records):
            if rtype == RecordType.SCHEDULED:
                _, sched, _, mid = scheduled_key(data, s)
                if sched == schedule_time and mid == message_id:
                    offsets.append(offset)
            elif rtype == RecordType.SCHEDULED_CANCEL:
                if cancel_key(data, s) == (schedule_time, message_id):
                    cancels.append(offset)
        if not offsets:
            return Found(MessageState.UNKNOWN)
        built = self.dispatches.build_slice(bucket, cached_only=True)
        if built:
            return None if built is True else built
        positions = [p for p in (self.dispatches.first(bucket, o) for o in offsets) if p is not None]
        if positions:
            records, missing = _records(store.dispatch_log, bucket, [min(positions)], got)
            if missing:
                return store.dispatch_log, bucket, missing
            [(_, data, s, e)] = records
            d = decode_dispatch(data, s, e)
            return Found(MessageState.DELIVERED, d.dispatch_time, d.broker_group, tuple(offsets))
        last_cancel = max(cancels, default=-1)
        if all(o < last_cancel for o in offsets):
            return Found(MessageState.CANCELLED, offsets=tuple(offsets))
        return Found(MessageState.PENDING, offsets=tuple(offsets))


def _records(log, bucket: int, offsets: list[int], got: dict) -> tuple[list, list[int]]:
    """The records at `offsets` (as `log.read_record` gives them) and those of `offsets` still to be
    read from the disk (then no records). A record is taken from `got` ({(log directory, offset):
    record}: what the same request has read so far), else from the page cache, and kept in `got`.
    Raises the CorruptSegment found at one once all are read."""
    key = log.directory
    unread = [offset for offset in offsets if (key, offset) not in got]
    if unread:
        for offset, record in zip(unread, log.read_records_at(bucket, unread, READ_GUESS_BYTES, cached_only=True)):
            if record is not None:
                got[key, offset] = record
    missing = [offset for offset in unread if (key, offset) not in got]
    if missing:
        return [], missing
    records = [got[key, offset] for offset in offsets]
    for record in records:
        if isinstance(record, Exception):
            raise record
    return records, []


async def _read_from_disk(log, bucket: int, offsets: list[int], got: dict) -> None:
    """Read the records at `offsets` into `got` in a worker thread (through a descriptor of its own)."""
    records = await trio.to_thread.run_sync(log.records_reader(bucket), offsets, READ_GUESS_BYTES)
    got.update(((log.directory, offset), record) for offset, record in zip(offsets, records))


async def read_records(log, bucket: int, offsets: list[int]) -> list:
    """The records at `offsets`, as `log.read_record` gives them, for a request: from the page
    cache on the event loop, the rest in a worker thread (the loop never waits for a seek).
    Raises CorruptSegment."""
    got: dict = {}
    records, missing = _records(log, bucket, offsets, got)
    if missing:
        await _read_from_disk(log, bucket, missing, got)
        records, _ = _records(log, bucket, offsets, got)
    return records
