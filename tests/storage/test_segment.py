"""Segment recovery, one test per failure mode: clean end, torn tail, corruption.

A torn tail (the last record incomplete, zero-filled or failing its crc with nothing valid after
it) is truncated and logged with file, offset and bytes; damage with valid records after it is
corruption and names file and offset. A damaged record is never yielded by any reader.
"""
from __future__ import annotations

import errno
import logging
import os

import pytest

from delayserver.storage.bucket_log import BucketLog
from delayserver.storage.errors import CorruptSegment, DiskFull, FsyncFailed, StorageError
from delayserver.storage.reader import scan
from delayserver.storage.record import HEADER_SIZE, RecordError, iter_records
from delayserver.storage.segment import Segment
from tests.damage import flip_bit, message_record, record_offsets, truncate, zero_fill

RECORDS = 5


@pytest.fixture
def segment_path(tmp_path):
    """A segment of RECORDS whole records, closed."""
    path = tmp_path / "segment.log"
    seg = Segment.open(path)
    seg.append(b"".join(message_record(i) for i in range(RECORDS)))
    seg.sync()
    seg.close()
    return path


def reopen(path):
    seg = Segment.open(path)
    seg.close()
    return seg


def whole_records(path, size):
    return [pos for pos, *_ in iter_records(path.read_bytes()[:size])]


def assert_torn_tail_logged(caplog, path, offset, dropped):
    [rec] = [r for r in caplog.records if "torn tail" in r.getMessage()]
    assert rec.levelno == logging.WARNING
    text = rec.getMessage()
    assert str(path) in text and f"offset {offset}" in text and f"{dropped} bytes" in text


def test_clean_segment_reopens_with_every_record(segment_path, caplog):
    offsets = record_offsets(segment_path)
    seg = reopen(segment_path)
    assert seg.size == offsets[-1]
    assert whole_records(segment_path, seg.size) == offsets[:-1]
    assert not caplog.records


def test_truncated_trailing_record_is_ignored_at_every_byte(segment_path, caplog):
    offsets = record_offsets(segment_path)
    last, end = offsets[-2], offsets[-1]
    original = segment_path.read_bytes()
    for cut in range(last + 1, end):
        segment_path.write_bytes(original[:cut])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="delayserver.storage"):
            seg = reopen(segment_path)
        assert seg.size == last
        assert segment_path.stat().st_size == last
        assert whole_records(segment_path, seg.size) == offsets[:-2]
        assert_torn_tail_logged(caplog, segment_path, last, cut - last)


def test_truncation_at_a_record_boundary_is_a_clean_end(segment_path, caplog):
    offsets = record_offsets(segment_path)
    truncate(segment_path, offsets[2])
    assert reopen(segment_path).size == offsets[2]
    assert not caplog.records


def test_zero_filled_tail_is_truncated(segment_path, caplog):
    end = record_offsets(segment_path)[-1]
    zero_fill(segment_path, end, 4096)
    with caplog.at_level(logging.WARNING, logger="delayserver.storage"):
        assert reopen(segment_path).size == end
    assert segment_path.stat().st_size == end
    assert_torn_tail_logged(caplog, segment_path, end, 4096)


def test_zero_filled_last_record_is_truncated(segment_path, caplog):
    offsets = record_offsets(segment_path)
    last, end = offsets[-2], offsets[-1]
    zero_fill(segment_path, last, end - last)
    with caplog.at_level(logging.WARNING, logger="delayserver.storage"):
        assert reopen(segment_path).size == last
    assert_torn_tail_logged(caplog, segment_path, last, end - last)


def test_bit_flip_in_last_record_is_torn_tail(segment_path, caplog):
    offsets = record_offsets(segment_path)
    last, end = offsets[-2], offsets[-1]
    original = segment_path.read_bytes()
    for pos in range(last, end):
        segment_path.write_bytes(original)
        flip_bit(segment_path, pos, bit=pos % 8)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="delayserver.storage"):
            assert reopen(segment_path).size == last, f"flip at {pos}"
        assert_torn_tail_logged(caplog, segment_path, last, end - last)


def test_bit_flip_in_sealed_region_raises_corrupt_segment_naming_file_and_offset(segment_path):
    offsets = record_offsets(segment_path)
    original = segment_path.read_bytes()
    for start, stop in zip(offsets[:-2], offsets[1:-1]):
        for pos in (start, start + 4, start + 8, start + HEADER_SIZE, stop - 1):
            segment_path.write_bytes(original)
            flip_bit(segment_path, pos, bit=7)
            damaged = segment_path.read_bytes()
            with pytest.raises(CorruptSegment) as info:
                Segment.open(segment_path)
            assert info.value.path == segment_path and info.value.offset == start
            assert str(segment_path) in str(info.value) and f"offset {start}" in str(info.value)
            assert segment_path.read_bytes() == damaged, "corruption must never be truncated away"


