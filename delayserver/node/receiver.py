"""The receiver: validation, group commit into message_log, acknowledgement after durability.

Producers' messages from every connection are queued; the commit task takes everything queued,
assigns sequences, writes it in one append and (flush = "sync") fsyncs once, then answers every
waiter. With flush = "async" the answer goes after the write and a timer fsyncs every
`flush_interval_ms`. Replay only ever reads up to the last fsynced offset (`durable_offset`), so
the schedule can never run ahead of what survives a crash.

Failure rules:
- DiskFull: that batch gets DISK_FULL and message_log is truncated back to where it was. The node
  releases its reserve file (room for schedule, dispatch and checkpoint writes, so due messages
  keep flowing) and refuses new messages until free space is back, then takes the reserve again
  and resumes by itself.
- An fsync error is fatal for acknowledgements: after it the node answers READ_ONLY to every write,
  since the kernel may have dropped the dirty pages; it is never retried, and no later fsync of
  the file is trusted (storage/segment.py), so every batch written since the last good fsync gets
  READ_ONLY too. A failed fsync of any other file of the data directory (schedule_log,
  dispatch_log, a checkpoint, the spool) also turns the node read-only.
- replication = "sync": a request is acknowledged only once `min_insync_replicas` slaves have
  fsynced its records too (`replicas`, replication/slaves.py); otherwise NOT_ENOUGH_REPLICAS, and
  writes are refused with it until a slave catches up.
- The log's end never runs more than `message_log.max_unsynced_bytes` ahead of the last completed
  fsync: a batch that would go further waits for the fsync in progress. Recovery relies on that
  bound to tell a power-loss tail from corruption (storage/message_log.py).
"""
from __future__ import annotations

import collections
import functools
import logging
from typing import Callable, Sequence

import attrs
import trio

from delayserver import failpoints
from delayserver.dedupe import dedupe_key
from delayserver.message import (
    MAX_HEADERS_BYTES, MAX_ID_BYTES, MAX_TIME_MS, MIN_TIME_MS, BadScheduleTime, InvalidMessage, ResultCode, TimeKind,
    check_schedule_time,
)
from delayserver.protocol import SendBatch, SendItem, SendResult
from delayserver.storage.epochs import EpochRegression
from delayserver.storage.errors import DiskFull, FsyncFailed, StorageError
from delayserver.storage.record import (
    CHECKED_SUBJECTS, EPOCH_RECORD_SIZE, HEADER, HEADER_SIZE, MESSAGE_HEAD, Cancel, RecordType, frame_records,
    encode_cancel, encode_epoch_record, encode_message_fields, encode_schedule_change, sequence_framed,
)
from delayserver.storage.segment import give_back_pages, storage_failures
from delayserver.storage.threads import run_disk
from delayserver.wakeup import Wakeup

try:  # the compiled pass over a request's messages (delayserver/native/receive.pyx), when built
    from delayserver.native.receive import admit as _native_admit
    from delayserver.native.receive import mark_committing as _native_mark_committing
    from delayserver.native.receive import stored_results as _native_stored_results
    from delayserver.native.receive import unmark_committing as _native_unmark_committing
except ImportError:
    _native_admit = _native_mark_committing = _native_unmark_committing = None
    _native_stored_results = None

#: The least of message_log's durable pages below the page floor handed back at once (`Receiver._give_back_pages`).
GIVE_BACK_BYTES = 1 << 20

log = logging.getLogger("delayserver.receiver")


def _duplicate(schedule_time: int, message_id: str) -> SendResult:
    return SendResult(ResultCode.DUPLICATE, "duplicate: the message accepted earlier under this id",
                      schedule_time, message_id)

