"""The per-bucket indexes behind status and cancel: right answers, O(log n) reads, restarts."""
from __future__ import annotations

import array
import random
import threading

import numpy as np
import pytest
import trio

from delayserver.lookup import Lookup
from delayserver.message import MessageState
from delayserver.storage import id_index
from delayserver.storage.errors import CorruptSegment
from delayserver.storage.id_index import SortedRuns
from delayserver.storage.record import RecordType, scheduled_key
from delayserver.storage.time_index import TimeIndex
from tests.damage import evict
from tests.pipeline_node import SCALE_MS, START_MS, Fired, Node


def bucket_of(t: int) -> int:
    return t - t % SCALE_MS


def test_sorted_runs_agree_with_a_model_through_merges_and_drops():
    rng = random.Random(7)
    runs = SortedRuns(with_values=True)
    model: list[tuple[int, int]] = []
    for i in range(20_000):
        key = rng.randrange(5000)
        runs.add(key, i)
        model.append((key, i))
        if i % 997 == 0:
            lo = rng.randrange(5000)
            hi = lo + rng.randrange(50)
            assert sorted(runs.find(lo, hi)) == sorted((k, v) for k, v in model if lo <= k < hi)
    assert len(runs) == len(model)
    # Geometric merging: a handful of runs, not one per sealed tail.
    assert len(runs.runs) <= 12
    runs.drop_where(lambda keys, vals: vals < np.uint64(10_000))
    model = [(k, v) for k, v in model if v < 10_000]
    assert len(runs) == len(model)
    for key in range(0, 5000, 37):
        assert sorted(runs.find(key, key + 1)) == sorted(e for e in model if e[0] == key)


def test_equal_keys_come_out_oldest_first():
    runs = SortedRuns(with_values=True)
    for i in range(3 * id_index.TAIL_KEYS + 5):
        runs.add(42 if i % 100 == 0 else i + 100, i)
    assert [v for _, v in runs.find(42, 43)] == [i for i in range(3 * id_index.TAIL_KEYS + 5) if i % 100 == 0]


async def test_a_big_merge_runs_in_a_worker_thread_and_keeps_every_key(monkeypatch):
    monkeypatch.setattr(id_index, "INLINE_MERGE_KEYS", 1024)
    runs = SortedRuns()
    for i in range(40_000):
        runs.add((i * 7919) % 40_000)
    before = len(runs.runs)
    while await runs.compact():
        pass
    assert len(runs.runs) <= before and len(runs) == 40_000
    keys = np.concatenate([k for k, _ in runs.runs] + [np.array(runs._tail_keys, dtype=np.uint64)])
    assert sorted(keys.tolist()) == list(range(40_000))


async def test_runs_merged_inline_while_a_big_merge_is_in_its_thread_are_kept_and_the_stale_merge_dropped(
        monkeypatch):
    # The worker thread's merge waits until the event loop has sealed more keys, merging the runs
    # the thread picked inline: the thread's result is stale then, and comparing it with the runs
    # (numpy arrays of other shapes) must not raise.
    import threading

    runs = SortedRuns()
    sealed_more = threading.Event()
    real_merge = id_index._merge

    def slow_merge(picked):
        if threading.current_thread() is not threading.main_thread():
            sealed_more.wait(10)
        return real_merge(picked)

    monkeypatch.setattr(id_index, "_merge", slow_merge)
    # Runs of 1000, 150 and 100 keys: the worker merges the last two. Sealing 512 keys meanwhile
    # merges the last run with them inline (at most 700 keys inline), so the worker's two runs
    # are no longer the runs' last two.
    monkeypatch.setattr(id_index, "INLINE_MERGE_KEYS", 700)
    runs.runs = [(np.arange(0, 1000, dtype=np.uint64), None), (np.arange(1000, 1150, dtype=np.uint64), None),
                 (np.arange(1150, 1250, dtype=np.uint64), None)]
    assert runs.merge_start() == 1
    first = 1250

    async def seal_meanwhile():
        for k in range(first, first + id_index.TAIL_KEYS):
            runs.add(k)  # seals once: the inline merge takes the last picked run with it
        assert len(runs.runs) == 3 and len(runs.runs[2][0]) == 100 + id_index.TAIL_KEYS
        sealed_more.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(seal_meanwhile)
        await runs.compact()
    keys = np.concatenate([k for k, _ in runs.runs] + [np.array(runs._tail_keys, dtype=np.uint64)])
    assert sorted(keys.tolist()) == list(range(first + id_index.TAIL_KEYS))


@pytest.mark.parametrize("tail", [id_index.TAIL_SCAN_KEYS, id_index.TAIL_SCAN_KEYS + 1, id_index.TAIL_KEYS - 1])
def test_a_tail_is_searched_the_same_key_by_key_or_in_numpy_up_to_the_largest_key(tail):
    top = (1 << 64) - 1
    runs = SortedRuns(with_values=True)
    keys = [top, top - 1, 0, 5, 5] + [7 + i for i in range(tail - 5)]
    for i, key in enumerate(keys):
        runs.add(key, i)
    assert runs.runs == [] and len(runs) == tail
    assert runs.find(top, 1 << 64) == [(top, 0)]
    assert runs.find(top - 1, 1 << 70) == [(top, 0), (top - 1, 1)]
    assert runs.find(top - 1, top) == [(top - 1, 1)]
    assert runs.find(5, 6) == [(5, 3), (5, 4)]  # equal keys in insertion order
    assert runs.find(0, 7) == [(0, 2), (5, 3), (5, 4)]
    assert runs.find(1, 5) == []
    runs.add(9, 99)  # the tail still grows after a search (no view of its buffer left behind)
    assert (9, 99) in runs.find(9, 10)


