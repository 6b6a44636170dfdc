"""`read_ahead` and `read_ahead_bytes` on a serving node: how long before they fall due messages'
records are read into memory, and how much of them may be held. Time moves by stepping the
node's clock (TrioClock.step); the waits below are for the read-ahead task's rounds (100 ms)."""
from __future__ import annotations

import time

import pytest
import trio

from delayserver.client import AsyncProducer, Message
from delayserver.clock import TrioClock
from delayserver.node.server import DelayServer
from delayserver.wheel.read_ahead import MAX_BYTES
from tests.node.conftest import node_config

COUNT = 40


@pytest.mark.parametrize("budget", [None, 0])
async def test_messages_are_read_ahead_within_the_configured_horizon_and_budget(tmp_path, nursery, budget):
    # Loaded as soon as replayed (load_ahead), long before their time enters the horizon: an entry
    # is looked for once, when the horizon's end passes its time.
    options = dict(read_ahead="20s", load_ahead="5m")
    if budget is not None:
        options["read_ahead_bytes"] = budget
    node = DelayServer(node_config(tmp_path, **options), clock=TrioClock(time.time_ns() // 1_000_000))
    await nursery.start(node.serve)
    assert node.ticks.ahead.max_bytes == (MAX_BYTES if budget is None else 0)
    async with AsyncProducer(f"127.0.0.1:{node.port}") as producer:
        await producer.send_many([Message("ra.x", b"x" * 100, delay=60_000) for _ in range(COUNT)])
    with trio.fail_after(10):
        while node.ticks.loaded < COUNT:
            await trio.sleep(0.02)

    await trio.sleep(0.3)  # three rounds of the read-ahead task: they are not within 20 s yet
    assert node.ticks.ahead.held_bytes == 0
    node.clock.step(45_000)
    if budget is None:
        # Due in 15 s, within the 20 s configured: held long before the default 1 s would read them.
        with trio.fail_after(5):
            while node.ticks.ahead.held_bytes == 0:
                await trio.sleep(0.02)
        assert sum(map(len, node.ticks.ahead.records.values())) == COUNT
    else:
        await trio.sleep(0.5)  # five rounds of the read-ahead task
        assert node.ticks.ahead.held_bytes == 0 and node.ticks.ahead.records == {}

    node.clock.step(15_000)
    with trio.fail_after(10):
        while node.sender.delivered < COUNT:
            await trio.sleep(0.02)
    assert node.ticks.ahead.hits == (COUNT if budget is None else 0)
    assert node.ticks.ahead.held_bytes == 0
