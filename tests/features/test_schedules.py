"""Recurring schedules through the real server, its clock injected and stepped by hand: a simulated
day of occurrences delivered once each, catch-up after downtime, pause, resume, update, delete,
and the schedules kept across a restart."""
from __future__ import annotations

import pytest
import trio

from delayserver.client import AsyncProducer
from delayserver.config import Config
from delayserver.message import DelayServerError, ResultCode
from delayserver.node.server import DelayServer
from delayserver.schedules.spec import occurrence_id
from delayserver.sender.spool import iter_spool

MINUTE, HOUR = 60_000, 3_600_000
DAY0 = 1_795_392_000_000  # 2026-11-23T00:00:00Z


class SetClock:
    """The node's wall clock, stepped by the test (the node's sleeps stay on trio's clock)."""

    def __init__(self, now_ms: int):
        self.now = now_ms

    def now_ms(self) -> int:
        return self.now


def config(root) -> Config:
    return Config.from_dict(dict(data_dir=str(root), listen="127.0.0.1:0", segment_scale="1m", max_delay="1d",
                                 reserve_bytes=0, checkpoint_interval_ms=20))


def delivered(root, subject: str) -> list:
    return [m for _, _, _, m in iter_spool(root, subject)]


async def wait_until(predicate, timeout: float = 30) -> None:
    with trio.fail_after(timeout):  # a real node: generous on a loaded machine
        while not await predicate():
            await trio.sleep(0.01)


async def step(server: DelayServer, clock: SetClock, to_ms: int) -> None:
    """Move the node's clock, and wake its emitter and wheel as a passing second would."""
    clock.now = to_ms
    server.schedules.changed.set()
    server.ticks.changed.set()


async def run_node(root, clock, body) -> None:
    server = DelayServer(config(root), clock=clock)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        async with AsyncProducer(f"127.0.0.1:{server.port}", timeout=30) as prod:
            await body(server, prod)
        await server.drain()


async def test_a_cron_schedule_delivers_each_occurrence_of_a_simulated_day_once(tmp_path):
    root = tmp_path / "node"
    clock = SetClock(DAY0 - MINUTE)

    async def body(server, prod):
        made = await prod.put_schedule("half-hourly", "reports.tick", "*/30 * * * *", b"tick",
                                       headers={"team": "ops"}, timezone="Europe/Berlin")
        assert made["next"] == DAY0 and made["emitted"] == 0 and made["last"] is None
        for k in range(49):
            await step(server, clock, DAY0 + k * 30 * MINUTE)

            async def next_sent_and_this_delivered():
                return ((await prod.schedules())[0]["next"] > clock.now
                        and len(delivered(root, "reports.tick")) == k + 1)

            await wait_until(next_sent_and_this_delivered)
        got = delivered(root, "reports.tick")
        assert [m.message_id for m in got] == [occurrence_id("half-hourly", DAY0 + k * 30 * MINUTE) for k in range(49)]
        assert all(m.body == b"tick" and m.headers["team"] == "ops" and m.headers["schedule"] == "half-hourly"
                   for m in got)
        [listed] = await prod.schedules()
        assert listed["emitted"] == 50 and listed["last"] == DAY0 + 49 * 30 * MINUTE

    await run_node(root, clock, body)


@pytest.mark.parametrize("policy, missed_delivered", [("skip", []), ("one", [5]), ("all", [2, 3, 4, 5])])
async def test_occurrences_missed_while_the_node_was_down_follow_the_catch_up_policy(tmp_path, policy,
                                                                                    missed_delivered):
    root = tmp_path / "node"
    clock = SetClock(DAY0 + 30 * MINUTE)

    async def before(server, prod):
        made = await prod.put_schedule("hourly", "q.hourly", "0 * * * *", catch_up=policy)
        assert made["next"] == DAY0 + HOUR
        await step(server, clock, DAY0 + HOUR)
        await wait_until(lambda: _ready(prod, DAY0 + 2 * HOUR))

    await run_node(root, clock, before)  # 01:00 delivered, 02:00 sent and pending
    clock.now = DAY0 + 5 * HOUR + 30 * MINUTE  # down until 05:30

    async def after(server, prod):
        await step(server, clock, clock.now)
        await wait_until(lambda: _ready(prod, DAY0 + 6 * HOUR))
        # 02:00 was stored before the downtime: it goes out overdue whatever the policy. 03:00 to
        # 05:00 were never sent: the policy decides.
        want = sorted({1, 2, *missed_delivered})

        async def all_there():
            return len(delivered(root, "q.hourly")) >= len(want)

        await wait_until(all_there)
        await trio.sleep(0.2)  # nothing more arrives
        got = sorted(int(m.message_id.rsplit(":", 1)[1]) for m in delivered(root, "q.hourly"))
        assert got == [DAY0 + h * HOUR for h in want]

    await run_node(root, clock, after)


async def _ready(prod, next_ms: int) -> bool:
    [s] = await prod.schedules()
    return s["next"] == next_ms


async def test_pause_resume_update_delete_and_a_restart(tmp_path):
    root = tmp_path / "node"
    clock = SetClock(DAY0)

    async def body(server, prod):
        await prod.put_schedule("every", "q.every", "@every 10m", b"v1")
        assert await _ready(prod, DAY0 + 10 * MINUTE)
        paused = await prod.pause_schedule("every")
        assert paused["paused"] and paused["next"] is None
        await step(server, clock, DAY0 + 25 * MINUTE)
        await trio.sleep(0.2)
        assert delivered(root, "q.every") == []  # the pending 00:10 was cancelled by the pause
        resumed = await prod.resume_schedule("every")
        assert not resumed["paused"] and resumed["next"] == DAY0 + 30 * MINUTE
        updated = await prod.put_schedule("every", "q.every", "@every 1h", b"v2")
        assert updated["next"] == DAY0 + 25 * MINUTE + HOUR and updated["emitted"] == 0
        with pytest.raises(DelayServerError) as e:
            await prod.pause_schedule("nope")
        assert e.value.code == ResultCode.NOT_FOUND
        with pytest.raises(DelayServerError) as e:
            await prod.put_schedule("bad", "q.every", "not cron")
        assert e.value.code == ResultCode.BAD_REQUEST
        await prod.put_schedule("gone", "q.gone", "0 0 * * *")
        await prod.delete_schedule("gone")
        assert [s["name"] for s in await prod.schedules()] == ["every"]

    await run_node(root, clock, body)
    clock.now = DAY0 + 25 * MINUTE + HOUR

    async def after(server, prod):
        [s] = await prod.schedules()
        assert s["body"] == b"v2" and s["rule"] == "@every 1h"
        await step(server, clock, clock.now)

        async def arrived():
            return [m.body for m in delivered(root, "q.every")] == [b"v2"]

        await wait_until(arrived)

    await run_node(root, clock, after)
