"""The tick manager: what is loaded into the wheel, and what fires.

Schedule segments are loaded `load_ahead_ms` before their bucket starts, in bucket order, tracked
by two cursors:

- the loading cursor: the bucket being loaded and its end offset pinned when loading began;
- the loaded cursor: the offset in that bucket up to which records are in memory, advanced record
  by record, so that a load cut short resumes where it stopped.

`load_step` loads one slice: at most `LOAD_CHUNK_BYTES` of segment, stopping once it has taken
`LOAD_SLICE_S` (a millisecond), so the tick task can advance the wheel and let the sender run
between slices however big the bucket (tests/wheel/test_bounded_loading.py).

Beginning a bucket reads what its load must skip: the offsets its dispatch_log records as
delivered, and those parked. After a restart in the middle of a busy bucket that is millions of
records (a second of walking per million), so when the dispatch_log is not small the tick task
reads them in a worker thread first (`pending_begin`, `settled_reader`, `prepare_begin`) and the
step that begins the bucket takes them from there; a step that finds nothing prepared reads them
itself.

`can_add(bucket, offset)` decides whether a freshly replayed record goes straight into the wheel:
a bucket before the loading cursor, yes (the loader has passed it); the bucket being loaded, only
past the pinned end (the loader stops there); a later bucket, no (the loader will read it). So
every record reaches the wheel exactly once, whichever of the replayer and the loader sees it
first (tests/test_tick_manager.py::test_records_racing_the_loader_fire_once).

When no segment exists yet for the target bucket, both cursors move onto it (pinned end 0): the
blocking-exit rule, without which replayed messages for an empty upcoming bucket would wait for
a loader that has nothing to load.

A message of the bucket being loaded that is due (overdue at load, or due while the load goes on)
is held back until the bucket is loaded to its pinned end: its cancel may sit in a chunk not read
yet, and the held messages then come out together in schedule-time order, however many chunks the
bucket took (tests/test_tick_manager.py::test_cancel_loaded_from_a_later_chunk_than_its_message_still_wins).

Memory: a loaded message is one (due, ref) pair in the wheel's arrays, where
ref = bucket_id << 40 | schedule_offset. Cancels are kept only for the loaded window (the loader
reads the others from their segments), and dropped once the loading cursor has passed their bucket
and none of its messages is left in memory.
"""
from __future__ import annotations

import collections
import itertools
import logging
import operator
import time
from array import array

import numpy as np

from delayserver.storage.errors import CorruptSegment
from delayserver.storage.record import (
    HEADER_SIZE, T_SCHEDULED, T_SCHEDULED_CANCEL, RecordError, cancel_key, record_size, scheduled_time,
    Message, decode_scheduled, iter_records, parse_record,
)
from delayserver.storage.store import Store
from delayserver.wakeup import Wakeup
from delayserver.wheel.read_ahead import MAX_BYTES as READ_AHEAD_BYTES, ReadAhead
from delayserver.wheel.timingwheel import TimingWheel

try:  # the compiled kernel (delayserver/native/records.pyx), when built
    from delayserver.native.records import read_scheduled as _native_read_scheduled
except ImportError:  # pragma: no cover - a build without a C compiler
    _native_read_scheduled = None

log = logging.getLogger("delayserver.wheel")

OFFSET_BITS = 40
OFFSET_MASK = (1 << OFFSET_BITS) - 1
#: ref -> its bucket's index, and its offset, as C-level callables for `map`.
_BUCKET_OF_REF = OFFSET_BITS.__rrshift__
_OFFSET_OF_REF = OFFSET_MASK.__and__
_REF_OF_ENTRY = operator.itemgetter(1)  # a wheel entry's (due, ref)
READ_GUESS_BYTES = 4096
LOAD_CHUNK_BYTES = 256 << 10  # records bigger than this are read whole
MIN_READ_BYTES = 16 << 10  # the least a time-bounded slice reads
#: How long one load step may hold the event loop (it stops after the record that passes it).
LOAD_SLICE_S = 0.001
_CLOCK_EVERY = 32  # records between two looks at the clock in a load step


