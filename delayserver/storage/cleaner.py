"""The cleaner: which segments may be deleted (pure rules), and a small executor that deletes them.

The rules never delete what replay or replication still needs:

- message_log: a sealed segment may go only when it ends at or before the replay checkpoint offset
  and at or before every replication (sync) offset, and its last write is more than the retention
  ago. Segments go oldest first and the active one never, so the log stays one contiguous range.
- schedule_log: a bucket's segment and its dispatch_log may go only when no message in it is
  pending (each one dispatched or cancelled), the bucket ended more than the retention ago, every
  record in it was replayed from before the replay checkpoint offset (else a restart would replay
  them into a fresh segment and deliver them again), and every slave has pulled its whole
  dispatch_log (else a promoted slave would deliver them again).
"""
from __future__ import annotations

import logging
from typing import Mapping, Sequence

import attrs

from delayserver.storage.errors import CorruptSegment
from delayserver.storage.record import OFFSET, RecordType
from delayserver.storage.store import Store, bucket_stats

log = logging.getLogger("delayserver.cleaner")


@attrs.frozen
class MessageLogSegment:
    base: int
    end: int
    last_write_ms: int


def removable_message_log_segments(segments: Sequence[MessageLogSegment], *, active_base: int, replay_offset: int,
                                   sync_offsets: Sequence[int], now_ms: int, retention_ms: int) -> list[int]:
    """The bases of the segments that may be deleted: a prefix of the log, oldest first."""
    needed_from = min((replay_offset, *sync_offsets))
    bases = []
    for segment in sorted(segments, key=lambda s: s.base):
        if (segment.base == active_base or segment.end > needed_from
                or now_ms - segment.last_write_ms <= retention_ms):
            break
        bases.append(segment.base)
    return bases


@attrs.frozen
class BucketState:
    bucket: int
    pending: int
    #: The highest message_log offset a record of the segment was replayed from; None when empty.
    last_message_log_offset: int | None
    dispatch_bytes: int


def bucket_expired(bucket: int, *, segment_scale_ms: int, now_ms: int, retention_ms: int) -> bool:
    """Whether the bucket ended more than the retention ago (the cheap first test)."""
    return now_ms - (bucket + segment_scale_ms) > retention_ms


def bucket_removable(state: BucketState, *, segment_scale_ms: int, replay_offset: int,
                     dispatch_sync_sizes: Sequence[Mapping[int, int]], now_ms: int, retention_ms: int) -> bool:
    """Whether a bucket's schedule segment and dispatch_log may be deleted (see the module rules)."""
    return (
        state.pending == 0
        and bucket_expired(state.bucket, segment_scale_ms=segment_scale_ms, now_ms=now_ms, retention_ms=retention_ms)
        and (state.last_message_log_offset is None or state.last_message_log_offset < replay_offset)
        and all(sizes.get(state.bucket, 0) >= state.dispatch_bytes for sizes in dispatch_sync_sizes)
    )


@attrs.frozen
class Cleaned:
    message_log_bases: list[int]
    buckets: list[int]


def clean(store: Store, *, replay_offset: int, now_ms: int, retention_ms: int, sync_offsets: Sequence[int] = (),
          dispatch_sync_sizes: Sequence[Mapping[int, int]] = ()) -> Cleaned:
    """Delete what the rules allow; returns what was deleted.

    Synchronous, so no append can come between a decision and its deletion. A bucket's schedule
    segment is deleted before its dispatch_log: a crash between the two leaves a dispatch_log
    alone (deleted on the next pass), never messages that look undelivered. A bucket with a
    damaged segment is logged and kept for the operator. The caller checkpoints the replayer
    before its next pass when buckets were deleted, so that no checkpoint lists the size of a
    deleted segment once a new one of that bucket is written. Raises StorageError subtypes.
    """
    message_log = store.message_log
    segments = [
        MessageLogSegment(base, base + size, message_log.path(base).stat().st_mtime_ns // 1_000_000)
        for base, size in message_log.segments.items()
        if base != message_log.active_base
    ]
    bases = removable_message_log_segments(
        segments, active_base=message_log.active_base, replay_offset=replay_offset, sync_offsets=sync_offsets,
        now_ms=now_ms, retention_ms=retention_ms,
    )
    if bases:
        ends = {s.base: s.end for s in segments}
        bases = message_log.delete_before(ends[bases[-1]])
    removed = []
    scale = store.segment_scale_ms
    for bucket in sorted(set(store.schedule_log.buckets()) | set(store.dispatch_log.buckets())):
        if not bucket_expired(bucket, segment_scale_ms=scale, now_ms=now_ms, retention_ms=retention_ms):
            continue
        try:
            state = bucket_state(store, bucket)
        except CorruptSegment as e:
            log.error("not cleaning bucket %d: %s", bucket, e)
            continue
        if bucket_removable(state, segment_scale_ms=scale, replay_offset=replay_offset,
                            dispatch_sync_sizes=dispatch_sync_sizes, now_ms=now_ms, retention_ms=retention_ms):
            store.schedule_log.remove(bucket)
            store.dispatch_log.remove(bucket)
            removed.append(bucket)
    if bases or removed:
        log.info("cleaned %d message_log segments and %d buckets", len(bases), len(removed))
    return Cleaned(bases, removed)


def bucket_state(store: Store, bucket: int) -> BucketState:
    """Read what the bucket rule needs (raises CorruptSegment)."""
    last_offset = None
    for _, rtype, payload in store.schedule_log.records(bucket):
        if rtype in (RecordType.SCHEDULED, RecordType.SCHEDULED_CANCEL):
            last_offset = max(OFFSET.unpack_from(payload, 0)[0], last_offset or 0)
    if bucket in store.schedule_log.sizes:
        pending = bucket_stats(store.schedule_log, store.dispatch_log, bucket).pending
    else:
        pending = 0  # a dispatch_log left alone by a crash mid-clean: nothing is scheduled
    return BucketState(bucket, pending, last_offset, store.dispatch_log.size(bucket))
