"""Reschedule and promote through the real server: the message moves, the old time never fires,
and a race with delivery answers who won, as cancel does."""
from __future__ import annotations

import threading
import time

import pytest
import trio

from delayserver import protocol as p
from delayserver.client import AsyncProducer, Message
from delayserver.config import Config
from delayserver.message import BadScheduleTime, CancelOutcome, Handle, MessageState, ResultCode, TimeSpec
from delayserver.node.server import DelayServer
from delayserver.sender.spool import iter_spool
from delayserver.storage.store import Store
from delayserver.wheel.tick_manager import TickManager

HOUR = 3_600_000


def config(root, **kw) -> Config:
    base = dict(data_dir=str(root), listen="127.0.0.1:0", segment_scale="1m", max_delay="1d", reserve_bytes=0,
                checkpoint_interval_ms=20)
    base.update(kw)
    return Config.from_dict(base)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def delivered(root, subject: str) -> list[str]:
    return [m.message_id for _, _, _, m in iter_spool(root, subject)]


async def wait_until(predicate, timeout: float = 30) -> None:
    with trio.fail_after(timeout):  # a real node delivering: generous on a loaded machine
        while not predicate():
            await trio.sleep(0.02)


async def state_once_recorded(prod, handle: Handle) -> MessageState:
    """The message's state once it is no longer PENDING: the spool holds a delivery as soon as the
    broker acknowledged it, and the dispatch_log record that makes it DELIVERED follows."""
    with trio.fail_after(30):
        while (state := (await prod.status(handle)).state) == MessageState.PENDING:
            await trio.sleep(0.02)
    return state


async def run_node(root, body, **kw) -> None:
    server = DelayServer(config(root, **kw))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        async with AsyncProducer(f"127.0.0.1:{server.port}", timeout=30) as prod:
            await body(server, prod)
        await server.drain()


async def test_a_rescheduled_message_moves_and_its_old_handle_reads_cancelled(tmp_path):
    root = tmp_path / "node"
    kept = {}

    async def body(server, prod):
        old = await prod.send("orders.expire", b"order 42", delay=HOUR, message_id="order-42",
                              headers={"tenant": "acme"})
        moved = await prod.reschedule(old, delay=2 * HOUR)
        assert moved.outcome == CancelOutcome.RESCHEDULED
        new = moved.handle
        assert new.message_id == "order-42" and new.schedule_time >= old.schedule_time + HOUR
        assert (await prod.status(old)).state == MessageState.CANCELLED
        assert (await prod.status(new)).state == MessageState.PENDING
        # A producer's retry of the first send gets the message's current handle.
        assert await prod.send("orders.expire", b"order 42", delay=HOUR, message_id="order-42") == new
        # The old handle lost the message: a second move of it says so.
        assert (await prod.reschedule(old, delay=5)).outcome == CancelOutcome.ALREADY_CANCELLED
        assert (await prod.reschedule(Handle(old.schedule_time, "nope"), delay=5)).outcome == CancelOutcome.UNKNOWN
        kept["new"], kept["old"] = new, old

    await run_node(root, body)

    async def after_restart(server, prod):
        assert (await prod.status(kept["old"])).state == MessageState.CANCELLED
        assert (await prod.status(kept["new"])).state == MessageState.PENDING
        promoted = await prod.promote(kept["new"])
        assert promoted.outcome == CancelOutcome.RESCHEDULED
        await wait_until(lambda: delivered(root, "orders.expire") == ["order-42"])
        assert await state_once_recorded(prod, promoted.handle) == MessageState.DELIVERED
        (_, _, _, m), = list(iter_spool(root, "orders.expire"))
        assert m.body == b"order 42" and m.headers == {"tenant": "acme"}

    await run_node(root, after_restart)


async def test_promote_delivers_now_once_and_a_delivered_message_cannot_move(tmp_path):
    root = tmp_path / "node"

    async def body(server, prod):
        handles = [await prod.send("q.promote", b"x", delay=HOUR, message_id=f"p{i}") for i in range(3)]
        promoted = await prod.promote(handles[1])
        assert promoted.outcome == CancelOutcome.RESCHEDULED
        await wait_until(lambda: delivered(root, "q.promote") == ["p1"])
        assert await state_once_recorded(prod, promoted.handle) == MessageState.DELIVERED
        assert (await prod.promote(promoted.handle)).outcome == CancelOutcome.ALREADY_DELIVERED
        assert (await prod.reschedule(promoted.handle, delay=HOUR)).outcome == CancelOutcome.ALREADY_DELIVERED
        assert (await prod.cancel(handles[0])) == CancelOutcome.CANCELLED
        assert (await prod.promote(handles[0])).outcome == CancelOutcome.ALREADY_CANCELLED
        await trio.sleep(0.2)
        assert delivered(root, "q.promote") == ["p1"]

    await run_node(root, body)


