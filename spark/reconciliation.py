"""The reconciliation on DataFrames: classify every scheduled message, count, write the ids.

A message is one SCHEDULED record, keyed by (node, bucket, offset): a dispatch_log record names the
schedule_log offset of its own bucket on its own node. What each figure means is in `report`.

Nothing grows with the number of messages on the driver. The logs are decoded once (cached, memory
then disk); one aggregation over grouping sets turns the classified messages into counts per
(level, key, state, lateness value) -- as many rows as distinct lateness values, not messages --
from which the counts, the exact nearest-rank percentiles (a running sum over the sorted values,
per key) and the lateness histogram of every level come. The driver collects at most `max_rows`
keys per level; with `out`, every level and every id is written there by the executors.
"""
from __future__ import annotations

import uuid
from pathlib import Path

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from spark import source
from spark.logs import (
    COLUMNS, DEFAULT_SPLIT_BYTES, DISPATCH_LOG, EXTRA_COLUMNS, SCHEDULE_LOG, SUFFIX, check_data_dir,
    normalize_data_dirs, segment_ranges,
)
from spark.report import HISTOGRAM_EDGES_MS, LEVELS, PERCENTILES, Damage, Figures, Report

#: A scheduled message's key: its data directory's position in the list, its bucket, its offset.
KEY = ["node_index", "bucket", "offset"]
#: The rows of each breakdown (bucket, subject, broker group) the driver collects for the report.
DEFAULT_MAX_ROWS = 1000
#: Damage rows the driver collects (all are counted, and written with `out`).
MAX_DAMAGE = 1000
#: What is read (and cached): the node as its index, the file not at all (both are the same for
#: every row of a segment, and long; damage rows and outputs get them back from the index).
SCHEDULE_COLUMNS = ["node_index", "bucket", "offset", "record_type", "message_log_offset", "schedule_time",
                    "sequence", "message_id", "subject", "error"]
DISPATCH_COLUMNS = ["node_index", "bucket", "offset", "record_type", "schedule_offset", "dispatch_time",
                    "broker_group", "error"]
MESSAGE_COLUMNS = ["node", "bucket", "offset", "message_log_offset", "message_id", "subject", "schedule_time",
                   "sequence"]
DISPATCH_FIGURES = ["dispatches", "first_dispatch_time", "last_dispatch_time", "broker_groups"]
#: The id tables written with `out`: which messages, with which columns.
ID_TABLES = {
    "missing": MESSAGE_COLUMNS,
    "duplicated": MESSAGE_COLUMNS + DISPATCH_FIGURES,
    "early": MESSAGE_COLUMNS + DISPATCH_FIGURES + ["lateness"],
    "orphans": ["node", "bucket", "offset"] + DISPATCH_FIGURES,
}


def read_log(spark: SparkSession, log: str, data_dirs: list[str], names: list[str],
             split_bytes: int = DEFAULT_SPLIT_BYTES) -> DataFrame:
    """The columns `names` of `log` in the data directories: one partition per byte range.

    The same ranges and decoding as the data source (`source.read_batches`), but the ranges are
    listed here and each is decoded by `mapInArrow` in the executors' Python workers. Through the
    data source, Spark starts a Python process on the driver for each step of planning each read
    (looking the formats up, creating each source, planning each read): six processes one after
    another, a few seconds of a small job's wall time (see README, Spark reconciliation).
    """
    kinds = dict(COLUMNS[log] + EXTRA_COLUMNS[log])
    ddl = ", ".join(f"{name} {kinds[name]}" for name in names)
    ranges = segment_ranges(data_dirs, log, split_bytes)
    if not ranges:
        return spark.createDataFrame([], ddl)

    def decode(batches):
        for batch in batches:
            for i in batch.column(0).to_pylist():
                yield from source.read_batches(ranges[i], names)

    return spark.range(len(ranges), numPartitions=len(ranges)).mapInArrow(decode, ddl)


