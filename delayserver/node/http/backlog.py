"""The backlog: pending messages per bucket, and when they fall due, for the console and metrics.

A worker thread reads the node's schedule_log and dispatch_log segments through read-only logs
(as `delayctl buckets` does), and only those buckets whose segment sizes changed since the last
pass, so a refresh of an idle node reads nothing. Per bucket it keeps the counts and the sorted
schedule times of its pending messages (8 bytes each), which answer "due in the next minute /
hour" with two bisects. Each pass also adds a sample to a bounded history (pending per bucket over
time) for the console's chart.
"""
from __future__ import annotations

import bisect
import collections
import logging
from array import array
from pathlib import Path

import attrs
import trio

from delayserver.sender.parked import iter_parked
from delayserver.storage.bucket_log import BucketLog
from delayserver.storage.buckets import bucket_name, bucket_start
from delayserver.storage.errors import CorruptSegment, StorageError
from delayserver.storage.record import DISPATCH_HEAD, SCHEDULED_CANCEL_HEAD, RecordType, scheduled_key

log = logging.getLogger("delayserver.backlog")

HISTORY_SAMPLES = 360


@attrs.frozen
class BucketBacklog:
    bucket: int
    sizes: tuple[int, int, int]  # schedule_log and dispatch_log segment, and parked.log, sizes counted at
    scheduled: int
    dispatched: int
    cancelled: int
    pending_times: array  # sorted schedule times of the pending messages
    error: str = ""
    parked: int = 0

    @property
    def pending(self) -> int:
        return len(self.pending_times)


def count_bucket(schedule_log: BucketLog, dispatch_log: BucketLog, bucket: int, parked: set[int] = frozenset(),
                 parked_size: int = 0) -> BucketBacklog:
    """Count one bucket from its segments; a damaged one comes back with `error` set. `parked`:
    the bucket's schedule_log offsets that were parked (settled, like the dispatched ones)."""
    sizes = (schedule_log.size(bucket), dispatch_log.size(bucket), parked_size)
    times: dict[int, int] = {}
    by_key: dict[tuple[int, str], list[int]] = {}
    cancelled: set[int] = set()
    dispatched: set[int] = set()
    try:
        if bucket in schedule_log.sizes:
            for offset, rtype, payload in schedule_log.records(bucket, 0, sizes[0]):
                if rtype == RecordType.SCHEDULED:
                    _, sched, _, mid = scheduled_key(payload, 0)
                    times[offset] = sched
                    by_key.setdefault((sched, mid), []).append(offset)
                elif rtype == RecordType.SCHEDULED_CANCEL:
                    _, _, sched, _, idlen = SCHEDULED_CANCEL_HEAD.unpack_from(payload, 0)
                    mid = bytes(payload[SCHEDULED_CANCEL_HEAD.size:SCHEDULED_CANCEL_HEAD.size + idlen]).decode()
                    cancelled.update(by_key.get((sched, mid), ()))
        if bucket in dispatch_log.sizes:
            for _, rtype, payload in dispatch_log.records(bucket, 0, sizes[1]):
                if rtype == RecordType.DISPATCH:
                    dispatched.add(DISPATCH_HEAD.unpack_from(payload, 0)[0])
        settled = dispatched | parked
    except (CorruptSegment, StorageError, UnicodeDecodeError) as e:
        return BucketBacklog(bucket, sizes, 0, 0, 0, array("q"), error=str(e))
    pending = array("q", sorted(t for off, t in times.items() if off not in settled and off not in cancelled))
    return BucketBacklog(bucket, sizes, len(times), len(dispatched & times.keys()),
                         len(cancelled - dispatched), pending, parked=len(parked & times.keys()))


