"""Loading a big bucket goes in slices of about a millisecond; what falls due meanwhile goes out."""
from __future__ import annotations

import threading

import pytest
import trio
import trio.testing

from delayserver.wakeup import Wakeup
from delayserver.wheel import tick_manager
from delayserver.wheel.service import serve_ticks
from tests.pipeline_node import START_MS, Node

SCALE_MS = 60_000
B1 = START_MS - START_MS % SCALE_MS + SCALE_MS  # the next bucket
LOAD_AHEAD_MS = 30_000


@pytest.fixture
def threads_clock():
    """A mock clock that jumps only once every task has waited 20 ms of real time: a worker
    thread's read takes far less, so virtual time does not run on while one reads."""
    return trio.testing.MockClock(autojump_threshold=0.02)


def test_a_load_step_stops_after_its_time_budget_and_resumes_where_it_stopped(tmp_path):
    node = Node(tmp_path, B1 - LOAD_AHEAD_MS, load_ahead_ms=LOAD_AHEAD_MS)
    node.send([(f"m{i}", B1 + i % SCALE_MS) for i in range(5000)])
    node.replay_all()
    ticks = node.ticks
    steps = 0
    while ticks.load_step(node.now, max_s=0.0):  # the smallest budget: one clock look
        steps += 1
        assert ticks.loaded_offset <= ticks.loading_end
    assert steps > 5000 // (2 * tick_manager._CLOCK_EVERY)
    assert len(ticks.wheel) == 5000  # every record once, however many slices
    node.crash()


class DriftingClock:
    """Epoch ms from trio's clock, plus 1 ms per reading: time passes while the loader works."""

    def __init__(self, epoch_ms: int):
        self.base = epoch_ms - int(trio.current_time() * 1000)
        self.drift = 0

    def now_ms(self) -> int:
        self.drift += 1
        return self.base + int(trio.current_time() * 1000) + self.drift


async def test_a_message_due_while_the_next_bucket_loads_goes_out_before_the_load_ends(tmp_path, autojump_clock):
    start = B1 - LOAD_AHEAD_MS - 50
    node = Node(tmp_path, start, load_ahead_ms=LOAD_AHEAD_MS)
    node.send([(f"big{i}", B1 + i % SCALE_MS) for i in range(40_000)])
    node.send([("due-now", B1 - LOAD_AHEAD_MS + 20)])  # in the current bucket
    node.replay_all()
    clock = DriftingClock(start)
    ready = Wakeup()
    seen = []

    async def consume():
        while True:
            await ready.wait()
            node.now = clock.now_ms()
            for f in node.take():
                if f.message.message_id == "due-now":
                    seen.append((f.at, node.ticks.loading_bucket, node.ticks.loaded_offset, node.ticks.loading_end))
                    return

    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_ticks, node.ticks, clock, ready.set)
            await consume()
            nursery.cancel_scope.cancel()
    at, bucket, loaded, end = seen[0]
    assert at >= B1 - LOAD_AHEAD_MS + 20  # never early
    assert bucket == B1 and loaded < end, "the due message waited for the whole next bucket to load"
    node.crash()


def evict_every_segment(node, in_thread) -> None:
    """As if schedule_log had left the page cache since it was written: every cached read misses,
    and each read the loader then makes in a worker thread first calls `in_thread()` there."""
    log_ = node.store.schedule_log
    log_.read_cached = lambda bucket, start=0, end=None: None
    log_.cached_reader = lambda bucket: None  # (the compiled reading of due messages, likewise)
    range_reader = log_.range_reader

    def reader(bucket, begin, end):
        read = range_reader(bucket, begin, end)

        def run():
            in_thread()
            return read()
        return run
    log_.range_reader = reader


async def test_a_slice_whose_segment_is_not_in_the_page_cache_is_read_in_a_worker_thread(tmp_path, threads_clock):
    start = B1 - LOAD_AHEAD_MS - 50
    node = Node(tmp_path, start, load_ahead_ms=LOAD_AHEAD_MS)
    node.send([(f"big{i}", B1 + i % SCALE_MS) for i in range(20_000)])
    node.replay_all()
    threads = []
    evict_every_segment(node, lambda: threads.append(threading.current_thread()))
    clock = DriftingClock(start)
    ticks = node.ticks
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_ticks, ticks, clock, Wakeup().set)
            while not (ticks.loading_bucket == B1 and ticks.loaded_offset == ticks.loading_end):
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert len(ticks.wheel) == 20_000  # every record once
    assert ticks.load_disk_reads == len(threads) > 1
    assert threading.main_thread() not in threads
    node.crash()


async def test_the_wheel_advances_while_a_slice_waits_for_the_disk(tmp_path, threads_clock):
    start = B1 - LOAD_AHEAD_MS - 50
    node = Node(tmp_path, start, load_ahead_ms=LOAD_AHEAD_MS)
    node.send([(f"big{i}", B1 + i % SCALE_MS) for i in range(5000)])
    due_at = B1 - LOAD_AHEAD_MS + 500  # in the current bucket, due while the next one loads
    node.send([("due-now", due_at)])
    node.replay_all()
    entered, released = threading.Event(), threading.Event()

    def a_slow_disk():
        entered.set()
        released.wait(60)
    clock = DriftingClock(start)
    ticks = node.ticks
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            try:
                await nursery.start(serve_ticks, ticks, clock, Wakeup().set)  # the current bucket loaded
                evict_every_segment(node, a_slow_disk)
                await trio.to_thread.run_sync(entered.wait, 60)
                assert ticks.loading_bucket == B1 and ticks.loaded_offset == 0
                await trio.sleep((due_at - start) / 1000 + 0.05)  # virtual time: past due-now
                node.now = clock.now_ms()
                assert [f.message.message_id for f in node.take()] == ["due-now"], \
                    "nothing advanced the wheel while the slice's read waited"
                assert ticks.loaded_offset == 0  # the read is still waiting
            finally:
                released.set()
            while ticks.loaded_offset < ticks.loading_end:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert len(ticks.wheel) == 5000
    node.crash()
