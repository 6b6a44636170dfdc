"""message_log: rollover across tiny segments, reads from any offset, reopen after damage, cleanup.

Damage in the active (last) segment's final record is a torn tail; damage anywhere in a sealed
segment is corruption, found when it is read, and no record past it is ever returned.
"""
from __future__ import annotations

import logging
import os

import pytest
from hypothesis import given, settings, strategies as st

from delayserver.storage.errors import CorruptSegment
from delayserver.storage.message_log import MessageLog, segment_name
from delayserver.storage.record import RecordType, decode_message, iter_records
from tests.damage import flip_bit, message, message_record, record_offsets, truncate, zero_fill

SEGMENT_BYTES = 400  # two or three records per segment: every test crosses many rolls
COUNT = 30


@pytest.fixture
def log_dir(tmp_path):
    """A message_log of COUNT records over many tiny segments, closed."""
    log = MessageLog.open(tmp_path, SEGMENT_BYTES)
    for i in range(COUNT):
        log.append(message_record(i))
    log.sync()
    log.close()
    return tmp_path


def read_all(log, offset=0):
    return [(off, decode_message(payload).message_id) for off, rtype, payload in log.iter_from(offset)]


def segments(log_dir):
    return sorted(log_dir.glob("*.log"))


def test_rollover_names_segments_by_base_offset_and_leaves_no_gap(log_dir):
    paths = segments(log_dir)
    assert len(paths) >= 8
    base = 0
    for path in paths:
        assert path.name == segment_name(base)
        assert 0 < path.stat().st_size <= SEGMENT_BYTES
        base += path.stat().st_size
    log = MessageLog.open(log_dir, SEGMENT_BYTES)
    assert log.end_offset == base and log.start_offset == 0
    assert [mid for _, mid in read_all(log)] == [f"m-{i}" for i in range(COUNT)]
    log.close()


def test_read_from_any_record_offset_returns_the_rest_in_order(log_dir):
    log = MessageLog.open(log_dir, SEGMENT_BYTES)
    everything = read_all(log)
    for i, (offset, _) in enumerate(everything):
        assert read_all(log, offset) == everything[i:]
    assert read_all(log, log.end_offset) == []
    with pytest.raises(ValueError):
        log.read(-1)
    log.close()


def test_read_returns_a_whole_record_even_over_max_bytes(tmp_path):
    log = MessageLog.open(tmp_path, SEGMENT_BYTES)
    big = message_record(0, body_bytes=1000)
    log.append(big)
    log.append(message_record(1))
    for max_bytes in (1, 8, 9, 100):
        data, base = log.read(0, max_bytes)
        assert (data, base) == (big, 0)
    data, base = log.read(len(big), 1)
    assert base == len(big) and [r for _, r, _, _ in iter_records(data)] == [RecordType.MESSAGE]
    log.close()


def _answer(fn, *args):
    try:
        return fn(*args)
    except CorruptSegment as e:
        return ("corrupt", e.path, e.offset)


@pytest.mark.parametrize("damaged", [False, True])
def test_a_reader_for_a_worker_thread_answers_as_read_does(log_dir, damaged):
    """`reader(offset, max_bytes)` finds the segment on the caller's thread and reads through a
    descriptor of its own: the same data, base, one whole record over max_bytes, and damage."""
    log = MessageLog.open(log_dir, SEGMENT_BYTES)
    big = message_record(99, body_bytes=1000)
    log.append(big)  # over a segment: one of its own
    log.append(message_record(100))  # in the active segment
    offsets = [off for off, _ in read_all(log)]
    if damaged:
        log.close()
        victim = segments(log_dir)[3]
        flip_bit(victim, record_offsets(victim)[0] + 12)
        log = MessageLog.open(log_dir, SEGMENT_BYTES)
    for offset in offsets + [log.end_offset]:
        for max_bytes in (1, 100, 1 << 20):
            assert _answer(log.reader(offset, max_bytes)) == _answer(log.read, offset, max_bytes)
    log.close()


def test_appends_continue_after_reopen(log_dir):
    log = MessageLog.open(log_dir, SEGMENT_BYTES)
    end = log.end_offset
    assert log.append(message_record(COUNT)) >= end
    log.close()
    log = MessageLog.open(log_dir, SEGMENT_BYTES)
    assert [mid for _, mid in read_all(log)][-2:] == [f"m-{COUNT - 1}", f"m-{COUNT}"]
    log.close()


@settings(max_examples=25, deadline=None)
@given(batches=st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=6), min_size=1, max_size=12),
       segment_bytes=st.integers(64, 2000))
