"""Browse through the real server: by subject, time range and state, paged by cursor, oldest or
newest first, across buckets and after a restart."""
from __future__ import annotations

import random
import threading
import time

import pytest
import trio

from delayserver import protocol as p
from delayserver.client import AsyncProducer, Message
from delayserver.config import Config
from delayserver.message import DelayServerError, MessageState, ResultCode
from delayserver.lookup import Lookup
from delayserver.node.browse import Browser, BrowseQuery
from delayserver.node.server import DelayServer
from delayserver.storage.record import RecordType, scheduled_key
from delayserver.storage.time_index import TimeIndex
from tests.pipeline_node import SCALE_MS, START_MS, Fired, Node

MINUTE = 60_000


def config(root, **kw) -> Config:
    base = dict(data_dir=str(root), listen="127.0.0.1:0", segment_scale="1m", max_delay="1d", reserve_bytes=0,
                checkpoint_interval_ms=20)
    base.update(kw)
    return Config.from_dict(base)


async def run_node(root, body) -> None:
    server = DelayServer(config(root))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        async with AsyncProducer(f"127.0.0.1:{server.port}", timeout=30) as prod:
            await body(server, prod)
        await server.drain()


async def everything(prod, **query) -> list:
    return [m async for m in prod.browse_all(**query)]


def now_ms() -> int:
    return time.time_ns() // 1_000_000


async def test_pages_walk_every_bucket_in_delivery_time_order_and_again_after_a_restart(tmp_path):
    root = tmp_path / "node"
    base = now_ms() - now_ms() % MINUTE + 10 * MINUTE
    rng = random.Random(7)
    # Five buckets, sent out of time order, three subjects.
    sent = [(f"m{i:03d}", ("orders.eu", "orders.us", "billing")[i % 3], base + rng.randrange(5 * MINUTE))
            for i in range(150)]
    seen = {}

    async def body(server, prod):
        await prod.send_many([Message(s, f"body {m}".encode(), deliver_at=t, message_id=m,
                                      headers={"n": m}) for m, s, t in sent])
        assert len(server.store.schedule_log.buckets()) == 5
        oldest = await everything(prod, limit=7)
        assert [(m.handle.schedule_time, m.handle.message_id) for m in oldest] == \
            sorted((t, m) for m, _, t in sent)
        assert all(m.state == MessageState.PENDING and m.body is None and m.headers == {"n": m.handle.message_id}
                   for m in oldest)
        newest = await everything(prod, limit=11, newest_first=True)
        assert [m.handle for m in newest] == [m.handle for m in reversed(oldest)]
        seen["before"] = [m.handle for m in oldest]

        eu = await everything(prod, subject="orders.eu", limit=5)
        assert {m.handle.message_id for m in eu} == {m for m, s, _ in sent if s == "orders.eu"}
        orders = await everything(prod, subject="orders.*", limit=50)
        assert {m.handle.message_id for m in orders} == {m for m, s, _ in sent if s.startswith("orders.")}

        lo, hi = base + MINUTE + 30_000, base + 3 * MINUTE + 10_000
        ranged = await everything(prod, since=lo, until=hi, limit=9)
        assert {m.handle.message_id for m in ranged} == {m for m, _, t in sent if lo <= t < hi}
        ranged_newest = await everything(prod, since=lo, until=hi, limit=4, newest_first=True)
        assert [m.handle for m in ranged_newest] == [m.handle for m in reversed(ranged)]

        with_bodies = await prod.browse(subject="billing", limit=3, bodies=True)
        assert [m.body for m in with_bodies.messages] == [f"body {m.handle.message_id}".encode()
                                                          for m in with_bodies.messages]

    await run_node(root, body)

    async def after(server, prod):
        assert [m.handle for m in await everything(prod, limit=13)] == seen["before"]
        assert await server.times.save(every=1) == 5  # as a node saves a bucket grown by 65,536

    await run_node(root, after)

    async def from_saved(server, prod):
        # Each bucket's keys were read back from its saved file, not built from its segment.
        assert sum(b.saved for b in server.times.buckets.values()) == 150
        assert [m.handle for m in await everything(prod, limit=13)] == seen["before"]

    await run_node(root, from_saved)


