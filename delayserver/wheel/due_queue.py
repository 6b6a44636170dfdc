"""The due queue: the one port between the wheel and the sender.

The sender sees due messages only through it: `take` hands out messages that fell due (read from
schedule_log, cancelled ones dropped), `settle` records one as done (delivered or parked), `drop`
forgets one without delivering it, `retry_later` holds one for a while on a monotonic clock, and
`generation` tells whether what the sender holds is still owed (the tick manager was reset by a
change of role: the reload owns it now). `falls_due_within` tells whether a batch waiting to fill
has anything to wait for. Waiting is by wake-ups, never by polling: `ready` is set
when messages are due, `retry_wakeup` when a retry was scheduled.

A due record that cannot be read (CorruptSegment) is handed to `on_corrupt(bucket, error)` (the
node quarantines its bucket, storage/quarantine.py), settled in memory and skipped: the other
messages keep going out. Without `on_corrupt` the error is raised.
"""
from __future__ import annotations

import heapq
import itertools
import logging

import attrs
import trio

from delayserver.storage.errors import CorruptSegment
from delayserver.storage.record import Message
from delayserver.storage.threads import run_disk
from delayserver.wakeup import Wakeup

log = logging.getLogger("delayserver.wheel")

@attrs.define(eq=False)
class DueReference:
    """One due message the sender holds; `message` is None while it waits in a backlog (it is read
    again from schedule_log when it leaves it, so that a long backlog costs no message bodies).

    `Due` is the compiled class of the same fields, defaults and identity (delayserver/native/
    wheel.pyx) where the install built it, made in C per message taken (`dues_of`); this one
    otherwise, and the reference the compiled one must equal."""

    ref: int
    bucket: int
    schedule_offset: int
    message: Message | None
    generation: int = 0
    attempt: int = 1
    tried: tuple[str, ...] = ()  # the broker groups it failed at (no set made per due message)
    group: object = None  # the broker group whose in-flight budget it counts against
    suspect: bool = False  # in a batch that failed whole: one more whole failure splits it
    message_log_offset: int = -1  # where its record was replayed from (its dispatch record names it)


try:
    from delayserver.native.wheel import Due, dues_of as _native_dues_of
except ImportError:  # not built: the reference
    Due, _native_dues_of = DueReference, None


