"""schedule_log and dispatch_log: one segment per bucket, named by its UTC start; bucket counts."""
from __future__ import annotations

import logging
import threading

import pytest

from delayserver.storage.bucket_log import BucketLog
from delayserver.storage.buckets import (
    DEFAULT_SCALE_MS, MINUTE_MS, bucket_name, bucket_start, check_scale, parse_bucket_name,
)
from delayserver.storage.errors import CorruptSegment, StorageError
from delayserver.storage.record import (
    Cancel, Dispatch, RecordType, decode_scheduled, encode_cancel, encode_dispatch, encode_record, encode_scheduled,
)
from delayserver.storage.store import Store, bucket_stats
from tests.damage import flip_bit, message, record_offsets, scheduled_record, truncate, zero_fill

B0 = parse_bucket_name("202611221600")
B1 = B0 + DEFAULT_SCALE_MS


def test_bucket_names_are_utc_and_round_trip():
    assert bucket_name(B0) == "202611221600"
    assert bucket_start(B0 + 59 * MINUTE_MS + 59_999, DEFAULT_SCALE_MS) == B0
    assert bucket_name(bucket_start(B0 + 61 * MINUTE_MS, 5 * MINUTE_MS)) == "202611221700"
    assert bucket_name(0) == "197001010000"
    for name in ("202603290100", "202610250200", "209912312359"):  # daylight-saving nights in Europe
        assert bucket_name(parse_bucket_name(name)) == name
    for bad in ("2026112216", "20261122160a", "202613011200", "x" * 12):
        with pytest.raises(ValueError):
            parse_bucket_name(bad)


@pytest.mark.parametrize("scale", [0, 30_000, 61 * MINUTE_MS, MINUTE_MS + 1])
def test_segment_scale_must_be_whole_minutes_up_to_an_hour(scale):
    with pytest.raises(ValueError):
        check_scale(scale)


def test_appends_to_many_buckets_read_back_and_survive_reopen(tmp_path):
    log = BucketLog.open(tmp_path, max_open=2)  # fewer descriptors than buckets: the LRU reopens
    offsets = {}
    for i in range(20):
        bucket = B0 + (i % 5) * DEFAULT_SCALE_MS
        offsets[i] = (bucket, log.append(bucket, scheduled_record(i, message_log_offset=i)))
    log.sync()
    log.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"20261122{h}00.log" for h in range(16, 21)]
    log = BucketLog.open(tmp_path, max_open=2)
    for i, (bucket, offset) in offsets.items():
        [(got, rtype, payload)] = [r for r in log.records(bucket) if r[0] == offset]
        assert rtype == RecordType.SCHEDULED and decode_scheduled(payload) == (i, message(i))
    log.close()


def test_torn_tail_of_a_bucket_segment_is_truncated_at_every_byte(tmp_path, caplog):
    log = BucketLog.open(tmp_path)
    for i in range(3):
        log.append(B0, scheduled_record(i))
    log.close()
    path = tmp_path / "202611221600.log"
    offsets = record_offsets(path)
    original = path.read_bytes()
    for cut in range(offsets[-2] + 1, offsets[-1]):
        path.write_bytes(original[:cut])
        caplog.clear()
        log = BucketLog.open(tmp_path)
        with caplog.at_level(logging.WARNING, logger="delayserver.storage"):
            result = log.recover_tail(B0)
        assert (result.valid_end, result.torn_bytes) == (offsets[-2], cut - offsets[-2])
        assert log.size(B0) == offsets[-2] == path.stat().st_size
        assert [o for o, *_ in log.records(B0)] == offsets[:-2]
        assert any(str(path) in r.getMessage() and f"offset {offsets[-2]}" in r.getMessage() for r in caplog.records)
        log.close()