def reconcile(spark: SparkSession, data_dirs: list[str], as_of: int, out: str | None = None, *,
              split_bytes: int = DEFAULT_SPLIT_BYTES, max_rows: int = DEFAULT_MAX_ROWS) -> Report:
    """Reconcile the data directories as of `as_of` (epoch ms); with `out`, write the summaries and
    the ids of missing, duplicated and early messages and of orphan dispatches there (Parquet and
    CSV, replacing earlier output).

    Raises ValueError for a malformed list of data directories (see `normalize_data_dirs`) and
    NotADataDirectory for a path that is not a data directory, before Spark reads anything.
    """
    data_dirs = normalize_data_dirs(data_dirs)
    for data_dir in data_dirs:
        check_data_dir(data_dir)
    schedule = read_log(spark, SCHEDULE_LOG, data_dirs, SCHEDULE_COLUMNS, split_bytes).persist(
        StorageLevel.MEMORY_AND_DISK)
    dispatch = read_log(spark, DISPATCH_LOG, data_dirs, DISPATCH_COLUMNS, split_bytes).persist(
        StorageLevel.MEMORY_AND_DISK)
    cached = [schedule, dispatch]
    try:
        damage_rows = _damage_rows(schedule, dispatch, data_dirs)
        damage = [Damage(r.file, r.offset, r.record_type, r.error)
                  for r in damage_rows.orderBy("file", "offset").limit(MAX_DAMAGE).collect()]
        damage_count = damage_rows.count() if len(damage) == MAX_DAMAGE else len(damage)
        cancels = latest_cancels(schedule).persist(StorageLevel.MEMORY_AND_DISK)
        cached.append(cancels)
        cancels.count()
        classified = classify(schedule, dispatch, as_of, data_dirs, cancels)
        stats = _stats(spark, classified, data_dirs).persist(StorageLevel.MEMORY_AND_DISK)
        cached.append(stats)
        summary = summarize(stats)
        levels, truncated = _collect(summary, max_rows)
        outputs = {}
        if out:
            outputs = write_all(out, summary, id_tables(classified), damage_rows)
    finally:
        for frame in cached:
            frame.unpersist()
    return Report(as_of, tuple(data_dirs), levels["total"].get((None, None), Figures()),
                  {d: levels["node"].get((d, None), Figures()) for d in data_dirs},
                  levels["bucket"], {key: f for (key, _), f in levels["subject"].items()},
                  {key: f for (key, _), f in levels["broker_group"].items()},
                  tuple(d for d in damage if d.kind != "TORN_TAIL"),
                  tuple(d for d in damage if d.kind == "TORN_TAIL"),
                  outputs, truncated, damage_count)


def _node(data_dirs: list[str]):
    """The data directory of a row, from its node_index."""
    return F.element_at(F.array(*[F.lit(d) for d in data_dirs]), F.col("node_index") + 1)


def _file(data_dirs: list[str], log: str):
    """The segment file of a row of `log`, as the data source names it, from node_index and bucket."""
    directories = F.array(*[F.lit(str(Path(d) / log) + "/") for d in data_dirs])
    return F.concat(F.element_at(directories, F.col("node_index") + 1), F.col("bucket"), F.lit(SUFFIX))


def _damage_rows(schedule: DataFrame, dispatch: DataFrame, data_dirs: list[str]) -> DataFrame:
    def damaged(frame, log):
        return frame.filter(F.col("error").isNotNull()).select(
            _node(data_dirs).alias("node"), "bucket", _file(data_dirs, log).alias("file"), "offset", "record_type",
            "error")
    return damaged(schedule, SCHEDULE_LOG).unionByName(damaged(dispatch, DISPATCH_LOG))


