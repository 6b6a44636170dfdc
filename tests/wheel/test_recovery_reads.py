"""Recovery reads a busy bucket's dispatch_log in a worker thread, not on the event loop.

After a restart in the middle of a bucket that was being delivered, the load of that bucket must
skip what dispatch_log records as delivered: millions of records on a busy hour, seconds of
walking. Before the node reports started its receiver already serves producers, so that walk must
not hold the loop.
"""
from __future__ import annotations

import threading

import trio

from delayserver.storage import bucket_log
from delayserver.storage.record import Dispatch, RecordType, encode_dispatch, encode_record
from delayserver.wakeup import Wakeup
from delayserver.wheel.service import serve_ticks
from delayserver.wheel.tick_manager import SETTLED_READ_ON_LOOP_BYTES
from tests.pipeline_node import GROUP, START_MS, Node

SCALE_MS = 60_000
B0 = START_MS - START_MS % SCALE_MS
MESSAGES = 6000


def a_node_that_delivered_most_of_its_bucket(root, dispatched: int) -> None:
    """One life: MESSAGES due late in the current bucket, the first `dispatched` of them (in
    schedule order) delivered and recorded in dispatch_log; then a crash."""
    node = Node(root, B0 + 1000, slots=4096)
    node.send([(f"m{i}", B0 + 10_000 + i) for i in range(MESSAGES)])
    node.replay_all()
    node.load_all()
    node.now = B0 + 10_000 + dispatched - 1
    node.ticks.advance(node.now)
    fired = node.take()
    assert len(fired) == dispatched
    node.dispatch(fired)
    for f in fired[:50]:  # some delivered twice (a redelivery after a broker's timeout)
        node.store.dispatch_log.append(B0, encode_record(RecordType.DISPATCH, encode_dispatch(
            Dispatch(f.offset, node.now, GROUP))))
    assert node.store.dispatch_log.size(B0) >= SETTLED_READ_ON_LOOP_BYTES  # big enough for a thread
    node.crash()


class FixedClock:
    def __init__(self, now_ms: int):
        self.now = now_ms

    def now_ms(self) -> int:
        return self.now


def hold_dispatch_log_reads(entered: threading.Event, released: threading.Event, verdicts: list):
    """Every read of a dispatch_log segment sets `entered`, then waits (up to 10 s) for
    `released` and notes whether it came: on the event loop it cannot, since only a task of the
    loop sets it."""
    real = bucket_log.read_file

    def read_file(path, *args, **kw):
        if path.parent.name == "dispatch_log":
            entered.set()
            verdicts.append(released.wait(10))
        return real(path, *args, **kw)

    return read_file


async def test_recovery_walks_a_big_dispatch_log_off_the_loop(tmp_path, monkeypatch):
    dispatched = 4000
    a_node_that_delivered_most_of_its_bucket(tmp_path, dispatched)
    entered, released, verdicts = threading.Event(), threading.Event(), []
    monkeypatch.setattr(bucket_log, "read_file", hold_dispatch_log_reads(entered, released, verdicts))
    node = Node(tmp_path, B0 + 10_000 + dispatched, slots=4096)
    now = node.now
    clock = FixedClock(now)
    async with trio.open_nursery() as nursery:
        async def serve_producers():  # what the receiver does meanwhile: here, one step of it
            while not entered.is_set():
                await trio.sleep(0.001)
            released.set()

        nursery.start_soon(serve_producers)
        with trio.fail_after(30):
            await nursery.start(serve_ticks, node.ticks, clock, Wakeup().set)
        nursery.cancel_scope.cancel()
    assert verdicts == [True], "the dispatch_log was read on the event loop, holding every other task"
    # And the load skipped exactly what was delivered.
    assert node.ticks.loaded == MESSAGES - dispatched
    node.ticks.advance(now + MESSAGES)
    assert sorted(f.message.message_id for f in node.take()) == sorted(
        f"m{i}" for i in range(dispatched, MESSAGES))
    node.crash()


async def test_a_torn_tail_of_a_big_dispatch_log_is_cut_after_a_read_in_a_thread(tmp_path):
    dispatched = 4000
    a_node_that_delivered_most_of_its_bucket(tmp_path, dispatched)
    path = bucket_log.BucketLog.open(tmp_path / "dispatch_log").path(B0)
    whole = path.stat().st_size
    with open(path, "ab") as f:  # a record cut short by the crash
        f.write(b"\x01\x02\x03\x04\x00\x00\x00\x40\x0c" + b"x" * 10)
    node = Node(tmp_path, B0 + 10_000 + dispatched, slots=4096)
    now = node.now
    clock = FixedClock(now)
    async with trio.open_nursery() as nursery:
        with trio.fail_after(30):
            await nursery.start(serve_ticks, node.ticks, clock, Wakeup().set)
        nursery.cancel_scope.cancel()
    assert path.stat().st_size == whole and node.store.dispatch_log.size(B0) == whole
    assert node.ticks.loaded == MESSAGES - dispatched
    node.crash()
