"""Read-ahead of what falls due: the ranges asked for, and when, under trio's MockClock."""
from __future__ import annotations

import trio

from delayserver.clock import TrioClock
from delayserver.wheel.prefetch import GAP_BYTES, prefetch_due, ranges
from delayserver.wheel.tick_manager import READ_GUESS_BYTES
from tests.pipeline_node import START_MS, Node

HOUR_MS = 3600_000


def test_nearby_records_are_read_ahead_as_one_range():
    assert ranges([]) == []
    assert ranges([100]) == [(100, READ_GUESS_BYTES)]
    near = [0, 500, 500 + READ_GUESS_BYTES + GAP_BYTES]  # the last starts just within the gap
    assert ranges(near) == [(0, 500 + 2 * READ_GUESS_BYTES + GAP_BYTES)]
    far = [10 * GAP_BYTES, 0]
    assert ranges(far) == [(0, READ_GUESS_BYTES), (10 * GAP_BYTES, READ_GUESS_BYTES)]


async def test_every_record_is_read_ahead_before_it_falls_due(tmp_path, autojump_clock):
    clock = TrioClock(START_MS - int(trio.current_time() * 1000))
    node = Node(tmp_path, START_MS, scale_ms=HOUR_MS, tick_ms=10, slots=4096)
    due = {f"m{i}": START_MS + 50 + 37 * i for i in range(200)}  # over 7.4 s
    node.send(list(due.items()))
    node.replay_all()
    node.load_all()
    offsets = {}  # message id -> schedule_log offset
    for ref in node.ticks.wheel.refs_due_between(START_MS, START_MS + HOUR_MS):
        bucket, offset, _, message = node.ticks.read_message(ref)
        offsets[message.message_id] = offset
    path = str(node.store.schedule_log.path(bucket))
    asked = []  # (time, start, length)

    def spy(wanted):
        for p, spans in wanted:
            assert p == path
            asked.extend((clock.now_ms(), start, length) for start, length in spans)
        return len(asked)

    async with trio.open_nursery() as nursery:
        async def on_the_loop(fn, *args):  # the mock clock would jump while a thread works
            return fn(*args)

        await nursery.start(lambda **kw: prefetch_due(node.ticks, clock, horizon_ms=500, step_ms=100,
                                                      advise=spy, run_blocking=on_the_loop, **kw))
        await trio.sleep(8)
        nursery.cancel_scope.cancel()
    for mid, at in due.items():
        covering = [t for t, start, length in asked if start <= offsets[mid] < start + length]
        assert covering, mid
        # Asked for within the horizon before it falls due (the first ones: at the start).
        assert any(max(START_MS, at - 500) <= t < at for t in covering), (mid, at, covering)
    node.crash()