def test_damage_before_the_last_record_of_a_bucket_segment_is_corruption(tmp_path):
    log = BucketLog.open(tmp_path)
    for i in range(3):
        log.append(B0, scheduled_record(i))
    log.close()
    path = tmp_path / "202611221600.log"
    offsets = record_offsets(path)
    flip_bit(path, offsets[1] + 30)
    log = BucketLog.open(tmp_path)
    with pytest.raises(CorruptSegment) as info:
        log.recover_tail(B0)
    assert (info.value.path, info.value.offset) == (path, offsets[1])
    assert path.stat().st_size == offsets[-1], "corruption is never truncated away"
    log.close()


def test_read_only_bucket_log_hides_a_torn_tail_and_writes_nothing(tmp_path):
    assert BucketLog.open(tmp_path / "missing", readonly=True).buckets() == []
    assert not (tmp_path / "missing").exists()
    log = BucketLog.open(tmp_path)
    log.append(B0, scheduled_record(0) + scheduled_record(1))
    log.close()
    path = tmp_path / "202611221600.log"
    offsets = record_offsets(path)
    zero_fill(path, offsets[-1], 100)
    log = BucketLog.open(tmp_path, readonly=True)
    assert log.recover_tail(B0).torn_bytes == 100
    assert [o for o, *_ in log.records(B0)] == offsets[:-1]
    assert path.stat().st_size == offsets[-1] + 100, "the torn tail is left for the node"
    for write in (lambda: log.append(B0, scheduled_record(2)), lambda: log.truncate(B0, 0), lambda: log.remove(B0)):
        with pytest.raises(StorageError):
            write()
    assert path.stat().st_size == offsets[-1] + 100
    log.close()


def test_truncate_and_remove(tmp_path):
    log = BucketLog.open(tmp_path)
    first = scheduled_record(0)
    log.append(B0, first + scheduled_record(1))
    log.truncate(B0, len(first))
    assert [o for o, *_ in log.records(B0)] == [0]
    log.remove(B0)
    assert log.buckets() == [] and not list(tmp_path.iterdir())
    log.close()


def test_a_segment_is_truncated_only_while_no_reader_copies_from_a_mapping_of_it(tmp_path):
    # The read-ahead's worker copies records from mapped segments holding `truncation`: a mapped
    # page past the end of its file is a SIGBUS, so a truncation waits for the copy to end.
    log = BucketLog.open(tmp_path)
    first = scheduled_record(0)
    log.append(B0, first + scheduled_record(1))
    whole = log.size(B0)
    with log.truncation:  # a copy under way
        cutting = threading.Thread(target=log.truncate, args=(B0, len(first)))
        cutting.start()
        cutting.join(0.2)
        assert cutting.is_alive() and log.path(B0).stat().st_size == whole
    cutting.join(10)
    assert not cutting.is_alive() and log.path(B0).stat().st_size == log.size(B0) == len(first)
    log.close()


def scheduled_cancel(mid: str, schedule_time: int) -> bytes:
    return encode_record(RecordType.SCHEDULED_CANCEL, encode_scheduled(0, encode_cancel(Cancel(mid, schedule_time))))


def dispatch(offset: int) -> bytes:
    return encode_record(RecordType.DISPATCH, encode_dispatch(Dispatch(offset, B0 + 5, "group-a")))


def test_a_segment_path_is_made_once_per_bucket_held_and_forgotten_with_it(tmp_path):
    """Appends, fsync rounds and reads ask for a segment's path each batch: the buckets the log
    holds have theirs made once; a bucket it does not hold (any bucket may be asked about) gets
    its path without being remembered, and a removed bucket's is forgotten."""
    log = BucketLog.open(tmp_path / "schedule_log")
    log.append(B0, encode_record(RecordType.SCHEDULED, encode_scheduled(0, b"x" * 40)))
    assert log.path(B0) is log.path(B0) == tmp_path / "schedule_log" / (bucket_name(B0) + ".log")
    assert log.path(B1) == tmp_path / "schedule_log" / (bucket_name(B1) + ".log") and log.path(B1) is not log.path(B1)
    assert set(log._paths) == {B0}
    log.remove(B0)
    assert log._paths == {} and not log.path(B0).exists()