def test_batched_appends_read_back_in_order_across_any_segment_size(tmp_path_factory, batches, segment_bytes):
    directory = tmp_path_factory.mktemp("log")
    log = MessageLog.open(directory, segment_bytes)
    expected, i = [], 0
    for batch in batches:
        records = [message_record(i + k, body_bytes=size) for k, size in enumerate(batch)]
        offset = log.append(b"".join(records))
        for record in records:
            expected.append((offset, f"m-{i}"))
            offset += len(record)
            i += 1
    log.close()
    log = MessageLog.open(directory, segment_bytes)
    assert read_all(log) == expected
    log.close()


def test_torn_tail_of_the_active_segment_is_truncated_at_every_byte(log_dir, caplog):
    active = segments(log_dir)[-1]
    offsets = record_offsets(active)
    original = active.read_bytes()
    base = int(active.name[:20])
    for cut in range(offsets[-2] + 1, offsets[-1]):
        active.write_bytes(original[:cut])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="delayserver.storage"):
            log = MessageLog.open(log_dir, SEGMENT_BYTES)
        assert log.end_offset == base + offsets[-2]
        assert [mid for _, mid in read_all(log)] == [f"m-{i}" for i in range(COUNT - 1)]
        assert any(str(active) in r.getMessage() and f"offset {offsets[-2]}" in r.getMessage() for r in caplog.records)
        log.close()


@pytest.mark.parametrize("damage", ["zero_filled_tail", "bit_flip_in_last_record", "zero_filled_last_record"])
def test_reopen_after_a_torn_tail_appends_where_the_valid_records_end(log_dir, damage):
    active = segments(log_dir)[-1]
    offsets = record_offsets(active)
    if damage == "zero_filled_tail":
        zero_fill(active, offsets[-1], 1000)
        kept = COUNT
    elif damage == "bit_flip_in_last_record":
        flip_bit(active, offsets[-1] - 1)
        kept = COUNT - 1
    else:
        zero_fill(active, offsets[-2], offsets[-1] - offsets[-2])
        kept = COUNT - 1
    log = MessageLog.open(log_dir, SEGMENT_BYTES)
    offset = log.append(message_record(100))
    log.close()
    log = MessageLog.open(log_dir, SEGMENT_BYTES)
    got = read_all(log)
    assert [mid for _, mid in got] == [f"m-{i}" for i in range(kept)] + ["m-100"]
    assert got[-1][0] == offset
    log.close()


def test_bit_flip_inside_the_active_segment_raises_corrupt_segment_on_open(log_dir):
    log = MessageLog.open(log_dir, SEGMENT_BYTES)
    log.roll()
    log.append(message_record(40) + message_record(41))
    log.close()
    active = segments(log_dir)[-1]
    offsets = record_offsets(active)
    flip_bit(active, offsets[0] + 20)
    # Damage further than max_unsynced_bytes from the last valid record lies before the last
    # durable offset: corruption (tests/storage/test_power_loss.py has the damage within it).
    with pytest.raises(CorruptSegment) as info:
        MessageLog.open(log_dir, SEGMENT_BYTES, max_unsynced_bytes=offsets[1] - offsets[0] - 1)
    assert (info.value.path, info.value.offset) == (active, offsets[0])


def one_segment(tmp_path, count):
    """A message_log of `count` records in one segment, closed: the segment and its record offsets."""
    log = MessageLog.open(tmp_path, 1 << 20)
    log.append(b"".join(message_record(i) for i in range(count)))
    log.sync()
    log.close()
    (path,) = segments(tmp_path)
    return path, record_offsets(path)


def test_the_last_segment_is_walked_from_the_durable_offset_a_checkpoint_names(tmp_path):
    path, offsets = one_segment(tmp_path, 6)
    flip_bit(path, offsets[1] + 20)  # before the durable offset: no power loss reaches it
    truncate(path, offsets[5] + 7)  # a torn tail after it
    log = MessageLog.open(tmp_path, 1 << 20, durable_to=offsets[3])
    assert log.end_offset == offsets[5]  # the torn tail is cut as by a whole walk
    assert [mid for _, mid in read_all(log, offsets[3])] == ["m-3", "m-4"]
    with pytest.raises(CorruptSegment) as info:  # the damage before it is found when it is read
        read_all(log)
    assert info.value.offset == offsets[1]
    log.close()


