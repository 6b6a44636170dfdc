"""The timing wheel against its rules, on tiny wheels that force the multi-round paths."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.timingwheel import bench_wheel
from delayserver.wheel.timingwheel import MAX_REF, TimingWheel

YEAR_MS = 365 * 24 * 3600 * 1000


def tiny(slots: int = 4, tick_ms: int = 1, start_ms: int = 0) -> TimingWheel:
    return TimingWheel(start_ms=start_ms, tick_ms=tick_ms, slots=slots)


@pytest.mark.parametrize("slots", [0, 3, 6, -4, 65535])
def test_slots_must_be_a_power_of_two(slots):
    with pytest.raises(ValueError, match="power of two"):
        TimingWheel(start_ms=0, slots=slots)


@pytest.mark.parametrize("tick_ms", [0, -10])
def test_tick_must_be_positive(tick_ms):
    with pytest.raises(ValueError, match="positive"):
        TimingWheel(start_ms=0, tick_ms=tick_ms)


def test_defaults():
    wheel = TimingWheel(start_ms=123)
    assert (wheel.tick_ms, wheel.slots, len(wheel), wheel.next_due()) == (10, 65536, 0, None)


@pytest.mark.parametrize("due_ms", [99, 100, -5])
def test_entry_due_now_or_in_the_past_is_refused_and_not_kept(due_ms):
    wheel = tiny()
    assert wheel.add(due_ms, 1, now=100) is False
    assert len(wheel) == 0 and 1 not in wheel and wheel.next_due() is None
    assert wheel.advance(10**6) == []


@pytest.mark.parametrize("ref", [-1, MAX_REF + 1])
def test_ref_outside_63_bits_is_refused_and_the_wheel_unchanged(ref):
    wheel = tiny()
    wheel.add(5, 1, now=0)
    with pytest.raises(ValueError):
        wheel.add(3, ref, now=0)
    assert len(wheel) == 1 and wheel.next_due() == 5
    assert wheel.add(7, MAX_REF, now=0) is True
    assert wheel.advance(7) == [(5, 1), (7, MAX_REF)]


def test_entries_at_slot_boundaries_fire_at_their_due_time_not_a_tick_early():
    # 4 slots of 5 ms from 1000: boundaries at 1000, 1005, ...; one revolution is 20 ms.
    wheel = tiny(slots=4, tick_ms=5, start_ms=1000)
    dues = [1004, 1005, 1009, 1010, 1020, 1025, 1040]
    for ref, due in enumerate(dues):
        assert wheel.add(due, ref, now=1000)
    for ref, due in enumerate(dues):
        assert wheel.advance(due - 1) == []
        assert wheel.next_due() == due
        assert not wheel.holds_due_by(due - 1) and wheel.holds_due_by(due)
        assert wheel.advance(due) == [(due, ref)]
    assert len(wheel) == 0 and not wheel.holds_due_by(10**9)


def test_ties_fire_in_insertion_order():
    wheel = tiny()
    for ref in [9, 3, 7, 1]:
        wheel.add(10, ref, now=0)
    wheel.add(6, 5, now=0)  # same slot (10 % 4 == 6 % 4), earlier round, added last
    assert wheel.advance(10) == [(6, 5), (10, 9), (10, 3), (10, 7), (10, 1)]


def test_far_future_entries_never_fire_early():
    wheel = tiny(slots=8)
    dues = [2 * YEAR_MS, YEAR_MS + 3, YEAR_MS, 17, 8 * 10**6 + 1]
    for ref, due in enumerate(dues):
        wheel.add(due, ref, now=0)
    now = 0
    for due, ref in sorted((due, ref) for ref, due in enumerate(dues)):
        # Visit every slot between the entries many times over, stepping and jumping.
        for step in [1, 7, 8, 9, 1000, 12345]:
            if now + step < due:
                now += step
                assert wheel.advance(now) == []
        assert wheel.advance(due - 1) == []
        assert wheel.advance(due) == [(due, ref)]
        now = due
    assert len(wheel) == 0


def test_big_forward_jump_fires_everything_due_once_in_order():
    rng = random.Random(7)
    wheel = tiny(slots=8)
    entries = [(rng.randrange(1, 10_000), ref) for ref in range(2_000)]
    for due, ref in entries:
        wheel.add(due, ref, now=0)
    in_order = sorted(entries, key=lambda e: e[0])  # stable: ties stay in insertion order
    assert wheel.advance(5_000) == [e for e in in_order if e[0] <= 5_000]
    assert wheel.advance(5_000) == [] and wheel.advance(100) == []
    assert wheel.advance(10**9) == [e for e in in_order if e[0] > 5_000]
    assert len(wheel) == 0 and wheel.next_due() is None


def test_huge_jump_does_not_walk_the_ticks():
    # 10**15 ms is 10**15 ticks: walking them one by one would never finish.
    wheel = TimingWheel(start_ms=0, tick_ms=1)
    wheel.add(5, 1, now=0)
    wheel.add(10**14, 2, now=0)
    assert wheel.advance(10**15) == [(5, 1), (10**14, 2)]


def test_backward_step_fires_nothing_and_later_advances_work():
    wheel = tiny()
    for due in [3, 50, 51, 80]:
        wheel.add(due, due, now=0)
    assert wheel.advance(50) == [(3, 3), (50, 50)]
    assert wheel.advance(10) == []  # the clock stepped back 40 ms
    assert wheel.advance(50) == []
    assert wheel.next_due() == 51
    assert wheel.advance(51) == [(51, 51)]
    assert wheel.advance(79) == [] and wheel.advance(80) == [(80, 80)]


def test_entry_added_after_a_clock_step_back_fires_at_its_due_time():
    wheel = tiny()
    wheel.add(2000, 1, now=0)
    assert wheel.advance(1000) == []
    # The caller's clock stepped back to 800: 900 is not due for it yet, though the wheel saw 1000.
    assert wheel.add(900, 2, now=800) is True
    assert wheel.next_due() == 900
    assert wheel.advance(899) == []
    assert wheel.advance(1000) == [(900, 2)]


def test_cancel_before_fire_removes_the_entry():
    wheel = tiny()
    for ref, due in enumerate([5, 9, 13, 9]):
        wheel.add(due, ref, now=0)
    assert wheel.cancel(0) is True  # the slot's first entry: next_due moves on
    assert wheel.next_due() == 9
    assert wheel.cancel(3, due_ms=9) is True
    assert 3 not in wheel and 1 in wheel and len(wheel) == 2
    assert wheel.advance(100) == [(9, 1), (13, 2)]


def test_cancel_of_a_fired_or_unknown_ref_returns_false():
    wheel = tiny()
    wheel.add(5, 1, now=0)
    wheel.add(6, 2, now=0)
    assert wheel.advance(5) == [(5, 1)]
    assert wheel.cancel(1) is False and wheel.cancel(1, due_ms=5) is False
    assert wheel.cancel(42) is False and wheel.cancel(42, due_ms=6) is False
    assert wheel.cancel(2, due_ms=7) is False  # a wrong due time does not match
    assert wheel.cancel(2, due_ms=6) is True and wheel.cancel(2) is False
    assert len(wheel) == 0 and wheel.next_due() is None and wheel.advance(100) == []


def test_cancel_without_due_time_matches_refs_not_due_times():
    wheel = tiny()
    wheel.add(5, 1, now=0)  # its due time equals the ref cancelled below
    wheel.add(6, 1, now=0)
    assert 5 not in wheel and wheel.cancel(5) is False
    wheel.add(7, 5, now=0)
    assert 5 in wheel and wheel.cancel(5) is True
    assert wheel.advance(100) == [(5, 1), (6, 1)]


def test_heap_stays_bounded_under_descending_adds():
    # Each add lands in front of the one slot and leaves the previous heap key stale.
    wheel = tiny(slots=1)
    for due in range(20_000, 0, -1):
        wheel.add(due, due, now=0)
        assert len(wheel._heap) <= 2 + 64
    assert wheel.next_due() == 1
    assert [due for due, _ in wheel.advance(20_000)] == list(range(1, 20_001))


def test_100k_random_entries_fire_exactly_once_in_order():
    rng = random.Random(2024)
    wheel = TimingWheel(start_ms=1_000, tick_ms=10, slots=256)  # 2.56 s per revolution
    now = 1_000
    expected = []
    for ref in range(100_000):
        due = now + rng.randrange(1, 600_000)
        assert wheel.add(due, ref, now=now)
        expected.append((due, ref))
    expected.sort(key=lambda e: e[0])  # stable: ties stay in insertion order
    fired = []
    while len(wheel):
        previous = now
        now += rng.choice([1, 7, 10, 333, 2_560, 9_999])
        batch = wheel.advance(now)
        # Each entry fires at the first advance at or past its due time, never before.
        assert all(previous < due <= now for due, _ in batch)
        fired += batch
    assert fired == expected


class Model:
    """A sorted-list model of the wheel: what it must answer, computed the slow, obvious way."""

    def __init__(self):
        self.entries = []  # (due, insertion number, ref), kept sorted
        self.count = 0

    def add(self, due, ref, now):
        if due <= now:
            return False
        self.entries.append((due, self.count, ref))
        self.count += 1
        self.entries.sort()
        return True

    def advance(self, now):
        fired = [(due, ref) for due, _, ref in self.entries if due <= now]
        self.entries = [e for e in self.entries if e[0] > now]
        return fired

    def cancel(self, ref, due_ms):
        for e in self.entries:
            if e[2] == ref and due_ms in (None, e[0]):
                self.entries.remove(e)
                return True
        return False

    def next_due(self):
        return self.entries[0][0] if self.entries else None


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(-3, 70), st.integers(-5, 5)),
        st.tuples(st.just("advance"), st.integers(-20, 40)),
        st.tuples(st.just("jump"), st.integers(0, 10**6)),
        st.tuples(
            st.just("cancel"), st.integers(0, 60), st.sampled_from(["none", "right", "wrong"])
        ),
    ),
    max_size=120,
)


@settings(derandomize=True, database=None, deadline=None, max_examples=1500)
@given(
    slots=st.sampled_from([1, 2, 4, 8]),
    tick_ms=st.sampled_from([1, 3]),
    start_ms=st.integers(-10, 10),
    ops=OPS,
)
def test_model_agrees(slots, tick_ms, start_ms, ops):
    wheel = tiny(slots=slots, tick_ms=tick_ms, start_ms=start_ms)
    model = Model()
    now = 0
    dues = {}  # every ref ever offered, for cancels of live, fired and unknown refs
    for op in ops:
        if op[0] == "add":
            ref = len(dues)
            dues[ref] = now + op[1]
            # The adder's clock may differ a little from the last advance's (another task).
            assert wheel.add(dues[ref], ref, now + op[2]) == model.add(dues[ref], ref, now + op[2])
        elif op[0] in ("advance", "jump"):
            now += op[1]
            assert wheel.advance(now) == model.advance(now)
        else:
            ref = op[1]
            due_ms = {"none": None, "right": dues.get(ref, 0), "wrong": dues.get(ref, 0) + 1}[op[2]]
            assert wheel.cancel(ref, due_ms) == model.cancel(ref, due_ms)
        assert len(wheel) == len(model.entries)
        assert wheel.next_due() == model.next_due()
    for ref in dues:
        assert (ref in wheel) == any(e[2] == ref for e in model.entries)
    assert wheel.advance(now + 10**9) == model.advance(now + 10**9)


def test_bench_wheel_reports_its_figures():
    figures = bench_wheel(n=20_000)
    assert figures["entries"] == 20_000
    assert figures["burst"] == 20_000
    for name in ["adds_per_s", "advance_per_s", "follow_per_s", "jump_per_s", "next_due_per_s", "burst_adds_per_s"]:
        assert figures[name] > 0
    # Each entry takes its 16 bytes at least; the 120-byte bound is for a full load (1,000,000
    # entries): with a few entries per 65536 slots the per-slot cost dominates.
    assert figures["bytes_per_entry_traced"] >= 16


@settings(max_examples=200, deadline=None)
@given(entries=st.lists(st.tuples(st.integers(1, 200), st.integers(0, 1000)), max_size=60),
       start=st.integers(0, 220), length=st.integers(0, 120), slots=st.sampled_from([4, 8, 64]),
       tick_ms=st.sampled_from([1, 3, 10]))
def test_refs_due_between_are_exactly_the_entries_due_in_the_span(entries, start, length, slots, tick_ms):
    wheel = tiny(slots=slots, tick_ms=tick_ms)
    for due, ref in entries:
        wheel.add(due, ref, 0)
    got = wheel.refs_due_between(start, start + length)
    assert sorted(got) == sorted(ref for due, ref in entries if start <= due < start + length)
    assert len(wheel) == len(entries)  # nothing taken out
