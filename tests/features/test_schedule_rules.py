"""Schedule rules and the emitter's plan, with the time passed in: a simulated day, catch-up,
limits, and daylight-saving transitions pinned."""
from __future__ import annotations

import datetime as dt
from zoneinfo import ZoneInfo

import pytest

from delayserver.schedules.emitter import plan
from delayserver.schedules.registry import Registry, ScheduleState
from delayserver.schedules.rules import BadRule, parse_rule
from delayserver.schedules.spec import BadSchedule, ScheduleSpec, occurrence_id, parse_occurrence_id
from delayserver.storage.record import RecordType, encode_message_fields, encode_schedule_change

MINUTE, HOUR = 60_000, 3_600_000
DAY0 = int(dt.datetime(2026, 11, 23, tzinfo=dt.timezone.utc).timestamp() * 1000)
BERLIN = ZoneInfo("Europe/Berlin")


def at(*fields, zone=BERLIN) -> int:
    return int(dt.datetime(*fields, tzinfo=zone).timestamp() * 1000)


def state(rule: str, created: int, **kw) -> ScheduleState:
    spec = ScheduleSpec("s", "q.s", rule, **kw)
    anchor = max(created, spec.start or 0)
    return ScheduleState(spec, anchor, anchor - 1)


def run(s: ScheduleState, start: int, stop: int, step: int) -> list[tuple[int, int]]:
    """Step the clock from `start` to `stop`, sending what `plan` says: (sent at, occurrence)."""
    sent = []
    for now in range(start, stop + 1, step):
        for t in plan(s, now):
            sent.append((now, t))
            s.cursor, s.emitted = t, s.emitted + 1
    return sent


def test_a_cron_schedule_over_a_simulated_day_sends_each_occurrence_once_and_ahead_of_time():
    s = state("*/30 * * * *", DAY0 - 1)
    sent = run(s, DAY0 - 1, DAY0 + 24 * HOUR, MINUTE)
    occurrences = [t for _, t in sent]
    assert occurrences == [DAY0 + k * 30 * MINUTE for k in range(49)]
    # Each one was sent before it was due: it waits in the wheel, and goes out on time.
    assert all(when < t for when, t in sent)


def test_a_six_field_rule_has_seconds_first_and_every_counts_from_its_anchor():
    assert parse_rule("*/10 * * * * *", "UTC", 0).next_after(DAY0) == DAY0 + 10_000
    every = parse_rule("@every 90s", "UTC", DAY0 + 5)
    assert every.next_after(DAY0) == DAY0 + 5 + 90_000
    assert every.next_after(DAY0 + 5 + 90_000) == DAY0 + 5 + 180_000


def test_daylight_saving_transitions_behave_as_croniter_documents():
    """Europe/Berlin: on 2026-03-29 02:00 becomes 03:00, so 02:30 does not exist and the 02:30
    occurrence fires at 03:00; on 2026-10-25 03:00 becomes 02:00 again, so 02:30 happens twice
    and fires twice, an hour apart."""
    rule = parse_rule("30 2 * * *", "Europe/Berlin", 0)
    spring = rule.next_after(at(2026, 3, 28, 12, 0))
    assert spring == at(2026, 3, 29, 3, 0)
    assert rule.next_after(spring) == at(2026, 3, 30, 2, 30)
    first = rule.next_after(at(2026, 10, 24, 12, 0))
    assert first == int(dt.datetime(2026, 10, 25, 0, 30, tzinfo=dt.timezone.utc).timestamp() * 1000)
    second = rule.next_after(first)
    assert second == first + HOUR
    assert rule.next_after(second) == at(2026, 10, 26, 2, 30)
    # An hourly rule on the autumn day: 25 occurrences, never two at one instant.
    hourly = parse_rule("0 * * * *", "Europe/Berlin", 0)
    t, day = at(2026, 10, 25, 0, 0) - 1, []
    while (t := hourly.next_after(t)) < at(2026, 10, 26, 0, 0):
        day.append(t)
    assert len(day) == 25 and len(set(day)) == 25


