"""Buckets: floor(schedule_time / segment_scale), named by their UTC start as yyyyMMddHHmm."""
from __future__ import annotations

import datetime as _dt

MINUTE_MS = 60_000
DEFAULT_SCALE_MS = 60 * MINUTE_MS
_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)


def check_scale(segment_scale_ms: int) -> int:
    """Raise ValueError unless the scale is a whole number of minutes from 1 to 60."""
    if segment_scale_ms % MINUTE_MS or not 1 <= segment_scale_ms // MINUTE_MS <= 60:
        raise ValueError(f"segment_scale must be 1 to 60 whole minutes, got {segment_scale_ms} ms")
    return segment_scale_ms


def bucket_start(schedule_time: int, segment_scale_ms: int) -> int:
    return schedule_time - schedule_time % segment_scale_ms


def bucket_name(start_ms: int) -> str:
    """`202611221600` for the bucket starting 2026-11-22 16:00 UTC (never local time)."""
    t = _EPOCH + _dt.timedelta(milliseconds=start_ms)
    return f"{t.year:04d}{t.month:02d}{t.day:02d}{t.hour:02d}{t.minute:02d}"


def parse_bucket_name(name: str) -> int:
    """The bucket start in epoch ms for a name like `202611221600`; ValueError if malformed."""
    if len(name) != 12 or not name.isdigit():
        raise ValueError(f"not a bucket name: {name!r}")
    t = _dt.datetime.strptime(name, "%Y%m%d%H%M").replace(tzinfo=_dt.timezone.utc)
    return (t - _EPOCH) // _dt.timedelta(milliseconds=1)
