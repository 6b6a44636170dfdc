"""schedule_log and dispatch_log segment files: found in data directories, decoded into rows.

No Spark here: the data sources run `read_segment` in Spark's Python workers, one call per segment
file, and tests run it directly. Decoding goes through the project's record codec.

A segment ends in one of the three ways `storage.segment.scan` tells apart, and none is skipped
silently:
- clean end: one row per record;
- torn tail (what a crash leaves at the end): rows for the valid part, then one TORN_TAIL row;
- corruption (damage with valid records after it): rows for the records before the damage, then
  one CORRUPT row naming the file and offset. Nothing after the damage is read.
A record whose crc holds but whose payload does not decode, or whose type does not belong to the
log, is corruption too.

Every row of a log has the columns of `COLUMNS[log]`, in that order; the first three (node, bucket,
file) are the same for every row of a segment and are added by the caller, so `read_segment`
yields the rest.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterator

import attrs

from delayserver.storage.buckets import parse_bucket_name
from delayserver.storage.record import (
    RecordType, decode_dispatch, decode_scheduled, decode_scheduled_cancel, iter_records,
)
from delayserver.storage.segment import CorruptSegment, scan

SCHEDULE_LOG = "schedule_log"
DISPATCH_LOG = "dispatch_log"
LOGS = (SCHEDULE_LOG, DISPATCH_LOG)
#: A data directory holds at least one of these (Store.open creates them all).
_DATA_DIR_LOGS = ("message_log", SCHEDULE_LOG, DISPATCH_LOG)
SUFFIX = ".log"

#: record_type of the row that reports damage; its `error` says what and where.
CORRUPT = "CORRUPT"
TORN_TAIL = "TORN_TAIL"

_SEGMENT_COLUMNS = [("node", "STRING"), ("bucket", "STRING"), ("file", "STRING"), ("offset", "BIGINT"),
                    ("record_type", "STRING")]
COLUMNS = {
    SCHEDULE_LOG: _SEGMENT_COLUMNS + [
        ("message_log_offset", "BIGINT"), ("store_time", "BIGINT"), ("schedule_time", "BIGINT"),
        ("sequence", "BIGINT"), ("flags", "INT"), ("message_id", "STRING"), ("subject", "STRING"),
        ("headers", "MAP<STRING,STRING>"), ("body_size", "INT"), ("error", "STRING"),
    ],
    DISPATCH_LOG: _SEGMENT_COLUMNS + [
        ("schedule_offset", "BIGINT"), ("dispatch_time", "BIGINT"), ("broker_group", "STRING"),
        ("error", "STRING"),
    ],
}
_PREFIX = 3  # node, bucket, file


class NotADataDirectory(ValueError):
    """A path given as a data directory that is not one (a typo must not reconcile to "all fine")."""


def parse_data_dirs(value: str) -> list[str]:
    """Data directories from `a,b` or a JSON list `["a", "b"]` (see `normalize_data_dirs`).

    Raises ValueError as `normalize_data_dirs` does, or when the JSON is not a list of strings.
    """
    value = value.strip()
    if not value.startswith("["):
        return normalize_data_dirs(value.split(","))
    dirs = json.loads(value)
    if not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs):
        raise ValueError(f"data directories: expected a JSON list of strings, got {value!r}")
    return normalize_data_dirs(dirs)


def normalize_data_dirs(dirs: list[str]) -> list[str]:
    """The directories without blanks or trailing slashes, so that each node has one name.

    Raises ValueError when there are none, or one is listed twice (its messages would count twice).
    """
    dirs = [os.path.normpath(d.strip()) for d in dirs if d.strip()]
    if not dirs:
        raise ValueError("no data directory given")
    if len(set(dirs)) != len(dirs):
        raise ValueError(f"a data directory is listed twice: {dirs}")
    return dirs


def check_data_dir(data_dir: str) -> None:
    """Raise NotADataDirectory unless `data_dir` is a directory holding at least one of the logs."""
    path = Path(data_dir)
    if not path.is_dir():
        raise NotADataDirectory(f"{data_dir}: no such directory")
    if not any((path / log).is_dir() for log in _DATA_DIR_LOGS):
        raise NotADataDirectory(f"{data_dir}: not a delay-server data directory "
                                f"(no {', '.join(_DATA_DIR_LOGS)})")


@attrs.frozen
class SegmentFile:
    """One segment of `log` in the data directory `node`; Spark reads one per partition."""

    node: str
    log: str
    bucket: str
    path: str


def segment_files(data_dirs: list[str], log: str) -> list[SegmentFile]:
    """Every segment of `log` in the data directories, by directory then bucket.

    Files whose names are not bucket names are not segments and are left out. Raises
    NotADataDirectory (see `check_data_dir`).
    """
    out = []
    for data_dir in data_dirs:
        check_data_dir(data_dir)
        directory = Path(data_dir) / log
        if not directory.is_dir():
            continue
        for path in sorted(directory.glob("*" + SUFFIX)):
            bucket = path.name[: -len(SUFFIX)]
            try:
                parse_bucket_name(bucket)
            except ValueError:
                continue
            out.append(SegmentFile(data_dir, log, bucket, str(path)))
    return out


def read_segment(segment: SegmentFile) -> Iterator[tuple]:
    """The rows of one segment without its first three columns (see the module docstring).

    Raises OSError when the file cannot be read (the job fails rather than count it as empty).
    """
    data = Path(segment.path).read_bytes()
    width = len(COLUMNS[segment.log]) - _PREFIX
    try:
        result = scan(data, segment.path)
    except CorruptSegment as e:
        end, problem = e.offset, (CORRUPT, f"{e}; the records from there on are not read")
    else:
        end, problem = result.valid_end, None
        if result.torn_bytes:
            problem = (TORN_TAIL, f"{segment.path}: torn tail at offset {result.valid_end} "
                                  f"({result.torn_reason}): {result.torn_bytes} bytes not read")
    decode = _DECODERS[segment.log]
    for pos, rtype, start, stop in iter_records(data, 0, end):
        try:
            yield decode(data, pos, rtype, start, stop)
        except (ValueError, struct.error) as e:
            end, problem = pos, (CORRUPT, f"{segment.path}: corrupt record at offset {pos}: {_what(rtype, e)}; "
                                          "the records from there on are not read")
            break
    if problem is not None:
        kind, error = problem
        yield (end, kind) + (None,) * (width - 3) + (error,)


class _WrongType(ValueError):
    """A record with a sound crc in a log it does not belong to."""


def _what(rtype: int, error: Exception) -> str:
    name = RecordType(rtype).name
    if isinstance(error, _WrongType):
        return f"a {name} record does not belong in this log"
    return f"{name} payload does not decode ({error})"


def _schedule_row(data: bytes, pos: int, rtype: int, start: int, stop: int) -> tuple:
    if rtype == RecordType.SCHEDULED:
        mlo, m = decode_scheduled(data, start, stop)
        return (pos, "SCHEDULED", mlo, m.store_time, m.schedule_time, m.sequence, m.flags, m.message_id,
                m.subject, m.headers, len(m.body), None)
    if rtype == RecordType.SCHEDULED_CANCEL:
        mlo, c = decode_scheduled_cancel(data, start, stop)
        return (pos, "SCHEDULED_CANCEL", mlo, c.store_time, c.schedule_time, c.sequence, None, c.message_id,
                None, None, None, None)
    raise _WrongType()


def _dispatch_row(data: bytes, pos: int, rtype: int, start: int, stop: int) -> tuple:
    if rtype == RecordType.DISPATCH:
        d = decode_dispatch(data, start, stop)
        return (pos, "DISPATCH", d.schedule_offset, d.dispatch_time, d.broker_group, None)
    raise _WrongType()


_DECODERS = {SCHEDULE_LOG: _schedule_row, DISPATCH_LOG: _dispatch_row}