async def test_a_bad_time_is_refused_and_nothing_moves(tmp_path):
    async def body(server, prod):
        h = await prod.send("q.bad", b"x", delay=HOUR)
        with pytest.raises(BadScheduleTime):
            await prod.reschedule(h, delay=10 * 24 * HOUR)  # past max_delay
        with pytest.raises(BadScheduleTime):
            await prod.reschedule(h, delay=-5)
        raw = p.encode_reschedule_request(h, TimeSpec.level(99))
        r = p.decode_reschedule_response(await prod.request(p.Command.RESCHEDULE, raw))
        assert r.code == ResultCode.BAD_SCHEDULE_TIME and r.outcome == CancelOutcome.UNKNOWN
        assert (await prod.status(h)).state == MessageState.PENDING

    await run_node(tmp_path / "node", body)


async def test_reschedule_racing_delivery_answers_who_won(tmp_path):
    """Messages fall due while each is moved an hour on: every answer agrees with what the broker
    saw. RESCHEDULED ones never arrive (their new time is an hour away); ALREADY_DELIVERED ones
    arrive, once."""
    root = tmp_path / "node"
    n = 200
    answers: dict[str, CancelOutcome] = {}

    async def body(server, prod):
        due = now_ms() + 300
        handles = await prod.send_many([Message("q.race", b"x", deliver_at=due + i, message_id=f"r{i}")
                                        for i in range(n)])
        while now_ms() < due - 60:
            await trio.sleep(0.005)

        async def move(h):
            answers[h.message_id] = (await prod.reschedule(h, delay=HOUR)).outcome

        async with trio.open_nursery() as nursery:
            for h in handles:
                nursery.start_soon(move, h)
        lost = {m for m, o in answers.items() if o == CancelOutcome.ALREADY_DELIVERED}
        await wait_until(lambda: lost <= set(delivered(root, "q.race")))
        await trio.sleep(0.3)  # anything wrongly left in the wheel would fire by now

    await run_node(root, body)
    assert set(answers.values()) <= {CancelOutcome.RESCHEDULED, CancelOutcome.ALREADY_DELIVERED}
    arrived = delivered(root, "q.race")
    assert len(arrived) == len(set(arrived)), "a message was delivered twice"
    assert set(arrived) == {m for m, o in answers.items() if o == CancelOutcome.ALREADY_DELIVERED}


async def test_cancel_and_reschedule_of_one_handle_agree(tmp_path):
    async def body(server, prod):
        for i in range(20):
            h = await prod.send("q.both", b"x", delay=HOUR, message_id=f"b{i}")
            out = {}

            async def cancel():
                out["cancel"] = await prod.cancel(h)

            async def move():
                out["move"] = (await prod.reschedule(h, delay=2 * HOUR)).outcome

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel)
                nursery.start_soon(move)
            if out["cancel"] == CancelOutcome.CANCELLED:
                assert out["move"] == CancelOutcome.ALREADY_CANCELLED
            else:
                assert out["move"] == CancelOutcome.RESCHEDULED and out["cancel"] == CancelOutcome.ALREADY_CANCELLED
            assert (await prod.status(h)).state == MessageState.CANCELLED

    await run_node(tmp_path / "node", body)


def test_a_message_due_while_it_moves_is_held_then_dropped_or_given_back(tmp_path):
    store = Store.open(tmp_path, segment_scale_ms=60_000, message_log_segment_bytes=1 << 20)
    try:
        ticks = TickManager(store, now_ms=0)
        for moved in (True, False):
            ref = ticks.ref(0, 100)
            ticks.outstanding[0] += 1
            ticks.inflight.add(ref)  # taken by the due queue
            assert not ticks.hold_if_moving(ref, 5, "m")  # not moving: it goes out
            ticks.begin_move(5, "m")
            assert ticks.hold_if_moving(ref, 5, "m")
            ticks.end_move(5, "m", moved)
            if moved:  # settled undelivered: its cancel is in the log
                assert ref not in ticks.inflight and not ticks.ready and not ticks.outstanding[0]
            else:  # the move failed: due again, first in line
                assert list(ticks.ready) == [ref] and ref not in ticks.inflight
            assert not ticks.moving
    finally:
        store.close()


async def test_a_move_reads_a_record_not_in_the_page_cache_in_a_worker_thread(tmp_path):
    """The message a move copies is read from the disk in a worker thread, never on the event
    loop (a big bucket is mostly on disk: a read there would hold every connection)."""
    root = tmp_path / "node"

    async def body(server, prod):
        old = await prod.send("orders.expire", b"order 7", delay=HOUR, message_id="order-7")
        assert (await prod.status(old)).state == MessageState.PENDING
        log = server.store.schedule_log
        on_loop = []
        loop_thread = threading.current_thread()

        def read_spy(bucket, start=0, end=None, real=log.read):
            on_loop.append(threading.current_thread() is loop_thread)
            return real(bucket, start, end)
        log.read = read_spy
        log.read_cached = lambda bucket, start=0, end=None: None  # nothing in the page cache
        moved = await prod.reschedule(old, delay=2 * HOUR)
        assert moved.outcome == CancelOutcome.RESCHEDULED
        assert (await prod.status(old)).state == MessageState.CANCELLED
        assert (await prod.status(moved.handle)).state == MessageState.PENDING
        assert not any(on_loop), "a read that may wait for the disk on the event loop"

    await run_node(root, body)