def _messages(n: int, rng: random.Random) -> list[tuple[str, int]]:
    return [(f"order-{i}", START_MS + rng.randrange(SCALE_MS)) for i in range(n)]


async def test_status_agrees_with_the_logs_for_pending_cancelled_delivered_and_unknown(tmp_path):
    rng = random.Random(3)
    node = Node(tmp_path, START_MS)
    look = Lookup(node.store)
    msgs = _messages(3000, rng)
    node.send(msgs)
    cancelled = msgs[::7]
    for mid, sched in cancelled:
        node.cancel(mid, sched)
    node.replay_all()
    # Deliver some (dispatch records written as the sender writes them).
    offsets = {}
    for bucket in node.store.schedule_log.buckets():
        for offset, rtype, payload in node.store.schedule_log.records(bucket):
            if rtype == RecordType.SCHEDULED:
                offsets[scheduled_key(payload, 0)[3]] = (bucket, offset)
    delivered = [m for m in msgs[1::5] if m not in cancelled]
    node.dispatch([Fired(0, *offsets[mid], None, START_MS) for mid, _ in delivered])
    for mid, sched in msgs:
        found = await look.find(sched, mid)
        assert look.find_now(sched, mid) == found  # built: the same answer without a wait
        if (mid, sched) in delivered:
            assert found.state == MessageState.DELIVERED and found.broker_group == "brokers-a"
        elif (mid, sched) in cancelled:
            assert found.state == MessageState.CANCELLED
        else:
            assert found.state == MessageState.PENDING
    assert (await look.find(msgs[0][1], "never-sent")).state == MessageState.UNKNOWN
    assert (await look.find(msgs[0][1] + 1, msgs[0][0])).state == MessageState.UNKNOWN
    assert look.find_now(msgs[0][1], "never-sent").state == MessageState.UNKNOWN
    assert look.find_now(START_MS + 5 * SCALE_MS, "a-bucket-never-written").state == MessageState.UNKNOWN
    node.crash()


