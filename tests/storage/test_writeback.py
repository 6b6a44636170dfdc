"""The paced writer of big files (storage/writeback.py): the bytes land as given, the writeback of
each step starts as it is written and the one before is waited for, and a failure of the call is
the write's failure. The saves that use it: the dedupe table's file and journal, a bucket's id index."""
from __future__ import annotations

import ctypes
import errno
import os

import numpy as np
import pytest

from delayserver.dedupe import FILE_NAME, Dedupe, DedupeTable
from delayserver.storage import id_index, writeback
from delayserver.storage.writeback import WAIT_AFTER, WAIT_BEFORE, WRITE, Writeback, sync_file_range, write_paced

HOUR = 3_600_000
T0 = 1_795_000_000_000
WAIT = WAIT_BEFORE | WRITE | WAIT_AFTER


class Calls:
    """Records the calls of sync_file_range a writer makes (and makes none)."""

    def __init__(self):
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, fd: int, offset: int, nbytes: int, flags: int) -> None:
        self.calls.append((offset, nbytes, flags))


def test_the_parts_land_as_given_after_what_the_file_held(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"keep")
    column = np.arange(5000, dtype=">u4")  # a big-endian column, as the dedupe file writes them
    parts = [b"head", column, memoryview(b"xyz" * 3000), b"", bytearray(b"tail")]
    fd = os.open(path, os.O_WRONLY)
    try:
        end = write_paced(fd, parts, at=4, step=4096)
    finally:
        os.close(fd)
    expected = b"keep" + b"head" + column.tobytes() + b"xyz" * 3000 + b"tail"
    assert path.read_bytes() == expected and end == len(expected)


def test_each_step_is_started_as_written_and_the_one_before_waited_for():
    calls = Calls()
    pace = Writeback(fd=-1, start=100, step=1000, sync_range=calls)
    pace.written(600)  # under a step: nothing yet
    pace.written(1100)
    pace.written(2500)
    pace.written(2600)
    pace.written(2600, last=True)
    assert calls.calls == [
        (100, 1000, WRITE),
        (1100, 1400, WRITE), (100, 1000, WAIT),
        (2500, 100, WRITE), (1100, 1400, WAIT),
    ]
    pace.written(2600, last=True)  # nothing new: no call
    assert len(calls.calls) == 5


def test_a_big_part_is_written_and_started_a_step_at_a_time(tmp_path):
    calls = Calls()
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        write_paced(fd, [bytes(10_000)], step=4096, sync_range=calls)
    finally:
        os.close(fd)
    started = [(o, n) for o, n, flags in calls.calls if flags == WRITE]
    waited = [(o, n) for o, n, flags in calls.calls if flags == WAIT]
    assert started == [(0, 4096), (4096, 4096), (8192, 1808)]
    assert waited == started[:-1]  # the last is left to the caller's fsync


def test_the_real_call_starts_writeback_and_its_failure_raises(tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        write_paced(fd, [os.urandom(3 << 20)])  # through the real system call, three steps
        os.fsync(fd)
    finally:
        os.close(fd)
    assert (tmp_path / "f").stat().st_size == 3 << 20
    if writeback._sync_file_range is None:
        pytest.skip("no sync_file_range on this system")
    r, w = os.pipe()
    try:
        with pytest.raises(OSError) as caught:
            sync_file_range(r, 0, 4096, WRITE)  # a pipe has no pages to write back
        assert caught.value.errno == errno.ESPIPE
    finally:
        os.close(r)
        os.close(w)


def _big_table(n: int) -> DedupeTable:
    table = DedupeTable(window_ms=HOUR)
    table.remember_many([(f"order-{i:09d}", T0 + i) for i in range(n)], T0)
    return table


def test_the_dedupe_tables_file_is_written_with_its_writeback_paced(tmp_path, monkeypatch):
    calls = Calls()
    monkeypatch.setattr(writeback, "_sync_file_range", lambda fd, o, n, f: calls(fd, o, n, f) or 0)
    path = tmp_path / FILE_NAME
    _big_table(100_000).save_to(path, 77)
    size = path.stat().st_size
    started = [(o, n) for o, n, flags in calls.calls if flags == WRITE]
    # Every byte's writeback started once, in order, a step at a time, before the fsync.
    assert started[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(started, started[1:]))
    assert started[-1][0] + started[-1][1] == size and size > 3 * writeback.WRITEBACK_STEP
    assert [(o, n) for o, n, flags in calls.calls if flags == WAIT] == started[:-1]
    again = DedupeTable(window_ms=HOUR)
    assert again.load(path) == 77 and again.find("order-000099999", T0) == T0 + 99_999


async def test_a_failed_writeback_fails_the_save_and_the_table_file_is_kept(tmp_path, monkeypatch):
    dedupe = Dedupe(HOUR, tmp_path)
    dedupe.table.remember_many([(f"a-{i}", T0) for i in range(40_000)], T0)
    await dedupe.save(T0, 100)
    inode = (tmp_path / FILE_NAME).stat().st_ino
    dedupe.table.remember_many([(f"b-{i}", T0 + 1) for i in range(40_000)], T0 + 1)
    dedupe.journal_bytes = 1 << 40  # the next save writes the table whole

    def failing(fd, offset, nbytes, flags):
        ctypes.set_errno(errno.EIO)
        return -1
    monkeypatch.setattr(writeback, "_sync_file_range", failing)
    await dedupe.save(T0 + 1, 200)
    assert dedupe.saved_offset == 100  # not saved: the file read back is the one before
    assert (tmp_path / FILE_NAME).stat().st_ino == inode
    monkeypatch.undo()
    await dedupe.save(T0 + 2, 300)
    again = Dedupe(HOUR, tmp_path)
    assert again.load() == 300 and again.table.find("b-39999", T0 + 2) == T0 + 1


def test_a_buckets_id_index_is_written_with_its_writeback_paced(tmp_path, monkeypatch):
    calls = Calls()
    monkeypatch.setattr(writeback, "_sync_file_range", lambda fd, o, n, f: calls(fd, o, n, f) or 0)
    keys = np.sort(np.random.default_rng(7).integers(0, 1 << 62, 400_000, dtype=np.uint64))
    path = tmp_path / "0.idx"
    assert id_index._write_saved(path, [(keys, None)], covered=123, head=0, saved_id=5) == len(keys)
    started = [(o, n) for o, n, flags in calls.calls if flags == WRITE]
    assert len(started) >= 3 and started[-1][0] + started[-1][1] == path.stat().st_size
    _, covered, count, _, _, saved_id, read = id_index._read_keys_file(path)
    assert (covered, count, saved_id) == (123, len(keys), 5) and (read.byteswap() == keys).all()
    journal = path.with_suffix(".idj")
    calls.calls.clear()
    id_index._append_chunk(journal, keys[:300_000].tobytes(), 5, 123, 456)
    started = [(o, n) for o, n, flags in calls.calls if flags == WRITE]
    assert len(started) >= 2 and started[-1][0] + started[-1][1] == journal.stat().st_size
    id_index._append_chunk(journal, keys[:10].tobytes(), 5, 456, 500)  # after the first chunk
    chunks, covered, whole = id_index._read_chunks(journal.read_bytes(), 5, 123)
    assert covered == 500 and whole and [len(c) for c in chunks] == [300_000, 10]
    assert (chunks[0] == np.sort(keys[:300_000])).all()