def test_zero_filled_record_in_sealed_region_raises_corrupt_segment(segment_path):
    offsets = record_offsets(segment_path)
    zero_fill(segment_path, offsets[1], offsets[2] - offsets[1])
    with pytest.raises(CorruptSegment) as info:
        Segment.open(segment_path)
    assert info.value.offset == offsets[1]


def test_truncation_inside_a_sealed_segment_raises_corrupt_segment(segment_path):
    offsets = record_offsets(segment_path)
    truncate(segment_path, offsets[-1] - 1)
    with pytest.raises(CorruptSegment) as info:
        Segment.open(segment_path, sealed=True)
    assert info.value.offset == offsets[-2]


def test_corrupt_record_is_never_yielded_by_any_reader(tmp_path, segment_path):
    offsets = record_offsets(segment_path)
    flip_bit(segment_path, offsets[2] + HEADER_SIZE)
    yielded = []
    with pytest.raises(RecordError) as info:
        for pos, *_ in iter_records(segment_path.read_bytes()):
            yielded.append(pos)
    assert yielded == offsets[:2] and info.value.offset == offsets[2]

    bucket_log = BucketLog.open(tmp_path / "buckets")
    bucket_log.append(0, segment_path.read_bytes())
    yielded = []
    with pytest.raises(CorruptSegment) as info:
        for pos, *_ in bucket_log.records(0):
            yielded.append(pos)
    assert yielded == offsets[:2] and info.value.offset == offsets[2]
    with pytest.raises(CorruptSegment):
        bucket_log.recover_tail(0)
    assert yielded == offsets[:2]
    bucket_log.close()


def test_scan_of_megabytes_of_zeros_finds_the_torn_tail(segment_path):
    end = record_offsets(segment_path)[-1]
    result = scan(segment_path.read_bytes() + bytes(32 << 20), segment_path)
    assert (result.valid_end, result.records, result.torn_bytes) == (end, RECORDS, 32 << 20)


def test_failed_write_leaves_the_segment_as_it_was(segment_path, monkeypatch):
    seg = Segment.open(segment_path)
    size = seg.size

    def no_space(fd, data, pos):
        os.ftruncate(fd, pos + 3)  # a partial write before the failure
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", no_space)
    with pytest.raises(DiskFull):
        seg.append(message_record(99))
    monkeypatch.setattr(os, "pwrite", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(StorageError):
        seg.append(message_record(99))
    monkeypatch.undo()
    assert seg.size == size and segment_path.stat().st_size == size
    seg.close()


def test_failed_fsync_raises_fsync_failed(segment_path, monkeypatch):
    seg = Segment.open(segment_path)
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(FsyncFailed):
        seg.sync()
    monkeypatch.undo()
    seg.close()


def test_each_fsync_is_timed_per_log_and_a_slow_one_is_logged_once_a_second(tmp_path, caplog, monkeypatch):
    from delayserver.storage import segment
    from delayserver.storage.segment import FSYNC_BUCKETS, FsyncTimes, fsync_path

    times = FsyncTimes()
    assert [times.log_of(p) for p in ("/d/message_log/0.log", "/d/spool/a.b.log", "/d/schedule_log",
                                      "/d/checkpoint/replay.json", "/elsewhere/x")] == [
        "message_log", "spool", "schedule_log", "checkpoint", "other"]
    with caplog.at_level("WARNING", logger="delayserver.storage"):
        times.observe("/d/spool/a.log", 0.0004)
        times.observe("/d/spool/a.log", 0.003)
        times.observe("/d/spool/a.log", 0.2)  # slow: logged
        times.observe("/d/message_log/0.log", 0.3)  # slow within the second: counted in the next line
        times.observe("/d/message_log/0.log", 9.0)
    counts, sums = times.snapshot()
    assert counts["spool"][0] == 1 and counts["spool"][FSYNC_BUCKETS.index(0.005)] == 1
    assert counts["spool"][FSYNC_BUCKETS.index(0.25)] == 1 and counts["message_log"][-1] == 1
    assert sum(counts["spool"]) == 3 and abs(sums["spool"] - 0.2034) < 1e-9 and times.longest_s == 9.0
    slow = [r.getMessage() for r in caplog.records if "slow fsync" in r.getMessage()]
    assert slow == ["slow fsync: /d/spool/a.log took 200 ms (acknowledgements and deliveries waiting for it "
                    "waited as long)"]

    # The real fsyncs of the storage layer go through it.
    monkeypatch.setattr(segment, "FSYNC_TIMES", times)
    (tmp_path / "dispatch_log").mkdir()
    path = tmp_path / "dispatch_log" / "1.log"
    path.write_bytes(b"x")
    fsync_path(path)
    assert sum(times.snapshot()[0]["dispatch_log"]) == 1
