"""Loading a big bucket goes in slices of about a millisecond; what falls due meanwhile goes out."""
from __future__ import annotations

import trio

from delayserver.wakeup import Wakeup
from delayserver.wheel import tick_manager
from delayserver.wheel.service import serve_ticks
from tests.pipeline_node import START_MS, Node

SCALE_MS = 60_000
B1 = START_MS - START_MS % SCALE_MS + SCALE_MS  # the next bucket
LOAD_AHEAD_MS = 30_000


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
            await nursery.start(serve_ticks, node.ticks, clock, ready)
            await consume()
            nursery.cancel_scope.cancel()
    at, bucket, loaded, end = seen[0]
    assert at >= B1 - LOAD_AHEAD_MS + 20  # never early
    assert bucket == B1 and loaded < end, "the due message waited for the whole next bucket to load"
    node.crash()
