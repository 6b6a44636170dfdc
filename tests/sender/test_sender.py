"""The sender end to end with real brokers: a redis-server that goes down, a slow webhook, weights,
circuit breaking, flow control, parking. The server runs in-process over real sockets."""
from __future__ import annotations

import collections
import random

import redis
import trio

from delayserver.client import AsyncProducer, Message
from delayserver.config import Config
from delayserver.node.server import DelayServer
from delayserver.sender.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from delayserver.sender.parked import iter_parked
from delayserver.sender.sender import BrokerGroup, Delivery, Sender
from delayserver.sender.spool import iter_spool
from delayserver.storage.record import Message as StoredMessage
from delayserver.storage.store import bucket_stats


def node_config(tmp_path, groups, **kw) -> Config:
    raw = dict(data_dir=str(tmp_path / "data"), listen="127.0.0.1:0", broker_group=groups, send_wait_ms=1)
    raw.update(kw)
    return Config.from_dict(raw)


async def start_node(nursery, cfg) -> DelayServer:
    server = DelayServer(cfg)
    await nursery.start(server.serve)
    return server


async def wait_until(predicate, timeout_s: float) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():
            await trio.sleep(0.02)


def total_dispatched(server) -> int:
    store = server.store
    return sum(bucket_stats(store.schedule_log, store.dispatch_log, b).dispatched for b in store.schedule_log.buckets())


async def test_redis_group_down_for_a_while_loses_nothing_and_dispatch_log_is_complete(tmp_path, nursery, redis_server):
    server = await start_node(nursery, node_config(tmp_path, [
        {"name": "redis-a", "transport": "redis", "address": redis_server.address,
         "options": {"timeout_ms": 500, "stream_template": "q:{subject}"}}]))
    redis_server.stop()
    async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
        handles = await prod.send_many([Message("orders.paid", f"m{i}".encode(), delay=0, headers={"k": str(i)})
                                        for i in range(200)])
    await trio.sleep(1.5)  # the broker stays down while deliveries fail and back off
    assert server.sender.retried > 0 and server.sender.delivered == 0
    redis_server.start()
    await wait_until(lambda: server.sender.delivered >= 200, 30)
    client = redis.Redis(host=redis_server.host, port=redis_server.port)
    entries = client.xrange("q:orders.paid")
    ids = collections.Counter(fields[b"id"].decode() for _, fields in entries)
    assert set(ids) == {h.message_id for h in handles}
    _, fields = entries[0]
    assert {b"id", b"subject", b"body", b"schedule_time", b"dispatch_time", b"attempt", b"h:k"} <= set(fields)
    assert int(fields[b"dispatch_time"]) >= int(fields[b"schedule_time"])
    assert total_dispatched(server) == 200
    assert server.ticks.loaded == 0


async def test_a_slow_group_does_not_hold_back_another(tmp_path, nursery, webhook_server):
    # The webhook holds every request until the test lets go: all the fast group's messages must
    # arrive while the slow group still waits for its first answer.
    webhook_server.respond(200, delay_ms=120_000)
    server = await start_node(nursery, node_config(tmp_path, [
        {"name": "slow-http", "transport": "http", "address": webhook_server.url, "subjects": ["slow.q"],
         "options": {"timeout_ms": 120_000}},
        {"name": "fast-spool", "transport": "spool", "subjects": ["fast.q"]}], send_batch_size=16))
    try:
        async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
            await prod.send_many([Message("slow.q", b"s", delay=0) for _ in range(64)])
            await wait_until(lambda: len(webhook_server.batches) >= 1, 10)
            await prod.send_many([Message("fast.q", b"f", delay=200) for _ in range(64)])
        # Counted as sent once its dispatch_log records are durable, just after the spool write.
        await wait_until(lambda: server.sender.groups["fast-spool"].sent == 64, 30)
        assert len(list(iter_spool(server.config.data_dir, "fast.q"))) == 64
        slow = server.sender.groups["slow-http"]
        assert slow.sent == 0 and slow.sending > 0  # its first batch is still unanswered
    finally:
        webhook_server.closing.set()  # answer the held requests at once
    await wait_until(lambda: server.sender.groups["slow-http"].sent == 64, 30)


def test_weighted_choice_spreads_messages_close_to_the_weights():
    groups = [BrokerGroup("a", transport=None, weight=1), BrokerGroup("b", transport=None, weight=3)]
    sender = Sender(ticks=None, store=None, groups=groups, clock=None)
    random.seed(7)
    m = StoredMessage("id", "s", b"", 0)
    picks = collections.Counter(sender.pick(Delivery(0, 0, 0, m), 0).name for _ in range(20_000))
    assert abs(picks["b"] / 20_000 - 0.75) < 0.02


