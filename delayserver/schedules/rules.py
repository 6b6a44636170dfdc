"""A schedule's rule: when its occurrences fall, as epoch milliseconds.

- Cron, 5 fields (minute hour day-of-month month day-of-week) or 6 (seconds first), read in the
  schedule's time zone by croniter. Daylight-saving transitions behave as croniter does: a time
  that does not exist on the day clocks go forward fires at the first time after the gap (02:30 in
  Europe/Berlin on the last Sunday of March fires at 03:00), and a time that happens twice on the
  day clocks go back fires twice, once per UTC offset
  (tests/features/test_schedule_rules.py pins both).
- ``@every <duration>`` (``@every 90s``, ``@every 1h``): every so long after the anchor (the
  schedule's start, or the time it was created or last updated), whatever the time zone.
"""
from __future__ import annotations

import datetime as dt
import zoneinfo

import attrs
from croniter import croniter

from delayserver.config import ConfigError, parse_duration

MIN_EVERY_MS = 1000


class BadRule(ValueError):
    """A rule or time zone that cannot be read; the message says why."""


def time_zone(name: str) -> zoneinfo.ZoneInfo:
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, TypeError):
        raise BadRule(f"unknown time zone {name!r} (an IANA name such as Europe/Berlin, or UTC)") from None


@attrs.frozen
class CronRule:
    expression: str
    zone: zoneinfo.ZoneInfo

    def next_after(self, ms: int) -> int:
        start = dt.datetime.fromtimestamp(ms / 1000, self.zone)
        seconds = len(self.expression.split()) == 6
        return int(croniter(self.expression, start, second_at_beginning=seconds).get_next(float) * 1000)


@attrs.frozen
class EveryRule:
    period_ms: int
    anchor_ms: int

    def next_after(self, ms: int) -> int:
        if ms < self.anchor_ms:
            return self.anchor_ms + self.period_ms
        return self.anchor_ms + ((ms - self.anchor_ms) // self.period_ms + 1) * self.period_ms


def parse_rule(text: str, zone_name: str, anchor_ms: int) -> CronRule | EveryRule:
    """The rule `text` means; raises BadRule naming what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise BadRule("rule: a cron expression (5 or 6 fields) or '@every <duration>'")
    text = " ".join(text.split())
    if text.startswith("@every"):
        try:
            period = parse_duration(text.removeprefix("@every").strip(), "@every")
        except ConfigError as e:
            raise BadRule(str(e)) from None
        if period < MIN_EVERY_MS:
            raise BadRule(f"@every: at least 1s, got {period} ms")
        return EveryRule(period, anchor_ms)
    fields = len(text.split())
    if fields not in (5, 6) or not croniter.is_valid(text, second_at_beginning=fields == 6):
        raise BadRule(f"rule {text!r}: not a cron expression of 5 fields (minute hour day month weekday), "
                      "or 6 with seconds first")
    return CronRule(text, time_zone(zone_name))