def _dispatches(dispatch: DataFrame) -> DataFrame:
    """Per dispatched offset: how many records, first and last time, the broker groups, the group
    of the first dispatch."""
    return (dispatch.filter(F.col("record_type") == "DISPATCH")
            .groupBy("node_index", "bucket", F.col("schedule_offset").alias("offset"))
            .agg(F.count("*").alias("dispatches"),
                 F.min("dispatch_time").alias("first_dispatch_time"),
                 F.max("dispatch_time").alias("last_dispatch_time"),
                 F.concat_ws(",", F.array_sort(F.collect_set("broker_group"))).alias("broker_groups"),
                 F.min_by("broker_group", F.struct("dispatch_time", "broker_group")).alias("broker_group")))


def latest_cancels(schedule: DataFrame) -> DataFrame:
    """The offset of the latest cancel per (node_index, bucket, schedule time, message id): a
    cancel applies to the earlier records of its key, so the latest one decides."""
    return (schedule.filter(F.col("record_type") == "SCHEDULED_CANCEL")
            .groupBy("node_index", "bucket", "schedule_time", "message_id")
            .agg(F.max("offset").alias("last_cancel_offset")))


def classify(schedule: DataFrame, dispatch: DataFrame, as_of: int, data_dirs: list[str],
             cancels: DataFrame | None = None) -> DataFrame:
    """One row per scheduled message, and one per dispatched offset with no scheduled message,
    with its node (its data directory, one of `data_dirs`; and node_index), its `state` (dispatched, cancelled, missing, not_yet_due; orphan), its dispatch figures,
    `broker_group` (of its first dispatch) and `lateness` (first dispatch - schedule time, null if
    not dispatched).

    One full outer join of the messages with the dispatches per offset finds both the dispatched
    messages and the orphans (a shuffle of each side, once). The cancels (`latest_cancels`, or
    those given) join after it on their own key. Given cached and counted, Spark knows their size
    when it plans: few, as usual, they are broadcast and the joined rows are not shuffled again;
    many, it is a sort-merge join. (Left to adaptive execution, the joined rows could be shuffled
    for a sort-merge join before the cancels' size is known.)"""
    scheduled = (schedule.filter(F.col("record_type") == "SCHEDULED")
                 .select("node_index", *MESSAGE_COLUMNS[1:], F.lit(True).alias("is_scheduled")))
    if cancels is None:
        cancels = latest_cancels(schedule)
    joined = (scheduled.join(_dispatches(dispatch), KEY, "full_outer")
              .join(cancels, ["node_index", "bucket", "schedule_time", "message_id"], "left")
              .withColumn("dispatches", F.coalesce(F.col("dispatches"), F.lit(0).cast("bigint"))))
    state = (F.when(F.col("is_scheduled").isNull(), "orphan")
             .when(F.col("dispatches") > 0, "dispatched")
             .when(F.col("last_cancel_offset") > F.col("offset"), "cancelled")
             .when(F.col("schedule_time") < F.lit(as_of), "missing")
             .otherwise("not_yet_due"))
    assert MESSAGE_COLUMNS[0] == "node"
    return joined.select("node_index", _node(data_dirs).alias("node"), *MESSAGE_COLUMNS[1:], *DISPATCH_FIGURES,
                         "broker_group", state.alias("state"),
                         (F.col("first_dispatch_time") - F.col("schedule_time")).alias("lateness"))


_GROUPING_SETS = {
    # level: the columns its key is made of
    "total": [],
    "node": ["node"],
    "bucket": ["node", "bucket"],
    "subject": ["subject"],
    "broker_group": ["broker_group"],
}
assert tuple(_GROUPING_SETS) == LEVELS


