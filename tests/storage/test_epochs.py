"""Epochs in message_log: every batch opens with the epoch that wrote it; the history indexes where
each epoch begins, survives a crash between its write and the batch's, and is rebuilt from the
log when its file is lost. A log written before epochs reads as epoch 0."""
from __future__ import annotations

import pytest

from delayserver.storage.epochs import FILE_NAME, EpochRegression
from delayserver.storage.message_log import MessageLog
from delayserver.storage.record import (
    EPOCH_RECORD_SIZE, Epoch, RecordError, RecordType, decode_payload, encode_epoch_record, encode_record,
)
from tests.damage import message_record

SEGMENT_BYTES = 400


def batch(epoch: int, *numbers: int) -> bytes:
    return encode_epoch_record(epoch) + b"".join(message_record(i) for i in numbers)


def write(log: MessageLog, epoch: int, *numbers: int) -> int:
    return log.append(batch(epoch, *numbers), epoch)


@pytest.fixture
def log(tmp_path):
    log = MessageLog.open(tmp_path, SEGMENT_BYTES)
    yield log
    log.close()


def test_the_epoch_record_is_the_batch_frame_and_decodes(log):
    record = encode_epoch_record(7)
    assert len(record) == EPOCH_RECORD_SIZE
    write(log, 7, 1)
    [(off, rtype, payload), (_, second, _)] = list(log.iter_from(0))
    assert (off, rtype, second) == (0, RecordType.EPOCH, RecordType.MESSAGE)
    assert decode_payload(rtype, payload, 0, len(payload)) == Epoch(7)
    bad = encode_record(RecordType.EPOCH, b"\x00" * 4)
    with pytest.raises(RecordError):
        decode_payload(RecordType.EPOCH, bad, 9, len(bad))


def test_the_history_indexes_where_each_epoch_begins_across_segments(log):
    starts = [write(log, e, i) for i, e in enumerate([1, 1, 2, 2, 2, 5])]
    end = log.end_offset
    assert len(log.segments) >= 2
    assert log.epochs.entries == [(1, starts[0]), (2, starts[2]), (5, starts[5])]
    assert log.epochs.last_epoch == 5
    assert [log.epochs.epoch_at(s) for s in starts] == [1, 1, 2, 2, 2, 5]
    assert log.epochs.end_offset_for(0, end) == (0, 0)  # epoch 0 holds nothing here
    assert log.epochs.end_offset_for(1, end) == (1, starts[2])
    assert log.epochs.end_offset_for(4, end) == (2, starts[5])  # the largest epoch not above 4
    assert log.epochs.end_offset_for(9, end) == (5, end)


def test_the_history_survives_a_reopen_and_is_rebuilt_when_its_file_is_lost_or_damaged(tmp_path, log):
    for i, e in enumerate([1, 3, 3, 4]):
        write(log, e, i)
    entries = log.epochs.entries
    log.close()
    assert MessageLog.open(tmp_path, SEGMENT_BYTES).epochs.entries == entries
    (tmp_path / FILE_NAME).unlink()
    assert MessageLog.open(tmp_path, SEGMENT_BYTES).epochs.entries == entries
    (tmp_path / FILE_NAME).write_text("{not json")
    assert MessageLog.open(tmp_path, SEGMENT_BYTES).epochs.entries == entries


def test_a_log_written_before_epochs_is_all_epoch_0(tmp_path, log):
    for i in range(10):
        log.append(message_record(i))
    log.close()
    (tmp_path / FILE_NAME).unlink(missing_ok=True)
    old = MessageLog.open(tmp_path, SEGMENT_BYTES)
    assert old.epochs.entries == [] and old.epochs.last_epoch == 0 and old.epochs.epoch_at(100) == 0
    assert old.epochs.end_offset_for(3, old.end_offset) == (0, old.end_offset)
    assert len(list(old.iter_from(0))) == 10
    # New batches of a later epoch go on after it.
    start = write(old, 2, 10)
    assert old.epochs.entries == [(2, start)] and old.epochs.end_offset_for(1, old.end_offset) == (0, start)
    old.close()


def test_a_log_without_epochs_is_read_for_its_history_once_not_at_every_open(tmp_path, log, monkeypatch):
    from delayserver.storage import epochs

    for i in range(10):
        log.append(message_record(i))  # a standalone node's batches: no EPOCH record
    log.close()
    (tmp_path / FILE_NAME).unlink(missing_ok=True)
    scans = []
    real = epochs._scan
    monkeypatch.setattr(epochs, "_scan", lambda message_log: scans.append(1) or real(message_log))
    MessageLog.open(tmp_path, SEGMENT_BYTES).close()
    assert scans == [1] and (tmp_path / FILE_NAME).exists()
    again = MessageLog.open(tmp_path, SEGMENT_BYTES)
    assert scans == [1], "the whole log was read again at the next open"
    assert again.epochs.entries == [] and again.epochs.last_epoch == 0
    again.close()


def test_an_epoch_whose_first_batch_never_landed_is_forgotten_at_open(tmp_path, log):
    write(log, 1, 0)
    log.epochs.begin(2, log.end_offset)  # noted, then the process died before the write
    assert log.epochs.last_epoch == 2
    log.close()
    assert MessageLog.open(tmp_path, SEGMENT_BYTES).epochs.entries == [(1, 0)]


def test_truncate_forgets_the_epochs_that_begin_at_or_after_the_cut(tmp_path, log):
    starts = [write(log, e, i) for i, e in enumerate([1, 2, 3])]
    log.truncate(starts[2])
    assert log.epochs.entries == [(1, 0), (2, starts[1])]
    log.truncate(starts[1])
    log.close()
    assert MessageLog.open(tmp_path, SEGMENT_BYTES).epochs.entries == [(1, 0)]


def test_a_batch_of_an_older_epoch_is_refused_and_nothing_is_written(log):
    write(log, 3, 0)
    end = log.end_offset
    with pytest.raises(EpochRegression):
        write(log, 2, 1)
    with pytest.raises(EpochRegression):
        log.append(batch(2, 1))  # copied records are checked the same way
    assert log.end_offset == end and log.epochs.entries == [(3, 0)]


def test_copied_records_bring_their_epochs_into_the_history(log):
    data = batch(1, 0, 1) + batch(1, 2) + batch(4, 3)
    log.append(data)
    assert log.epochs.entries == [(1, 0), (4, len(batch(1, 0, 1) + batch(1, 2)))]