def test_a_retry_goes_to_a_group_it_has_not_failed_at_while_there_is_one():
    groups = [BrokerGroup("a", transport=None, weight=1), BrokerGroup("b", transport=None, weight=100)]
    sender = Sender(ticks=None, store=None, groups=groups, clock=None)
    m = StoredMessage("id", "s", b"", 0)
    assert {sender.pick(Delivery(0, 0, 0, m, tried=("b",)), 0).name for _ in range(200)} == {"a"}
    assert {sender.pick(Delivery(0, 0, 0, m, tried=("b", "a")), 0).name for _ in range(200)} <= {"a", "b"}
    assert Delivery(0, 0, 0, m).tried == ()  # nothing made per message until it fails somewhere


def test_circuit_breaker_opens_half_opens_and_closes():
    b = CircuitBreaker(failure_threshold=3, success_threshold=2, cooldown_ms=100)
    for _ in range(3):
        assert b.allows(0)
        b.record_failure(0)
    assert b.state == OPEN and not b.allows(50)
    assert b.allows(100) and b.state == HALF_OPEN
    b.record_failure(100)
    assert b.state == OPEN and not b.allows(250) and b.allows(300)  # the cool-down doubled
    b.record_success(300)
    b.record_success(301)
    assert b.state == CLOSED


async def test_a_failing_group_is_skipped_and_its_messages_go_to_another(tmp_path, nursery, unused_port):
    server = await start_node(nursery, node_config(tmp_path, [
        {"name": "dead", "transport": "http", "address": f"http://127.0.0.1:{unused_port}/", "weight": 100},
        {"name": "spool", "transport": "spool", "weight": 1}]))
    async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
        await prod.send_many([Message("any.q", b"x", delay=0) for _ in range(100)])
    await wait_until(lambda: server.sender.delivered == 100, 15)
    dead = server.sender.groups["dead"]
    assert dead.failed_batches >= 1 and dead.sent == 0
    assert server.sender.groups["spool"].sent == 100


async def test_flow_control_bounds_in_flight_and_drops_nothing(tmp_path, nursery, webhook_server):
    webhook_server.respond(200, delay_ms=100)
    server = await start_node(nursery, node_config(tmp_path, [
        {"name": "hook", "transport": "http", "address": webhook_server.url}],
        max_inflight=8, send_batch_size=4))
    peak_waiting = peak_inflight = 0
    async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
        await prod.send_many([Message("fc.q", b"x", delay=0) for _ in range(60)])
    with trio.fail_after(30):
        while server.sender.delivered < 60:
            metrics = server.sender.metrics()
            peak_waiting = max(peak_waiting, metrics["delayserver_due_waiting"])
            peak_inflight = max(peak_inflight, metrics["delayserver_inflight"])
            await trio.sleep(0.01)
    assert peak_inflight <= 8 and peak_waiting > 0
    delivered = collections.Counter(m["id"] for batch in webhook_server.batches for m in batch["messages"])
    assert len(delivered) == 60


async def test_a_permanent_rejection_parks_the_message_without_blocking_others(tmp_path, nursery, webhook_server):
    webhook_server.respond(200, body=lambda batch: {"results": [
        {"id": m["id"], "status": "rejected" if m["subject"] == "unknown.q" else "ok", "detail": "no such queue"}
        for m in batch["messages"]]})
    server = await start_node(nursery, node_config(tmp_path, [
        {"name": "hook", "transport": "http", "address": webhook_server.url}]))
    async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
        bad = await prod.send("unknown.q", b"nobody", delay=0)
        good = await prod.send_many([Message("known.q", b"x", delay=0) for _ in range(20)])
    await wait_until(lambda: server.sender.delivered == 20 and server.sender.parked_count == 1, 10)
    parked = [p for _, p in iter_parked(server.config.data_dir / "parked")]
    assert [p.message.message_id for p in parked] == [bad.message_id]
    assert "no such queue" in parked[0].reason
    assert server.ticks.loaded == 0


def routing_groups():
    """Groups in each case `route_taken` meets: a subject with one group, with two (weighted),
    with one that is full, with one whose breaker is open, with none."""
    groups = [BrokerGroup("one", transport=None, subjects=frozenset({"s.one"})),
              BrokerGroup("w1", transport=None, weight=1, subjects=frozenset({"s.two"})),
              BrokerGroup("w2", transport=None, weight=3, subjects=frozenset({"s.two"})),
              BrokerGroup("full", transport=None, subjects=frozenset({"s.full"}), inflight=4),
              BrokerGroup("open", transport=None, subjects=frozenset({"s.open"}),
                          breaker=CircuitBreaker(state=OPEN, open_until=10**12))]
    return groups


