"""Recovery of the scheduling pipeline: crashes at random points of replay, load and fire.

A crash drops every in-memory object and keeps the files (with, at times, a torn tail on a
schedule segment or on a dispatch_log, as a write cut short leaves). A fake broker counts what
it received; the node records deliveries in dispatch_log as the sender does. After the last
restart every message has fired once unless it was cancelled or dispatched first, and none more
than once beyond the times it was in flight (taken, not yet recorded) at a crash.
"""
from __future__ import annotations

import collections
import random

import pytest

from delayserver.storage.record import Dispatch, RecordType, encode_dispatch, encode_record
from delayserver.storage.store import bucket_stats
from tests.pipeline_node import GROUP, SCALE_MS, START_MS, Fired, Node, run_until_idle


class Broker:
    """What the broker group received and what the node recorded, across every life."""

    def __init__(self) -> None:
        self.deliveries: collections.Counter[str] = collections.Counter()
        self.in_flight_at_crashes: collections.Counter[str] = collections.Counter()
        self.recorded: set[str] = set()
        self.schedule_time: dict[str, int] = {}
        self.cancel_offset: dict[str, int] = {}

    def receive(self, node: Node, fired: list[Fired]) -> None:
        for f in fired:
            mid = f.message.message_id
            assert f.message.schedule_time <= node.now, f"{mid} fired before its time"
            assert mid not in self.recorded, f"{mid} fired again after its dispatch was recorded"
            cancel = self.cancel_offset.get(mid)
            assert cancel is None or cancel >= node.replayer.offset, f"{mid} fired after its cancel was replayed"
            self.deliveries[mid] += 1

    def record(self, fired: list[Fired]) -> None:
        self.recorded.update(f.message.message_id for f in fired)


class CrashLoop:
    """Random work on one data directory, crashing after a random number of steps."""

    def __init__(self, root, seed: int):
        self.root = root
        self.rng = random.Random(seed)
        self.broker = Broker()
        self.now = START_MS
        self.ids = 0

    def life(self, steps: int) -> None:
        rng, broker = self.rng, self.broker
        node = Node(self.root, self.now, slots=16)
        in_flight: list[Fired] = []
        for _ in range(steps):
            op = rng.choices(["send", "cancel", "replay", "checkpoint", "load", "fire", "dispatch", "time"],
                             weights=[3, 1, 4, 1, 4, 4, 3, 3])[0]
            if op == "send":
                batch = [(f"m{self.ids + i}", node.now + rng.randrange(-20_000, 3 * SCALE_MS))
                         for i in range(rng.randrange(1, 12))]
                self.ids += len(batch)
                node.send(batch)
                broker.schedule_time.update(batch)
            elif op == "cancel" and broker.schedule_time:
                mid = rng.choice(sorted(broker.schedule_time))
                if mid not in broker.cancel_offset:
                    broker.cancel_offset[mid] = node.cancel(mid, broker.schedule_time[mid])
            elif op == "replay":
                node.replay(max_bytes=rng.randrange(40, 2000))
            elif op == "checkpoint":
                node.replayer.checkpoint()
            elif op == "load":
                node.ticks.load_step(node.now, max_bytes=rng.randrange(1, 1500))
            elif op == "fire":
                node.ticks.advance(node.now)
                fired = node.take(rng.randrange(1, 20))
                broker.receive(node, fired)
                in_flight += fired
            elif op == "dispatch":
                k = rng.randrange(len(in_flight) + 1)
                node.dispatch(in_flight[:k])
                broker.record(in_flight[:k])
                del in_flight[:k]
            elif op == "time":
                node.now += rng.randrange(-500, 8000)
        self.crash(node, in_flight)

    def crash(self, node: Node, in_flight: list[Fired]) -> None:
        rng = self.rng
        torn = rng.random()
        if torn < 0.25 and in_flight:
            # The sender died writing the dispatch record of the first in-flight message.
            f = in_flight[0]
            rec = encode_record(RecordType.DISPATCH, encode_dispatch(Dispatch(f.offset, node.now, GROUP)))
            node.store.dispatch_log.append(f.bucket, rec[: rng.randrange(1, len(rec))])
        elif torn < 0.5 and node.store.schedule_log.buckets():
            # The replayer died in the middle of an append.
            bucket = rng.choice(node.store.schedule_log.buckets())
            node.store.schedule_log.append(bucket, bytes(rng.randrange(256) for _ in range(rng.randrange(1, 60))))
        self.broker.in_flight_at_crashes.update(f.message.message_id for f in in_flight)
        self.now = node.now + rng.choice([0, 1000, 5 * SCALE_MS])
        node.crash()

    def last_life(self) -> Node:
        node = Node(self.root, self.now, slots=16)

        def deliver(fired):
            self.broker.receive(node, fired)
            self.broker.record(fired)

        run_until_idle(node, deliver=deliver)
        return node


