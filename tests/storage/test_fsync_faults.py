"""fsync failures are final, one checkpoint writer, I/O failpoints, and the power-loss tail rule.

Unit tests of the storage layer on real files, with faults injected by the failpoint layer
(delayserver/failpoints.py), not by mocks.
"""
from __future__ import annotations

import errno
import logging

import pytest
import trio

from delayserver import failpoints
from delayserver.replayer import Replayer
from delayserver.storage.checkpoint import read_checkpoint
from delayserver.storage.message_log import MessageLog
from delayserver.storage.errors import CorruptSegment, FsyncFailed, StorageError
from delayserver.storage.segment import fsync_failures, fsync_path, storage_failures
from delayserver.storage.store import Store
from tests.damage import message_record, record_offsets
from tests.pipeline_node import START_MS, Node


@pytest.fixture
def faults():
    """Arm I/O faults for one test; disarmed after it."""
    yield failpoints.set_io_faults
    failpoints.set_io_faults("")


# --- failpoint specs --------------------------------------------------------------------------


def test_io_fault_specs_parse_and_bad_ones_are_refused():
    (f,) = failpoints.parse_io_faults("fsync:message_log:EIO@3+")
    assert (f.op, f.log, f.errno, f.at, f.forever) == ("fsync", "message_log", errno.EIO, 3, True)
    assert [x.op for x in failpoints.parse_io_faults("write:*:ENOSPC, rename:checkpoint:EIO")] == ["write", "rename"]
    for bad in ("fsync:message_log", "sync:message_log:EIO", "fsync:message_log:ENOTANERRNO", "write:x:EIO@0"):
        with pytest.raises(ValueError, match="DELAYSERVER_IO_FAULT"):
            failpoints.parse_io_faults(bad)


def test_a_fault_fires_at_the_nth_hit_once_or_for_good(tmp_path, faults):
    log = MessageLog.open(tmp_path / "message_log")
    faults("write:message_log:EIO@2")
    log.append(message_record(1))
    with pytest.raises(StorageError):
        log.append(message_record(2))
    log.append(message_record(3))  # once: the third write goes through
    faults("write:message_log:ENOSPC@1+")
    for i in range(3):
        with pytest.raises(StorageError):
            log.append(message_record(10 + i))
    log.close()


# --- fsyncgate --------------------------------------------------------------------------------


def test_after_a_failed_fsync_no_later_fsync_of_the_file_succeeds_even_through_a_new_descriptor(tmp_path, faults):
    log = MessageLog.open(tmp_path / "data" / "message_log")
    log.append(message_record(1))
    faults("fsync:message_log:EIO")
    with pytest.raises(FsyncFailed):
        log.sync()
    faults("")
    log.append(message_record(2))
    path = log.path(log.active_base)
    with pytest.raises(FsyncFailed, match="earlier fsync"):
        fsync_path(path)  # a fresh descriptor: the real fsync would report success
    with pytest.raises(FsyncFailed):
        log.sync()
    assert str(path) in fsync_failures(tmp_path / "data")
    assert storage_failures(tmp_path / "data") and not storage_failures(tmp_path / "elsewhere")
    log.close()
    # Opening the data directory afresh is recovery: it trusts what is on disk, not the past.
    Store.open(tmp_path / "data").close()
    assert not fsync_failures(tmp_path / "data")


def test_a_failed_roll_fsync_leaves_the_batches_it_covered_unacknowledgeable(tmp_path, faults):
    log = MessageLog.open(tmp_path / "message_log", segment_bytes=400)
    log.append(message_record(1))
    log.append(message_record(2))  # written, not yet fsynced (a group commit waiting)
    faults("fsync:roll:EIO")
    with pytest.raises(FsyncFailed):
        log.append(message_record(3, body_bytes=300))  # does not fit: the roll's fsync fails
    with pytest.raises(FsyncFailed):
        fsync_path(log.path(log.active_base))  # what the flusher would do next
    log.close()


def test_a_failed_schedule_fsync_never_lets_a_checkpoint_name_those_sizes(tmp_path, faults):
    node = Node(tmp_path, START_MS)
    node.send([("m1", START_MS + 1000)])
    node.replay_all()
    node.replayer.checkpoint()
    before = read_checkpoint(node.replayer.checkpoint_path)
    node.send([("m2", START_MS + 2000)])
    node.replay_all()
    faults("fsync:schedule_log:EIO")
    with pytest.raises(FsyncFailed):
        trio.run(node.replayer.checkpoint_async)
    faults("")
    for _ in range(2):  # retried: still refused, the file's fsync is not trusted any more
        with pytest.raises(FsyncFailed):
            trio.run(node.replayer.checkpoint_async)
    assert read_checkpoint(node.replayer.checkpoint_path) == before


# --- one checkpoint writer --------------------------------------------------------------------