def routed(batch: list[tuple[str, str]], one_at_a_time: bool):
    """What routing the (message id, subject) pairs of `batch` leaves in a fresh sender over
    `routing_groups()`, by `route` of each or by `route_taken` of the batch."""
    import types
    from delayserver.wheel.due_queue import DueQueue
    sender = Sender(ticks=None, store=None, groups=routing_groups(), clock=None, max_inflight=5)
    sender.due = DueQueue(types.SimpleNamespace(generation=0))
    deliveries = [Delivery(k, 0, k, StoredMessage(mid, subject, b"", 0)) for k, (mid, subject) in enumerate(batch)]
    random.seed(11)
    if one_at_a_time:
        for d in deliveries:
            sender.route(d, 0)
    else:
        sender.route_taken(deliveries, 0)
    return (
        {g.name: ([d.message.message_id for d in g.queue], [d.ref for d in g.backlog], g.inflight,
                  g.wakeup._event.is_set()) for g in sender.groups.values()},
        sender.no_route, sender.due.retrying, [d.group.name if d.group else None for d in deliveries])


async def test_a_taken_batch_is_routed_as_each_of_its_messages_would_be():
    """`route_taken` (the dispatch task's: a subject's groups looked up once a batch, a batch of
    one subject queued in bulk when its group has room for all) queues, backlogs and counts every
    message as `route` of each does, in the same order."""
    subjects = ["s.one", "s.two", "s.full", "s.open", "s.none"]
    rng = random.Random(5)
    mixed = [(f"m{i}", rng.choice(subjects)) for i in range(300)]
    assert routed(mixed, True) == routed(mixed, False)
    queued, no_route, retrying, _ = routed(mixed, False)
    assert len(queued["one"][0]) > 1 and queued["full"][2] == 5 and queued["full"][1]  # cases met
    assert queued["w1"][0] and queued["w2"][0] and queued["open"][1] and no_route == retrying > 0
    # One subject's: room for all (in bulk), room for some, two groups, a full one, an open one, none.
    for subject, n in [("s.one", 5), ("s.one", 6), ("s.two", 4), ("s.full", 3), ("s.open", 2), ("s.none", 2)]:
        batch = [(f"{subject}-{i}", subject) for i in range(n)]
        assert routed(batch, True) == routed(batch, False), (subject, n)
    queued = routed([(f"o{i}", "s.one") for i in range(5)], False)[0]
    assert queued["one"] == ([f"o{i}" for i in range(5)], [], 5, True)


async def test_a_transport_that_raises_costs_its_batch_a_retry_not_the_node(tmp_path, nursery):
    """A transport that raises instead of answering (a bug, or a reply its client library did not
    expect) fails its batch as RETRY; the node goes on and delivers every message once."""
    server = await start_node(nursery, node_config(tmp_path, [{"name": "g", "transport": "spool"}]))
    group = server.sender.groups["g"]
    spool, raised = group.transport, []

    class RaisingOnce:  # the real spool transport, whose first batch raises
        def __getattr__(self, name):
            return getattr(spool, name)

        async def send_batch(self, messages):
            if not raised:
                raised.append(len(messages))
                raise RuntimeError("a reply the client library did not expect")
            return await spool.send_batch(messages)

    group.transport = RaisingOnce()
    async with AsyncProducer(f"127.0.0.1:{server.port}") as producer:
        await producer.send_many([Message("t.raise", b"x", message_id=f"r{i}") for i in range(5)])
    await wait_until(lambda: server.sender.delivered == 5, 10)
    assert raised and server.sender.retried >= raised[0]
    delivered = [m.message_id for _, _, _, m in iter_spool(server.config.data_dir, "t.raise")]
    assert sorted(delivered) == [f"r{i}" for i in range(5)]


async def test_the_lateness_reported_is_each_delivered_messages_own(tmp_path, nursery):
    """The lateness the sender reports (its window, the metrics' hook) is dispatch time minus
    schedule time of each delivered message, as the delivered records carry them, for batches of
    one subject and of several (the spool's two paths). Each batch lingers 50 ms to fill, for a
    message falling due 20 ms after the others (the last of each list): none is 0 ms late."""
    server = await start_node(nursery, node_config(tmp_path, [{"name": "g", "transport": "spool"}], send_wait_ms=50))
    reported = []
    server.sender.on_delivered = lambda group, lateness_ms: reported.extend((group, ms) for ms in lateness_ms)
    one = [Message("late.one", b"x", delay=0 if i < 39 else 20) for i in range(40)]
    mixed = [Message(f"late.s{i % 3}", b"y", delay=0 if i < 29 else 20) for i in range(30)]
    async with AsyncProducer(f"127.0.0.1:{server.port}") as producer:
        await producer.send_many(one, batch=40)
        await wait_until(lambda: server.sender.delivered == 40, 10)
        await producer.send_many(mixed, batch=30)
    await wait_until(lambda: server.sender.delivered == 70, 10)
    spooled = [t - m.schedule_time for subject in ("late.one", "late.s0", "late.s1", "late.s2")
               for _, t, _, m in iter_spool(server.config.data_dir, subject)]
    assert len(spooled) == 70 and min(spooled) > 0
    assert sorted(ms for _, ms in reported) == sorted(spooled) == sorted(server.sender.lateness_ms)
    assert {group for group, _ in reported} == {"g"}