async def test_find_now_answers_only_once_the_buckets_indexes_cover_it_building_a_slice_a_call(tmp_path):
    node = Node(tmp_path, START_MS, segment_bytes=64 << 20)
    msgs = [(f"order-{i}", START_MS + 1000) for i in range(4000)]
    node.send(msgs, body=b"x" * 200)
    node.cancel(*msgs[-1])
    node.replay_all()
    node.replayer.checkpoint()
    node.crash()

    node = Node(tmp_path, START_MS, segment_bytes=64 << 20)
    look = Lookup(node.store)
    bucket = bucket_of(START_MS)
    slices = -(-node.store.schedule_log.size(bucket) // id_index.BUILD_SLICE_BYTES)
    assert slices > 10
    answers = [look.find_now(START_MS + 1000, "order-0") for _ in range(slices + 2)]
    # None while the id index is being built (a slice per call); then the dispatch index's
    # turn (no dispatch_log: nothing to build); then the answer, the same as find's.
    assert answers[: slices - 1] == [None] * (slices - 1)
    assert answers[-1] == await look.find(START_MS + 1000, "order-0")
    assert answers[-1].state == MessageState.PENDING
    assert look.find_now(START_MS + 1000, msgs[-1][0]).state == MessageState.CANCELLED
    node.crash()


async def test_a_key_sharing_its_hash_with_another_is_told_apart_by_reading_the_record(tmp_path, monkeypatch):
    monkeypatch.setattr(id_index, "key_hash", lambda sched, mid: 5)  # every key collides
    monkeypatch.setattr(id_index, "_native_id_keys", None)  # (the compiled keys hash for real)
    node = Node(tmp_path, START_MS)
    look = Lookup(node.store)
    node.send([("a", START_MS + 10), ("b", START_MS + 10), ("c", START_MS + 20)])
    node.cancel("b", START_MS + 10)
    node.replay_all()
    assert (await look.find(START_MS + 10, "a")).state == MessageState.PENDING
    assert (await look.find(START_MS + 10, "b")).state == MessageState.CANCELLED
    assert (await look.find(START_MS + 10, "c")).state == MessageState.UNKNOWN
    node.crash()


async def test_a_lookup_reads_a_few_records_not_the_bucket(tmp_path):
    node = Node(tmp_path, START_MS, segment_bytes=64 << 20)
    look = Lookup(node.store)
    msgs = _messages(20_000, random.Random(5))
    node.send(msgs, body=b"x" * 200)
    node.replay_all()
    bucket = bucket_of(msgs[0][1])
    assert node.store.schedule_log.size(bucket) > 4 << 20
    read = []
    log = node.store.schedule_log

    def counting(real):
        def count(bucket, start=0, end=None):
            data = real(bucket, start, end)
            read.append(len(data))
            return data
        return count

    log.read, log.read_cached = counting(log.read), counting(log.read_cached)
    for mid, sched in msgs[::1000]:
        read.clear()
        assert (await look.find(sched, mid)).state == MessageState.PENDING
        assert sum(read) < 4096, read  # the candidate records, never the 4 MiB bucket
    node.crash()


async def test_after_a_restart_the_index_is_rebuilt_from_the_segments_and_follows_new_appends(tmp_path):
    rng = random.Random(11)
    node = Node(tmp_path, START_MS)
    msgs = _messages(2000, rng)
    node.send(msgs)
    node.cancel(*msgs[0])
    node.replay_all()
    node.replayer.checkpoint()
    node.crash()

    node = Node(tmp_path, START_MS)
    look = Lookup(node.store)
    assert sorted(look.ids.unbuilt()) == sorted({bucket_of(s) for _, s in msgs})  # nothing read at open: the node starts at once
    later = _messages(2100, rng)[2000:]
    node.send(later)
    node.replay_all()  # appended while the bucket is not indexed yet: the build reads them
    assert (await look.find(msgs[0][1], msgs[0][0])).state == MessageState.CANCELLED
    for mid, sched in msgs[1::50] + later[::10]:
        assert (await look.find(sched, mid)).state == MessageState.PENDING
    assert look.ids.unbuilt() == []
    more = [("after-build", START_MS + 5)]
    node.send(more)
    node.replay_all()
    assert (await look.find(START_MS + 5, "after-build")).state == MessageState.PENDING
    node.crash()


async def test_a_truncated_segment_drops_what_it_cut_from_the_index(tmp_path):
    node = Node(tmp_path, START_MS)
    look = Lookup(node.store)
    node.send([("kept", START_MS + 1)])
    node.replay_all()
    bucket = bucket_of(START_MS + 1)
    size = node.store.schedule_log.size(bucket)
    node.send([("cut", START_MS + 2)])
    node.replay_all()
    assert (await look.find(START_MS + 2, "cut")).state == MessageState.PENDING
    node.store.schedule_log.truncate(bucket, size)  # as a rolled-back replay pass does
    assert (await look.find(START_MS + 2, "cut")).state == MessageState.UNKNOWN
    assert (await look.find(START_MS + 1, "kept")).state == MessageState.PENDING
    node.crash()


async def test_a_saved_index_is_read_back_at_start_and_only_the_segment_past_it_is_parsed(tmp_path):
    rng = random.Random(13)
    node = Node(tmp_path, START_MS)
    look = Lookup(node.store, tmp_path / "index")
    msgs = [(f"order-{i}", START_MS - START_MS % SCALE_MS + SCALE_MS + rng.randrange(SCALE_MS)) for i in range(3000)]
    node.send(msgs)
    node.cancel(*msgs[5])
    node.replay_all()
    bucket = bucket_of(msgs[0][1])
    assert await look.ids.save(every=1) == 1
    saved_at = node.store.schedule_log.size(bucket)
    later = [(f"later-{i}", msgs[0][1] + i) for i in range(50)]
    node.send(later)
    node.replay_all()
    node.replayer.checkpoint()
    node.crash()

    node = Node(tmp_path, START_MS)
    look = Lookup(node.store, tmp_path / "index")
    parsed = []

    def counting(real):
        def read(bucket, start=0, end=None):
            data = real(bucket, start, end)
            if data is not None and len(data) > 1024:  # a build slice, not a lookup's read of one record
                parsed.append(start)
            return data
        return read

    node.store.schedule_log.read = counting(node.store.schedule_log.read)
    node.store.schedule_log.read_cached = counting(node.store.schedule_log.read_cached)
    assert look.ids.buckets[bucket].covered == saved_at  # read back, not rebuilt
    assert (await look.find(msgs[5][1], msgs[5][0])).state == MessageState.CANCELLED
    for mid, sched in msgs[::97] + later[::7]:
        assert (await look.find(sched, mid)).state == MessageState.PENDING
    assert parsed and min(parsed) >= saved_at  # only the part written after the save was parsed
    node.crash()


async def test_a_saved_index_of_another_segment_or_a_damaged_one_is_ignored(tmp_path):
    node = Node(tmp_path, START_MS)
    look = Lookup(node.store, tmp_path / "index")
    node.send([("first-life", START_MS + 1)])
    node.replay_all()
    bucket = bucket_of(START_MS + 1)
    assert await look.ids.save(every=1) == 1
    saved = look.ids._saved_path(bucket).read_bytes()
    node.store.schedule_log.remove(bucket)  # the cleaner deletes the bucket: its index goes too
    assert not look.ids._saved_path(bucket).exists()
    node.send([("second-life", START_MS + 2)])
    node.replay_all()
    node.replayer.checkpoint()
    node.crash()
    look.ids._saved_path(bucket).write_bytes(saved)  # a stale file left by a crash
    node = Node(tmp_path, START_MS)
    look = Lookup(node.store, tmp_path / "index")
    assert (await look.find(START_MS + 2, "second-life")).state == MessageState.PENDING
    node.crash()
    for damaged in (saved[:-3] + b"xyz", saved[:-3], saved + b"\0", saved[:20]):  # bad crc, length or head
        look.ids._saved_path(bucket).write_bytes(damaged)
        node = Node(tmp_path, START_MS)
        look = Lookup(node.store, tmp_path / "index")
        assert (await look.find(START_MS + 2, "second-life")).state == MessageState.PENDING
        node.crash()


async def test_a_torn_dispatch_log_tail_does_not_stop_the_index_from_serving(tmp_path):
    import trio

    node = Node(tmp_path, START_MS)
    node.send([("a", START_MS + 1), ("b", START_MS + 2)])
    node.replay_all()
    fired = []
    for bucket in node.store.schedule_log.buckets():
        for offset, rtype, payload in node.store.schedule_log.records(bucket):
            fired.append(Fired(0, bucket, offset, None, START_MS))
    node.dispatch(fired[:1])
    bucket = fired[0].bucket
    with open(node.store.dispatch_log.path(bucket), "ab") as f:
        f.write(b"\xff" * 40)  # a torn tail, as a crash mid-write leaves
    node.replayer.checkpoint()
    node.crash()
    node = Node(tmp_path, START_MS)
    look = Lookup(node.store)
    async with trio.open_nursery() as nursery:
        await nursery.start(look.serve)
        await trio.sleep(0)
        # The loader truncates the torn tail before it loads the bucket; then lookups answer.
        node.store.dispatch_log.recover_tail(bucket)
        assert (await look.find(START_MS + 1, "a")).state == MessageState.DELIVERED
        assert (await look.find(START_MS + 2, "b")).state == MessageState.PENDING
        nursery.cancel_scope.cancel()
    node.crash()


def _journal(look, bucket):
    return look.ids._saved_path(bucket).with_suffix(".idj")


def _fresh(tmp_path):
    """A new node with a saved id index, and the bucket the tests fill: (node, lookup, bucket)."""
    node = Node(tmp_path, START_MS)
    return node, Lookup(node.store, tmp_path / "index"), bucket_of(START_MS) + SCALE_MS


def _restart(node, tmp_path, while_down=None):
    """Checkpoint, crash, run `while_down` (if given), and open the node again with its saved
    indexes: (node, lookup)."""
    node.replayer.checkpoint()
    node.crash()
    if while_down is not None:
        while_down()
    node = Node(tmp_path, START_MS)
    return node, Lookup(node.store, tmp_path / "index")


async def _all_pending(look, msgs):
    for mid, sched in msgs:
        assert (await look.find(sched, mid)).state == MessageState.PENDING


def _grow(node, bucket_start, first, count):
    msgs = [(f"m-{i}", bucket_start + SCALE_MS // 2 + i) for i in range(first, first + count)]
    node.send(msgs)
    node.replay_all()
    return msgs


async def test_later_saves_append_to_a_journal_and_a_restart_reads_file_and_journal(tmp_path):
    node, look, bucket = _fresh(tmp_path)
    start = bucket
    msgs = _grow(node, start, 0, 400)
    assert await look.ids.save(every=1) == 1
    first = look.ids._saved_path(bucket).read_bytes()
    assert not _journal(look, bucket).exists()
    for round_ in range(3):
        msgs += _grow(node, start, 400 + 10 * round_, 10)
        assert await look.ids.save(every=1) == 1
    assert look.ids._saved_path(bucket).read_bytes() == first  # the file was not written again
    assert _journal(look, bucket).stat().st_size == 3 * (id_index._CHUNK.size + 8 * 10)
    covered = look.ids.buckets[bucket].covered
    node, look = _restart(node, tmp_path)
    b = look.ids.buckets[bucket]
    assert b.covered == covered and len(b.runs) == len(msgs)  # read back whole, nothing to parse
    await _all_pending(look, msgs[::37] + msgs[-10:])
    node.crash()


async def test_a_damaged_chunk_ends_the_journal_and_the_segment_past_it_is_parsed(tmp_path):
    node, look, bucket = _fresh(tmp_path)
    start = bucket
    msgs = _grow(node, start, 0, 300)
    await look.ids.save(every=1)
    msgs += _grow(node, start, 300, 20)
    await look.ids.save(every=1)
    after_first_chunk = look.ids.buckets[bucket].covered
    msgs += _grow(node, start, 320, 20)
    await look.ids.save(every=1)
    journal = _journal(look, bucket)

    def damage():
        raw = bytearray(journal.read_bytes())
        raw[-5] ^= 0x40  # a key of the second chunk
        journal.write_bytes(bytes(raw))

    node, look = _restart(node, tmp_path, damage)
    assert look.ids.buckets[bucket].covered == after_first_chunk  # the first chunk only
    await _all_pending(look, msgs[::17] + msgs[-20:])
    node.crash()


async def test_a_journal_left_beside_a_file_written_whole_after_it_is_not_read(tmp_path):
    """A crash between writing the file whole and removing the old journal leaves chunks that
    name the old file: they must not chain onto the new one."""
    node, look, bucket = _fresh(tmp_path)
    start = bucket
    _grow(node, start, 0, 100)
    await look.ids.save(every=1)
    _grow(node, start, 100, 10)
    await look.ids.save(every=1)
    old_journal = _journal(look, bucket).read_bytes()
    look.ids.buckets[bucket].saved_id = None  # as after a failed append: the next save is whole
    _grow(node, start, 110, 10)
    await look.ids.save(every=1)
    assert not _journal(look, bucket).exists()
    whole = look.ids.buckets[bucket].covered
    node, look = _restart(node, tmp_path, lambda: _journal(look, bucket).write_bytes(old_journal))
    assert look.ids.buckets[bucket].covered == whole
    assert len(look.ids.buckets[bucket].runs) == 120  # no key twice
    node.crash()


async def test_the_file_is_written_whole_again_once_the_journal_holds_as_many_keys(tmp_path):
    node, look, bucket = _fresh(tmp_path)
    start = bucket
    _grow(node, start, 0, 100)
    await look.ids.save(every=1)
    writes = []
    for i in range(12):
        _grow(node, start, 1000 + 20 * i, 20)
        before = look.ids._saved_path(bucket).stat().st_ino
        await look.ids.save(every=1)
        writes.append(look.ids._saved_path(bucket).stat().st_ino != before)
        if writes[-1]:
            assert not _journal(look, bucket).exists()
    # 100 keys in the file: chunks until the journal holds 100 (five of 20), then the file whole
    # (200 keys): chunks until the journal holds 200 (ten of 20 more), ...
    assert writes == [False] * 5 + [True] + [False] * 6
    assert len(look.ids.buckets[bucket].runs) == 100 + 12 * 20
    covered = look.ids.buckets[bucket].covered
    node, look = _restart(node, tmp_path)
    assert look.ids.buckets[bucket].covered == covered and len(look.ids.buckets[bucket].runs) == 340
    node.crash()


async def test_keys_indexed_while_a_save_runs_go_to_the_next_chunk(tmp_path, monkeypatch):
    node, look, bucket = _fresh(tmp_path)
    start = bucket
    msgs = _grow(node, start, 0, 200)
    real = id_index._write_saved

    def slow_whole(*args):  # the node appends while the first save's thread writes
        msgs.extend(_grow(node, start, 200, 7))
        return real(*args)

    monkeypatch.setattr(id_index, "_write_saved", slow_whole)
    await look.ids.save(every=1)
    monkeypatch.setattr(id_index, "_write_saved", real)
    msgs += _grow(node, start, 300, 3)
    await look.ids.save(every=1)
    assert _journal(look, bucket).exists()
    node, look = _restart(node, tmp_path)
    assert len(look.ids.buckets[bucket].runs) == 210
    assert look.ids.buckets[bucket].covered == node.store.schedule_log.size(bucket)
    await _all_pending(look, msgs)
    node.crash()


async def test_a_failed_append_makes_the_next_save_write_the_file_whole(tmp_path, monkeypatch):
    node, look, bucket = _fresh(tmp_path)
    start = bucket
    msgs = _grow(node, start, 0, 50)
    await look.ids.save(every=1)
    msgs += _grow(node, start, 50, 5)
    real = id_index._append_chunk

    def failing(path, *args):
        with open(path, "ab") as f:
            f.write(b"\x00" * 7)  # half a chunk, as a full disk leaves
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(id_index, "_append_chunk", failing)
    assert await look.ids.save(every=1) == 0
    monkeypatch.setattr(id_index, "_append_chunk", real)
    assert await look.ids.save(every=1) == 1
    assert not _journal(look, bucket).exists()  # written whole
    covered = look.ids.buckets[bucket].covered
    node, look = _restart(node, tmp_path)
    assert look.ids.buckets[bucket].covered == covered
    await _all_pending(look, msgs)
    node.crash()


async def test_a_file_of_the_first_format_is_read_and_the_next_save_writes_the_new_one(tmp_path):
    node, look, bucket = _fresh(tmp_path)
    start = bucket
    msgs = _grow(node, start, 0, 30)
    look.ids.buckets[bucket].runs.seal()
    keys = id_index._merge(look.ids.buckets[bucket].runs.runs)[0]
    body = keys.astype(">u8").tobytes()
    covered = look.ids.buckets[bucket].covered
    path = look.ids._saved_path(bucket)
    path.write_bytes(id_index._SAVED_HEAD.pack(id_index._SAVED_MAGIC, covered, len(keys),
                                               id_index.crc32c(body), look.ids._fingerprint(bucket)) + body)
    node, look = _restart(node, tmp_path)
    assert look.ids.buckets[bucket].covered == covered
    msgs += _grow(node, start, 30, 3)
    await look.ids.save(every=1)
    assert path.read_bytes()[:8] == id_index._SAVED_MAGIC_2 and not _journal(look, bucket).exists()
    await _all_pending(look, msgs)
    node.crash()


@pytest.mark.parametrize("kind", ["id", "time"])
async def test_the_keys_replay_hands_over_are_the_keys_a_build_parses_from_the_segments(tmp_path, kind):
    """Replay gives the indexes each record's type, id and time (no parse of what it just
    appended): an index it follows must hold exactly what one built from the segments holds, for
    messages and cancels, over several buckets and several passes."""
    rng = random.Random(17)
    node = Node(tmp_path, START_MS)

    def new_index():
        if kind == "id":
            return id_index.IdIndex(node.store.schedule_log)
        return TimeIndex(node.store.schedule_log, SCALE_MS)

    followed = new_index()
    msgs = [(f"order-{i}-é" if i % 9 == 0 else f"order-{i}", START_MS + rng.randrange(3 * SCALE_MS))
            for i in range(1500)]
    for part in range(3):
        node.send(msgs[part * 500:(part + 1) * 500])
        for mid, sched in msgs[part * 500:(part + 1) * 500:11]:
            node.cancel(mid, sched)
        node.replay(max_bytes=20_000)  # a few passes, each appending to several buckets
    node.replay_all()
    assert len({bucket_of(s) for _, s in msgs}) >= 3
    built = new_index()
    for bucket in node.store.schedule_log.buckets():
        assert followed.buckets[bucket].covered == node.store.schedule_log.size(bucket)
        await built.ensure(bucket)

    def keys(index, bucket):
        runs = index.buckets[bucket].runs
        runs.seal()
        return sorted(np.concatenate([k for k, _ in runs.runs]).tolist())

    for bucket in node.store.schedule_log.buckets():
        assert keys(followed, bucket) == keys(built, bucket)
    cancels = len(range(0, 500, 11)) * 3 if kind == "id" else 0  # the time index keeps messages only
    assert sum(len(keys(followed, b)) for b in node.store.schedule_log.buckets()) == 1500 + cancels
    node.crash()


def _pending_cancelled_delivered(node, sched: int, count: int) -> int:
    """`count` messages order-0... due at `sched` with 200-byte bodies, order-1 cancelled and
    order-2 delivered; returns their bucket."""
    msgs = [(f"order-{i}", sched) for i in range(count)]
    node.send(msgs, body=b"x" * 200)
    node.cancel(*msgs[1])
    node.replay_all()
    bucket = bucket_of(sched)
    offsets = {scheduled_key(payload, 0)[3]: offset for offset, rtype, payload
               in node.store.schedule_log.records(bucket) if rtype == RecordType.SCHEDULED}
    node.dispatch([Fired(0, bucket, offsets["order-2"], None, START_MS)])
    return bucket


async def test_a_record_not_in_the_page_cache_is_read_in_a_worker_thread_never_on_the_event_loop(tmp_path):
    """A big bucket is mostly on disk, not in memory: a status or cancel that waited for the disk
    on the event loop would hold every other connection while it seeks. `find_now` (the pump's
    answer in line) steps aside for a record not in memory; `find` reads it in a worker thread,
    the message's schedule record and its dispatch record alike, and answers what it answers
    from memory."""
    node = Node(tmp_path, START_MS)
    look = Lookup(node.store)
    sched = START_MS + 1000
    bucket = _pending_cancelled_delivered(node, sched, 100)
    asked = ["order-0", "order-1", "order-2", "never-sent"]
    expected = [await look.find(sched, mid) for mid in asked]  # every index built, all in memory
    assert [f.state for f in expected] == [MessageState.PENDING, MessageState.CANCELLED,
                                           MessageState.DELIVERED, MessageState.UNKNOWN]
    logs = (node.store.schedule_log, node.store.dispatch_log)
    on_loop, in_threads = [], []
    loop_thread = threading.current_thread()
    for log in logs:
        def read_spy(bucket, start=0, end=None, real=log.read):
            on_loop.append(threading.current_thread() is loop_thread)
            return real(bucket, start, end)

        def reader_spy(bucket, real=log.records_reader):
            read = real(bucket)

            def run(offsets, guess):
                in_threads.append(threading.current_thread() is not loop_thread)
                return read(offsets, guess)
            return run
        log.read, log.records_reader = read_spy, reader_spy

    # The files dropped from the page cache: whether the kernel then answers a read that may not
    # wait (RWF_NOWAIT) at once depends on the disk, but no lookup reads with one that may wait
    # on the event loop.
    for mid, answer in zip(asked, expected):
        evict(node.store.schedule_log.path(bucket), node.store.dispatch_log.path(bucket))
        assert await look.find(sched, mid) == answer
    assert not any(on_loop), "a read that may wait for the disk on the event loop"

    # Every record missing from the page cache: find_now steps aside, find reads in a thread.
    for log in logs:
        log.read_cached = lambda bucket, start=0, end=None: None
    in_threads.clear()
    for mid, answer in zip(asked, expected):
        if answer.state != MessageState.UNKNOWN:  # an unknown id's hash names no record to read
            assert look.find_now(sched, mid) is None, f"{mid}: the event loop would wait for the disk"
        assert await look.find(sched, mid) == answer
    # order-0 and order-1: their schedule records; order-2: its schedule record, then its dispatch record.
    assert in_threads == [True] * 4
    assert not any(on_loop)
    node.crash()


async def test_a_bucket_the_cleaner_removes_while_its_record_is_read_from_disk_is_unknown(tmp_path):
    node = Node(tmp_path, START_MS)
    look = Lookup(node.store)
    sched = START_MS + 1000
    node.send([("order-0", sched)])
    node.replay_all()
    assert (await look.find(sched, "order-0")).state == MessageState.PENDING
    log = node.store.schedule_log
    log.read_cached = lambda bucket, start=0, end=None: None  # on disk only
    records_reader = log.records_reader

    def removed_meanwhile(bucket):
        read = records_reader(bucket)
        log.remove(bucket)  # as the cleaner does once a bucket is settled and past retention
        node.store.dispatch_log.remove(bucket)
        return read

    log.records_reader = removed_meanwhile
    with trio.fail_after(5):
        assert (await look.find(sched, "order-0")).state == MessageState.UNKNOWN
    node.crash()


def _on_disk_only(node):
    """Every read of the node's buckets misses the page cache; returns (whether each plain read
    ran on the event loop's thread, whether each index slice was read off it)."""
    on_loop, reads = [], []
    loop_thread = threading.current_thread()
    for log in (node.store.schedule_log, node.store.dispatch_log):
        def read_spy(bucket, start=0, end=None, real=log.read):
            on_loop.append(threading.current_thread() is loop_thread)
            return real(bucket, start, end)

        _disk_reads_only(log, reads)
        log.read = read_spy
    return on_loop, reads


async def test_an_index_slice_not_in_the_page_cache_is_read_in_a_worker_thread(tmp_path):
    """After a restart with no saved index, the first status in a bucket builds its indexes from
    the segments, 64 KiB a slice. A slice on disk is read in a worker thread (find_now steps aside),
    never with a read that waits for the disk on the event loop; the answers are those the
    indexes give once built from memory."""
    node = Node(tmp_path, START_MS)
    sched = START_MS + 1000
    bucket = _pending_cancelled_delivered(node, sched, 1500)  # about 400 KiB: several slices
    asked = ["order-0", "order-1", "order-2", "order-1499", "never-sent"]
    expected = [await Lookup(node.store).find(sched, mid) for mid in asked]
    assert [f.state for f in expected] == [MessageState.PENDING, MessageState.CANCELLED, MessageState.DELIVERED,
                                           MessageState.PENDING, MessageState.UNKNOWN]
    node.replayer.checkpoint()
    node.crash()

    node = Node(tmp_path, START_MS)
    look = Lookup(node.store)  # nothing saved: built from the segments
    on_loop, reads = _on_disk_only(node)
    assert look.find_now(sched, "order-0") is None, "the event loop would wait for the disk"
    assert look.ids.buckets[bucket].covered == 0
    for mid, answer in zip(asked, expected):
        assert await look.find(sched, mid) == answer
    assert look.ids.buckets[bucket].covered == node.store.schedule_log.size(bucket)
    assert len(reads) == 2 and all(in_thread for _, _, in_thread in reads)  # one read ahead for each index (under 1 MiB)
    assert not any(on_loop), "a read that may wait for the disk on the event loop"
    node.crash()


async def test_a_slice_read_from_disk_before_its_segment_is_cut_back_is_read_again(tmp_path):
    """A slice read in a worker thread may be stale when it is indexed: its segment cut back
    (a replay pass rolled back) and appended to again meanwhile. The index reads it again rather
    than give the new records the keys of the old ones."""
    node = Node(tmp_path, START_MS)
    sched = START_MS + 1000
    msgs = [(f"order-{i}", sched) for i in range(100)]
    node.send(msgs, body=b"x" * 200)
    node.replay_all()
    bucket = bucket_of(sched)
    log = node.store.schedule_log
    offsets = {scheduled_key(payload, 0)[3]: offset for offset, rtype, payload
               in log.records(bucket) if rtype == RecordType.SCHEDULED}
    look = Lookup(node.store)
    look.ids.buckets[bucket].covered = 0  # as after a restart with nothing saved
    look.ids.buckets[bucket].runs = id_index.SortedRuns(False)
    log.read_cached = lambda bucket, start=0, end=None: None
    range_reader = log.range_reader
    fresh = [(f"fresh-{i}", sched) for i in range(20)]
    reads = []

    def cut_back_meanwhile(bucket, start, end):
        read = range_reader(bucket, start, end)

        def run():
            data = read()
            reads.append(start)

            def cut_and_append():
                log.truncate(bucket, offsets["order-50"])
                node.send(fresh, body=b"y" * 200)
                node.replay_all()
            if len(reads) == 1:
                trio.from_thread.run_sync(cut_and_append)
            return data
        return run

    log.range_reader = cut_back_meanwhile
    with trio.fail_after(10):
        await look.ids.ensure(bucket)
    log.range_reader = range_reader
    assert reads == [0, 0]  # read again
    assert look.ids.buckets[bucket].covered == log.size(bucket)
    for mid, _ in fresh:
        assert (await look.find(sched, mid)).state == MessageState.PENDING
    assert (await look.find(sched, "order-49")).state == MessageState.PENDING
    assert (await look.find(sched, "order-50")).state == MessageState.UNKNOWN
    node.crash()


async def test_a_bucket_the_cleaner_removes_while_an_index_slice_is_read_is_left(tmp_path):
    node = Node(tmp_path, START_MS)
    sched = START_MS + 1000
    node.send([("order-0", sched)])
    node.replay_all()
    bucket = bucket_of(sched)
    look = Lookup(node.store)
    look.ids.buckets[bucket].covered = 0
    log = node.store.schedule_log
    log.read_cached = lambda bucket, start=0, end=None: None
    range_reader = log.range_reader

    def removed_meanwhile(bucket, start, end):
        read = range_reader(bucket, start, end)
        log.remove(bucket)  # as the cleaner does once a bucket is settled and past retention
        node.store.dispatch_log.remove(bucket)
        return read

    log.range_reader = removed_meanwhile
    with trio.fail_after(5):
        await look.ids.ensure(bucket)  # (serve builds with the same call: it must not fail)
        assert (await look.find(sched, "order-0")).state == MessageState.UNKNOWN
    node.crash()


def _disk_reads_only(log, reads: list | None = None) -> list[tuple[int, int, bool]]:
    """Make every read of `log` miss the page cache; returns the list (`reads`, or a new one) of
    the (start, end, off the event loop's thread) of each read its worker threads then make."""
    reads = [] if reads is None else reads
    loop_thread = threading.current_thread()
    range_reader = log.range_reader

    def counted(bucket, start, end):
        read = range_reader(bucket, start, end)

        def run():
            reads.append((start, end, threading.current_thread() is not loop_thread))
            return read()
        return run

    log.read_cached = lambda bucket, start=0, end=None: None
    log.range_reader = counted
    return reads


async def test_builders_of_one_bucket_share_each_read_from_disk_a_megabyte_at_a_time(tmp_path):
    """The index's own build and a status's both build a bucket not yet indexed: each range the
    disk is read for is read once, a megabyte at a time (one worker thread hop for sixteen
    slices), and indexed from memory a slice at a time."""
    node = Node(tmp_path, START_MS)
    sched = START_MS + 1000
    msgs = [(f"order-{i}", sched) for i in range(1500)]
    node.send(msgs, body=b"x" * 2000)  # about 3 MiB
    node.replay_all()
    bucket = bucket_of(sched)
    look = Lookup(node.store)
    look.ids.buckets[bucket].covered = 0  # as after a restart with nothing saved
    look.ids.buckets[bucket].runs = id_index.SortedRuns(False)
    log = node.store.schedule_log
    reads, slices = _disk_reads_only(log), []
    index = look.ids._index

    def one_slice(bucket, b, data, start, *, checked):
        slices.append(len(data))
        return index(bucket, b, data, start, checked=checked)

    look.ids._index = one_slice
    found = []

    async def status():
        found.append(await look.find(sched, "order-1499"))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(look.ids.ensure, bucket)
            nursery.start_soon(status)
    assert found[0].state == MessageState.PENDING
    size = log.size(bucket)
    assert look.ids.buckets[bucket].covered == size
    starts = [start for start, _, _ in reads]
    assert len(starts) == len(set(starts)) == -(-size // id_index.BUILD_READ_BYTES), reads
    assert all(end - start <= id_index.BUILD_READ_BYTES for start, end, _ in reads)
    assert max(slices) <= id_index.BUILD_SLICE_BYTES and len(slices) >= size // id_index.BUILD_SLICE_BYTES
    node.crash()


@pytest.mark.parametrize("tail", ["whole", "torn"])
async def test_a_build_from_disk_reads_a_record_bigger_than_its_read_and_stops_at_a_torn_tail(tmp_path, tail):
    """Read from disk a megabyte at a time, a record longer than that is read whole and indexed;
    a record cut short by the segment's end is damage (CorruptSegment), never a read again and
    again."""
    node = Node(tmp_path, START_MS)
    sched = START_MS + 1000
    node.send([(f"small-{i}", sched) for i in range(100)], body=b"x" * 2000)
    node.send([("big", sched)], body=b"y" * (id_index.BUILD_READ_BYTES + (1 << 19)))
    node.send([("after", sched)])
    node.replay_all()
    bucket = bucket_of(sched)
    log = node.store.schedule_log
    if tail == "torn":
        whole = log.size(bucket)
        last = log.read(bucket, whole - 64, whole)
        log.truncate(bucket, whole - 10)  # as a crash leaves it: the last record cut short
        assert log.read(bucket, whole - 64, whole - 10) == last[:-10]
    look = Lookup(node.store)
    look.ids.buckets[bucket].covered = 0
    look.ids.buckets[bucket].runs = id_index.SortedRuns(False)
    reads = _disk_reads_only(log)
    with trio.fail_after(10):
        if tail == "whole":
            await look.ids.ensure(bucket)
            assert look.ids.buckets[bucket].covered == log.size(bucket)
            for mid in ("small-0", "small-99", "big", "after"):
                assert (await look.find(sched, mid)).state == MessageState.PENDING
        else:
            with pytest.raises(CorruptSegment, match="cut short"):
                await look.ids.ensure(bucket)
            assert look.ids.buckets[bucket].covered < log.size(bucket)
    assert len(reads) <= 4, reads
    node.crash()


def test_the_dispatch_index_takes_the_sender_s_offsets_as_a_build_parses_them(tmp_path):
    """The sender names the schedule offsets of the dispatch records it appends (records of one
    length: one group's): the dispatch index following the log must hold what one built from the
    segment holds. An append of records of several lengths, or whose offsets do not match its
    records, is parsed."""
    from delayserver.storage.record import encode_dispatch_data, encode_dispatch_records
    node = Node(tmp_path, START_MS)
    bucket = START_MS - START_MS % SCALE_MS
    log_ = node.store.dispatch_log
    followed = id_index.DispatchIndex(log_)
    parsed = []
    index = followed._index
    followed._index = lambda *args, **kw: parsed.append(args[3]) or index(*args, **kw)
    rng = random.Random(3)
    for batch in range(20):
        offsets = [rng.randrange(1 << 30) for _ in range(rng.randrange(1, 40))]
        group = rng.choice(["spool", "a-longer-group-name"])
        records = encode_dispatch_records(START_MS + batch, group, [(o, o + 7) for o in offsets])
        if batch % 5 == 4:  # two groups' records in one append: several lengths, no names given
            more = encode_dispatch_records(START_MS, "g2", [(5, 6)])
            log_.append(bucket, b"".join(records + more), None)
            offsets.append(5)
        elif batch % 7 == 6:  # offsets that do not match the records: parsed instead
            log_.append(bucket, b"".join(records), offsets + [1])
        elif batch % 2:  # as the sender makes a batch of one bucket: one piece, the offsets in an array
            keys = array.array("Q", offsets)
            data = encode_dispatch_data(START_MS + batch, group, keys, array.array("q", [o + 7 for o in offsets]))
            assert data == b"".join(records)
            log_.append(bucket, data, keys)
        else:
            log_.append(bucket, b"".join(records), offsets)
    built = id_index.DispatchIndex(log_)
    built.buckets.clear()
    trio.run(built.ensure, bucket)

    def pairs(index):
        runs = index.buckets[bucket].runs
        runs.seal()
        return sorted(zip(np.concatenate([k for k, _ in runs.runs]).tolist(),
                          np.concatenate([v for _, v in runs.runs]).tolist()))

    assert followed.buckets[bucket].covered == log_.size(bucket)
    assert pairs(followed) == pairs(built) and len(pairs(built)) > 100
    assert len(parsed) == 6  # only the appends of batches 4, 6, 9, 13, 14 and 19 were parsed
    for offset, position in pairs(built)[:50]:  # each names a record of that offset
        assert followed.first(bucket, offset) <= position
    node.crash()
