"""The cleaner's rules, one test per rule, then the executor on a real data directory."""
from __future__ import annotations

import logging
import os

import pytest

from delayserver.storage.buckets import DEFAULT_SCALE_MS, parse_bucket_name
from delayserver.storage.cleaner import (
    BucketState, MessageLogSegment, bucket_removable, clean, removable_message_log_segments,
)
from delayserver.storage.record import (
    Cancel, Dispatch, RecordType, encode_cancel, encode_dispatch, encode_message, encode_record, encode_scheduled,
)
from delayserver.storage.store import Store
from tests.damage import flip_bit, message, message_record

HOUR = 3_600_000
RETENTION = 24 * HOUR
NOW = parse_bucket_name("202611230000") + 10 * 24 * HOUR
OLD = NOW - RETENTION - 1
SEGMENTS = [MessageLogSegment(0, 100, OLD), MessageLogSegment(100, 200, OLD), MessageLogSegment(200, 300, OLD),
            MessageLogSegment(300, 350, OLD)]


def removable(segments=SEGMENTS, *, active_base=300, replay_offset=350, sync_offsets=(), now_ms=NOW):
    return removable_message_log_segments(segments, active_base=active_base, replay_offset=replay_offset,
                                          sync_offsets=sync_offsets, now_ms=now_ms, retention_ms=RETENTION)


# --- message_log rules ------------------------------------------------------------------------


def test_message_log_segment_goes_only_when_wholly_before_the_replay_offset():
    assert removable(replay_offset=250) == [0, 100]
    assert removable(replay_offset=200) == [0, 100], "a segment ending exactly at the offset is replayed"
    assert removable(replay_offset=199) == [0]
    assert removable(replay_offset=0) == []


def test_message_log_segment_goes_only_when_before_every_sync_offset():
    assert removable(replay_offset=350, sync_offsets=(300, 150)) == [0]
    assert removable(replay_offset=350, sync_offsets=(300,)) == [0, 100, 200]
    assert removable(replay_offset=350, sync_offsets=(0,)) == []


def test_message_log_segment_goes_only_when_older_than_the_retention():
    young = [MessageLogSegment(0, 100, OLD), MessageLogSegment(100, 200, NOW - RETENTION), *SEGMENTS[2:]]
    assert removable(young) == [0], "deletion stops at the first young segment: the log stays contiguous"
    assert removable(now_ms=OLD + RETENTION) == []


def test_the_active_message_log_segment_is_never_removable():
    assert removable(active_base=300, replay_offset=350) == [0, 100, 200]
    assert removable(SEGMENTS[:1], active_base=0, replay_offset=10**9) == []


# --- bucket rules -----------------------------------------------------------------------------

BUCKET = parse_bucket_name("202611221600")
BUCKET_END = BUCKET + DEFAULT_SCALE_MS


def removable_bucket(*, pending=0, last_offset=500, dispatch_bytes=64, replay_offset=1000,
                     dispatch_sync_sizes=(), now_ms=BUCKET_END + RETENTION + 1):
    state = BucketState(BUCKET, pending, last_offset, dispatch_bytes)
    return bucket_removable(state, segment_scale_ms=DEFAULT_SCALE_MS, replay_offset=replay_offset,
                            dispatch_sync_sizes=dispatch_sync_sizes, now_ms=now_ms, retention_ms=RETENTION)


def test_bucket_goes_when_done_replayed_and_past_retention():
    assert removable_bucket()
    assert removable_bucket(last_offset=None), "an empty segment holds nothing replay needs"


def test_bucket_with_a_pending_message_is_kept():
    assert not removable_bucket(pending=1)
    assert not removable_bucket(pending=-1), "counts that do not add up are never a reason to delete"


def test_bucket_is_kept_until_it_ended_more_than_the_retention_ago():
    assert not removable_bucket(now_ms=BUCKET_END + RETENTION)
    assert not removable_bucket(now_ms=BUCKET + RETENTION + 1), "measured from the bucket's end, not its start"


def test_bucket_holding_records_past_the_replay_checkpoint_is_kept():
    assert not removable_bucket(last_offset=1000, replay_offset=1000)
    assert removable_bucket(last_offset=999, replay_offset=1000)


def test_bucket_is_kept_until_every_slave_pulled_its_dispatch_log():
    assert not removable_bucket(dispatch_sync_sizes=({BUCKET: 64}, {BUCKET: 63}))
    assert not removable_bucket(dispatch_sync_sizes=({},))
    assert removable_bucket(dispatch_sync_sizes=({BUCKET: 64}, {BUCKET: 64}))


# --- the executor -----------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path):
    store = Store.open(tmp_path, message_log_segment_bytes=300)
    yield store
    store.close()


def age(path, ms: int) -> None:
    os.utime(path, ns=(ms * 1_000_000, ms * 1_000_000))


