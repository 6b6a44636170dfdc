"""PySpark data sources over a delay server's logs, read in byte ranges, decoded column by column.

    spark.read.format("delayserver.schedule_log").option("data_dirs", "/var/a,/var/b").load()
    spark.read.format("delayserver.dispatch_log").load("/var/a")
    spark.read.format("delayserver.schedule_log").schema("node STRING, message_id STRING, body BINARY").load(d)

Options: `data_dirs`, one data directory or many (one per node), comma-separated or a JSON list,
or the path(s) given to `load()`; `split_bytes`, the most of a segment one task reads (default
64 MiB). The directories must be readable by every executor (a shared file system on a cluster).

The columns are `logs.COLUMNS[log]`; a schema given with `.schema()` picks any of them (and `body`
for schedule_log, and `node_index` for both), and only those are decoded: a job that does not ask
for bodies never copies one.
Every row carries the node (its data directory as given), the bucket name, the segment file and
the record's offset in it. Damage is reported in rows, never skipped: record_type CORRUPT,
TORN_TAIL or AMBIGUOUS_SPLIT with an `error` naming file and offset (see
`delayserver.storage.range_reader`). `register(spark)` makes both formats known to a session.
"""
from __future__ import annotations

import weakref

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from delayserver.storage.range_reader import CORRUPT, Damage, Records, read_range
from spark import columns as _columns
from spark.logs import (
    COLUMNS, DEFAULT_SPLIT_BYTES, DISPATCH_LOG, EXTRA_COLUMNS, SCHEDULE_LOG, SegmentRange, parse_data_dirs,
    segment_ranges,
)

_ARROW_TYPES = {
    "STRING": pa.string(),
    "BIGINT": pa.int64(),
    "INT": pa.int32(),
    "BINARY": pa.binary(),
    "MAP<STRING,STRING>": pa.map_(pa.string(), pa.string()),
}
_PREFIX = ("node", "bucket", "file")


def schema_ddl(log: str) -> str:
    return ", ".join(f"{name} {kind}" for name, kind in COLUMNS[log])


def arrow_schema(log: str, names: list[str] | None = None) -> pa.Schema:
    """The Arrow schema of the columns `names` (default: all the default ones) of `log`.

    Raises ValueError for a column the log does not have.
    """
    known = dict(COLUMNS[log] + EXTRA_COLUMNS[log])
    names = [name for name, _ in COLUMNS[log]] if names is None else names
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"{log} has no column {', '.join(unknown)} (it has {', '.join(known)})")
    return pa.schema([(name, _ARROW_TYPES[known[name]]) for name in names])


def data_dirs_option(options) -> list[str]:
    """The data directories named by `data_dirs`, or by the path(s) given to `load()`.

    Raises ValueError when none is given or the value is malformed (see `parse_data_dirs`).
    """
    if "data_dirs" in options:
        return parse_data_dirs(options["data_dirs"])
    if "paths" in options:  # load([...]) passes its list as JSON
        return parse_data_dirs(options["paths"])
    if "path" in options:
        return parse_data_dirs(options["path"])
    raise ValueError('no data directory: give .option("data_dirs", "DIR[,DIR...]") or .load(DIR)')


def split_bytes_option(options) -> int:
    value = options.get("split_bytes", str(DEFAULT_SPLIT_BYTES))
    try:
        split = int(value)
    except ValueError:
        raise ValueError(f"split_bytes must be a whole number of bytes, got {value!r}") from None
    if split < 1:
        raise ValueError(f"split_bytes must be at least 1, got {split}")
    return split


class LogReader(DataSourceReader):
    """Reads one log: `partitions` lists byte ranges (on the driver), `read` decodes one."""

    def __init__(self, log: str, data_dirs: list[str], split_bytes: int, names: list[str]):
        self.log = log
        self.data_dirs = data_dirs
        self.split_bytes = split_bytes
        self.names = names

    def partitions(self) -> list[InputPartition]:
        """A range of at most split_bytes of a segment per partition. Raises NotADataDirectory."""
        return [InputPartition(r) for r in segment_ranges(self.data_dirs, self.log, self.split_bytes)]

    def read(self, partition: InputPartition):
        segment = partition.value
        # With no segment at all, Spark still reads one partition, with no value.
        if segment is None:
            return
        yield from read_batches(segment, self.names)


def read_batches(segment: SegmentRange, names: list[str] | None = None):
    """Arrow record batches of the columns `names` (default: all default ones) of one range."""
    schema = arrow_schema(segment.log, names)
    wanted = frozenset(schema.names)
    for item in read_range(segment.path, segment.start, segment.end, segment.size):
        if isinstance(item, Records):
            decoded, bad = _columns.decode(segment.log, item.data, item.base, item.positions, wanted)
            for rows in decoded:
                yield _batch(schema, segment, rows.record_type, rows.count, rows.columns)
            for offset, reason in bad:
                yield _damage_row(schema, segment, Damage(offset, CORRUPT, f"{reason}; the record is not read", None))
        else:
            yield _damage_row(schema, segment, item)


def _constant(value: str | None, n: int, kind: pa.DataType) -> pa.Array:
    if value is None:
        return pa.nulls(n, kind)
    raw = value.encode("utf-8")
    offsets = np.arange(n + 1, dtype=np.int32) * len(raw)
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(raw * n)])


def _batch(schema: pa.Schema, segment: SegmentRange, record_type: str, n: int, columns: dict,
           error: str | None = None) -> pa.RecordBatch:
    constants = {"node": segment.node, "bucket": segment.bucket, "file": segment.path,
                 "record_type": record_type, "error": error}
    arrays = []
    for field in schema:
        if field.name == "node_index":
            arrays.append(pa.array(np.full(n, segment.node_index, dtype=np.int32)))
        elif field.name in constants:
            arrays.append(_constant(constants[field.name], n, field.type))
        elif field.name in columns:
            arrays.append(columns[field.name])
        else:
            arrays.append(pa.nulls(n, field.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _damage_row(schema: pa.Schema, segment: SegmentRange, damage: Damage) -> pa.RecordBatch:
    error = f"{segment.path}: {_WHAT[damage.kind]} at offset {damage.offset}: {damage.reason}"
    return _batch(schema, segment, damage.kind, 1, {"offset": pa.array([damage.offset], pa.int64())}, error)


_WHAT = {"CORRUPT": "corrupt record", "TORN_TAIL": "torn tail", "AMBIGUOUS_SPLIT": "ambiguous split"}


class _LogSource(DataSource):
    log: str

    @classmethod
    def name(cls) -> str:
        return f"delayserver.{cls.log}"

    def schema(self) -> str:
        return schema_ddl(self.log)

    def reader(self, schema) -> LogReader:
        names = [field.name for field in schema.fields]
        arrow_schema(self.log, names)  # an unknown column is refused here, on the driver
        return LogReader(self.log, data_dirs_option(self.options), split_bytes_option(self.options), names)


class ScheduleLogSource(_LogSource):
    """`delayserver.schedule_log`: SCHEDULED and SCHEDULED_CANCEL records."""

    log = SCHEDULE_LOG


class DispatchLogSource(_LogSource):
    """`delayserver.dispatch_log`: DISPATCH records."""

    log = DISPATCH_LOG


_registered: weakref.WeakSet = weakref.WeakSet()


def register(spark) -> None:
    """Make both formats known to the session `spark`; once per session (Spark warns on each
    repeat)."""
    if spark in _registered:
        return
    spark.dataSource.register(ScheduleLogSource)
    spark.dataSource.register(DispatchLogSource)
    _registered.add(spark)