@pytest.mark.parametrize("where", ["inside_a_record", "past_the_end", "none"])
def test_without_a_record_at_the_durable_offset_the_whole_segment_is_walked(tmp_path, where):
    path, offsets = one_segment(tmp_path, 6)
    flip_bit(path, offsets[1] + 20)
    durable_to = {"inside_a_record": offsets[3] + 5, "past_the_end": offsets[-1] + 1, "none": 0}[where]
    with pytest.raises(CorruptSegment) as info:
        MessageLog.open(tmp_path, 1 << 20, durable_to=durable_to, max_unsynced_bytes=16)
    assert info.value.offset == offsets[1]


def damage_in_place(path, offsets, kind):
    """Damage a sealed segment without changing its size; returns the offset of the bad record."""
    if kind == "bit_flip_in_first_record":
        flip_bit(path, offsets[0] + 12)
        return offsets[0]
    if kind == "bit_flip_in_last_record":
        flip_bit(path, offsets[-1] - 1)
        return offsets[-2]
    if kind == "bit_flip_in_last_length":
        flip_bit(path, offsets[-2] + 6, bit=4)  # the last record now claims to run past the end
        return offsets[-2]
    if kind == "zero_filled_last_record":
        zero_fill(path, offsets[-2], offsets[-1] - offsets[-2])
        return offsets[-2]
    raise AssertionError(kind)


def damage_size(path, offsets, kind):
    """Change a sealed segment's size; returns the offset where it stops matching the next base."""
    if kind == "truncated_inside_last_record":
        truncate(path, offsets[-1] - 5)
        return offsets[-1] - 5
    if kind == "truncated_at_a_record_boundary":
        truncate(path, offsets[-2])
        return offsets[-2]
    if kind == "truncated_to_a_few_bytes":
        truncate(path, 4)
        return 4
    if kind == "zeros_appended":
        zero_fill(path, offsets[-1], 64)
        return offsets[-1]
    raise AssertionError(kind)


def read_until_corrupt(log_dir):
    """The records read before CorruptSegment, and the exception."""
    log = MessageLog.open(log_dir, SEGMENT_BYTES)
    got = []
    with pytest.raises(CorruptSegment) as info:
        for offset, rtype, payload in log.iter_from(0):
            got.append((offset, decode_message(payload).message_id))
    log.close()
    return got, info.value


@pytest.mark.parametrize("kind", [
    "bit_flip_in_first_record", "bit_flip_in_last_record", "bit_flip_in_last_length", "zero_filled_last_record",
])
def test_damage_in_a_sealed_segment_is_corruption_naming_file_and_offset(log_dir, kind):
    log = MessageLog.open(log_dir, SEGMENT_BYTES)
    before = read_all(log)
    log.close()
    victim = segments(log_dir)[3]
    base = int(victim.name[:20])
    at = damage_in_place(victim, record_offsets(victim), kind)
    got, error = read_until_corrupt(log_dir)
    assert (error.path, error.offset) == (victim, at)
    assert str(victim) in str(error) and f"offset {at}" in str(error)
    assert got == [r for r in before if r[0] < base + at], "every record before the damage, none after"


@pytest.mark.parametrize("kind", [
    "truncated_inside_last_record", "truncated_at_a_record_boundary", "truncated_to_a_few_bytes", "zeros_appended",
])
def test_sealed_segment_of_the_wrong_size_is_quarantined(log_dir, kind, caplog):
    log = MessageLog.open(log_dir, SEGMENT_BYTES)
    before = read_all(log)
    log.close()
    victim = segments(log_dir)[3]
    base = int(victim.name[:20])
    at = damage_size(victim, record_offsets(victim), kind)
    with caplog.at_level(logging.ERROR, logger="delayserver.storage"):
        got, error = read_until_corrupt(log_dir)
    assert any("quarantined" in r.getMessage() and str(victim) in r.getMessage() for r in caplog.records)
    assert (error.path, error.offset) == (victim, at)
    assert got == [r for r in before if r[0] < base], "nothing of a quarantined segment is returned"
    log = MessageLog.open(log_dir, SEGMENT_BYTES)
    nxt = segments(log_dir)[4]
    assert read_all(log, int(nxt.name[:20])) == [r for r in before if r[0] >= int(nxt.name[:20])]
    log.close()


def test_delete_before_removes_only_sealed_segments_wholly_before_the_offset(log_dir):
    log = MessageLog.open(log_dir, SEGMENT_BYTES)
    everything = read_all(log)
    bases = [int(p.name[:20]) for p in segments(log_dir)]
    cut = bases[4] + 1  # inside the fifth segment: it must stay
    assert log.delete_before(cut) == bases[:4]
    assert [int(p.name[:20]) for p in segments(log_dir)] == bases[4:]
    assert log.start_offset == bases[4]
    assert read_all(log, bases[4]) == [r for r in everything if r[0] >= bases[4]]
    with pytest.raises(ValueError):
        log.read(bases[3])
    assert log.delete_before(log.end_offset + 1000) == bases[4:-1], "the active segment is never deleted"
    log.close()
    log = MessageLog.open(log_dir, SEGMENT_BYTES)
    assert log.start_offset == bases[-1]
    assert read_all(log, log.start_offset) == [r for r in everything if r[0] >= bases[-1]]
    log.close()


