"""The event-loop watch: slow task steps counted and logged (rate-limited), fast ones ignored.

The watch's clock is a counter the tasks move forward themselves, so "a step of 250 ms" takes no
real time."""
from __future__ import annotations

import logging

import trio

from delayserver.loopwatch import LoopWatch


class StepClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_slow_steps_are_counted_with_the_longest_and_logged_at_most_once_per_interval(caplog):
    caplog.set_level(logging.WARNING, logger="delayserver.loop")
    clock = StepClock()
    watch = LoopWatch(threshold_s=0.1, log_every_s=1.0, clock=clock)

    async def work(step_seconds: list[float]) -> None:
        for took in step_seconds:
            clock.now += took  # this step "takes" `took` seconds of the loop
            await trio.lowlevel.checkpoint()

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(work, [0.001] * 50, name="fast")
            nursery.start_soon(work, [0.25, 0.001, 0.15], name="loader")
        await work([0.09] * 10)  # under the threshold, but the log interval passes
        await work([0.4])

    trio.run(main, instruments=[watch])
    assert watch.slow_steps == 3
    assert round(watch.longest_s, 6) == 0.4 and watch.longest_task.endswith("main")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0] == "event loop blocked for 250 ms by task loader"
    assert "blocked for 400 ms" in lines[1] and "(1 more slow steps since the last warning)" in lines[1]


def test_a_step_under_the_threshold_is_not_counted():
    clock = StepClock()
    watch = LoopWatch(threshold_s=0.1, clock=clock)

    async def main():
        for _ in range(100):
            clock.now += 0.099
            await trio.lowlevel.checkpoint()

    trio.run(main, instruments=[watch])
    assert watch.slow_steps == 0 and watch.longest_s == 0.0


def test_the_step_that_installs_the_watch_is_not_timed():
    clock = StepClock()
    watch = LoopWatch(threshold_s=0.1, clock=clock)

    async def main():
        clock.now = 1000.0  # a clock that does not start at 0
        trio.lowlevel.add_instrument(watch)
        clock.now += 0.001
        await trio.lowlevel.checkpoint()
        clock.now += 0.2
        await trio.lowlevel.checkpoint()
        trio.lowlevel.remove_instrument(watch)

    trio.run(main)
    assert watch.slow_steps == 1 and round(watch.longest_s, 6) == 0.2


def test_a_slow_step_says_how_much_of_it_the_garbage_collector_took(caplog):
    caplog.set_level(logging.WARNING, logger="delayserver.loop")
    clock = StepClock()
    watch = LoopWatch(threshold_s=0.1, log_every_s=0.0, clock=clock, gc_clock=clock)

    async def main():
        clock.now += 0.03
        watch.on_gc("start", {"generation": 2})
        clock.now += 0.12  # a full collection inside this step
        watch.on_gc("stop", {"generation": 2, "collected": 0})
        await trio.lowlevel.checkpoint()
        clock.now += 0.2  # a slow step with no collection in it
        await trio.lowlevel.checkpoint()

    trio.run(main, instruments=[watch])
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("event loop blocked for 150 ms by task ")
    assert lines[0].endswith(", 120 ms of it in garbage collection (generation 2)")
    assert "garbage collection" not in lines[1]
    assert round(watch.gc_seconds, 6) == 0.12 and round(watch.gc_longest_s, 6) == 0.12


def test_the_node_times_real_collections():
    import gc

    watch = LoopWatch()
    gc.callbacks.append(watch.on_gc)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(watch.on_gc)
    assert watch.gc_seconds > 0 and watch.gc_longest_s > 0
