"""The node's own disk work (the message_log fsync an acknowledgement waits for, the dispatch_log
fsync a delivery is settled by) runs in worker threads of its own pool: with every thread of
trio's default limiter taken by other blocking work, a message is still acknowledged, delivered
and settled. And the pool itself (`ThreadPool`, which the transports use too): results and errors
come back, at most its threads run at once and the rest wait in order, a waiting call is
cancellable and a running one is waited for, idle threads end.

The server runs in-process over real sockets with its default settings (flush = "sync") and
delivers to the spool."""
from __future__ import annotations

import threading

import pytest
import trio

from delayserver.client import AsyncProducer
from delayserver.config import Config
from delayserver.node.server import DelayServer
from delayserver.storage.threads import DISK_THREADS, ThreadPool, disk_pool, run_disk
from tests.sender.test_dispatch_sync import spooled_ids, wait_until


async def test_acknowledged_and_delivered_while_the_default_threads_are_all_taken(tmp_path, nursery):
    cfg = Config.from_dict(dict(data_dir=str(tmp_path / "data"), listen="127.0.0.1:0",
                                broker_group=[{"name": "spool", "transport": "spool"}]))
    server = DelayServer(cfg)
    await nursery.start(server.serve)
    default = trio.to_thread.current_default_thread_limiter()
    holders = [object() for _ in range(int(default.total_tokens))]
    for holder in holders:  # other blocking work holds every default thread
        default.acquire_on_behalf_of_nowait(holder)
    try:
        async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
            with trio.fail_after(30):
                h = await prod.send("threads.q", b"body", delay=0)
        await wait_until(lambda: server.sender.delivered == 1)
        assert spooled_ids(server, "threads.q") == {h.message_id}
        assert default.borrowed_tokens == default.total_tokens  # none of them was given back meanwhile
    finally:
        for holder in holders:
            default.release_on_behalf_of(holder)


async def test_run_disk_uses_one_pool_per_run_of_disk_threads():
    assert disk_pool() is disk_pool()
    assert disk_pool().max_threads == DISK_THREADS
    assert await run_disk(lambda a, b: a + b, 2, 3) == 5
    assert await run_disk(threading.current_thread) is not threading.current_thread()


async def test_a_calls_error_is_raised_in_the_caller_and_the_thread_goes_on():
    pool = ThreadPool(1)

    def fail():
        raise OSError(5, "Input/output error")

    with pytest.raises(OSError, match="Input/output error"):
        await pool.run(fail)
    assert await pool.run(len, b"abc") == 3
    assert pool.threads == 1 and pool.busy == 0


class Gate:
    """Calls that block in a worker thread until released, recording the order they began in."""

    def __init__(self):
        self.began: list[int] = []
        self.release = threading.Event()
        self.lock = threading.Lock()

    def call(self, i: int) -> int:
        with self.lock:
            self.began.append(i)
        self.release.wait(30)
        return i


async def wait_for(predicate) -> None:
    """Until a worker thread has done what `predicate` looks for (real threads: no clock to mock)."""
    with trio.fail_after(30):
        while not predicate():
            await trio.sleep(0.001)


async def test_at_most_max_threads_run_at_once_and_the_rest_wait_in_order():
    pool, gate = ThreadPool(3), Gate()
    results = {}

    async def call(i):
        results[i] = await pool.run(gate.call, i)

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(call, i)
            await trio.testing.wait_all_tasks_blocked()
        await wait_for(lambda: len(gate.began) == 3)
        assert pool.busy == pool.threads == 3 and pool.queued == 5
        assert sorted(gate.began) == [0, 1, 2]
        gate.release.set()
    assert results == {i: i for i in range(8)}
    assert sorted(gate.began) == list(range(8))
    assert pool.threads == 3 and pool.busy == 0 and pool.queued == 0


async def test_calls_waiting_for_the_thread_run_in_the_order_they_asked():
    pool, gate = ThreadPool(1), Gate()
    async with trio.open_nursery() as nursery:
        for i in range(6):
            nursery.start_soon(pool.run, gate.call, i)
            await trio.testing.wait_all_tasks_blocked()
        await wait_for(lambda: gate.began == [0])
        assert pool.queued == 5
        gate.release.set()
    assert gate.began == [0, 1, 2, 3, 4, 5]


async def test_a_waiting_call_is_cancelled_and_never_runs_a_running_one_is_waited_for():
    pool, gate = ThreadPool(1), Gate()
    returned, cancelled = {}, set()

    async def call(i, scope_box):
        with trio.CancelScope() as scope:
            scope_box.append(scope)
            returned[i] = await pool.run(gate.call, i)
            await trio.lowlevel.checkpoint()
        if scope.cancelled_caught:
            cancelled.add(i)

    running, waiting = [], []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(call, 0, running)
        await wait_for(lambda: gate.began == [0])
        nursery.start_soon(call, 1, waiting)
        await trio.testing.wait_all_tasks_blocked()
        assert pool.queued == 1
        waiting[0].cancel()
        running[0].cancel()  # under way: the cancel waits for it
        await trio.testing.wait_all_tasks_blocked()
        assert cancelled == {1} and pool.queued == 0 and returned == {}
        gate.release.set()
    # The running call's result came back; its caller met the cancel at its next checkpoint.
    assert returned == {0: 0} and cancelled == {0, 1}
    assert gate.began == [0]  # the cancelled waiting call never ran
    assert pool.busy == 0


async def test_idle_threads_end_and_new_ones_start_when_asked_again():
    pool = ThreadPool(2, idle_seconds=0.01)
    assert await pool.run(threading.get_ident)
    await wait_for(lambda: pool.threads == 0)
    assert await pool.run(lambda: 7) == 7
    assert pool.threads == 1


def test_one_pool_serves_two_trio_runs():
    pool = ThreadPool(2)

    async def main(x):
        return await pool.run(lambda: x * 2)

    assert trio.run(main, 2) == 4
    assert trio.run(main, 5) == 10