def _split_refs_py(refs: list[int], bits: int, offsets_too: bool = True) -> tuple[int, list[int] | None] | None:
    """When every ref of `refs` names one bucket (``ref >> bits``): (that bucket's index, the
    refs' offsets in it, in order; None for them without `offsets_too`); else None (also for no
    refs). The compiled `wheel.split_refs` must answer the same."""
    ids = set(map(bits.__rrshift__, refs))
    if len(ids) != 1:
        return None
    return ids.pop(), list(map(((1 << bits) - 1).__and__, refs)) if offsets_too else None


try:  # the compiled pass (delayserver/native/wheel.pyx), when built; its None for refs that are
    # not plain ints sends them the general way of `_by_bucket`, which gives the same answer
    from delayserver.native.wheel import split_refs as _split_refs
except ImportError:  # pragma: no cover - a build without a C compiler
    _split_refs = _split_refs_py


_NO_SKIP = array("q")
_BEYOND = 1 << 62  # past every offset: no more to skip

#: A dispatch_log smaller than this (about 1,500 records, 2 ms to walk) is read by the step that
#: begins its bucket, on the loop: a worker thread's round trip would cost more than it saves.
SETTLED_READ_ON_LOOP_BYTES = 64 << 10


def _message_of(bucket: int, offset: int, record):
    """(bucket, offset, message_log_offset, Message) of a record as `read_records_at` answers it;
    None (not in memory) and a CorruptSegment as they are."""
    if record is None or isinstance(record, CorruptSegment):
        return record
    _, data, s, e = record
    return (bucket, offset, *decode_scheduled(data, s, e))


def _message_in(bucket: int, offset: int, data: bytes):
    """`_message_of` of a record read ahead (`data`: the record's bytes, header included), or
    False when they are not one sound SCHEDULED record (read again from its segment, where the
    damage is met and reported)."""
    try:
        parsed = parse_record(data, 0, len(data))
        if parsed is None or parsed[0] != T_SCHEDULED or parsed[2] != len(data):
            return False
        return (bucket, offset, *decode_scheduled(data, parsed[1], parsed[2]))
    except Exception:
        return False