def _stats(spark: SparkSession, classified: DataFrame, data_dirs: list[str]) -> DataFrame:
    """Counts per (level, key, state, lateness): one pass over the classified rows, grouping sets.

    The rows are first counted per combination of every dimension (few: the distinct lateness
    values times buckets, subjects and groups), so that the grouping sets expand those counts
    five-fold rather than every message. They are counted by node_index, named after."""
    dimensions = ["node_index", "bucket", "subject", "broker_group", "state", "lateness"]
    orphan = F.col("state") == "orphan"
    facts = (classified.select(*dimensions, F.lit(1).alias("n"),
                               F.when(orphan, 0).otherwise((F.col("dispatches") > 1).cast("int")).alias("duplicated"),
                               F.when(orphan, F.col("dispatches")).otherwise(0).cast("bigint")
                               .alias("orphan_dispatches"))
             .groupBy(*dimensions).agg(F.sum("n").alias("n"), F.sum("duplicated").alias("duplicated"),
                                       F.sum("orphan_dispatches").alias("orphan_dispatches"))
             .withColumn("node", _node(data_dirs)).drop("node_index"))
    view = f"facts_{uuid.uuid4().hex}"
    facts.createOrReplaceTempView(view)
    sets = ", ".join("(" + ", ".join(cols + ["state", "lateness"]) + ")" for cols in _GROUPING_SETS.values())
    level = "CASE " + " ".join(
        f"WHEN {' AND '.join(f'grouping({c}) = 0' for c in cols)} THEN '{name}'"
        for name, cols in sorted(_GROUPING_SETS.items(), key=lambda kv: -len(kv[1])) if cols) + " ELSE 'total' END"
    try:
        return spark.sql(f"""
            SELECT {level} AS level,
                   CASE WHEN grouping(node) = 0 THEN node WHEN grouping(subject) = 0 THEN subject
                        WHEN grouping(broker_group) = 0 THEN broker_group END AS key,
                   CASE WHEN grouping(bucket) = 0 THEN bucket END AS sub_key,
                   state, lateness, sum(n) AS n, sum(duplicated) AS duplicated,
                   sum(orphan_dispatches) AS orphan_dispatches
            FROM {view} GROUP BY GROUPING SETS ({sets})""")
    finally:
        spark.catalog.dropTempView(view)


def _bin(lateness):
    """Index of the histogram bin of `lateness` (0: early; see report.HISTOGRAM_EDGES_MS)."""
    expr = F.when(lateness < 0, F.lit(0))
    for i, edge in enumerate(HISTOGRAM_EDGES_MS[1:], start=1):
        expr = expr.when(lateness < edge, F.lit(i))
    return expr.otherwise(F.lit(len(HISTOGRAM_EDGES_MS)))


def summarize(stats: DataFrame) -> DataFrame:
    """One row per (level, key, sub_key): the counts, the lateness percentiles (exact nearest
    rank), max and the histogram (an array of counts, one per bin).

    One window (a running count of dispatched messages over the sorted lateness values of a key)
    and one aggregation over it: the stats are small, and each stage more costs more than its data.
    """
    keys = ["level", "key", "sub_key"]
    state, n, lateness = F.col("state"), F.col("n"), F.col("lateness")
    dispatched = state == "dispatched"
    by_key = Window.partitionBy(*keys)
    ranked = (stats.withColumn("cum", F.sum(F.when(dispatched, n).otherwise(0)).over(
                  by_key.orderBy(lateness.asc_nulls_first(), "state")
                  .rowsBetween(Window.unboundedPreceding, Window.currentRow)))
              .withColumn("total", F.sum(F.when(dispatched, n).otherwise(0)).over(by_key))
              .withColumn("bin", _bin(lateness)))

    def total(condition, value=n):
        return F.coalesce(F.sum(F.when(condition, value)), F.lit(0)).cast("bigint")

    # Nearest rank: the P-th percentile is the smallest value with at least ceil(P * count) values <= it.
    percentiles = [F.min(F.when(dispatched & (F.col("cum") >= F.ceil(F.lit(p) * F.col("total"))), lateness))
                   .alias(name) for name, p in PERCENTILES]
    bins = [total(dispatched & (F.col("bin") == i)) for i in range(len(HISTOGRAM_EDGES_MS) + 1)]
    return ranked.groupBy(*keys).agg(
        total(state != "orphan").alias("scheduled"), total(state == "cancelled").alias("cancelled"),
        total(dispatched).alias("dispatched"), total(dispatched, F.col("duplicated")).alias("duplicated"),
        total(state == "missing").alias("missing"), total(state == "not_yet_due").alias("not_yet_due"),
        total(F.lit(True), F.col("orphan_dispatches")).alias("orphan_dispatches"),
        total(dispatched & (lateness < 0)).alias("early"),
        *percentiles, F.max(F.when(dispatched, lateness)).alias("max"),
        F.when(F.max(F.when(dispatched, lateness)).isNotNull(), F.array(*bins)).alias("lateness_histogram"))


