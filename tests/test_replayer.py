"""The replayer: message_log into schedule segments, checkpoint, truncate-and-replay on open."""
from __future__ import annotations

import pytest
import trio

from delayserver.clock import TrioClock
from delayserver.replayer import Replayer
from delayserver.storage.checkpoint import read_checkpoint, write_checkpoint
from delayserver.storage.errors import DiskFull, StorageError
from delayserver.storage.record import HEADER_SIZE
from delayserver.wakeup import Wakeup
from tests.pipeline_node import SCALE_MS, START_MS, Node, run_until_idle


def bucket_of(t: int) -> int:
    return t - t % SCALE_MS


def schedule_files(root) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((root / "schedule_log").glob("*.log"))}


def three_buckets(n: int) -> list[tuple[str, int]]:
    return [(f"m{i}", START_MS + (i % 3) * SCALE_MS + i) for i in range(n)]


def test_replay_appends_each_record_to_its_bucket_with_its_message_log_offset(tmp_path):
    node = Node(tmp_path, START_MS)
    node.send(three_buckets(6))
    assert node.replay() == 6
    assert node.replay() == 0
    for bucket in node.store.schedule_log.buckets():
        assert len(list(node.store.schedule_log.records(bucket))) == 2
    node.crash()


async def test_one_pass_over_records_that_alternate_between_buckets_schedules_each_where_one_by_one_would(tmp_path):
    """A pass keeps the bucket it is appending to at hand and switches when a record falls in
    another: the segments, and where the lookups and the wheel find each message, are those of
    passes of one record each."""
    from delayserver.lookup import Lookup
    from delayserver.message import MessageState

    messages = [(f"m{i}", START_MS + [0, 1, 1, 0, 2, 0, 2, 2, 1][i % 9] * SCALE_MS + i) for i in range(40)]
    nodes = {}
    for name in ("whole", "one-by-one"):
        node = Node(tmp_path / name, START_MS)
        node.load_all()  # the current bucket is loaded: its records go to the wheel as they are replayed
        lookup = Lookup(node.store)  # its indexes follow the segments from here on
        node.send(messages[:25])
        node.cancel("m3", messages[3][1])
        node.send(messages[25:])
        if name == "whole":
            assert node.replay() == len(messages) + 1  # one pass
        else:
            while node.replayer.offset < node.store.message_log.end_offset:
                assert node.replayer.replay_once(START_MS, node.replayer.offset + 1) <= 1
        for mid, sched in messages:
            found = await lookup.find(sched, mid)
            assert found.state == (MessageState.CANCELLED if mid == "m3" else MessageState.PENDING), mid
        files = schedule_files(tmp_path / name)
        fired = [(f.bucket, f.offset, f.message.message_id, f.message.schedule_time) for f in run_until_idle(node)]
        nodes[name] = (files, fired)
        node.crash()
    (files, fired), (files_one_by_one, fired_one_by_one) = nodes["whole"], nodes["one-by-one"]
    assert len(files) == 3 and files == files_one_by_one
    assert fired == fired_one_by_one and sorted(f[2] for f in fired) == sorted(m for m, _ in messages if m != "m3")


def test_replay_stops_at_the_limit(tmp_path):
    node = Node(tmp_path, START_MS)
    node.send(three_buckets(2))
    limit = node.store.message_log.end_offset
    node.send(three_buckets(2))
    assert node.replayer.replay_once(START_MS, limit) == 2
    assert node.replayer.offset == limit
    assert node.replayer.replay_once(START_MS, limit) == 0
    node.crash()


def test_a_crash_after_schedule_appends_before_the_checkpoint_schedules_nothing_twice(tmp_path):
    clean = tmp_path / "clean"
    node = Node(clean, START_MS)
    node.send(three_buckets(30))
    node.replay_all()
    node.replayer.checkpoint()
    node.crash()

    crashed = tmp_path / "crashed"
    node = Node(crashed, START_MS)
    node.send(three_buckets(10))
    node.replay_all()
    node.replayer.checkpoint()
    node.send(three_buckets(30)[10:])
    node.replay_all()  # appended to the segments, never checkpointed
    node.crash()

    again = Node(crashed, START_MS)
    assert schedule_files(crashed) == schedule_files(clean)
    assert sorted(f.message.message_id for f in run_until_idle(again)) == sorted(f"m{i}" for i in range(30))
    again.crash()


