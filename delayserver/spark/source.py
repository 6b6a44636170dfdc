"""PySpark data sources over a delay server's logs: one partition per segment file.

    spark.read.format("delayserver.schedule_log").option("data_dirs", "/var/a,/var/b").load()
    spark.read.format("delayserver.dispatch_log").load("/var/a")

Options: `data_dirs`, one data directory or many (one per node), comma-separated or a JSON list;
or the path(s) given to `load()`. The directories must be readable by every executor (a shared
file system on a cluster). The columns are `segments.COLUMNS[log]`: every row carries the node
(its data directory as given), the bucket name, the segment file and the record's offset in it.
Damage is reported in rows, never skipped: a CORRUPT or TORN_TAIL row with an `error` text (see
`segments`). `register(spark)` makes both formats known to a session.
"""
from __future__ import annotations

import weakref

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from delayserver.spark.segments import (
    COLUMNS, DISPATCH_LOG, SCHEDULE_LOG, SegmentFile, parse_data_dirs, read_segment, segment_files,
)

#: Rows per Arrow batch handed to Spark: large enough to amortise, small enough for any worker.
BATCH_ROWS = 8192

_ARROW_TYPES = {
    "STRING": pa.string(),
    "BIGINT": pa.int64(),
    "INT": pa.int32(),
    "MAP<STRING,STRING>": pa.map_(pa.string(), pa.string()),
}


def schema_ddl(log: str) -> str:
    return ", ".join(f"{name} {kind}" for name, kind in COLUMNS[log])


def arrow_schema(log: str) -> pa.Schema:
    return pa.schema([(name, _ARROW_TYPES[kind]) for name, kind in COLUMNS[log]])


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


class LogReader(DataSourceReader):
    """Reads the segments of one log; `partitions` lists them (on the driver), `read` decodes one."""

    def __init__(self, log: str, data_dirs: list[str]):
        self.log = log
        self.data_dirs = data_dirs

    def partitions(self) -> list[InputPartition]:
        """One partition per segment file. Raises NotADataDirectory for a path that is not one."""
        return [InputPartition(segment) for segment in segment_files(self.data_dirs, self.log)]

    def read(self, partition: InputPartition):
        segment = partition.value
        # With no segment at all, Spark still reads one partition, with no value.
        if segment is None:
            return
        yield from _batches(segment)


def _batches(segment: SegmentFile):
    schema = arrow_schema(segment.log)
    prefix = (segment.node, segment.bucket, segment.path)
    rows = []
    for row in read_segment(segment):
        rows.append(row)
        if len(rows) == BATCH_ROWS:
            yield _batch(schema, prefix, rows)
            rows = []
    if rows:
        yield _batch(schema, prefix, rows)


def _batch(schema: pa.Schema, prefix: tuple, rows: list[tuple]) -> pa.RecordBatch:
    columns = [[value] * len(rows) for value in prefix] + [list(c) for c in zip(*rows)]
    return pa.RecordBatch.from_arrays(
        [pa.array(values, type=field.type) for values, field in zip(columns, schema)], schema=schema)


class _LogSource(DataSource):
    log: str

    @classmethod
    def name(cls) -> str:
        return f"delayserver.{cls.log}"

    def schema(self) -> str:
        return schema_ddl(self.log)

    def reader(self, schema) -> LogReader:
        return LogReader(self.log, data_dirs_option(self.options))


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
