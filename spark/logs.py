"""schedule_log and dispatch_log in data directories: their columns, their segment files, and the
byte ranges a job reads them in.

No Spark here. The driver lists `segment_ranges` (one or more ranges per segment file, each at most
`split_bytes`), and each Spark task reads one range (`source.read_batches`), so one busy bucket is
read by many tasks at once.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import attrs

from delayserver.storage.buckets import parse_bucket_name

SCHEDULE_LOG = "schedule_log"
DISPATCH_LOG = "dispatch_log"
LOGS = (SCHEDULE_LOG, DISPATCH_LOG)
#: A data directory holds at least one of these (Store.open creates them all).
_DATA_DIR_LOGS = ("message_log", SCHEDULE_LOG, DISPATCH_LOG)
SUFFIX = ".log"
#: A task reads at most this much of a segment (Hadoop's and Spark's usual split size).
DEFAULT_SPLIT_BYTES = 64 << 20

_SEGMENT_COLUMNS = [("node", "STRING"), ("bucket", "STRING"), ("file", "STRING"), ("offset", "BIGINT"),
                    ("record_type", "STRING")]
#: The columns a log's data source has by default, in order.
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
#: Columns a reader may ask for by giving a schema, beyond the default ones. node_index is the
#: position of the row's data directory in the list given: a join or aggregation keyed by it does
#: not carry the directory's name (a path, often long) through every row.
EXTRA_COLUMNS = {SCHEDULE_LOG: [("node_index", "INT"), ("body", "BINARY")], DISPATCH_LOG: [("node_index", "INT")]}


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
class SegmentRange:
    """Bytes [start, end) of one segment of `log` in the data directory `node` (at `node_index`
    in the list given), which was `size` bytes long when the job was planned (what is appended
    later is not read)."""

    node: str
    log: str
    bucket: str
    path: str
    start: int
    end: int
    size: int
    node_index: int = 0


def segment_ranges(data_dirs: list[str], log: str, split_bytes: int = DEFAULT_SPLIT_BYTES) -> list[SegmentRange]:
    """The ranges of every segment of `log` in the data directories, by directory, bucket, start.

    Files whose names are not bucket names are not segments and are left out; empty ones have no
    range. Raises NotADataDirectory (see `check_data_dir`), ValueError for a split under 1 byte.
    """
    if split_bytes < 1:
        raise ValueError(f"split_bytes must be at least 1, got {split_bytes}")
    out = []
    for node_index, data_dir in enumerate(data_dirs):
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
            size = path.stat().st_size
            out += [SegmentRange(data_dir, log, bucket, str(path), start, min(start + split_bytes, size), size,
                                 node_index) for start in range(0, size, split_bytes)]
    return out