def test_bucket_stats_count_scheduled_dispatched_cancelled_and_pending(tmp_path):
    store = Store.open(tmp_path)
    t = B0 + 1000
    offsets = [store.schedule_log.append(B0, scheduled_record(i, schedule_time=t)) for i in range(6)]
    store.schedule_log.append(B0, scheduled_cancel("m-1", t))  # cancelled, never dispatched
    store.schedule_log.append(B0, scheduled_cancel("m-2", t))  # dispatched before the cancel: stays dispatched
    store.schedule_log.append(B0, scheduled_cancel("m-3", t + 1))  # another schedule time: no match
    for offset in (offsets[0], offsets[2], offsets[2], offsets[4]):
        store.dispatch_log.append(B0, dispatch(offset))
    stats = bucket_stats(store.schedule_log, store.dispatch_log, B0)
    assert (stats.scheduled, stats.dispatched, stats.cancelled, stats.pending, stats.duplicate_dispatches) == (6, 3, 1, 2, 1)
    assert bucket_stats(store.schedule_log, store.dispatch_log, B1).scheduled == 0
    assert set(store.dispatched(B0)) == {offsets[0], offsets[2], offsets[4]}
    store.close()


@pytest.mark.parametrize("cached_only", [False, True])
def test_records_read_together_answer_as_read_one_by_one(tmp_path, cached_only):
    """Neighbouring records share one read (a tick's due records mostly lie side by side): each
    offset, in any order, gets the record `read_record` gives, a record bigger than the guess or
    far from the others is read on its own, and a damaged one is answered as its CorruptSegment
    while the others are still read."""
    import random

    log = BucketLog.open(tmp_path)
    offsets = [log.append(B0, scheduled_record(i, message_log_offset=i, body_bytes=9000 if i == 7 else 32))
               for i in range(200)]
    log.append(B0, b"\0" * 70_000)  # a gap wider than one shared read
    offsets += [log.append(B0, scheduled_record(i, message_log_offset=i)) for i in range(200, 210)]
    log.sync()
    path = tmp_path / "202611221600.log"
    flip_bit(path, offsets[50] + 30)
    wanted = random.Random(3).sample(range(210), 210)
    reads = []
    original = log.read_cached if cached_only else log.read
    setattr(log, "read_cached" if cached_only else "read",
            lambda bucket, start=0, end=None: reads.append((start, end)) or original(bucket, start, end))
    got = log.read_records_at(B0, [offsets[i] for i in wanted], 512, cached_only=cached_only)
    for i, record in zip(wanted, got):
        if i == 50:
            assert isinstance(record, CorruptSegment) and record.offset == offsets[50]
            continue
        rtype, data, s, e = record
        assert rtype == RecordType.SCHEDULED and decode_scheduled(data, s, e) == (i, message(i, body_bytes=9000 if i == 7 else 32))
    assert len(reads) < 20, reads  # not one read per record
    assert all(end - start <= 1 << 16 for start, end in reads)
    # A worker thread's reader (records not in the page cache) answers the same.
    in_thread = log.records_reader(B0)([offsets[i] for i in wanted], 512)
    assert [type(r) for r in in_thread] == [type(r) for r in got]
    assert [r[1][r[2]:r[3]] for r in in_thread if not isinstance(r, CorruptSegment)] == \
        [r[1][r[2]:r[3]] for r in got if not isinstance(r, CorruptSegment)]
    log.close()


def test_a_shared_read_not_all_in_memory_leaves_its_whole_run_to_a_read_that_may_wait(tmp_path):
    """When the shared read of neighbours finds part of its range out of the page cache, every
    record of the run is answered "not in memory" (the due queue reads them in a worker thread):
    reading them one by one after it would race the read-ahead that miss started."""
    log = BucketLog.open(tmp_path)
    offsets = [log.append(B0, scheduled_record(i)) for i in range(5)]
    log.sync()
    real = log.read_cached
    log.read_cached = lambda bucket, start=0, end=None: None if end - start > 512 else real(bucket, start, end)
    assert log.read_records_at(B0, offsets, 512, cached_only=True) == [None] * 5
    log.close()