async def test_a_lone_message_goes_at_once_without_waiting_for_a_batch_to_fill(tmp_path, nursery):
    """A batch waits `send_wait_ms` to fill only when something more falls due within that time:
    with a wait of a minute, a message with nothing due behind it is delivered at once."""
    server = await start_node(nursery, node_config(tmp_path, [{"name": "g", "transport": "spool"}],
                                                   send_wait_ms=60_000))
    async with AsyncProducer(f"127.0.0.1:{server.port}") as producer:
        for k in range(3):
            await producer.send(f"alone.{k}", b"x", delay=0)
            await wait_until(lambda: server.sender.delivered == k + 1, 10)
    assert [m.subject for k in range(3) for _, _, _, m in iter_spool(server.config.data_dir, f"alone.{k}")] == \
        ["alone.0", "alone.1", "alone.2"]


async def test_a_batch_waits_to_fill_for_what_falls_due_within_its_wait(tmp_path, nursery):
    """A message due 100 ms after another, within the batch's wait of 400 ms: the batch waits for
    it and both go in it (one dispatch time), neither early."""
    server = await start_node(nursery, node_config(tmp_path, [{"name": "g", "transport": "spool"}],
                                                   send_wait_ms=400))
    async with AsyncProducer(f"127.0.0.1:{server.port}") as producer:
        await producer.send_many([Message("fill.q", b"first", delay=0), Message("fill.q", b"second", delay=100)])
    await wait_until(lambda: server.sender.delivered == 2, 10)
    (_, at_a, _, a), (_, at_b, _, b) = iter_spool(server.config.data_dir, "fill.q")
    assert (a.body, b.body) == (b"first", b"second")
    assert at_a == at_b  # one batch, one dispatch time
    assert b.schedule_time - a.schedule_time >= 100 and at_b >= b.schedule_time


async def test_messages_falling_due_are_taken_and_routed_in_the_tick_task_s_step(tmp_path, nursery):
    """The tick task that advanced the wheel takes and routes what fell due itself, when it is in
    memory and a group has room: the dispatch task does not wake for each tick (at tens of
    thousands of messages a second, a task step per tick spent on a hand-over)."""
    server = await start_node(nursery, node_config(tmp_path, [{"name": "g", "transport": "spool"}]))
    steps = collections.Counter()

    class CountSteps(trio.abc.Instrument):
        def before_task_step(self, task):
            steps[".".join(task.name.split(".")[-2:])] += 1  # "Sender.serve": the dispatch task's

    counting = CountSteps()
    started = trio.current_time()
    trio.lowlevel.add_instrument(counting)
    try:
        async with AsyncProducer(f"127.0.0.1:{server.port}") as producer:
            for k in range(20):  # twenty batches falling due, each on its own tick
                await producer.send_many([Message("tick.q", b"x", message_id=f"t{k}-{i}") for i in range(10)])
                await wait_until(lambda: server.sender.delivered == 10 * (k + 1), 10)
    finally:
        trio.lowlevel.remove_instrument(counting)
    assert steps["service.serve_ticks"] >= 20 and steps["Sender._group_task"] >= 20
    # (Its wait's timeout, once a second, however slow the machine.)
    assert steps["Sender.serve"] <= 2 + int(trio.current_time() - started)
    assert server.sender.due.waiting == 0 and server.sender.delivered == 200


async def test_batches_routed_to_a_group_do_not_wake_its_empty_backlog(tmp_path, nursery):
    """A group's backlog task wakes for what concerns it (its backlog filled, room freed while one
    waits, a breaker's cool-down), not for each batch routed to the group's queue: at tens of
    thousands of messages a second those wake-ups were a task step per batch spent on nothing."""
    server = await start_node(nursery, node_config(tmp_path, [{"name": "g", "transport": "spool"}]))
    steps = collections.Counter()

    class CountSteps(trio.abc.Instrument):
        def before_task_step(self, task):
            steps[task.name.rpartition(".")[2]] += 1

    counting = CountSteps()
    trio.lowlevel.add_instrument(counting)
    try:
        async with AsyncProducer(f"127.0.0.1:{server.port}") as producer:
            for k in range(20):  # twenty batches, each routed on its own
                await producer.send_many([Message("wake.q", b"x", message_id=f"w{k}-{i}") for i in range(10)])
                await wait_until(lambda: server.sender.delivered == 10 * (k + 1), 10)
    finally:
        trio.lowlevel.remove_instrument(counting)
    assert steps["_group_task"] >= 20
    assert steps["_backlog_task"] <= 2
