"""The due queue's reads: records in the page cache are read on the event loop, the others in a
worker thread (the loop never waits for the disk); a due record damaged after it was loaded is
handed to `on_corrupt` (the node quarantines its bucket), settled and skipped, instead of stopping
delivery, whichever way it was read."""
from __future__ import annotations

import threading

import pytest
import trio

from delayserver.storage.errors import CorruptSegment
from delayserver.storage.record import iter_records
from delayserver.wheel.due_queue import DueQueue
from tests.damage import evict
from tests.pipeline_node import START_MS, Node


def _node(tmp_path, n=5):
    node = Node(tmp_path, START_MS)
    due_at = START_MS + 500
    node.send([(f"m-{i}", due_at) for i in range(n)])
    node.replay_all()
    node.load_all()
    [bucket] = node.store.schedule_log.buckets()
    node.now = due_at + 10
    node.ticks.advance(node.now)
    return node, bucket


def _damage(node, bucket):
    path = node.store.schedule_log.path(bucket)
    raw = bytearray(path.read_bytes())
    offsets = [pos for pos, *_ in iter_records(bytes(raw))]
    raw[offsets[2] + 30] ^= 0xFF  # inside the third record, after the loader read it
    path.write_bytes(bytes(raw))


class ThreadSpy:
    """Wraps `ticks.disk_reader`: records the thread each disk read ran in."""

    def __init__(self, ticks):
        self.threads = []
        disk_reader = ticks.disk_reader

        def spy(refs):
            read = disk_reader(refs)

            def run():
                self.threads.append(threading.current_thread())
                return read()
            return run
        ticks.disk_reader = spy


async def test_records_in_the_page_cache_are_read_on_the_loop(tmp_path):
    node, _ = _node(tmp_path)
    spy = ThreadSpy(node.ticks)
    due = DueQueue(node.ticks)
    taken = await due.take(100)
    assert sorted(d.message.message_id for d in taken) == [f"m-{i}" for i in range(5)]
    assert due.disk_reads == 0 and spy.threads == []


async def test_records_not_in_the_page_cache_are_read_in_a_worker_thread(tmp_path):
    node, bucket = _node(tmp_path)
    evict(node.store.schedule_log.path(bucket))
    spy = ThreadSpy(node.ticks)
    due = DueQueue(node.ticks)
    taken = await due.take(100)
    assert sorted(d.message.message_id for d in taken) == [f"m-{i}" for i in range(5)]
    assert [d.message.body for d in taken] == [b"b"] * 5
    # A read that misses the cache starts the kernel reading ahead: the records after the first
    # miss may be in memory by the time they are read, and on a fast disk the first one too.
    if due.disk_reads == 0:
        pytest.skip("the disk answered every read that may not wait at once: none went to a thread")
    assert spy.threads and threading.main_thread() not in spy.threads


def _evict(node) -> None:
    """Every page-cache-only read of schedule_log misses, the compiled one's too."""
    node.store.schedule_log.read_cached = lambda bucket, start=0, end=None: None
    node.store.schedule_log.cached_reader = lambda bucket: None


async def test_a_reset_while_the_disk_is_read_hands_out_nothing(tmp_path):
    node, bucket = _node(tmp_path)
    # Every record misses the cache. (Evicting the segment was not enough: once, in a full-suite
    # run, all five records were found in the page cache after it, so nothing went to the thread
    # this test is about.)
    _evict(node)
    disk_reader = node.ticks.disk_reader

    def reset_meanwhile(refs):
        read = disk_reader(refs)
        node.ticks.reset(node.now)  # as a change of role does, while the thread reads
        return read
    node.ticks.disk_reader = reset_meanwhile
    assert await DueQueue(node.ticks).take(100) == []


@pytest.mark.parametrize("evicted", [False, True], ids=["cached", "read-from-disk"])
async def test_an_unreadable_due_record_is_quarantined_settled_and_skipped(tmp_path, evicted):
    node, bucket = _node(tmp_path)
    _damage(node, bucket)
    if evicted:
        # Every record misses the cache (the kernel's readahead after a real miss would bring the
        # damaged one back in memory before it is read, at random): all are read in the thread.
        _evict(node)
    quarantined = []
    due = DueQueue(node.ticks, on_corrupt=lambda b, e: quarantined.append((b, e)))
    taken = await due.take(100)
    assert sorted(d.message.message_id for d in taken) == ["m-0", "m-1", "m-3", "m-4"]
    [(b, error)] = quarantined
    assert b == bucket and isinstance(error, CorruptSegment)
    assert len(node.ticks.inflight) == 4  # the damaged one is settled in memory, not owed
    assert due.disk_reads == (5 if evicted else 0)


async def test_without_on_corrupt_the_error_is_raised(tmp_path):
    node, bucket = _node(tmp_path)
    _damage(node, bucket)
    with pytest.raises(CorruptSegment):
        await DueQueue(node.ticks).take(100)


async def test_take_now_hands_out_what_is_in_memory_without_waiting(tmp_path):
    node, _ = _node(tmp_path)
    spy = ThreadSpy(node.ticks)
    due = DueQueue(node.ticks)
    taken = due.take_now(100)
    assert sorted(d.message.message_id for d in taken) == [f"m-{i}" for i in range(5)]
    assert due.waiting == 0 and spy.threads == [] and len(node.ticks.inflight) == 5


async def test_what_take_now_cannot_read_from_memory_waits_for_the_next_take(tmp_path):
    node, _ = _node(tmp_path)
    _evict(node)
    spy = ThreadSpy(node.ticks)
    due = DueQueue(node.ticks)
    assert due.take_now(100) is None
    # Taken off the ready queue, not read yet: still waiting, and nothing read in a thread yet.
    assert not node.ticks.ready and due.waiting == 5 and spy.threads == []
    assert due.take_now(100) is None  # (the next `take` finishes those first)
    taken = await due.take(2)  # the whole of what was left, whatever the limit
    assert sorted(d.message.message_id for d in taken) == [f"m-{i}" for i in range(5)]
    assert due.waiting == 0 and due.disk_reads == 5 and threading.main_thread() not in spy.threads


async def test_what_take_now_left_is_handed_out_by_no_take_after_a_reset(tmp_path):
    node, bucket = _node(tmp_path)
    _damage(node, bucket)
    _evict(node)
    quarantined = []
    due = DueQueue(node.ticks, on_corrupt=lambda b, e: quarantined.append((b, e)))
    assert due.take_now(100) is None
    node.ticks.reset(node.now)  # a change of role before the dispatch task took them
    assert await due.take(100) == []
    assert quarantined == [] and due.waiting == 0  # nothing of the old generation acted on


async def test_take_now_takes_nothing_while_a_take_reads_from_disk(tmp_path):
    """The messages behind those a take is reading in a worker thread go after them."""
    node, _ = _node(tmp_path)
    _evict(node)
    release, started = threading.Event(), threading.Event()
    disk_reader = node.ticks.disk_reader

    def slow_reader(refs):
        read = disk_reader(refs)

        def run():
            started.set()
            release.wait(10)
            return read()
        return run
    node.ticks.disk_reader = slow_reader
    due = DueQueue(node.ticks)
    taken = []
    async with trio.open_nursery() as nursery:
        async def take() -> None:
            taken.extend(await due.take(2))
        nursery.start_soon(take)
        assert await trio.to_thread.run_sync(started.wait, 10)
        assert due.take_now(100) is None
        assert len(node.ticks.ready) == 3  # nothing taken past the two being read
        release.set()
    assert len(taken) == 2 and len(node.ticks.ready) == 3