class DueQueue:
    def __init__(self, ticks, on_corrupt=None):
        self._ticks = ticks
        self._on_corrupt = on_corrupt
        self.ready = Wakeup()
        self.retry_wakeup = Wakeup()
        self._retries: list = []
        self._seq = itertools.count()
        self.cancelled = 0
        self.disk_reads = 0  # due records read in a worker thread: not in the page cache
        # What `take_now` took and could not read from memory: (refs, reads, generation), for `take`.
        self._unread: tuple[list[int], list, int] | None = None
        self._reading = False  # a `take` is reading records from disk

    @property
    def generation(self) -> int:
        return self._ticks.generation

    @property
    def waiting(self) -> int:
        """Due messages not taken yet (those `take_now` left unread among them)."""
        if self._unread is not None:
            return len(self._ticks.ready) + len(self._unread[0])
        return len(self._ticks.ready)

    def falls_due_within(self, now: int, ms: int) -> bool:
        """Whether a message is due and not taken yet, or the wheel holds one due by `now + ms`
        (wall ms): what a batch waiting to fill would wait for."""
        return bool(self.waiting) or self._ticks.wheel.holds_due_by(now + ms)

    @property
    def taken(self) -> int:
        """Messages taken and not settled or dropped yet (in flight, backlogged or retrying)."""
        return len(self._ticks.inflight)

    @property
    def retrying(self) -> int:
        return len(self._retries)

    async def take(self, limit: int) -> list[Due]:
        """Up to `limit` due messages, read from schedule_log; cancelled ones are dropped here.

        The records in the page cache are read here, on the event loop; the others (a segment
        evicted since it was written) in a worker thread, so that the loop never waits for the
        disk: a read that waits would hold every delivery, acknowledgement and answer.
        A record that cannot be read goes to `on_corrupt` and is skipped (raised without it).
        What `take_now` left unread is finished first."""
        if self._unread is None:
            dues = self.take_now(limit)
            if dues is not None or self._unread is None:
                return dues or []  # (nothing, if another take is reading from disk)
        refs, reads, generation = self._unread
        self._unread = None
        if generation != self._ticks.generation:
            return []  # reset since (a change of role): the reload owns them now
        self._reading = True
        try:
            reads = await self._read_the_rest(refs, reads, generation)
        finally:
            self._reading = False
        if reads is None:
            return []  # reset meanwhile (a change of role): the reload owns them now
        return self._dues(refs, reads, generation)

    def take_now(self, limit: int) -> list[Due] | None:
        """`take` without waiting, for a caller in the middle of its own task step (the tick task,
        as messages fall due): the dues when every record taken is in memory (the read-ahead's or
        the page cache's, most batches); else None, the refs taken and what was read of them left
        for the next `take`, which reads the rest in a worker thread (`waiting` counts them).
        None, taking nothing, while a `take` reads from disk or has that to do: the messages behind
        those go after them."""
        if self._unread is not None or self._reading:
            return None
        ticks = self._ticks
        generation = ticks.generation
        refs = ticks.take(limit)
        reads = ticks.read_messages(refs, cached_only=True)
        if set(map(type, reads)) - {tuple}:  # not all read from memory: a miss (None) or damage
            self._unread = (refs, reads, generation)
            return None
        return self._dues(refs, reads, generation)

    def _dues(self, refs: list[int], reads: list, generation: int) -> list[Due]:
        """The dues of `refs`, whose messages are `reads` (None for one skipped)."""
        ticks = self._ticks
        # Cancels and moves asked about only in buckets with cancels and while a move is under way
        # (most batches: neither).
        cancels = ticks.cancels
        if ticks.moving or (cancels and any(read[0] in cancels for read in reads if read is not None)):
            reads = self._screen(refs, reads)
        if _native_dues_of is not None:
            return _native_dues_of(refs, reads, generation)
        return [Due(ref, read[0], read[1], read[3], generation, message_log_offset=read[2])
                for ref, read in zip(refs, reads) if read is not None]

    def _screen(self, refs: list[int], reads: list) -> list:
        """`reads` with None for each message found cancelled (dropped) or being moved (held)."""
        ticks = self._ticks
        out = []
        for ref, read in zip(refs, reads):
            if read is not None:
                bucket, offset, _, message = read
                if ticks.is_cancelled(bucket, offset, message.schedule_time, message.message_id):
                    ticks.drop_cancelled(ref)
                    self.cancelled += 1
                    read = None
                elif ticks.hold_if_moving(ref, message.schedule_time, message.message_id):
                    read = None
            out.append(read)
        return out

    async def _read_the_rest(self, refs: list[int], reads: list, generation: int) -> list | None:
        """`reads` completed: what the page cache did not hold (None) read in a worker thread,
        and a damaged record (CorruptSegment) handed to `on_corrupt`, None in its place; None if
        the tick manager was reset meanwhile."""
        ticks = self._ticks
        reads = list(reads)
        misses = []
        for k, (ref, read) in enumerate(zip(refs, reads)):
            if read is None:
                misses.append(k)
            elif isinstance(read, CorruptSegment):
                reads[k] = self._corrupt(ref, read)
        if not misses:
            return reads
        self.disk_reads += len(misses)
        got = await run_disk(ticks.disk_reader([refs[k] for k in misses]))
        if ticks.generation != generation:
            return None
        for k in misses:
            read = got.get(refs[k])
            if isinstance(read, CorruptSegment):
                read = self._corrupt(refs[k], read)
            elif read is None:  # its segment could not be opened there: read it here
                read = self._read(refs[k])
            reads[k] = read
        return reads

    def reread(self, due: Due) -> Message | None:
        """The message of a backlogged `due`, read again; None when its record cannot be read
        (handed to `on_corrupt` and settled: the caller lets it go)."""
        read = self._read(due.ref) if self.is_current(due) else None
        due.message = read[3] if read is not None else None
        return due.message

    def _read(self, ref: int):
        try:
            return self._ticks.read_message(ref)
        except CorruptSegment as e:
            return self._corrupt(ref, e)

    def _corrupt(self, ref: int, error: CorruptSegment) -> None:
        if self._on_corrupt is None:
            log.error("cannot read a due message: it stays undelivered until repaired")
            raise error
        # Quarantine its bucket, settle it in memory and go on.
        self._on_corrupt(self._ticks.split(ref)[0], error)
        self._ticks.on_dispatched(ref)
        return None

    def is_current(self, due: Due) -> bool:
        return due.generation == self._ticks.generation

    def settle(self, due: Due) -> None:
        """Delivered (its dispatch_log record is durable) or parked: never owed again."""
        if self.is_current(due):
            self._ticks.on_dispatched(due.ref)

    def settle_refs(self, refs: list[int]) -> None:
        """`settle` of the dues of these refs, all of the current generation (the sender picks
        them out of a batch in its one pass over it)."""
        self._ticks.on_dispatched_many(refs)

    def drop(self, due: Due) -> None:
        """Not delivered and not owed any more (found cancelled)."""
        if self.is_current(due):
            self._ticks.drop_cancelled(due.ref)

    # --- retry later, on a monotonic clock ----------------------------------------------------

    def retry_later(self, item, delay_ms: int) -> None:
        """Hold `item` (a Due, or a batch of them) for `delay_ms` of monotonic time."""
        heapq.heappush(self._retries, (trio.current_time() + delay_ms / 1000, next(self._seq), item))
        self.retry_wakeup.set()

    def due_retries(self) -> list:
        """The held items whose time has come, in the order they fell due."""
        now = trio.current_time()
        out = []
        while self._retries and self._retries[0][0] <= now:
            out.append(heapq.heappop(self._retries)[2])
        return out

    def next_retry_in(self) -> float | None:
        """Seconds until the next held item is due, or None when none is held."""
        if not self._retries:
            return None
        return max(0.0, self._retries[0][0] - trio.current_time())