def _admit(rows, items, view, now: int, refused: ResultCode | None, refusal_text: str | None, table,
           committing: dict, schedule_time: Callable, at_window: tuple[int, int], max_bytes: int,
           context: tuple) -> tuple:
    """`Receiver.send`'s pass over a request's messages, in order: the ones refused (`refused`, with
    `refusal_text`), invalid, or duplicates of an id in the dedupe `table`, earlier in the request
    or committing for another request (`committing`: key -> its _Pending), and
    the records of the others, framed: each a record header (its checksum left for
    `sequence_framed`) and a payload, a new MESSAGE head in front of its span of the request (`view`
    over it; a row without a span, or whose fields need checks, goes through `encode_message_fields`).

    Returns ``(results, accepted, framed, keys, twins, waits)``: a result per row (None for the
    ones to store), ``(index, schedule time)`` of each to store and their records in one bytearray,
    the dedupe key of each row (None without a table), ``(index, index of the first row with its
    id)`` of the twins, ``(index, the other request's _Pending, its schedule time)`` of those that
    wait. Changes nothing. A row's time that is an int (an epoch time as the protocol decodes it)
    within `at_window` (first, last) is its schedule time as it is; any other goes through
    `schedule_time`. `context`: `_admit_context()` (what the compiled
    `delayserver.native.receive.admit` needs from this module; it must answer as this does:
    tests/test_native.py)."""
    results: list[SendResult | None] = [None] * len(rows)
    accepted: list[tuple[int, int]] = []
    framed = bytearray()
    message_header = functools.partial(HEADER.pack, 0)  # (its checksum: set when it is sequenced)
    in_batch: dict[str, int] = {}
    keys: list[str | None] = [None] * len(rows)
    twins: list[tuple[int, int]] = []
    waits: list[tuple[int, _Pending, int]] = []
    last_spec, last_when = None, 0
    pack_head, checked_subjects = MESSAGE_HEAD.pack, CHECKED_SUBJECTS
    at_first, at_last = at_window
    ids, saved = table.screen() if table is not None else (None, None)
    for i, row in enumerate(rows):
        message_id, subject, spec, headers, id_at, id_len, subject_len, headers_len, body_len = row
        if refused is not None:
            results[i] = SendResult(refused, refusal_text, 0, message_id)
            continue
        if table is not None:
            key = keys[i] = dedupe_key(message_id, headers)
            known = None if saved is None and key not in ids else table.find(key, now)
            if known is not None:
                results[i] = _duplicate(known, message_id)
                continue
            if key in in_batch:
                twins.append((i, in_batch[key]))
                continue
            if key in committing:
                other = committing[key]
                waits.append((i, other, other.when_of(key)))
                continue
        try:
            if type(spec) is int:  # an epoch time, as decoded
                when = spec if at_first <= spec <= at_last else schedule_time(spec, now)
            else:
                # Items of a batch usually share one time spec object (protocol.decode_send_request).
                if spec is not last_spec:
                    last_when, last_spec = schedule_time(spec, now), spec
                when = last_when  # checked by check_schedule_time in schedule_time
            if (id_at >= 0 and 0 < id_len <= MAX_ID_BYTES and subject in checked_subjects
                    and body_len <= max_bytes
                    and (not headers_len or (headers_len <= MAX_HEADERS_BYTES and "" not in headers))):
                span = id_len + subject_len + headers_len + body_len
                framed += message_header(MESSAGE_HEAD.size + span, RecordType.MESSAGE)
                framed += pack_head(now, when, 0, 0, id_len, subject_len, headers_len, body_len)
                framed += view[id_at : id_at + span]
            else:
                item = items[i]
                payload = encode_message_fields(item.message_id, item.subject, item.body, when,
                                                item.headers, now, max_body_bytes=max_bytes)
                framed += message_header(len(payload), RecordType.MESSAGE)
                framed += payload
        except InvalidMessage as e:
            results[i] = SendResult(e.code, str(e), 0, message_id)
            continue
        accepted.append((i, when))
        if table is not None:
            in_batch[key] = i
    return results, accepted, framed, keys, twins, waits


def _admit_context() -> tuple:
    """What the compiled `admit` takes from this module (it imports nothing of the project), as the
    module holds it now (a request's worth of lookups: tests replace some of these)."""
    return (SendResult, _duplicate, InvalidMessage, encode_message_fields, CHECKED_SUBJECTS, dedupe_key,
            MAX_ID_BYTES, MAX_HEADERS_BYTES)


# A stored request's passes over its accepted messages, ``(index, schedule time)`` each: the
# compiled kernels (receive.pyx) must do as these do (tests/test_native.py).