def _collect(summary: DataFrame, max_rows: int):
    """{level: {(key, sub_key): Figures}} with at most `max_rows` keys of each level, and the
    levels cut short there."""
    ranked = summary.withColumn("rank", F.row_number().over(
        Window.partitionBy("level").orderBy(F.col("key").asc_nulls_first(), "sub_key")))
    rows = ranked.filter(F.col("rank") <= max_rows + 1).collect()
    levels = {level: {} for level in LEVELS}
    truncated = []
    for r in sorted(rows, key=lambda r: r["rank"]):
        if r["rank"] > max_rows:
            truncated.append(r.level)
            continue
        levels[r.level][(r.key, r.sub_key)] = _figures(r)
    return levels, tuple(sorted(set(truncated)))


def _figures(r) -> Figures:
    lateness = None
    if r["max"] is not None:
        lateness = {name: r[name] for name, _ in PERCENTILES} | {"max": r["max"]}
    return Figures(r.scheduled, r.cancelled, r.dispatched, r.duplicated, r.missing, r.not_yet_due,
                   r.orphan_dispatches, r.early, lateness,
                   tuple(r.lateness_histogram) if r.lateness_histogram is not None else None)


def id_tables(classified: DataFrame) -> dict[str, DataFrame]:
    """The messages (and orphan dispatches) an operator must look at, by kind."""
    state = F.col("state")
    return {
        "missing": classified.filter(state == "missing"),
        "duplicated": classified.filter((state == "dispatched") & (F.col("dispatches") > 1)),
        "early": classified.filter((state == "dispatched") & (F.col("lateness") < 0)),
        "orphans": classified.filter(state == "orphan"),
    }


def write_all(out: str, summary: DataFrame, ids: dict[str, DataFrame], damage: DataFrame) -> dict[str, dict[str, str]]:
    """Write OUT/{missing,duplicated,early,orphans}.{parquet,csv} (sorted by node, bucket, offset),
    OUT/summary.{parquet,csv} and OUT/damage.{parquet,csv}; one part file each, written even when
    empty (so that a reader finds them), replacing earlier output. Returns where."""
    out = out.rstrip("/")
    # The rows to look at are few next to the messages: computed once, in one pass, then written.
    problems = None
    for kind, frame in ids.items():
        rows = frame.select(F.lit(kind).alias("kind"), *[F.col(c) for c in ID_TABLES[kind]])
        problems = rows if problems is None else problems.unionByName(rows, allowMissingColumns=True)
    problems = problems.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        written = {kind: _write(problems.filter(F.col("kind") == kind).select(*ID_TABLES[kind]), out, kind,
                                ["node", "bucket", "offset"]) for kind in ids}
        flat = summary.withColumn("lateness_histogram", F.to_json("lateness_histogram"))
        written["summary"] = _write(flat, out, "summary", ["level", "key", "sub_key"])
        written["damage"] = _write(damage, out, "damage", ["file", "offset"])
    finally:
        problems.unpersist()
    return written


def _write(frame: DataFrame, out: str, name: str, order: list[str]) -> dict[str, str]:
    # One shuffle into one partition keeps the upstream work parallel (coalesce would not).
    single = frame.repartition(1).sortWithinPartitions(*order)
    paths = {"parquet": f"{out}/{name}.parquet", "csv": f"{out}/{name}.csv"}
    single.write.mode("overwrite").parquet(paths["parquet"])
    single.write.mode("overwrite").option("header", True).csv(paths["csv"])
    return paths