def test_clean_deletes_replayed_old_message_log_segments_and_keeps_the_rest(store):
    for i in range(20):
        store.message_log.append(message_record(i))
    bases = store.message_log.segments.keys()
    for base in bases:
        age(store.message_log.path(base), OLD)
    replay_offset = bases[5] + 1
    cleaned = clean(store, replay_offset=replay_offset, sync_offsets=(bases[3],), now_ms=NOW, retention_ms=RETENTION)
    assert cleaned.message_log_bases == bases[:3]
    assert store.message_log.start_offset == bases[3]
    assert sorted(p.name for p in store.message_log.directory.iterdir())[0] == f"{bases[3]:020d}.log"
    assert clean(store, replay_offset=replay_offset, now_ms=NOW, retention_ms=RETENTION).message_log_bases == bases[3:5]
    assert sum(1 for _ in store.message_log.iter_from(store.message_log.start_offset)) > 0


def test_clean_keeps_message_log_segments_younger_than_the_retention(store):
    for i in range(10):
        store.message_log.append(message_record(i))
    written = store.message_log.path(0).stat().st_mtime_ns // 1_000_000
    cleaned = clean(store, replay_offset=store.message_log.end_offset, now_ms=written + RETENTION, retention_ms=RETENTION)
    assert cleaned.message_log_bases == []
    cleaned = clean(store, replay_offset=store.message_log.end_offset, now_ms=written + RETENTION + 1000,
                    retention_ms=RETENTION)
    assert cleaned.message_log_bases[0] == 0


def schedule(store, bucket, i, *, message_log_offset=0, dispatch=False):
    payload = encode_message(message(i, schedule_time=bucket + i))
    at = store.schedule_log.append(bucket, encode_record(RecordType.SCHEDULED, encode_scheduled(message_log_offset, payload)))
    if dispatch:
        record = encode_record(RecordType.DISPATCH, encode_dispatch(Dispatch(at, bucket + i, "g")))
        store.dispatch_log.append(bucket, record)


def cancel(store, bucket, i, *, message_log_offset=0):
    payload = encode_cancel(Cancel(message(i).message_id, bucket + i))
    store.schedule_log.append(bucket, encode_record(RecordType.SCHEDULED_CANCEL, encode_scheduled(message_log_offset, payload)))


def test_clean_deletes_only_finished_old_replayed_buckets(store):
    done, pending, recent, unreplayed = (BUCKET + k * DEFAULT_SCALE_MS for k in range(4))
    for bucket in (done, pending, unreplayed):
        schedule(store, bucket, 1, dispatch=True)
        schedule(store, bucket, 2, message_log_offset=10)
        cancel(store, bucket, 2, message_log_offset=20)
    schedule(store, pending, 3, message_log_offset=30)  # never dispatched, never cancelled
    cancel(store, unreplayed, 9, message_log_offset=5000)  # replayed after the checkpoint
    schedule(store, recent, 1, dispatch=True)
    now = recent + DEFAULT_SCALE_MS + RETENTION  # the recent bucket ended exactly the retention ago
    cleaned = clean(store, replay_offset=1000, now_ms=now, retention_ms=RETENTION)
    assert cleaned.buckets == [done]
    assert not store.schedule_log.path(done).exists() and not store.dispatch_log.path(done).exists()
    assert set(store.schedule_log.buckets()) == {pending, recent, unreplayed}
    assert set(store.dispatch_log.buckets()) == {pending, recent, unreplayed}


def test_clean_deletes_a_dispatch_log_left_alone_by_a_crash(store):
    schedule(store, BUCKET, 1, dispatch=True)
    store.schedule_log.remove(BUCKET)  # the crash came between the two deletions
    cleaned = clean(store, replay_offset=1000, now_ms=BUCKET_END + RETENTION + 1, retention_ms=RETENTION)
    assert cleaned.buckets == [BUCKET] and store.dispatch_log.buckets() == []


def test_clean_keeps_a_damaged_bucket_and_says_so(store, caplog):
    schedule(store, BUCKET, 1, dispatch=True)
    schedule(store, BUCKET, 2, dispatch=True)
    flip_bit(store.schedule_log.path(BUCKET), 20)
    with caplog.at_level(logging.ERROR, logger="delayserver.cleaner"):
        cleaned = clean(store, replay_offset=1000, now_ms=BUCKET_END + RETENTION + 1, retention_ms=RETENTION)
    assert cleaned.buckets == [] and store.schedule_log.path(BUCKET).exists()
    assert any("not cleaning bucket" in r.getMessage() for r in caplog.records)


def test_clean_keeps_a_bucket_a_slave_has_not_pulled(store):
    schedule(store, BUCKET, 1, dispatch=True)
    size = store.dispatch_log.size(BUCKET)
    now = BUCKET_END + RETENTION + 1
    assert clean(store, replay_offset=1000, now_ms=now, retention_ms=RETENTION,
                 dispatch_sync_sizes=({BUCKET: size - 1},)).buckets == []
    assert clean(store, replay_offset=1000, now_ms=now, retention_ms=RETENTION,
                 dispatch_sync_sizes=({BUCKET: size},)).buckets == [BUCKET]