def test_a_torn_tail_on_a_schedule_segment_is_cut_and_replayed_once(tmp_path):
    node = Node(tmp_path, START_MS)
    node.send(three_buckets(9))
    node.replay_all()
    node.replayer.checkpoint()
    node.send([("late", START_MS + 5)])
    node.replay_all()
    node.crash()
    path = tmp_path / "schedule_log" / sorted(schedule_files(tmp_path))[0]
    with open(path, "ab") as f:  # the replayer died half way through writing "late"
        f.write(b"\x17" * (HEADER_SIZE + 11))

    again = Node(tmp_path, START_MS)
    fired = sorted(f.message.message_id for f in run_until_idle(again))
    assert fired == sorted([f"m{i}" for i in range(9)] + ["late"])
    again.crash()


def test_dispatch_records_of_offsets_past_the_checkpoint_stay_valid_after_a_restart(tmp_path):
    """Delivered before the crash but replayed after the last checkpoint: the restart rebuilds
    the same offsets, and the loader, started before anything new is replayed, skips them."""
    node = Node(tmp_path, START_MS)
    node.send([("m0", START_MS + 100)])
    node.replay_all()
    node.replayer.checkpoint()
    node.send([("m1", START_MS + 200), ("m2", START_MS + 300)])
    node.replay_all()
    delivered = run_until_idle(node)
    assert [f.message.message_id for f in delivered] == ["m0", "m1", "m2"]
    node.crash()

    again = Node(tmp_path, node.now)
    again.load_all()
    again.replay_all()
    assert run_until_idle(again) == []
    again.crash()


def test_a_cancel_replayed_before_a_crash_still_holds_after_it(tmp_path):
    """The cancel is after the checkpoint; its message before it and due when the node restarts."""
    t = START_MS + 2 * SCALE_MS
    node = Node(tmp_path, START_MS)
    node.send([("m", t), ("n", t)])
    node.replay_all()
    node.replayer.checkpoint()
    node.cancel("m", t)
    node.replay_all()
    node.crash()

    again = Node(tmp_path, t + 1)
    again.load_all()
    again.ticks.advance(again.now)
    assert [f.message.message_id for f in again.take()] == ["n"]
    again.crash()


def test_sequence_counter_resumes_above_the_highest_sequence_ever_written(tmp_path):
    node = Node(tmp_path, START_MS)
    node.send(three_buckets(5))
    node.replay_all()
    node.replayer.checkpoint()
    node.send(three_buckets(3))
    node.replay_all()  # replayed past the checkpoint
    node.send(three_buckets(2))  # not replayed at all
    node.cancel("m0", START_MS)  # the highest sequence is a cancel's
    highest = node.next_sequence - 1
    assert highest == 11
    node.crash()
    again = Node(tmp_path, START_MS)
    assert again.replayer.max_sequence == highest
    again.crash()


def test_the_checkpoint_holds_the_offset_the_sequence_and_the_segment_sizes(tmp_path):
    node = Node(tmp_path, START_MS)
    node.send(three_buckets(6))
    node.replay_all()
    node.replayer.checkpoint()
    cp = read_checkpoint(node.replayer.checkpoint_path)
    assert cp["message_log_offset"] == node.store.message_log.end_offset
    assert cp["max_sequence"] == 6
    assert sorted(cp["schedule_sizes"].values()) == sorted(
        node.store.schedule_log.size(b) for b in node.store.schedule_log.buckets())
    node.crash()


def test_a_segment_shorter_than_its_checkpoint_stops_the_open(tmp_path):
    node = Node(tmp_path, START_MS)
    node.send(three_buckets(3))
    node.replay_all()
    node.replayer.checkpoint()
    node.crash()
    path = sorted((tmp_path / "schedule_log").glob("*.log"))[1]
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(StorageError, match="checkpoint says"):
        Node(tmp_path, START_MS)


def test_a_checkpoint_past_the_end_of_message_log_stops_the_open(tmp_path):
    node = Node(tmp_path, START_MS)
    node.send(three_buckets(3))
    node.replay_all()
    node.replayer.checkpoint()
    cp = read_checkpoint(node.replayer.checkpoint_path)
    node.crash()
    write_checkpoint(tmp_path / "checkpoint" / "replay.json", {**cp, "message_log_offset": 10**9})
    with pytest.raises(StorageError, match="past the end of message_log"):
        Node(tmp_path, START_MS)


def fill_the_disk_at_append(node, monkeypatch, nth: int) -> None:
    """Make the `nth` schedule_log append of `node` fail with DiskFull (the others go through)."""
    real_append = node.store.schedule_log.append
    calls = []

    def append_until_the_disk_fills(bucket, data, ids=None):
        calls.append(bucket)
        if len(calls) == nth:
            raise DiskFull("no space left on device")
        return real_append(bucket, data, ids)

    monkeypatch.setattr(node.store.schedule_log, "append", append_until_the_disk_fills)


