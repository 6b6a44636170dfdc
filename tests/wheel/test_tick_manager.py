"""The tick manager: loading cursors, can_add, firing, cancels and clock steps, on real segments.

Time is passed in; every test drives the pipeline synchronously through tests/pipeline_node.py.
"""
from __future__ import annotations

import logging
import random

import pytest

from delayserver.storage.errors import CorruptSegment
from delayserver.storage.record import HEADER_SIZE
from delayserver.storage.store import bucket_stats
from tests.pipeline_node import SCALE_MS, START_MS, Node, run_until_idle

TICK_MS = 10
DAY_MS = 24 * 3600 * 1000
YEAR_MS = 365 * DAY_MS


def bucket_of(t: int) -> int:
    return t - t % SCALE_MS


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path, START_MS)
    yield n
    n.crash()


def fire_ids(fired) -> list[str]:
    return [f.message.message_id for f in fired]


def hundred_thousand_schedule_times(rng: random.Random) -> list[int]:
    """Past (with empty buckets between), now, the next hours (with gaps), bucket edges, years ahead."""
    times = []
    past_minutes = [m for m in range(1, 6 * 60) if m % 3]
    times += [START_MS - rng.choice(past_minutes) * SCALE_MS + rng.randrange(SCALE_MS) for _ in range(20_000)]
    times += [START_MS + rng.randrange(-5_000, SCALE_MS) for _ in range(10_000)]
    near_minutes = [m for m in range(2, 2 * 60) if m % 5 in (0, 1)]
    times += [bucket_of(START_MS) + rng.choice(near_minutes) * SCALE_MS + rng.randrange(SCALE_MS)
              for _ in range(38_000)]
    edges = [bucket_of(START_MS) + m * SCALE_MS for m in range(-3, 10)]
    times += [e + d for e in edges for d in (0, -1, 1) for _ in range(20)]
    far_minutes = rng.sample(range(DAY_MS // SCALE_MS, 2 * YEAR_MS // SCALE_MS), 300)
    times += [bucket_of(START_MS) + rng.choice(far_minutes) * SCALE_MS + rng.randrange(SCALE_MS)
              for _ in range(100_000 - len(times))]
    return times


def test_100k_messages_over_past_now_gaps_and_years_ahead_fire_once_in_time_order_never_early(node):
    rng = random.Random(7)
    times = hundred_thousand_schedule_times(rng)
    assert len(times) == 100_000
    batch = 1000
    for i in range(0, len(times), batch):
        node.send([(f"m{j}", times[j]) for j in range(i, i + batch)])
    node.replay_all()
    node.replayer.checkpoint()

    fired = run_until_idle(node)

    assert sorted(fire_ids(fired), key=lambda s: int(s[1:])) == [f"m{j}" for j in range(len(times))]
    latest = 0
    for f in fired:
        sched = f.message.schedule_time
        assert sched <= f.at, "fired before its time"
        if sched > START_MS:
            assert f.at - sched <= TICK_MS, "fired later than one tick after its time"
        assert sched >= latest - TICK_MS, "out of time order by more than a tick"
        latest = max(latest, sched)
    assert node.ticks.loaded == 0 and not node.ticks.outstanding


# --- can_add and the loading cursors -----------------------------------------------------------


def test_nothing_is_added_directly_before_the_first_load(node):
    assert node.ticks.loading_bucket is None
    assert not node.ticks.can_add(bucket_of(START_MS) - 10 * SCALE_MS, 0)


def test_can_add_before_at_and_after_the_loading_cursor(node):
    b = bucket_of(START_MS)
    node.send([("a", b + 5), ("b", b + 6)])
    node.replay_all()
    assert node.ticks.load_step(START_MS) is True  # begins bucket b, end pinned at its size
    pinned = node.ticks.loading_end
    assert node.ticks.loading_bucket == b and pinned > 0 and node.ticks.loaded_offset == 0
    assert node.ticks.can_add(b - SCALE_MS, 0)
    assert not node.ticks.can_add(b, 0)
    assert not node.ticks.can_add(b, pinned - 1)
    assert node.ticks.can_add(b, pinned)
    assert not node.ticks.can_add(b + SCALE_MS, 0)


def test_replayed_records_told_in_bulk_go_where_one_by_one_they_would(tmp_path):
    """on_replayed_many (the replayer's call) against on_replayed per record, on the same state:
    before the loading bucket, in it before and after its pinned end, after it, due and not."""
    b = bucket_of(START_MS)
    nodes = [Node(tmp_path / str(k), START_MS) for k in range(2)]
    try:
        for n in nodes:
            n.send([("a", b + 5), ("b", b + 6)])
            n.replay_all()
            assert n.ticks.load_step(START_MS) is True
        pinned = nodes[0].ticks.loading_end
        batches = {b - SCALE_MS: [(0, START_MS - 10), (50, START_MS + 20)],
                   b: [(0, b + 7), (pinned - 1, b + 8), (pinned, START_MS + 30), (pinned + 60, START_MS - 1)],
                   b + SCALE_MS: [(0, b + SCALE_MS + 1)]}
        one, bulk = nodes[0].ticks, nodes[1].ticks
        for bucket, entries in batches.items():
            went = [one.on_replayed(bucket, offset, t, START_MS) for offset, t in entries]
            assert went == [one.can_add(bucket, offset) for offset, _ in entries]
            bulk.on_replayed_many(bucket, entries, START_MS)
        assert len(one.wheel) == len(bulk.wheel) == 2
        assert list(one.ready) == list(bulk.ready) and len(one.ready) == 2
        assert one.outstanding == bulk.outstanding
    finally:
        for n in nodes:
            n.crash()


def test_blocking_exit_moves_both_cursors_onto_an_empty_target_bucket(node):
    later = bucket_of(START_MS) + 10 * SCALE_MS
    node.send([("far", later + 1)])
    node.replay_all()
    node.load_all()
    target = node.ticks.load_target(START_MS)
    assert (node.ticks.loading_bucket, node.ticks.loading_end, node.ticks.loaded_offset) == (target, 0, 0)
    node.send([("now", START_MS + 100)])
    node.replay_all()
    assert len(node.ticks.wheel) == 1, "a message for the target bucket went straight into the wheel"
    assert fire_ids(run_until_idle(node)) == ["now", "far"]


@pytest.mark.parametrize("seed", range(8))
def test_records_racing_the_loader_fire_once(tmp_path, seed):
    """Messages for the bucket being loaded arrive before and after its pinned end, and for the
    buckets around it, while it loads in chunks smaller than a record."""
    rng = random.Random(seed)
    node = Node(tmp_path, START_MS)
    b = node.ticks.load_target(START_MS)
    ids = iter(range(10**6))

    def send_some(n):
        node.send([(f"m{next(ids)}", b + rng.randrange(-2 * SCALE_MS, 2 * SCALE_MS)) for _ in range(n)])

    send_some(50)
    for _ in range(rng.randrange(3)):
        node.replay(max_bytes=rng.randrange(1, 400))
    while True:
        action = rng.random()
        if action < 0.4:
            send_some(rng.randrange(1, 4))
        elif action < 0.7:
            node.replay(max_bytes=rng.randrange(1, 400))
        elif not node.ticks.load_step(START_MS, max_bytes=rng.randrange(1, 120)):
            break
    node.replay_all()
    fired = run_until_idle(node)
    sent = next(ids)
    assert sorted(fire_ids(fired)) == sorted(f"m{i}" for i in range(sent))
    node.crash()


def test_load_chunks_smaller_than_a_record_header_still_make_progress(node):
    node.send([(f"m{i}", START_MS + 1000 + i) for i in range(5)])
    node.replay_all()
    steps = 0
    while node.ticks.load_step(START_MS, max_bytes=HEADER_SIZE - 1):
        steps += 1
    assert steps >= 5 and len(node.ticks.wheel) == 5


def test_a_load_cut_short_resumes_from_the_loaded_cursor(node, monkeypatch):
    node.send([(f"m{i}", START_MS + 1000 + i) for i in range(20)])
    node.replay_all()
    node.ticks.load_step(START_MS)
    node.ticks.load_step(START_MS, max_bytes=300)
    half = node.ticks.loaded_offset
    assert 0 < half < node.ticks.loading_end
    real_read = node.store.schedule_log.read

    def failing_read(*a, **kw):
        raise OSError("EIO")

    monkeypatch.setattr(node.store.schedule_log, "read", failing_read)
    with pytest.raises(OSError):
        node.ticks.load_step(START_MS, max_bytes=300)
    assert node.ticks.loaded_offset == half
    monkeypatch.setattr(node.store.schedule_log, "read", real_read)
    fired = run_until_idle(node)
    assert sorted(fire_ids(fired)) == sorted(f"m{i}" for i in range(20))


def test_a_corrupt_record_quarantines_its_bucket_and_nothing_past_it_is_loaded(node):
    node.send([(f"m{i}", START_MS + 1000 + i) for i in range(3)])
    node.send([("later", START_MS + 2 * SCALE_MS)])
    node.replay_all()
    node.replayer.checkpoint()
    bucket = bucket_of(START_MS)
    path = node.store.schedule_log.path(bucket)
    raw = bytearray(path.read_bytes())
    first_end = len(raw) // 3
    raw[first_end + HEADER_SIZE + 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    node.ticks.load_step(START_MS)
    assert node.ticks.load_step(START_MS), "the loader goes on past a damaged bucket"
    assert len(node.ticks.wheel) == 1, "what lay before the damage is loaded, nothing past it"
    quarantined = node.store.quarantined()
    assert list(quarantined) == [bucket]
    assert (quarantined[bucket].path, quarantined[bucket].offset) == (str(path), first_end)
    node.now = START_MS + 3 * SCALE_MS
    node.load_all()
    assert len(node.ticks.wheel) + len(node.ticks.ready) == 2, "the later bucket still loads"


def test_overdue_messages_of_a_bucket_larger_than_a_chunk_come_out_in_schedule_time_order(node):
    b = bucket_of(START_MS)
    rng = random.Random(3)
    times = [b - SCALE_MS + rng.randrange(2 * SCALE_MS) for _ in range(300)]
    node.send([(f"m{i}", t) for i, t in enumerate(times)])
    node.replay_all()
    node.now = b + SCALE_MS + 1
    node.load_all(max_bytes=500)
    fired = node.take()
    assert [f.message.schedule_time for f in fired] == sorted(times)


# --- cancel ------------------------------------------------------------------------------------


def test_cancel_before_the_bucket_loads_keeps_the_message_from_firing(node):
    later = START_MS + 10 * SCALE_MS
    node.send([("keep", later), ("drop", later + 1)])
    node.cancel("drop", later + 1)
    node.replay_all()
    assert fire_ids(run_until_idle(node)) == ["keep"]


def test_cancels_for_buckets_not_loaded_yet_are_left_to_the_loader(node):
    far = START_MS + 365 * DAY_MS
    node.send([("m", far), ("n", far)])
    node.cancel("m", far)
    node.replay_all()
    node.load_all()
    assert node.ticks.cancels == {}, "memory holds the cancels of the loaded window only"
    node.now = far - 1000
    node.tick()
    assert fire_ids(run_until_idle(node)) == ["n"]


def test_cancel_replayed_while_the_bucket_loads_keeps_the_message_from_firing(node):
    b = node.ticks.load_target(START_MS)
    node.send([(f"m{i}", b + 1000 + i) for i in range(10)])
    node.replay_all()
    node.ticks.load_step(START_MS)
    node.ticks.load_step(START_MS, max_bytes=200)
    assert 0 < node.ticks.loaded_offset < node.ticks.loading_end
    node.cancel("m1", b + 1001)
    node.cancel("m8", b + 1008)
    node.replay_all()
    assert fire_ids(run_until_idle(node)) == [f"m{i}" for i in range(10) if i not in (1, 8)]


@pytest.mark.parametrize("overdue", [True, False], ids=["overdue-at-load", "due-during-load"])
def test_cancel_loaded_from_a_later_chunk_than_its_message_still_wins(tmp_path, overdue):
    """After a restart the cancel is known only from the segment: the message is in the first
    chunk, its cancel in a later one, and time moves on between the chunks."""
    b = bucket_of(START_MS) + SCALE_MS
    before = Node(tmp_path, START_MS)
    before.send([("late", b + 5)] + [(f"pad{i}", b + SCALE_MS - 1) for i in range(20)])
    before.cancel("late", b + 5)
    before.replay_all()
    before.replayer.checkpoint()
    before.crash()
    node = Node(tmp_path, b + 10 if overdue else b)
    assert node.ticks.load_step(node.now) and node.ticks.loading_bucket == b
    while node.ticks.load_step(node.now, max_bytes=200):
        node.now += 5
        node.ticks.advance(node.now)
        assert "late" not in fire_ids(node.take())
    assert "late" not in fire_ids(run_until_idle(node))
    node.crash()


def test_cancel_after_the_message_is_loaded_keeps_it_from_firing(node):
    node.send([("m", START_MS + 500), ("n", START_MS + 600)])
    node.replay_all()
    node.load_all()
    assert len(node.ticks.wheel) == 2
    node.cancel("m", START_MS + 500)
    node.replay_all()
    assert fire_ids(run_until_idle(node)) == ["n"]
    assert node.ticks.cancelled_drops == 1 and not node.ticks.outstanding


def test_cancel_after_firing_does_not_undeliver_and_nothing_fires_again_after_a_restart(tmp_path):
    node = Node(tmp_path, START_MS)
    node.send([("m", START_MS + 500)])
    node.replay_all()
    assert fire_ids(run_until_idle(node)) == ["m"]
    node.cancel("m", START_MS + 500)
    node.replay_all()
    node.replayer.checkpoint()
    assert run_until_idle(node) == []
    node.crash()
    again = Node(tmp_path, node.now)
    assert run_until_idle(again) == []
    stats = bucket_stats(again.store.schedule_log, again.store.dispatch_log, bucket_of(START_MS))
    assert (stats.dispatched, stats.cancelled, stats.pending) == (1, 0, 0)
    again.crash()


def test_a_cancel_applies_to_earlier_records_of_its_key_only(node):
    t = START_MS + 5 * SCALE_MS
    node.send([("m", t)])
    node.cancel("m", t)
    node.send([("m", t)])  # sent again under the same handle after the cancel: it stands
    node.replay_all()
    fired = run_until_idle(node)
    assert fire_ids(fired) == ["m"] and fired[0].offset > 0


def test_a_message_sent_and_cancelled_twice_never_fires(tmp_path):
    """The load meets the first cancel after the replayer reported the second."""
    t = START_MS + 5 * SCALE_MS
    before = Node(tmp_path, START_MS)
    before.send([("m", t)])
    before.cancel("m", t)
    before.send([("m", t)])
    before.replay_all()
    before.replayer.checkpoint()
    before.crash()
    node = Node(tmp_path, t - 1000)
    node.ticks.load_step(node.now)
    assert node.ticks.loading_bucket == bucket_of(t)
    node.ticks.load_step(node.now, max_bytes=1)  # the first message, not its cancel
    node.cancel("m", t)
    node.replay_all()
    assert run_until_idle(node) == []
    node.crash()


def test_cancels_of_a_passed_and_settled_bucket_are_forgotten(node):
    """Its last message settles while the bucket is still the loading cursor."""
    b = bucket_of(START_MS) + SCALE_MS
    node.send([("m", b + 100), ("n", b + 200)])
    node.cancel("m", b + 100)
    node.replay_all()
    assert fire_ids(run_until_idle(node)) == ["n"]
    assert node.ticks.loading_bucket == b
    node.now += 3 * SCALE_MS
    node.tick()
    assert node.ticks.cancels == {}


# --- clock steps -------------------------------------------------------------------------------


def test_a_clock_step_back_fires_nothing_early_and_is_logged(node, caplog):
    node.send([("m", START_MS + 2000)])
    node.replay_all()
    node.load_all()
    node.now = START_MS + 1500
    node.tick()
    caplog.set_level(logging.WARNING, logger="delayserver.wheel")
    node.now = START_MS - 3_600_000
    node.tick()
    assert node.take() == []
    assert "clock stepped back by 3601500 ms" in caplog.text
    node.now = START_MS + 1999
    node.tick()
    assert node.take() == []
    node.now = START_MS + 2000
    node.tick()
    assert fire_ids(node.take()) == ["m"]


def test_a_clock_step_forward_fires_what_became_due_each_once_and_is_logged(node, caplog):
    times = [START_MS + k * 7 * SCALE_MS // 3 for k in range(1, 40)]
    node.send([(f"m{i}", t) for i, t in enumerate(times)])
    node.replay_all()
    node.tick()
    caplog.set_level(logging.WARNING, logger="delayserver.wheel")
    node.now = START_MS + 3_600_000
    node.tick()
    fired = node.take()
    node.dispatch(fired)
    assert "clock stepped forward by 3600000 ms" in caplog.text
    assert [f.message.schedule_time for f in fired] == [t for t in times if t <= node.now]
    rest = run_until_idle(node)
    assert sorted(fire_ids(fired + rest)) == sorted(f"m{i}" for i in range(len(times)))


def test_a_batch_of_one_bucket_settles_as_each_of_its_refs_does(tmp_path):
    """The same for a batch of one bucket's refs (most batches, counted by what left the set in
    flight): a ref of that bucket never handed out, and one settled twice, count nothing."""
    states = []
    for many in (False, True):
        node = Node(tmp_path / str(many), START_MS)
        node.send([(f"a{i}", START_MS - SCALE_MS + i) for i in range(30)] + [("later", START_MS + 5 * SCALE_MS)])
        node.replay_all()
        node.tick()
        refs = [f.ref for f in node.take()]
        never = max(refs) + 1  # the same bucket, an offset not handed out
        assert never >> 40 == refs[0] >> 40
        settle = refs[:20] + [refs[3], never]
        if many:
            node.ticks.on_dispatched_many(settle)
        else:
            for ref in settle:
                node.ticks.on_dispatched(ref)
        states.append((sorted(node.ticks.inflight), dict(node.ticks.outstanding)))
        node.crash()
    assert states[0] == states[1]
    inflight, outstanding = states[1]
    assert len(inflight) == 10 and list(outstanding.values()) == [10]


def test_a_batch_settles_as_each_of_its_refs_does(tmp_path):
    """`on_dispatched_many` (the sender's, once an fsync covers a batch) leaves the counts as
    `on_dispatched` of each does: in flight, outstanding per bucket, a finished bucket's cancels,
    a ref handed out before a reset ignored."""
    states = []
    for many in (False, True):
        node = Node(tmp_path / str(many), START_MS)
        # Two buckets, some of each due now; a cancel in the first.
        due = [(f"a{i}", START_MS - 2 * SCALE_MS + i) for i in range(30)]
        due += [(f"b{i}", START_MS - SCALE_MS + i) for i in range(20)] + [("later", START_MS + 5 * SCALE_MS)]
        node.send(due)
        node.cancel("a3", START_MS - 2 * SCALE_MS + 3)
        node.replay_all()
        node.tick()
        fired = node.take()
        refs = [f.ref for f in fired]
        settle = refs[:25] + refs[30:] + [refs[0] ^ (1 << 50)]  # not one handed out
        if many:
            node.ticks.on_dispatched_many(settle)
        else:
            for ref in settle:
                node.ticks.on_dispatched(ref)
        states.append((sorted(node.ticks.inflight), dict(node.ticks.outstanding), sorted(node.ticks.cancels)))
        node.crash()
    assert states[0] == states[1]
    inflight, outstanding, _ = states[1]
    # 49 taken (a3 cancelled) in time order, 44 settled: the 26th to 30th still owed.
    assert len(inflight) == 5 and sorted(outstanding.values()) == [1, 4]