def test_truncate_drops_everything_from_an_offset(log_dir):
    log = MessageLog.open(log_dir, SEGMENT_BYTES)
    everything = read_all(log)
    cut = everything[7][0]
    log.truncate(cut)
    assert log.end_offset == cut and read_all(log) == everything[:7]
    log.append(message_record(50))
    assert [mid for _, mid in read_all(log)] == [mid for _, mid in everything[:7]] + ["m-50"]
    log.close()


def test_a_record_larger_than_a_segment_gets_a_segment_of_its_own(tmp_path):
    log = MessageLog.open(tmp_path, SEGMENT_BYTES)
    log.append(message_record(0))
    big = log.append(message_record(1, body_bytes=SEGMENT_BYTES * 2))
    log.append(message_record(2))
    assert big in [int(p.name[:20]) for p in segments(tmp_path)]
    assert [mid for _, mid in read_all(log)] == ["m-0", "m-1", "m-2"]
    assert decode_message(dict((o, p) for o, _, p in log.iter_from(0))[big]) == message(1, body_bytes=SEGMENT_BYTES * 2)
    log.close()


def test_pages_to_give_back_name_each_segment_s_part_once_from_a_folio_s_start(tmp_path, monkeypatch):
    """The ranges cover the log from where the last call stopped up to the offset asked for (never
    past the end), split at segment boundaries, each from the folio boundary below its first byte
    (2 MiB in a node, a page here); a log cut back below them names that part again."""
    from delayserver.storage import segment
    PAGE_BYTES = 4096
    monkeypatch.setattr(segment, "FOLIO_ALIGN_BYTES", PAGE_BYTES)
    monkeypatch.setattr(segment, "GIVE_BACK_LAG_BYTES", 0)  # (a MiB in a node)
    log = MessageLog.open(tmp_path, 10_000)
    record = message_record(0, body_bytes=3000)  # three a segment
    for _ in range(9):
        log.append(record)
    bases = sorted(int(p.name[:20]) for p in tmp_path.glob("*.log"))
    assert len(bases) == 3 and log.end_offset == 9 * len(record)

    first = log.pages_to_give_back(4 * len(record) + 100)
    assert first == [(log.path(bases[0]), 0, 3 * len(record)),
                     (log.path(bases[1]), 0, len(record) + 100)]
    assert log.pages_to_give_back(4 * len(record) + 100) == []  # nothing new
    rest = log.pages_to_give_back(10**12)  # the end, not past it
    start = len(record) + 100
    assert rest == [(log.path(bases[1]), start - start % PAGE_BYTES, 3 * len(record)),
                    (log.path(bases[2]), 0, 3 * len(record))]
    log.truncate(7 * len(record))  # a slave realigning: other records take those offsets
    log.append(record)
    assert log.pages_to_give_back(10**12) == [(log.path(bases[2]), len(record) - len(record) % PAGE_BYTES,
                                               2 * len(record))]
    log.close()


def test_what_a_give_back_ended_inside_goes_with_the_next_one(tmp_path, monkeypatch):
    """Writes of many pages go into large folios, and advice drops only the folios wholly inside its
    range: each range starts at a folio boundary below where the last one ended, so that the folio
    the last one ended inside goes once the log has passed it (from a page's start, it stayed)."""
    from delayserver.storage import segment
    from delayserver.storage.segment import give_back_pages
    from tests.damage import gives_back_pages, resident_map
    monkeypatch.setattr(segment, "GIVE_BACK_LAG_BYTES", 0)  # (a MiB in a node: the log here is smaller)
    if not gives_back_pages(tmp_path):
        pytest.skip("this file system keeps its pages whatever it is told")
    log = MessageLog.open(tmp_path, 1 << 30)
    record = message_record(0, body_bytes=60_000)  # one write of 15 pages each
    for n in range(1, 7):
        log.append(record)
        log.sync()
        give_back_pages(log.pages_to_give_back(n * len(record) - len(record) // 2))  # ends inside a write
    fd = os.open(log.path(0), os.O_RDONLY)
    try:
        resident = resident_map(fd)
    finally:
        os.close(fd)
    assert not any(resident[:5 * len(record) // 4096 - 1]), resident
    log.close()