class Backlog:
    def __init__(self, data_dir: Path, clock, scale_ms: int, *, interval_s: float = 5.0):
        self.data_dir = Path(data_dir)
        self.scale_ms = scale_ms
        self.clock = clock
        self.interval_s = interval_s
        self.buckets: dict[int, BucketBacklog] = {}
        self.history: collections.deque[tuple[int, dict[str, int]]] = collections.deque(maxlen=HISTORY_SAMPLES)
        self._lock = trio.Lock()
        self._refreshed_at = float("-inf")  # trio time
        self._pass_s = 0.0  # how long the last pass took

    def _scan(self, previous: dict[int, BucketBacklog]) -> dict[int, BucketBacklog]:
        schedule_log = BucketLog.open(self.data_dir / "schedule_log", readonly=True)
        dispatch_log = BucketLog.open(self.data_dir / "dispatch_log", readonly=True)
        parked_path = self.data_dir / "parked" / "parked.log"
        parked_size = parked_path.stat().st_size if parked_path.exists() else 0
        parked_by_bucket: dict[int, set[int]] | None = None
        try:
            out = {}
            for bucket in sorted(set(schedule_log.buckets()) | set(dispatch_log.buckets())):
                old = previous.get(bucket)
                if old is not None and old.sizes == (schedule_log.size(bucket), dispatch_log.size(bucket), parked_size):
                    out[bucket] = old
                    continue
                if parked_by_bucket is None:
                    parked_by_bucket = self._parked(schedule_log.buckets())
                try:
                    out[bucket] = count_bucket(schedule_log, dispatch_log, bucket,
                                               parked_by_bucket.get(bucket, set()), parked_size)
                except FileNotFoundError:
                    continue  # the cleaner deleted it since the listing: nothing of it is pending
            return out
        finally:
            schedule_log.close()
            dispatch_log.close()

    def _parked(self, buckets) -> dict[int, set[int]]:
        """Per bucket, the schedule_log offsets of parked messages (one read of parked.log)."""
        out: dict[int, set[int]] = {}
        try:
            for _, p in iter_parked(self.data_dir / "parked"):
                out.setdefault(bucket_start(p.message.schedule_time, self.scale_ms), set()).add(p.schedule_offset)
        except StorageError as e:
            log.warning("cannot read parked.log: %s", e)
        return out

    async def refresh(self) -> None:
        """Count the buckets that changed, and add a history sample."""
        async with self._lock:
            started = trio.current_time()
            self.buckets = await trio.to_thread.run_sync(self._scan, self.buckets)
            self._pass_s = trio.current_time() - started
            self.history.append((self.clock.now_ms(),
                                 {bucket_name(b.bucket): b.pending for b in self.buckets.values() if b.pending}))
            self._refreshed_at = trio.current_time()

    async def fresh(self, min_age_s: float = 0.2) -> None:
        """Refresh unless the last pass is younger than `min_age_s`, or than ten times what it took:
        pages asking often cost an idle node little, and a node with big segments at most a tenth
        of one worker thread."""
        if trio.current_time() - self._refreshed_at > max(min_age_s, 10 * self._pass_s):
            try:
                await self.refresh()
            except OSError as e:
                log.warning("backlog refresh failed, answering from the last pass: %s", e)

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await self.refresh()
        task_status.started()
        while True:
            await trio.sleep(max(self.interval_s, 10 * self._pass_s))
            try:
                await self.refresh()
            except OSError as e:
                log.warning("backlog refresh failed: %s", e)

    def rows(self) -> list[dict]:
        return [{"bucket": bucket_name(b.bucket), "start": b.bucket, "scheduled": b.scheduled,
                 "dispatched": b.dispatched, "cancelled": b.cancelled, "parked": b.parked, "pending": b.pending,
                 **({"error": b.error} if b.error else {})}
                for b in self.buckets.values()]

    def total_pending(self) -> int:
        return sum(b.pending for b in self.buckets.values())

    def due_before(self, limit_ms: int) -> int:
        """Pending messages due at or before `limit_ms` (overdue ones included)."""
        return sum(bisect.bisect_right(b.pending_times, limit_ms) for b in self.buckets.values())