@pytest.mark.parametrize("seed", range(24))
def test_after_crashes_at_random_points_every_message_fires_once_or_was_in_flight(tmp_path, seed):
    loop = CrashLoop(tmp_path, seed)
    for _ in range(12):
        loop.life(steps=loop.rng.randrange(1, 80))
    node = loop.last_life()
    broker = loop.broker

    assert broker.schedule_time, "the loop sent nothing"
    for mid in broker.schedule_time:
        if mid not in broker.cancel_offset:
            assert broker.deliveries[mid] >= 1, f"{mid} never fired"
        assert broker.deliveries[mid] <= 1 + broker.in_flight_at_crashes[mid], f"{mid} fired twice"
    assert node.ticks.loaded == 0
    for bucket in node.store.schedule_log.buckets():
        assert bucket_stats(node.store.schedule_log, node.store.dispatch_log, bucket).pending == 0
    node.crash()


def test_a_torn_dispatch_record_means_one_more_delivery_and_no_more(tmp_path):
    node = Node(tmp_path, START_MS)
    node.send([("m", START_MS + 100), ("n", START_MS + 100)])
    node.replay_all()
    node.now = START_MS + 100
    node.tick()
    m, n = node.take()
    node.dispatch([m])
    rec = encode_record(RecordType.DISPATCH, encode_dispatch(Dispatch(n.offset, node.now, GROUP)))
    node.store.dispatch_log.append(n.bucket, rec[:-3])
    node.crash()

    again = Node(tmp_path, node.now + 1)
    again.load_all()
    again.ticks.advance(again.now)
    fired = again.take()
    assert [f.message.message_id for f in fired] == ["n"]
    again.dispatch(fired)
    again.crash()
    third = Node(tmp_path, again.now)
    assert run_until_idle(third) == []
    assert [d.schedule_offset for d in third.store.dispatched(n.bucket).values()] == [m.offset, n.offset]
    third.crash()


def test_overdue_messages_come_out_at_once_in_schedule_time_order_after_a_restart(tmp_path):
    rng = random.Random(5)
    node = Node(tmp_path, START_MS)
    times = [START_MS + rng.randrange(10 * SCALE_MS) for _ in range(2000)]
    node.send([(f"m{i}", t) for i, t in enumerate(times)])
    node.replay_all()
    node.replayer.checkpoint()
    node.crash()

    later = START_MS + 20 * SCALE_MS
    again = Node(tmp_path, later)
    again.load_all(max_bytes=4096)
    fired = again.take()
    assert [f.message.schedule_time for f in fired] == sorted(times)
    again.crash()


def test_recovery_reloads_every_bucket_with_undelivered_messages_however_old(tmp_path):
    node = Node(tmp_path, START_MS)
    old = [(f"old{d}", START_MS + d * 24 * 3600_000) for d in range(5)]
    node.send(old)
    node.replay_all()
    node.now = START_MS + 2 * 24 * 3600_000 + 1
    node.tick()
    delivered = node.take()
    node.dispatch(delivered)
    assert [f.message.message_id for f in delivered] == ["old0", "old1", "old2"]
    node.crash()

    again = Node(tmp_path, START_MS + 30 * 24 * 3600_000)
    again.load_all()
    assert [f.message.message_id for f in again.take()] == ["old3", "old4"]
    again.crash()