async def test_states_pending_delivered_and_cancelled_are_told_apart(tmp_path):
    root = tmp_path / "node"

    async def body(server, prod):
        later = now_ms() + 30 * MINUTE
        pending = [await prod.send("q.state", b"x", deliver_at=later + i, message_id=f"p{i}") for i in range(4)]
        cancelled = [await prod.send("q.state", b"x", deliver_at=later + 10 + i, message_id=f"c{i}") for i in range(3)]
        for h in cancelled:
            await prod.cancel(h)
        done = [await prod.send("q.state", b"x", delay=0, message_id=f"d{i}") for i in range(2)]
        with trio.fail_after(30):
            for h in done:
                while (await prod.status(h)).state != MessageState.DELIVERED:
                    await trio.sleep(0.02)
        ids = lambda page: {m.handle.message_id for m in page}  # noqa: E731
        assert ids(await everything(prod)) == {h.message_id for h in pending}
        assert ids(await everything(prod, states=["cancelled"])) == {h.message_id for h in cancelled}
        delivered = await everything(prod, states=["delivered"])
        assert ids(delivered) == {h.message_id for h in done}
        assert all(m.dispatch_time > 0 and m.broker_group for m in delivered)
        assert len(await everything(prod, states=["pending", "cancelled", "delivered"], limit=2)) == 9
        # A rescheduled message: its old record reads cancelled, the moved one pending.
        moved = await prod.reschedule(pending[0], deliver_at=later + 5 * MINUTE)
        pend = await everything(prod)
        assert moved.handle in [m.handle for m in pend] and pending[0] not in [m.handle for m in pend]

    await run_node(root, body)


async def test_a_page_of_a_big_bucket_comes_in_order_from_the_index(tmp_path):
    root = tmp_path / "node"
    bucket = now_ms() - now_ms() % MINUTE + 20 * MINUTE
    n = 3000  # several sorted runs of the time index, and its unsorted tail

    async def body(server, prod):
        times = [bucket + (i * 7919) % MINUTE for i in range(n)]
        await prod.send_many([Message("q.big", b"", deliver_at=t, message_id=f"b{i}") for i, t in enumerate(times)])
        first = await prod.browse(limit=100)
        assert [m.handle.schedule_time for m in first.messages] == sorted(times)[:100]
        last = await prod.browse(limit=100, newest_first=True)
        assert [m.handle.schedule_time for m in last.messages] == sorted(times, reverse=True)[:100]
        assert len(await everything(prod, limit=1000)) == n

    await run_node(root, body)


async def test_a_query_that_cannot_be_answered_is_refused_with_bad_request(tmp_path):
    async def body(server, prod):
        for query in ({"states": ["lost"]}, {"limit": 0}, {"limit": 5000}, {"order": "sideways"},
                      {"cursor": "not-a-cursor"}, {"since": -1}, {"colour": "red"}, [1, 2]):
            with pytest.raises(DelayServerError) as e:
                await prod.request(p.Command.BROWSE, p.encode_json(query))
            assert e.value.code == ResultCode.BAD_REQUEST
        with pytest.raises(DelayServerError) as e:
            await prod.request(p.Command.BROWSE, b"\xff not json")
        assert e.value.code == ResultCode.BAD_REQUEST
        assert (await prod.browse()).messages == []  # the connection and the node are fine

    await run_node(tmp_path / "node", body)


async def test_a_page_reads_what_is_not_in_the_page_cache_in_worker_threads(tmp_path):
    """A big bucket is mostly on disk: a page of it that read its records on the event loop would
    hold every connection while the disk seeks. What is not in the page cache is read in a worker
    thread (the messages, their cancels, their dispatch records), and the page is the same."""
    node = Node(tmp_path, START_MS)
    browser = Browser(node.store, Lookup(node.store), TimeIndex(node.store.schedule_log, SCALE_MS))
    sched = START_MS + 1000
    node.send([(f"m{i}", sched + i) for i in range(20)], body=b"a body " * 100)
    node.cancel("m1", sched + 1)
    node.replay_all()
    bucket = sched - sched % SCALE_MS
    offsets = {scheduled_key(payload, 0)[3]: offset for offset, rtype, payload
               in node.store.schedule_log.records(bucket) if rtype == RecordType.SCHEDULED}
    node.dispatch([Fired(0, bucket, offsets["m2"], None, START_MS)])
    query = BrowseQuery(states=frozenset({MessageState.PENDING, MessageState.CANCELLED, MessageState.DELIVERED}),
                        bodies=True)
    expected = await browser.page(query)  # everything in memory
    assert len(expected.messages) == 20 and expected.messages[0].body == b"a body " * 100
    assert [m.state for m in expected.messages[:3]] == [MessageState.PENDING, MessageState.CANCELLED,
                                                         MessageState.DELIVERED]
    on_loop, in_threads = [], []
    loop_thread = threading.current_thread()
    for log in (node.store.schedule_log, node.store.dispatch_log):
        def read_spy(bucket, start=0, end=None, real=log.read):
            on_loop.append(threading.current_thread() is loop_thread)
            return real(bucket, start, end)

        def thread_spy(make):
            def made(*args):
                read = make(*args)

                def run(*args):
                    in_threads.append(threading.current_thread() is not loop_thread)
                    return read(*args)
                return run
            return made
        log.read = read_spy
        log.range_reader, log.records_reader = thread_spy(log.range_reader), thread_spy(log.records_reader)
        log.read_cached = lambda bucket, start=0, end=None: None  # nothing in the page cache
    assert await browser.page(query) == expected
    assert not any(on_loop), "a read that may wait for the disk on the event loop"
    # Per message its record (and its body, past the first read); m1's cancel; m2's dispatch record.
    assert len(in_threads) >= 22 and all(in_threads)
    node.crash()