def _mark_committing(committing: dict, keys: list, accepted: list, pending) -> None:
    """Each accepted message's key committing for `pending` (`_Pending.when_of` tells its schedule
    time)."""
    for i, _ in accepted:
        committing[keys[i]] = pending


def _unmark_committing(committing: dict, keys: list, accepted: list, pending) -> None:
    """Each accepted message's key out of `committing`, where `pending` still holds it."""
    for i, _ in accepted:
        if committing.get(keys[i]) is pending:
            del committing[keys[i]]


def _stored_results(results: list, accepted: list, rows: list, result_type, code, text: str) -> None:
    """The result of each accepted message, made as the named tuple's own constructor makes it."""
    new = tuple.__new__
    for i, when in accepted:
        results[i] = new(result_type, (code, text, when, rows[i][0]))


mark_committing = _native_mark_committing or _mark_committing
unmark_committing = _native_unmark_committing or _unmark_committing
stored_results = _native_stored_results or _stored_results

RECENT_BATCHES = 64


@attrs.define(eq=False)
class _Pending:
    """The records of one request, committed together: one event per request, not per message.
    `records` of them framed one after the other in `framed`, each a header (its checksum set with
    its sequence at append: `sequence_framed`) and a payload, as `admit` frames a send's and
    `frame_records` any other request's (`_Pending.of`)."""

    framed: bytearray
    records: int
    done: trio.Event = attrs.field(factory=trio.Event)
    code: ResultCode = ResultCode.OK
    error: str = ""
    offset: int = -1
    #: Called once the records are durable (in the commit task: a request cancelled while it waits
    #: for its answer still has it called).
    on_durable: Callable[[], None] | None = None
    end: int = -1  # message_log offset after its last record
    nbytes: int = attrs.field(init=False)  # the payloads' bytes
    #: A send's dedupe keys and accepted ``(index, schedule time)`` (`admit`'s), with dedupe on:
    #: what `when_of` looks in.
    keys: list | None = None
    accepted: list | None = None
    _whens: dict | None = attrs.field(default=None, init=False)  # key -> schedule time, made at the first wait

    def __attrs_post_init__(self) -> None:
        self.nbytes = len(self.framed) - HEADER_SIZE * self.records

    def when_of(self, key) -> int:
        """The schedule time of this send's message stored under dedupe `key` (one the send holds
        committing: a later request with that key waits for this one and answers with it). Only
        such a wait asks: the map of the send's keys to their times is made at the first one."""
        if self._whens is None:
            keys = self.keys
            self._whens = {keys[i]: when for i, when in self.accepted}
        return self._whens[key]

    @classmethod
    def of(cls, *records: tuple[int, bytes]) -> _Pending:
        """The request of `records`, ``(type, payload)`` each (ValueError for one message_log
        does not hold, raised here and not in the commit task)."""
        return cls(frame_records(records), len(records))


class RecentBatches:
    """The last batches this node wrote to message_log, by offset: the replayer takes a batch from
    here instead of reading back what was just written."""

    def __init__(self, keep: int = RECENT_BATCHES):
        self.keep = keep
        self._batches: collections.OrderedDict[int, bytes] = collections.OrderedDict()

    def remember(self, start: int, data: bytes) -> None:
        self._batches[start] = data
        while len(self._batches) > self.keep:
            self._batches.popitem(last=False)

    def forget(self) -> None:
        """Drop every batch (message_log was cut back: its offsets hold other records now)."""
        self._batches.clear()

    def take(self, offset: int) -> tuple[bytes, int] | None:
        """The batch written at message_log `offset` and that offset, if still in memory."""
        data = self._batches.pop(offset, None)
        return (data, offset) if data is not None else None


class DiskSpace:
    """Disk-full mode: entered on ENOSPC anywhere (message_log, schedule_log, dispatch_log); new
    messages are refused with DISK_FULL and the reserve is released so that the records keeping
    due messages flowing still fit; left once there is room for the reserve and as much again."""

    def __init__(self, store, reserve_bytes: int, *, full: bool = False):
        self.store = store
        self.reserve_bytes = reserve_bytes
        self.full = full

    def enter_full(self) -> None:
        if not self.full:
            self.full = True
            released = self.store.release_reserve()
            log.error("disk full: refusing new messages with DISK_FULL%s",
                      "; released the reserve so that due messages keep flowing" if released else "")

    def refuses(self) -> bool:
        """Still full? Checks whether the space is back (and takes the reserve again) first."""
        return self.full and not self._space_is_back()

    def _space_is_back(self) -> bool:
        reserve = self.reserve_bytes
        try:
            if self.store.free_bytes() < 2 * reserve + (1 << 20) or not self.store.ensure_reserve(reserve):
                return False
        except OSError:
            return False
        log.warning("disk space is back: accepting messages again")
        self.full = False
        return True