class TickManager:
    """Synchronous core: loading, can_add, firing, cancels. Time is always passed in."""

    def __init__(self, store: Store, *, now_ms: int, tick_ms: int = 10, slots: int = 1 << 13,
                 load_ahead_ms: int | None = None, settled_elsewhere=None, read_ahead_bytes: int = READ_AHEAD_BYTES):
        """`settled_elsewhere(bucket) -> set of offsets` names records that a load must skip besides
        those in dispatch_log (parked messages)."""
        self.store = store
        self.scale = store.segment_scale_ms
        self.load_ahead_ms = self.scale // 2 if load_ahead_ms is None else load_ahead_ms
        self.wheel = TimingWheel(tick_ms=tick_ms, slots=slots, start_ms=now_ms)
        self._bucket_ids: dict[int, int] = {}
        self._buckets: list[int] = []
        self.loading_bucket: int | None = None
        self.loading_end = 0
        self.loaded_offset = 0
        # The offsets the bucket being loaded skips (delivered or parked), sorted, and how far
        # the load has passed through them.
        self._skip_in_load: array = _NO_SKIP
        self._skip_at = 0
        # (schedule_time, ref) of the loading bucket's messages that are due but not released yet.
        self._held: list[tuple[int, int]] = []
        self._settled_elsewhere = settled_elsewhere
        # (bucket, generation, dispatch_log scan, offsets to skip) read ahead of `_begin`.
        self._prepared: tuple | None = None
        # Bytes the last time-bounded slice consumed: the next reads about twice that, not a whole
        # chunk it would mostly throw away.
        self._last_slice_bytes: int | None = None
        # Load slices whose segment range was not in the page cache (the tick task read them in a
        # worker thread).
        self.load_disk_reads = 0
        # Per bucket: messages in the wheel, ready or in flight; and (sched, id) -> cancel offset.
        self.outstanding: collections.Counter[int] = collections.Counter()
        self.cancels: dict[int, dict[tuple[int, str], int]] = {}
        self.ready: collections.deque[int] = collections.deque()
        self.inflight: set[int] = set()
        self.last_now = now_ms
        # The tick task sleeps until `sleeping_until`; an earlier entry must wake it.
        self.sleeping_until: int | None = None
        self.changed = Wakeup()
        self.fired = 0
        self.cancelled_drops = 0
        # Bumped by `reset`: what the sender holds from an older generation is no longer owed.
        self.generation = 0
        # Reschedule: (schedule_time, id) of messages being moved -> refs that fell due meanwhile.
        self.moving: dict[tuple[int, str], list[int]] = {}
        # The records of what falls due soon, read into memory by prefetch_due's worker thread.
        self.ahead = ReadAhead(read_ahead_bytes)
        store.schedule_log.listeners.append(self.ahead)

    def reset(self, now: int) -> None:
        """Forget everything in memory (the node stopped or started being its group's master):
        the next `load_step` loads from disk again, skipping what dispatch_log records by then.
        Refs handed out before are ignored when they settle."""
        self.wheel = TimingWheel(tick_ms=self.wheel.tick_ms, slots=self.wheel.slots, start_ms=now)
        self.loading_bucket = None
        self.loading_end = self.loaded_offset = 0
        self._set_skip(_NO_SKIP)
        self._prepared = None
        self._held = []
        self.outstanding.clear()
        self.cancels.clear()
        self.ready.clear()
        self.inflight.clear()
        for held in self.moving.values():
            held.clear()
        self.last_now = now
        self.generation += 1
        self.ahead.clear()
        self.changed.set()

    # --- refs -------------------------------------------------------------------------------

    def ref(self, bucket: int, offset: int) -> int:
        bid = self._bucket_ids.get(bucket)
        if bid is None:
            bid = self._bucket_ids[bucket] = len(self._buckets)
            self._buckets.append(bucket)
        return bid << OFFSET_BITS | offset

    def split(self, ref: int) -> tuple[int, int]:
        """(bucket, schedule_offset) of a ref."""
        return self._buckets[ref >> OFFSET_BITS], ref & OFFSET_MASK

    # --- adding -------------------------------------------------------------------------------

    def loads_later(self, bucket: int) -> bool:
        """Whether `bucket` is after the bucket being loaded (or loaded last): its records are read
        when it loads, not before. False while nothing is loaded (a slave, a node starting)."""
        return self.loading_bucket is not None and bucket > self.loading_bucket

    def can_add(self, bucket: int, offset: int) -> bool:
        if self.loading_bucket is None:
            return False
        if bucket < self.loading_bucket:
            return True
        return bucket == self.loading_bucket and offset >= self.loading_end

    def add(self, bucket: int, offset: int, schedule_time: int, now: int) -> None:
        ref = self.ref(bucket, offset)
        self.outstanding[bucket] += 1
        if not self.wheel.add(schedule_time, ref, now):
            self.ready.append(ref)
            self.changed.set()
        elif self.sleeping_until is not None and schedule_time < self.sleeping_until:
            self.changed.set()

    def on_replayed(self, bucket: int, offset: int, schedule_time: int, now: int) -> bool:
        """A SCHEDULED record was appended by the replayer; True if it went into memory."""
        if self.can_add(bucket, offset):
            self.add(bucket, offset, schedule_time, now)
            return True
        return False

    def on_replayed_many(self, bucket: int, entries: list[tuple[int, int]], now: int) -> None:
        """`on_replayed` for (offset, schedule_time) records appended to one bucket, in offset
        order: whether they go into memory is decided once for the bucket where it can be."""
        loading = self.loading_bucket
        if loading is None or bucket > loading:
            return
        # Of the loading bucket, only what the loader has read past (it reads the rest); the
        # entries are in offset order, so the last tells whether any is.
        min_offset = self.loading_end if bucket == loading else 0
        if not entries or entries[-1][0] < min_offset:
            return
        base = self.ref(bucket, 0)  # the bucket's refs: its id above the offset
        due, taken, earliest = self.wheel.add_entries(entries, base, now, min_offset)
        self.outstanding[bucket] += taken
        self.ready += due
        sleeping_until = self.sleeping_until
        if due or (sleeping_until is not None and earliest is not None and earliest < sleeping_until):
            self.changed.set()

    def on_cancel(self, bucket: int, offset: int, schedule_time: int, message_id: str) -> None:
        """A SCHEDULED_CANCEL was appended at `offset`: every earlier record of that key is dropped
        at fire. One the loader is still to read is left to it, so that memory holds the cancels
        of the loaded window only, however far ahead cancelled messages were due."""
        if self.can_add(bucket, offset):
            self._note_cancel(bucket, offset, schedule_time, message_id)

    def _note_cancel(self, bucket: int, offset: int, schedule_time: int, message_id: str) -> None:
        keyed = self.cancels.setdefault(bucket, {})
        key = (schedule_time, message_id)
        # The loader reads a bucket's cancels after the replayer may have reported later ones:
        # only the latest cancel of a key counts (test_a_message_sent_and_cancelled_twice_never_fires).
        if keyed.get(key, -1) < offset:
            keyed[key] = offset

    def is_cancelled(self, bucket: int, offset: int, schedule_time: int, message_id: str) -> bool:
        """Whether a cancel of this (schedule_time, id) follows `offset` in the bucket's segment;
        exact for every message in memory (its bucket's cancels are all loaded or replayed)."""
        return self.cancels.get(bucket, {}).get((schedule_time, message_id), -1) > offset

    # --- loading ------------------------------------------------------------------------------

    def load_target(self, now: int) -> int:
        t = now + self.load_ahead_ms
        return t - t % self.scale

    def pending_read(self, max_bytes: int = LOAD_CHUNK_BYTES, max_s: float | None = LOAD_SLICE_S):
        """(bucket, start, end): the segment range the next load slice reads, or None when the next
        step reads nothing (it begins a bucket, or there is nothing to load)."""
        if self.loading_bucket is None or self.loaded_offset >= self.loading_end:
            return None
        start = self.loaded_offset
        if max_s is not None and self._last_slice_bytes is not None:
            max_bytes = min(max_bytes, max(MIN_READ_BYTES, 2 * self._last_slice_bytes))
        return self.loading_bucket, start, min(self.loading_end, start + max(max_bytes, HEADER_SIZE))

    def load_step(self, now: int, max_bytes: int = LOAD_CHUNK_BYTES, max_s: float | None = LOAD_SLICE_S,
                  data: bytes | None = None) -> bool:
        """Load one slice toward the target bucket; True while there is more to do now.

        A slice is at most `max_bytes` of segment and stops once it has taken `max_s` seconds
        (None: no time bound), so that the caller can let other work run between slices.
        `data`, when given, is what `pending_read(max_bytes, max_s)` names, read by the caller (in
        a worker thread when it was not in the page cache); otherwise the slice reads it.

        A damaged record quarantines its bucket (nothing past it is loaded) and the load goes on.
        """
        target = self.load_target(now)
        try:
            if self.loading_bucket is not None and self.loaded_offset < self.loading_end:
                self._load_chunk(now, max_bytes, max_s, data)
                return True
            nxt = self._bucket_to_begin(target)
            if nxt is not None:
                self._begin(nxt)
                return True
        except CorruptSegment as e:
            # Quarantine the bucket (storage/quarantine.py) and go on past it: what was loaded
            # before the damage is delivered, the rest waits for `delayctl salvage`.
            self.store.quarantine(self.loading_bucket, e)
            self.loaded_offset = self.loading_end
            self._set_skip(_NO_SKIP)
            self._release_held()
            return True
        if self.loading_bucket is None or self.loading_bucket < target:
            # Blocking exit: no segment for the target bucket yet, so move the cursors onto it
            # and let the replayer put its records straight into the wheel.
            self._begin(target)
        return False

    def pending_begin(self, now: int) -> int | None:
        """The bucket the next `load_step` begins, when it begins one whose skip set is worth
        reading in a worker thread (a dispatch_log of SETTLED_READ_ON_LOOP_BYTES or more) and is not
        prepared yet (`prepare_begin`); otherwise None."""
        if self.loading_bucket is not None and self.loaded_offset < self.loading_end:
            return None
        nxt = self._bucket_to_begin(self.load_target(now))
        if nxt is None or not self.store.schedule_log.size(nxt) \
                or self.store.dispatch_log.size(nxt) < SETTLED_READ_ON_LOOP_BYTES or self._prepared_for(nxt):
            return None
        return nxt

    def _bucket_to_begin(self, target: int) -> int | None:
        """The bucket after the loading one, when there is one to load up to `target`."""
        nxt = self._next_bucket()
        return nxt if nxt is not None and nxt <= target else None

    def _prepared_for(self, bucket: int) -> tuple | None:
        """What `prepare_begin` handed over for `bucket` in the current generation, or None."""
        prepared = self._prepared
        return prepared[2:] if prepared is not None and prepared[:2] == (bucket, self.generation) else None

    def settled_reader(self, bucket: int):
        """A function for a worker thread: (dispatch_log's scan or CorruptSegment or None, the
        offsets of `bucket` a load must skip, sorted, as an `array("q")`), for `prepare_begin`."""
        dispatched = self.store.dispatched_reader(bucket)
        elsewhere = self._settled_elsewhere

        def read():
            scanned, offsets = dispatched()
            if isinstance(scanned, CorruptSegment):
                return scanned, _NO_SKIP
            skip = np.frombuffer(offsets, dtype=np.int64)
            if elsewhere is not None:
                try:
                    parked = elsewhere(bucket)
                except CorruptSegment as e:
                    return e, _NO_SKIP
                skip = np.concatenate([skip, np.fromiter(parked, dtype=np.int64, count=len(parked))])
            # Sorted without repeats. (Not np.unique: it hashes, about 0.7 s a million here; a
            # stable sort of offsets written nearly in order takes milliseconds.)
            skip = np.sort(skip, kind="stable")
            if len(skip) > 1:
                skip = skip[np.concatenate(([True], skip[1:] != skip[:-1]))]
            return scanned, array("q", skip.tobytes())

        return read

    def prepare_begin(self, bucket: int, generation: int, settled) -> None:
        """Hand over what `settled_reader(bucket)` read, while `generation` was current: the step
        that begins `bucket` in that generation skips those offsets without reading them again.
        Nothing of a bucket not begun yet is in memory, so none of it can be dispatched or parked
        between the read and the begin."""
        self._prepared = (bucket, generation, *settled)

    def _next_bucket(self) -> int | None:
        sizes = self.store.schedule_log.sizes
        if self.loading_bucket is None:
            return sizes.first()
        return sizes.higher(self.loading_bucket)

    def _begin(self, bucket: int) -> None:
        self._forget_cancels_before(bucket)
        self.loading_bucket = bucket
        self.loading_end = self.store.schedule_log.size(bucket)
        self.loaded_offset = 0
        self._set_skip(_NO_SKIP)
        prepared, self._prepared = self._prepared_for(bucket), None
        if self.loading_end:
            scanned, skip = prepared if prepared is not None else self.settled_reader(bucket)()
            if isinstance(scanned, CorruptSegment):
                raise scanned
            if scanned is not None:
                self.store.dispatch_log.cut_tail(bucket, scanned)
            self._set_skip(skip)
        log.debug("loading bucket %d up to %d", bucket, self.loading_end)

    def _set_skip(self, skip: array) -> None:
        """The offsets the load of the bucket being begun skips, sorted: the load walks the
        segment in offset order and them with it (`_skip_at`), one comparison a record."""
        self._skip_in_load = skip
        self._skip_at = 0

    def _forget_cancels_before(self, bucket: int) -> None:
        """Cancels of a bucket the loader has passed matter only while its messages are in memory."""
        for passed in [b for b in self.cancels if b < bucket and not self.outstanding[b]]:
            del self.cancels[passed]

    def _load_chunk(self, now: int, max_bytes: int, max_s: float | None = None, data: bytes | None = None) -> None:
        bucket, start, end = self.pending_read(max_bytes, max_s)
        log_ = self.store.schedule_log
        if data is None:
            data = log_.read(bucket, start, end)
        if len(data) >= HEADER_SIZE:
            need = record_size(data, 0)
            if need > len(data):  # one record bigger than the chunk
                data = log_.read(bucket, start, min(self.loading_end, start + need))
        held = self._held
        consumed = 0
        skip, at = self._skip_in_load, self._skip_at
        skips = len(skip)
        next_skip = skip[at] if at < skips else _BEYOND
        deadline = None if max_s is None else time.perf_counter() + max_s
        count = 0
        try:
            for pos, rtype, s, e in iter_records(data):
                count += 1
                if deadline is not None and not count % _CLOCK_EVERY and consumed \
                        and time.perf_counter() > deadline:
                    break
                if rtype == T_SCHEDULED:
                    offset = start + pos
                    while next_skip < offset:
                        at += 1
                        next_skip = skip[at] if at < skips else _BEYOND
                    if offset != next_skip:
                        sched = scheduled_time(data, s)
                        ref = self.ref(bucket, offset)
                        self.outstanding[bucket] += 1
                        if not self.wheel.add(sched, ref, now):
                            held.append((sched, ref))
                elif rtype == T_SCHEDULED_CANCEL:
                    sched, mid = cancel_key(data, s)
                    self._note_cancel(bucket, start + pos, sched, mid)
                consumed = e
        except RecordError as err:
            # The records before the bad one are in memory: a retry must not add them again.
            self.loaded_offset = start + consumed
            raise CorruptSegment(log_.path(bucket), start + err.offset, err.reason) from None
        finally:
            self._skip_at = at
        if consumed == 0:
            # The pinned end cuts a record: only possible if the segment was damaged under us.
            raise CorruptSegment(log_.path(bucket), start, "record cut short before the pinned end")
        self.loaded_offset = start + consumed
        self._last_slice_bytes = consumed if max_s is not None else None
        if self.loaded_offset >= self.loading_end:
            self._set_skip(_NO_SKIP)
            self._release_held()

    def _release_held(self) -> None:
        """The bucket is loaded whole: its due messages come out at once, in schedule-time order."""
        self._held.sort()
        self.ready.extend(map(_REF_OF_ENTRY, self._held))
        self._held = []

    # --- firing -------------------------------------------------------------------------------

    def advance(self, now: int) -> int:
        """Move due entries from the wheel to the ready queue; returns how many.

        Due entries of a bucket still loading are held back until it is loaded (module docstring).
        """
        if now < self.last_now:
            log.warning("clock stepped back by %d ms: nothing fires early", self.last_now - now)
        elif now - self.last_now > 60_000:
            log.warning("clock stepped forward by %d ms: firing what became due", now - self.last_now)
        self.last_now = now
        due = self.wheel.advance(now)
        if due and self.loaded_offset < self.loading_end:
            loading = self._bucket_ids.get(self.loading_bucket)
            held = [entry for entry in due if entry[1] >> OFFSET_BITS == loading]
            if held:
                self._held.extend(held)
                due = [entry for entry in due if entry[1] >> OFFSET_BITS != loading]
        self.ready.extend(map(_REF_OF_ENTRY, due))
        return len(due)

    def next_load_time(self) -> int:
        """When the next bucket after the loading cursor becomes a load target."""
        base = self.loading_bucket if self.loading_bucket is not None else 0
        return base + self.scale - self.load_ahead_ms

    def take(self, limit: int) -> list[int]:
        """Pop up to `limit` ready refs and mark them in flight (the sender owns them now)."""
        out = list(map(operator.call, itertools.repeat(self.ready.popleft, min(limit, len(self.ready)))))
        self.inflight.update(out)
        self.fired += len(out)
        return out

    def remove_cancelled(self, bucket: int, offsets, schedule_time: int) -> int:
        """Take cancelled messages (by their schedule_log offsets) out of the wheel at once, so
        they stop taking memory; any not in the wheel are still dropped when they fire (see
        `is_cancelled`). Returns how many were removed."""
        if bucket not in self._bucket_ids:
            return 0
        removed = 0
        for offset in offsets:
            if self.wheel.cancel(self.ref(bucket, offset), schedule_time):
                removed += 1
                self.cancelled_drops += 1
                self.outstanding[bucket] -= 1
                if self.outstanding[bucket] <= 0:
                    del self.outstanding[bucket]
        return removed

    def drop_cancelled(self, ref: int) -> None:
        """The sender found `ref` cancelled when it read the record: never deliver it."""
        self.cancelled_drops += 1
        self._settle((ref,))

    def on_dispatched(self, ref: int) -> None:
        """`ref`'s dispatch_log record is written."""
        self._settle((ref,))

    def on_dispatched_many(self, refs: list[int]) -> None:
        """`on_dispatched` of each of `refs` (a batch whose dispatch records are written)."""
        self._settle(refs)

    def _settle(self, refs) -> None:
        """`refs` are owed no more: out of flight, their buckets' counts settled once each."""
        inflight = self.inflight
        one = _split_refs(refs, OFFSET_BITS, False) if type(refs) is list and len(refs) > 1 else None
        if one is not None:  # most batches: one bucket's, counted by what left the set (C-level passes)
            before = len(inflight)
            inflight.difference_update(refs)
            counts = {one[0]: before - len(inflight)} if before > len(inflight) else {}
        else:
            present = set(refs)
            if not inflight.issuperset(present):  # some handed out before a reset: nothing of them is counted any more
                present &= inflight
            inflight.difference_update(present)
            counts = collections.Counter(map(_BUCKET_OF_REF, present))
        for bid, count in counts.items():
            bucket = self._buckets[bid]
            self.outstanding[bucket] -= count
            if self.outstanding[bucket] <= 0:
                del self.outstanding[bucket]
                if self.loading_bucket is not None and bucket < self.loading_bucket:
                    self.cancels.pop(bucket, None)

    def read_message(self, ref: int):
        """(bucket, offset, message_log_offset, Message) for a ref, from schedule_log.

        One read of READ_GUESS_BYTES covers most records whole; a bigger one takes a second read.
        Raises CorruptSegment if the record there is damaged or cut short. (`read_messages` reads
        many, from the page cache only if asked: see `disk_reader` for the others.)
        """
        bucket, offset = self.split(ref)
        _, data, s, e = self.store.schedule_log.read_record(bucket, offset, READ_GUESS_BYTES)
        mlo, message = decode_scheduled(data, s, e)
        return bucket, offset, mlo, message

    def read_messages(self, refs: list[int], *, cached_only: bool = False) -> list:
        """`read_message` of each of `refs`, in order, with neighbouring records of a bucket read
        together (`BucketLog.read_records_at`): per ref its answer, None (`cached_only`: not in the
        page cache), or the CorruptSegment."""
        per_bucket = self._by_bucket(refs)
        if len(per_bucket) == 1:  # one bucket's: its answers are in the order of `refs`
            bucket, _, offsets = per_bucket[0]
            return self._read_bucket(bucket, offsets, cached_only)
        out: list = [None] * len(refs)
        for bucket, indexes, offsets in per_bucket:
            for k, read in zip(indexes, self._read_bucket(bucket, offsets, cached_only)):
                out[k] = read
        return out

    def _read_bucket(self, bucket: int, offsets: list[int], cached_only: bool) -> list:
        """`read_messages` of one bucket's `offsets`: the compiled kernel's reading from the page
        cache where it is built, and this reference for the records it leaves (False) or all of
        them. A record read ahead (read_ahead.py) is decoded from memory, not read."""
        schedule_log = self.store.schedule_log
        ahead = self.ahead.take(bucket, offsets)
        got = None
        target = schedule_log.cached_reader(bucket) if cached_only and _native_read_scheduled is not None else None
        if target is not None:
            fd, size = target
            got = _native_read_scheduled(fd, size, offsets, READ_GUESS_BYTES, bucket, Message, ahead)
        if got is None:
            got = [False] * len(offsets) if ahead is None else [
                False if data is None else _message_in(bucket, offset, data) for offset, data in zip(offsets, ahead)]
        left = [k for k, read in enumerate(got) if read is False]
        if left:
            records = schedule_log.read_records_at(bucket, [offsets[k] for k in left], READ_GUESS_BYTES,
                                                   cached_only=cached_only)
            for k, record in zip(left, records):
                got[k] = _message_of(bucket, offsets[k], record)
        return got

    def disk_reader(self, refs: list[int]):
        """A function for a worker thread that reads the messages of `refs` as `read_messages`
        does, from descriptors of its own: {ref: (bucket, offset, message_log_offset, Message) or
        the CorruptSegment}; a ref whose segment it cannot open is left out."""
        readers = [(bucket, indexes, offsets, self.store.schedule_log.records_reader(bucket))
                   for bucket, indexes, offsets in self._by_bucket(refs)]

        def read() -> dict:
            out = {}
            for bucket, indexes, offsets, reader in readers:
                try:
                    records = reader(offsets, READ_GUESS_BYTES)
                except OSError:
                    continue
                for k, offset, record in zip(indexes, offsets, records):
                    out[refs[k]] = _message_of(bucket, offset, record)
            return out

        return read

    def offsets_by_bucket(self, refs: list[int]) -> dict[int, list[int]]:
        """The schedule offsets of `refs` per bucket, in the order of `refs`."""
        return {bucket: offsets for bucket, _, offsets in self._by_bucket(refs)} if refs else {}

    def _by_bucket(self, refs: list[int]) -> list[tuple[int, list[int], list[int]]]:
        """(bucket, indexes into `refs`, their schedule offsets) per bucket the refs name."""
        one = _split_refs(refs, OFFSET_BITS)
        if one is not None:  # most batches: one bucket's (one compiled pass where built)
            return [(self._buckets[one[0]], range(len(refs)), one[1])]
        by_index: dict[int, list[int]] = {}
        for k, ref in enumerate(refs):
            by_index.setdefault(ref >> OFFSET_BITS, []).append(k)
        return [(self._buckets[index], ks, [refs[k] & OFFSET_MASK for k in ks]) for index, ks in by_index.items()]

    @property
    def loaded(self) -> int:
        return len(self.wheel) + len(self._held) + len(self.ready) + len(self.inflight)

    # --- reschedule: holding a message while it moves ---------------------------------------------

    def begin_move(self, schedule_time: int, message_id: str) -> None:
        """From now on a message of this key that falls due is held, not delivered, until
        `end_move` (the due queue asks `hold_if_moving`)."""
        self.moving.setdefault((schedule_time, message_id), [])

    def hold_if_moving(self, ref: int, schedule_time: int, message_id: str) -> bool:
        """Hold a taken ref whose message is being moved; True if it was held."""
        held = self.moving.get((schedule_time, message_id))
        if held is None:
            return False
        held.append(ref)
        return True

    def end_move(self, schedule_time: int, message_id: str, moved: bool) -> None:
        """The move is durable (`moved`: what was held is settled undelivered, its cancel is in the
        log) or failed (what was held is due again, first in line)."""
        held = self.moving.pop((schedule_time, message_id), [])
        for ref in held:
            if moved:
                self.drop_cancelled(ref)
            elif ref in self.inflight:
                self.inflight.remove(ref)
                self.ready.appendleft(ref)
        if held and not moved:
            self.changed.set()