@pytest.mark.parametrize("policy, missed_sent", [("skip", []), ("one", [5]), ("all", [2, 3, 4, 5])])
def test_catch_up_after_downtime(policy, missed_sent):
    """An hourly schedule whose occurrence at 01:00 was the last sent; the node comes back at 05:30:
    02:00 to 05:00 were missed."""
    s = state("0 * * * *", DAY0, catch_up=policy)
    s.cursor = DAY0 + HOUR
    assert plan(s, DAY0 + 5 * HOUR + 30 * MINUTE) == [DAY0 + h * HOUR for h in missed_sent] + [DAY0 + 6 * HOUR]


def test_start_end_count_and_pause_limit_the_occurrences():
    s = state("@every 10m", DAY0, start=DAY0 + HOUR, end=DAY0 + 2 * HOUR)
    occurrences = [t for _, t in run(s, DAY0, DAY0 + 3 * HOUR, MINUTE)]
    assert occurrences == [DAY0 + HOUR + k * 10 * MINUTE for k in range(1, 6)]
    counted = state("@every 10m", DAY0, count=3)
    assert [t for _, t in run(counted, DAY0, DAY0 + 3 * HOUR, MINUTE)] == [DAY0 + k * 10 * MINUTE for k in (1, 2, 3)]
    paused = state("@every 10m", DAY0)
    paused.paused = True
    assert plan(paused, DAY0 + HOUR) == []


def test_bad_definitions_are_refused_naming_the_field():
    good = {"name": "n", "subject": "q.s", "rule": "0 * * * *"}
    for bad, word in ((dict(rule="61 * * * *"), "cron"), (dict(rule="@every 10"), "@every"),
                      (dict(rule="@every 10ms"), "at least"), (dict(timezone="Mars/Olympus"), "time zone"),
                      (dict(name="a b"), "name"), (dict(catch_up="some"), "catch_up"), (dict(count=0), "count"),
                      (dict(start=10, end=5), "end"), (dict(body="***"), "base64"), (dict(colour=1), "colour")):
        with pytest.raises(BadSchedule) as e:
            ScheduleSpec.from_json({**good, **bad})
        assert word in str(e.value)
    with pytest.raises(BadRule):
        parse_rule("", "UTC", 0)


def test_the_registry_follows_changes_and_occurrences_and_applying_twice_changes_nothing():
    reg = Registry("/nonexistent")
    spec = ScheduleSpec("r", "q.r", "@every 1m")
    records = [
        (RecordType.SCHEDULE, encode_schedule_change({"op": "put", "schedule": spec.to_json(), "from": DAY0}, 0)),
        (RecordType.MESSAGE, encode_message_fields(occurrence_id("r", DAY0 + MINUTE), "q.r", b"", DAY0 + MINUTE, {})),
        (RecordType.MESSAGE, encode_message_fields("other", "q.r", b"", DAY0, {})),
        (RecordType.SCHEDULE, encode_schedule_change({"op": "pause", "name": "r"}, 0)),
    ]
    for _ in range(2):
        for rtype, payload in records:
            reg.feed_record(rtype, payload, 0, len(payload))
        s = reg.schedules["r"]
        assert (s.cursor, s.emitted, s.paused) == (DAY0 + MINUTE, 1, True)
    gone = encode_schedule_change({"op": "delete", "name": "r"}, 0)
    reg.feed_record(RecordType.SCHEDULE, gone + b"trailing bytes of the next record", 0, len(gone))
    assert reg.schedules == {}
    assert parse_occurrence_id(occurrence_id("a.b-c", 42)) == ("a.b-c", 42)
    assert parse_occurrence_id("schedule:bad name:1") is None and parse_occurrence_id("x") is None