class Receiver:
    def __init__(self, store, clock, config, *, recent: RecentBatches, disk: DiskSpace, on_durable: Wakeup,
                 sequence_floor: Callable[[], int], next_sequence: int = 0, dedupe=None):
        """`sequence_floor`: the lowest sequence the next record may take (the replayed log's top
        plus one: after a promotion, sequences go on above what was replicated). `dedupe`: the
        node's DedupeTable (dedupe.py), or None."""
        self.dedupe = dedupe
        # Ids of messages being committed, with their request and schedule time: a retry that
        # arrives meanwhile waits for the first one's answer instead of storing the id twice.
        self._committing: dict[str, _Pending] = {}
        self.store = store
        self.clock = clock
        self.config = config
        self.next_sequence = next_sequence
        self.sequence_floor = sequence_floor
        self.on_durable = on_durable
        self.recent = recent
        self.disk = disk
        self.durable_offset = store.message_log.end_offset
        # Set and replaced at each advance of durable_offset (replication long polls wait on it).
        self.durable_changed = trio.Event()
        self.read_only_reason = ""
        self._queue: list[_Pending] = []
        # flush=sync: batches written and waiting for the flusher's fsync.
        self._unflushed: list[tuple[int, list[_Pending]]] = []
        self._flush_wakeup = Wakeup()
        self._flushing = False
        self._queued = 0
        self._queued_bytes = 0
        self._wakeup = Wakeup()
        self._idle = trio.Event()
        self._idle.set()
        self.appended = 0
        self.batches = 0
        #: replication = "sync": the gate every acknowledgement waits at (replication/slaves.py).
        self.replicas = None
        #: The master epoch each batch is written under (its EPOCH record), and whether an
        #: acknowledgement may go out now (the master's lease holds): set by the node.
        self.epoch: Callable[[], int] = lambda: 0
        self.may_acknowledge: Callable[[], bool] = lambda: True
        #: The message_log offset below which nothing reads the log back from the page cache any
        #: more (replayed, and pulled by the slaves that hold back the cleaner): set by the node.
        #: The durable pages below it are handed back to the kernel (`_give_back_pages`). None:
        #: every page is left to the kernel.
        self.page_floor: Callable[[], int] | None = None
        self._giving_back = False
        self._nursery: trio.Nursery | None = None

    # --- validation ---------------------------------------------------------------------------

    def schedule_time(self, spec, now: int) -> int:
        """The absolute delivery time for a time spec, or for an epoch time as an int (as a decoded
        request keeps one: `_admit`); a time at or before now means now.

        Raises BadScheduleTime for a time past max_delay, an unknown level or a negative delay.
        """
        if type(spec) is int:
            when = spec
        elif spec.kind == TimeKind.AT:
            when = spec.value
        elif spec.kind == TimeKind.DELAY:
            if spec.value < 0:
                raise BadScheduleTime(f"delay must not be negative, got {spec.value} ms")
            when = now + spec.value
        elif spec.kind == TimeKind.LEVEL:
            levels = self.config.delay_levels
            if not 1 <= spec.value <= len(levels):
                raise BadScheduleTime(f"delay level must be 1 to {len(levels)}, got {spec.value}")
            when = now + levels[spec.value - 1]
        else:
            raise BadScheduleTime(f"unknown time kind {spec.kind}")
        # Compare before any further arithmetic: a huge value is refused, never wrapped.
        if when > now + self.config.max_delay_ms:
            raise BadScheduleTime(
                f"delivery time {when} is more than max_delay ({self.config.max_delay_ms} ms) ahead"
            )
        when = max(when, now)
        check_schedule_time(when)
        return when

    def _at_window(self, now: int) -> tuple[int, int]:
        """The epoch times `schedule_time` takes as they are at `now`: from now to max_delay ahead,
        within MIN_TIME_MS..MAX_TIME_MS (before now it answers now; past max_delay it refuses)."""
        return max(now, MIN_TIME_MS), min(now + self.config.max_delay_ms, MAX_TIME_MS)

    def _check_fsync_failures(self) -> None:
        """Turn read-only on any failed fsync (or I/O error) in the data directory."""
        if not self.read_only_reason:
            failures = storage_failures(self.store.root)
            if failures:
                path, error = next(iter(failures.items()))
                self._go_read_only(f"{path}: {error}")

    def _refuse_writes(self) -> ResultCode | None:
        self._check_fsync_failures()
        if self.read_only_reason:
            return ResultCode.READ_ONLY
        if self.disk.refuses():
            return ResultCode.DISK_FULL
        if self.replicas is not None and self.replicas.refuses():
            return ResultCode.NOT_ENOUGH_REPLICAS
        if self._queued >= self.config.max_queued_messages or self._queued_bytes >= self.config.max_queued_bytes:
            return ResultCode.BUSY
        return None

    # --- API used by connections --------------------------------------------------------------

    async def send(self, items: Sequence[SendItem]) -> list[SendResult]:
        """Store a batch; every OK result is durable (flush=sync) before this returns. With
        dedupe on, an id accepted within the window (or earlier in this batch, or committing for
        another request) is answered DUPLICATE with the first message's schedule time, not stored.

        `items` may be a SendBatch (protocol.py): a message of it whose id, subject, headers and
        body pass the checks of `encode_message_fields` at a glance (a subject that passed them
        before) is stored as a new head in front of its span of the request, the same bytes that
        function makes of it; any other message goes through that function, its checks and errors."""
        now = self.clock.now_ms()
        if type(items) is SendBatch:
            rows, view = items.rows, memoryview(items.buf)
        else:  # rows as SendBatch has them, without a span (id_at -1)
            rows, view = [(item.message_id, item.subject, item.time, item.headers, -1, 0, 0, 0, 0)
                          for item in items], None
        refused = self._refuse_writes()
        table = self.dedupe if self.dedupe is not None and self.dedupe.enabled else None
        admit = _admit if _native_admit is None else _native_admit
        results, accepted, framed, keys, twins, waits = admit(
            rows, items, view, now, refused, None if refused is None else self._refusal_text(refused), table,
            self._committing, self.schedule_time, self._at_window(now), self.config.max_message_bytes,
            _admit_context())
        if accepted:
            p = _Pending(framed, len(accepted))
            if table is not None:
                p.keys, p.accepted = keys, accepted
                mark_committing(self._committing, keys, accepted, p)
                p.on_durable = lambda: table.remember_accepted(keys, accepted, now)
            try:
                await self._commit(p)
            finally:
                if table is not None:
                    unmark_committing(self._committing, keys, accepted, p)
            code = p.code
            if code == ResultCode.OK:
                stored_results(results, accepted, rows, SendResult, code, "stored")
            else:
                for i, _ in accepted:
                    results[i] = SendResult(code, p.error, 0, rows[i][0])
        for i, first in twins:
            r = results[first]
            results[i] = _duplicate(r.schedule_time, r.message_id) if r.code == ResultCode.OK else r
        for i, other, when in waits:
            await other.done.wait()
            results[i] = (_duplicate(when, rows[i][0]) if other.code == ResultCode.OK
                          else SendResult(other.code, other.error, 0, rows[i][0]))
        if table is not None and len(accepted) < len(results):  # (all stored: no duplicate)
            duplicate = ResultCode.DUPLICATE  # (an enum member's lookup, once a batch)
            table.duplicates += sum(r.code == duplicate for r in results)
        return results

    async def append_cancel(self, schedule_time: int, message_id: str) -> tuple[ResultCode, str, int]:
        """Durably append a CANCEL record; returns (code, message, message_log offset)."""
        refused = self._refuse_writes()
        if refused is not None:
            return refused, self._refusal_text(refused), -1
        try:
            payload = encode_cancel(Cancel(message_id, schedule_time, self.clock.now_ms()))
        except InvalidMessage as e:
            return e.code, str(e), -1
        p = _Pending.of((RecordType.CANCEL, payload))
        await self._commit(p)
        return p.code, p.error or "stored", p.offset

    async def append_move(self, message, new_time: int) -> tuple[ResultCode, str, int]:
        """Durably append, in one write, `message` (a record.Message) again at `new_time`, then a
        CANCEL of it at its old time; returns (code, message, message_log offset after both).

        The message comes first: a crash that tears the write keeps at most the new copy without
        the cancel (delivered twice, never lost), and the write is not acknowledged then."""
        refused = self._refuse_writes()
        if refused is not None:
            return refused, self._refusal_text(refused), -1
        now = self.clock.now_ms()
        try:
            moved = encode_message_fields(message.message_id, message.subject, message.body, new_time,
                                          message.headers, now, flags=message.flags,
                                          max_body_bytes=max(self.config.max_message_bytes, len(message.body)))
            cancel = encode_cancel(Cancel(message.message_id, message.schedule_time, now))
        except InvalidMessage as e:
            return e.code, str(e), -1
        p = _Pending.of((RecordType.MESSAGE, moved), (RecordType.CANCEL, cancel))
        table = self.dedupe
        if table is not None and table.enabled:
            key = dedupe_key(message.message_id, message.headers)
            p.on_durable = lambda: table.remember(key, new_time, now)
        await self._commit(p)
        return p.code, p.error or "stored", p.end

    async def append_schedule_change(self, change: dict) -> tuple[ResultCode, str, int]:
        """Durably append a SCHEDULE record; returns (code, message, message_log offset after it)."""
        refused = self._refuse_writes()
        if refused is not None:
            return refused, self._refusal_text(refused), -1
        payload = encode_schedule_change(change, self.clock.now_ms())
        p = _Pending.of((RecordType.SCHEDULE, payload))
        await self._commit(p)
        return p.code, p.error or "stored", p.end

    async def append_record(self, rtype: int, payload: bytes) -> tuple[ResultCode, str, int]:
        """Durably append one record of `rtype` whose payload starts store_time, schedule_time,
        sequence (the transactional records); returns (code, message, message_log offset)."""
        refused = self._refuse_writes()
        if refused is not None:
            return refused, self._refusal_text(refused), -1
        p = _Pending.of((rtype, payload))
        await self._commit(p)
        return p.code, p.error or "stored", p.offset

    def _refusal_text(self, code: ResultCode) -> str:
        if code == ResultCode.READ_ONLY:
            return f"node is read-only: {self.read_only_reason}"
        return code.description

    async def _commit(self, pending: _Pending) -> None:
        self._queue.append(pending)
        self._queued += pending.records
        self._queued_bytes += pending.nbytes
        self._wakeup.set()
        await pending.done.wait()
        if pending.code == ResultCode.OK and self.replicas is not None \
                and not await self.replicas.replicated(pending.end):
            # Stored here, not acknowledged: it is delivered unless this node's disk is lost.
            pending.code = ResultCode.NOT_ENOUGH_REPLICAS
            pending.error = (f"stored on the master but no {self.replicas.min_insync_replicas} slave(s) "
                             f"acknowledged it within sync_timeout_ms ({self.replicas.timeout_s * 1000:.0f} ms)")

    # --- the commit task ----------------------------------------------------------------------

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._flush_timer if self.config.flush == "async" else self._flusher)
            task_status.started()
            while True:
                if not self._queue:
                    self._check_idle()
                    await self._wakeup.wait()
                    continue
                self._idle = trio.Event()
                batch, size = self._take_batch()
                if batch:
                    await self._wait_for_room(size + EPOCH_RECORD_SIZE)
                    self._write_batch(batch)
                # Let the connections queue the next batch while this one is fsynced.
                await trio.lowlevel.checkpoint()

    def _take_batch(self) -> tuple[list[_Pending], int]:
        """The queued requests that fit in `max_unsynced_bytes` (at least one), and their size. A
        request larger than that on its own is refused (it could never be written in bounds)."""
        limit = self.store.message_log.max_unsynced_bytes
        batch, total, taken = [], 0, 0
        for p in self._queue:
            payload_bytes = p.nbytes
            size = payload_bytes + HEADER_SIZE * p.records
            if batch and total + size > limit:
                break
            taken += 1
            if size > limit:
                self._finish([p], ResultCode.MESSAGE_TOO_LARGE,
                             f"request of {size} bytes is over the {limit}-byte write window of message_log")
                self._queued -= p.records
                self._queued_bytes -= payload_bytes
                continue
            batch.append(p)
            total += size
            self._queued -= p.records
            self._queued_bytes -= payload_bytes
        del self._queue[:taken]
        return batch, total

    async def _wait_for_room(self, size: int) -> None:
        """Wait until writing `size` more bytes keeps message_log's end within
        `max_unsynced_bytes` of the last completed fsync (nothing unsynced always has room)."""
        message_log = self.store.message_log
        while not self.read_only_reason:
            ahead = message_log.end_offset - self.durable_offset
            if ahead <= 0 or ahead + size <= message_log.max_unsynced_bytes:
                return
            await self.durable_changed.wait()

    def _write_batch(self, batch: list[_Pending]) -> None:
        """One write for the whole batch; with flush=sync it then waits for the flusher."""
        self._check_fsync_failures()
        if self.read_only_reason:
            return self._finish(batch, ResultCode.READ_ONLY, self._refusal_text(ResultCode.READ_ONLY))
        epoch = self.epoch()
        parts, seq = [encode_epoch_record(epoch)], max(self.next_sequence, self.sequence_floor())
        sizes = []
        for p in batch:  # each request's records sequenced in place, one piece of the write each
            sizes.append(sequence_framed(p.framed, p.records, seq))
            parts.append(p.framed)
            seq += p.records
        data = b"".join(parts)
        try:
            start = self.store.message_log.append(data, epoch)
        except DiskFull as e:
            log.warning("message_log append refused: %s", e)
            self.disk.enter_full()
            return self._finish(batch, ResultCode.DISK_FULL, ResultCode.DISK_FULL.description)
        except EpochRegression as e:  # the log holds a newer epoch than this node was told of
            return self._finish(batch, ResultCode.FENCED, str(e))
        except StorageError as e:
            self._go_read_only(f"write failed: {e}")
            return self._finish(batch, ResultCode.READ_ONLY, self._refusal_text(ResultCode.READ_ONLY))
        self.next_sequence = seq
        self.recent.remember(start, data)
        pos = start + EPOCH_RECORD_SIZE
        for p, size in zip(batch, sizes):
            p.offset = pos
            pos += size
            p.end = pos
        failpoints.hit("after-append-before-ack")
        if self.config.flush == "sync":
            self._unflushed.append((pos, batch))
            self._flush_wakeup.set()
        else:
            self._acknowledge(batch)

    async def _flusher(self) -> None:
        """flush=sync: fsync whatever was written since the last fsync, then acknowledge it.

        Writes go on while an fsync runs, and the next fsync covers all of them: group commit
        across batches. MessageLog.sync fsyncs through a descriptor of its own, so a roll during
        an fsync is safe. A failed fsync is never retried: what it covered is refused with
        READ_ONLY, as is every later write (the kernel may have dropped the dirty pages).
        """
        while True:
            if not self._unflushed:
                self._check_idle()
                await self._flush_wakeup.wait()
                continue
            items, self._unflushed = self._unflushed, []
            self._flushing = True
            try:
                await run_disk(self.store.message_log.sync)
            except FsyncFailed as e:
                self._go_read_only(str(e))
                for _, batch in items:
                    self._finish(batch, ResultCode.READ_ONLY, self._refusal_text(ResultCode.READ_ONLY))
                continue
            finally:
                self._flushing = False
            self._check_fsync_failures()
            if self.read_only_reason:
                # Another file's fsync failed meanwhile: once read-only, nothing more is
                # acknowledged or counted durable (a restart replays it all the same).
                for _, batch in items:
                    self._finish(batch, ResultCode.READ_ONLY, self._refusal_text(ResultCode.READ_ONLY))
                continue
            self.set_durable(items[-1][0])
            for _, batch in items:
                self._acknowledge(batch)
            self._give_back_pages()

    def _give_back_pages(self) -> None:
        """Hand back to the kernel, in a worker thread of its own, the pages of message_log that an
        fsync made durable below the page floor, once there is GIVE_BACK_BYTES of them and no
        give-back is under way: off the acknowledgements' path (no acknowledgement waits for it),
        and a thread's trip per MiB or so, not per fsync. Written once and read back only after a
        restart, by a slave far behind, or for a half message's check (from the disk, in worker
        threads), those pages would otherwise fill the page cache with a copy of the whole log;
        given back, the next writes reuse them at once. On the benchmark machine a write into a
        page the page cache takes anew cost four times one into a page given back, the advice
        included (`ops/bench memory --fill 2 --give-back`)."""
        if self.page_floor is None or self._giving_back or self._nursery is None:
            return
        message_log = self.store.message_log
        if message_log.give_back_due(self.durable_offset) < GIVE_BACK_BYTES:
            return  # (most fsyncs: the floor, never above the durable offset, is not worked out)
        ranges = message_log.pages_to_give_back(min(self.page_floor(), self.durable_offset), GIVE_BACK_BYTES)
        if not ranges:
            return
        self._giving_back = True

        async def give_back() -> None:
            try:
                await run_disk(give_back_pages, ranges)
            finally:
                self._giving_back = False

        self._nursery.start_soon(give_back)

    def _acknowledge(self, batch: list[_Pending]) -> None:
        if not self.may_acknowledge():
            # Durable here, but the master's lease lapsed meanwhile: a newer master may be taking
            # writes, so no acknowledgement goes out (the producer retries with the new master).
            return self._finish(batch, ResultCode.FENCED, ResultCode.FENCED.description)
        self.appended += sum(p.records for p in batch)
        self.batches += 1
        self._finish(batch, ResultCode.OK, "")
        # Acks released, replay not begun: the replayer cannot have read this batch (no await since
        # durable_offset moved; with flush=async it has not moved yet). The responses have not left
        # the process either, but sending them writes no file, so the disk holds what it would once
        # they are out: the crash test counts the whole batch as acknowledged
        # (tests/faults/test_failpoints.py).
        failpoints.hit("after-ack-before-replay")

    def _check_idle(self) -> None:
        if not self._queue and not self._unflushed and not self._flushing:
            self._idle.set()

    def set_durable(self, offset: int) -> None:
        """message_log is fsynced up to `offset` (by the commit task, or by replication)."""
        if offset > self.durable_offset:
            self.durable_offset = offset
            self.on_durable.set()
            self.durable_changed.set()
            self.durable_changed = trio.Event()

    async def _flush_timer(self) -> None:
        while True:
            await trio.sleep(self.config.flush_interval_ms / 1000)
            end = self.store.message_log.end_offset
            self._check_fsync_failures()
            if end > self.durable_offset and not self.read_only_reason:
                try:
                    await run_disk(self.store.message_log.sync)
                except FsyncFailed as e:
                    self._go_read_only(str(e))
                    continue
                self.set_durable(end)
                self._give_back_pages()

    def _finish(self, batch: list[_Pending], code: ResultCode, error: str) -> None:
        for p in batch:
            p.code, p.error = code, error
            if code == ResultCode.OK and p.on_durable is not None:
                p.on_durable()
            p.done.set()

    def _go_read_only(self, reason: str) -> None:
        if self.read_only_reason:
            return
        log.critical("read-only at message_log durable offset %d: no more writes are acknowledged: %s",
                     self.durable_offset, reason)
        self.read_only_reason = reason
        # Wake whoever waits for durability: it will not come.
        self.durable_changed.set()
        self.durable_changed = trio.Event()

    async def drain(self) -> None:
        """Finish what is queued and make it durable (used on shutdown)."""
        while self._queue or self._unflushed or self._flushing or not self._idle.is_set():
            await self._idle.wait()
            await trio.lowlevel.checkpoint()
        if self.store.message_log.end_offset > self.durable_offset and not self.read_only_reason:
            try:
                await run_disk(self.store.message_log.sync)
            except FsyncFailed as e:
                self._go_read_only(str(e))
                return
            self.set_durable(self.store.message_log.end_offset)