def test_a_failed_pass_rolls_back_every_bucket_and_its_retry_appends_each_record_once(tmp_path, monkeypatch):
    clean = Node(tmp_path / "clean", START_MS)
    clean.send(three_buckets(12))
    clean.replay_all()
    clean.crash()

    node = Node(tmp_path / "full", START_MS)
    node.send(three_buckets(12))
    fill_the_disk_at_append(node, monkeypatch, 3)
    with pytest.raises(DiskFull):
        node.replay()
    assert node.replayer.offset == 0 and len(node.ticks.wheel) == 0
    assert all(node.store.schedule_log.size(b) == 0 for b in node.store.schedule_log.buckets())
    node.replay_all()
    assert schedule_files(tmp_path / "full") == schedule_files(tmp_path / "clean")
    node.crash()


def test_the_followers_get_each_record_once_even_when_a_pass_is_rolled_back(tmp_path, monkeypatch):
    """The dedupe table and the schedules follow what replay appended: a pass that a full disk rolls
    back hands them nothing, and its retry hands each record once."""
    node = Node(tmp_path, START_MS)
    node.send(three_buckets(12))
    followed = []
    node.replayer.on_records = lambda data, records, own: followed.extend(
        (rtype, bytes(data[s:e])) for rtype, s, e in records)
    fill_the_disk_at_append(node, monkeypatch, 2)
    with pytest.raises(DiskFull):
        node.replay()
    assert followed == []
    node.replay_all()
    assert len(followed) == 12 and len(set(followed)) == 12
    node.crash()


async def test_serve_replays_new_data_and_checkpoints_every_interval(tmp_path, autojump_clock):
    node = Node(tmp_path, START_MS)
    clock = TrioClock(START_MS)
    new_data = Wakeup()
    async with trio.open_nursery() as nursery:
        await nursery.start(node.replayer.serve, clock, lambda: node.store.message_log.end_offset, new_data)
        node.send(three_buckets(3))
        new_data.set()
        await trio.sleep(0.01)
        assert node.replayer.offset == node.store.message_log.end_offset
        assert node.replayer.checkpointed_offset == 0
        await trio.sleep(1)
        # The fsyncs run in a worker thread, which the mock clock does not wait for: poll.
        while node.replayer.checkpointed_offset != node.replayer.offset:
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert Replayer.open(node.store, node.ticks).offset == node.store.message_log.end_offset
    node.crash()


def test_a_checkpoint_gives_back_the_pages_of_the_buckets_not_loaded_yet_and_keeps_the_loaded_ones(tmp_path,
                                                                                                      monkeypatch):
    """Once a checkpoint's fsync covers them, the pages of a bucket after the one the wheel is
    loading go back to the kernel (it reads them again when the bucket loads); the loaded bucket's
    stay for its deliveries, and before anything is loaded every page stays."""
    import os

    from tests.damage import gives_back_pages, resident_map
    if not gives_back_pages(tmp_path):
        pytest.skip("this file system keeps its pages whatever it is told")
    from delayserver.storage import segment
    monkeypatch.setattr(segment, "GIVE_BACK_LAG_BYTES", 4096)  # (a MiB: the segments here are smaller)
    node = Node(tmp_path, START_MS)
    body = b"x" * 3000
    later = START_MS + 5 * SCALE_MS

    def resident(bucket: int) -> list[bool]:
        fd = os.open(node.store.schedule_log.path(bucket), os.O_RDONLY)
        try:
            return resident_map(fd)
        finally:
            os.close(fd)

    node.send([(f"a{i}", START_MS + 10 + i) for i in range(20)] + [(f"b{i}", later + i) for i in range(20)], body)
    node.replay_all()
    node.replayer.checkpoint()  # nothing loaded: nothing handed back
    assert all(resident(bucket_of(START_MS))) and all(resident(later))
    node.load_all()
    assert node.ticks.loads_later(later) and not node.ticks.loads_later(bucket_of(START_MS))
    node.send([(f"c{i}", START_MS + 100 + i) for i in range(20)] + [(f"d{i}", later + 100 + i) for i in range(20)], body)
    node.replay_all()
    node.replayer.checkpoint()
    kept, given = resident(bucket_of(START_MS)), resident(later)
    assert all(kept)
    assert not any(given[:-2]) and all(given[-1:])  # the last page, and the lag's before it, kept
    node.crash()
