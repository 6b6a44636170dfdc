"""The scheduling pipeline driven by hand: message_log -> replayer -> tick manager -> a fake broker.

Tests run it synchronously with time passed in, as serve_ticks and the sender would, and crash it:
`crash()` drops every in-memory object and keeps the files, as a kill -9 does (the page cache
survives it). Dispatch records are written with the storage code exactly as the sender writes them.
"""
from __future__ import annotations

import attrs

from delayserver.replayer import Replayer
from delayserver.storage.record import (
    Cancel, Dispatch, Message, RecordType, encode_cancel, encode_dispatch, encode_message, encode_record,
)
from delayserver.storage.store import Store
from delayserver.wheel.tick_manager import TickManager

#: Not aligned to a bucket or a tick, so that no test passes by a lucky boundary.
START_MS = 1_763_800_012_345
SCALE_MS = 60_000
GROUP = "brokers-a"


@attrs.frozen
class Fired:
    """A message the tick manager handed out at `at` (epoch ms), read back from schedule_log."""

    ref: int
    bucket: int
    offset: int
    message: Message
    at: int


class Node:
    """One life of a node: Store.open, a new TickManager, Replayer.open, as the server starts."""

    def __init__(self, root, now: int, *, scale_ms: int = SCALE_MS, tick_ms: int = 10, slots: int = 64,
                 load_ahead_ms: int | None = None, segment_bytes: int = 1 << 20):
        self.now = now
        self.store = Store.open(root, segment_scale_ms=scale_ms, message_log_segment_bytes=segment_bytes)
        self.ticks = TickManager(self.store, now_ms=now, tick_ms=tick_ms, slots=slots,
                                 load_ahead_ms=load_ahead_ms)
        self.replayer = Replayer.open(self.store, self.ticks)
        self.next_sequence = self.replayer.max_sequence + 1

    # --- the receiver's side ----------------------------------------------------------------

    def _append(self, records: list[bytes]) -> int:
        return self.store.message_log.append(b"".join(records))

    def _sequence(self) -> int:
        seq, self.next_sequence = self.next_sequence, self.next_sequence + 1
        return seq

    def send(self, messages: list[tuple[str, int]], body: bytes = b"b") -> int:
        """Append MESSAGE records for (id, schedule_time) pairs as one durable batch."""
        return self._append([
            encode_record(RecordType.MESSAGE, encode_message(
                Message(mid, "orders.created", body, sched, {}, self.now, self._sequence())))
            for mid, sched in messages
        ])

    def cancel(self, message_id: str, schedule_time: int) -> int:
        """Append a CANCEL record; returns its message_log offset."""
        return self._append([encode_record(RecordType.CANCEL, encode_cancel(
            Cancel(message_id, schedule_time, self.now, self._sequence())))])

    # --- the replayer, the loader and the tick task -----------------------------------------

    def replay(self, max_bytes: int = 1 << 20) -> int:
        return self.replayer.replay_once(self.now, self.store.message_log.end_offset, max_bytes)

    def replay_all(self) -> None:
        while self.replay():
            pass

    def load_all(self, max_bytes: int | None = None) -> None:
        kw = {} if max_bytes is None else {"max_bytes": max_bytes}
        while self.ticks.load_step(self.now, **kw):
            pass

    def tick(self) -> None:
        """What one wake-up of serve_ticks does."""
        self.ticks.advance(self.now)
        self.load_all()
        self.ticks.advance(self.now)

    def next_event(self) -> int | None:
        """When something next becomes due or loadable, skipping buckets with no segment (the
        server wakes at least every second; a test jumps straight there)."""
        times = []
        due = self.ticks.wheel.next_due()
        if due is not None:
            times.append(due)
        sizes = self.store.schedule_log.sizes
        loading = self.ticks.loading_bucket
        nxt = sizes.first() if loading is None else sizes.higher(loading)
        if nxt is not None:
            times.append(max(self.now + 1, nxt - self.ticks.load_ahead_ms))
        return min(times) if times else None

    # --- the sender's side ------------------------------------------------------------------

    def take(self, limit: int = 1 << 30) -> list[Fired]:
        """Take due messages as the sender does: read each, drop the cancelled ones."""
        out = []
        for ref in self.ticks.take(limit):
            bucket, offset, _, message = self.ticks.read_message(ref)
            if self.ticks.is_cancelled(bucket, offset, message.schedule_time, message.message_id):
                self.ticks.drop_cancelled(ref)
            else:
                out.append(Fired(ref, bucket, offset, message, self.now))
        return out

    def dispatch(self, fired: list[Fired]) -> None:
        """Record deliveries in dispatch_log, then settle them, as the sender does (it fsyncs in
        between; a test crash keeps the page cache, so the fsync is left out to keep tests fast)."""
        dispatch_log = self.store.dispatch_log
        for f in fired:
            dispatch_log.append(f.bucket, encode_record(
                RecordType.DISPATCH, encode_dispatch(Dispatch(f.offset, self.now, GROUP))))
        for f in fired:
            self.ticks.on_dispatched(f.ref)

    def crash(self) -> None:
        """Drop the in-memory state; the files stay as they are."""
        self.store.close()


def run_until_idle(node: Node, *, deliver=None, horizon: int | None = None) -> list[Fired]:
    """Jump from event to event, firing and dispatching everything, until nothing is left in
    memory or on the way (or `horizon` is passed). `deliver(fired)` sees each batch first."""
    out = []
    while True:
        node.tick()
        fired = node.take()
        if fired:
            if deliver is not None:
                deliver(fired)
            node.dispatch(fired)
            out += fired
        nxt = node.next_event()
        if nxt is None or (horizon is not None and nxt > horizon):
            return out
        node.now = max(node.now, nxt)