async def test_concurrent_checkpoint_writers_are_serialized_and_each_names_only_fsynced_sizes(tmp_path):
    node = Node(tmp_path, START_MS)
    node.send([(f"m{i}", START_MS + 1000 + i) for i in range(20)])
    node.replay_all()
    replayer: Replayer = node.replayer
    order = []
    real = replayer._write_checkpoint

    def write(snapshot):
        order.append(("begin", snapshot[2]["message_log_offset"]))
        real(snapshot)
        order.append(("end", snapshot[2]["message_log_offset"]))

    replayer._write_checkpoint = write

    async def more_and_checkpoint():
        node.send([("late", START_MS + 5000)])
        node.replay_all()
        await replayer.checkpoint_async()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(replayer.checkpoint_async)
        nursery.start_soon(replayer.checkpoint_async)
        nursery.start_soon(more_and_checkpoint)
    kinds = [k for k, _ in order]
    assert kinds == ["begin", "end"] * 3, "never two writers at once"
    ends = [o for k, o in order if k == "end"]
    assert ends == sorted(ends), "no older snapshot replaces a newer one"
    cp = read_checkpoint(replayer.checkpoint_path)
    assert cp["message_log_offset"] == node.store.message_log.end_offset
    assert not list(node.store.checkpoint_dir.glob("*.tmp"))
    for name, size in cp["schedule_sizes"].items():
        assert (node.store.schedule_log.directory / f"{name}.log").stat().st_size >= size


def test_a_failed_checkpoint_rename_leaves_the_old_checkpoint_and_no_temp_file(tmp_path, faults):
    node = Node(tmp_path, START_MS)
    node.send([("m1", START_MS + 1000)])
    node.replay_all()
    node.replayer.checkpoint()
    before = read_checkpoint(node.replayer.checkpoint_path)
    node.send([("m2", START_MS + 2000)])
    node.replay_all()
    faults("rename:checkpoint:EIO")
    with pytest.raises(StorageError):
        node.replayer.checkpoint()
    assert read_checkpoint(node.replayer.checkpoint_path) == before
    assert not list(node.store.checkpoint_dir.glob("*.tmp"))
    assert storage_failures(tmp_path), "an I/O error turns the node read-only"


# --- power loss ------------------------------------------------------------------------------


def write_log_with_hole(log_dir, hole_at: int) -> tuple[list[int], int]:
    """Five records in the active segment; record `hole_at` zeroed as an unsynced write lost to a
    power cut while later writes reached the disk. Returns (record offsets, file size)."""
    log = MessageLog.open(log_dir)
    log.append(b"".join(message_record(i) for i in range(5)))
    log.close()
    path = log_dir / f"{0:020d}.log"
    offsets = record_offsets(path)  # the size last
    raw = bytearray(path.read_bytes())
    raw[offsets[hole_at]:offsets[hole_at + 1]] = bytes(offsets[hole_at + 1] - offsets[hole_at])
    path.write_bytes(bytes(raw))
    return offsets[:-1], len(raw)


def test_a_hole_followed_by_valid_writes_within_the_unsynced_window_is_truncated_and_logged(tmp_path, caplog):
    offsets, size = write_log_with_hole(tmp_path / "ml", hole_at=2)
    caplog.set_level(logging.WARNING, logger="delayserver.storage")
    log = MessageLog.open(tmp_path / "ml", max_unsynced_bytes=size - offsets[2])
    assert log.end_offset == offsets[2]
    assert [o for o, _, _ in log.iter_from(0)] == offsets[:2]
    text = caplog.text
    assert "power loss" in text and f"offset {offsets[2]}" in text and "holding 2 whole records" in text
    log.close()


def test_a_hole_before_the_last_durable_offset_stays_corruption(tmp_path):
    offsets, size = write_log_with_hole(tmp_path / "ml", hole_at=1)
    with pytest.raises(CorruptSegment) as info:
        MessageLog.open(tmp_path / "ml", max_unsynced_bytes=size - offsets[2])
    assert info.value.offset == offsets[1]


def test_dispatch_log_holes_near_its_end_are_power_loss_too(tmp_path):
    node = Node(tmp_path, START_MS)
    node.send([(f"m{i}", START_MS + 1000 + i) for i in range(5)])
    node.replay_all()
    node.now = START_MS + 2000
    node.load_all()
    node.ticks.advance(node.now)
    fired = node.take()
    assert len(fired) == 5
    node.dispatch(fired)
    bucket = fired[0].bucket
    path = node.store.dispatch_log.path(bucket)
    node.crash()
    offsets = record_offsets(path)
    raw = bytearray(path.read_bytes())
    raw[offsets[1]:offsets[2]] = bytes(offsets[2] - offsets[1])  # lost; later records reached the disk
    path.write_bytes(bytes(raw))
    again = Node(tmp_path, node.now)
    assert set(again.store.dispatched(bucket)) == {fired[0].offset}, "the records past the hole are dropped"
    again.load_all()
    again.ticks.advance(again.now)
    assert sorted(f.message.message_id for f in again.take()) == ["m1", "m2", "m3", "m4"], "delivered again, not lost"
