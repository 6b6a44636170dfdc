"""The reconciliation on DataFrames: classify every scheduled message, count, write the ids.

A message is one SCHEDULED record, keyed by (node, bucket, offset): a dispatch_log record names the
schedule_log offset of its own bucket on its own node. What each figure means is in `report`.
"""
from __future__ import annotations

import json

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from delayserver.spark import source
from delayserver.spark.report import PERCENTILES, Damage, Figures, Report
from delayserver.spark.segments import CORRUPT, DISPATCH_LOG, SCHEDULE_LOG, check_data_dir, normalize_data_dirs

KEY = ["node", "bucket", "offset"]
#: Accuracy of percentile_approx: rank error at most 1/10000 of the number of values.
PERCENTILE_ACCURACY = 10_000
MISSING_COLUMNS = ["node", "bucket", "offset", "message_log_offset", "message_id", "subject", "schedule_time",
                   "sequence"]
DUPLICATED_COLUMNS = MISSING_COLUMNS + ["dispatches", "first_dispatch_time", "last_dispatch_time",
                                        "broker_groups"]


def read_log(spark: SparkSession, log: str, data_dirs: list[str]) -> DataFrame:
    source.register(spark)
    return spark.read.format(f"delayserver.{log}").option("data_dirs", json.dumps(data_dirs)).load()


def reconcile(spark: SparkSession, data_dirs: list[str], as_of: int, out: str | None = None) -> Report:
    """Reconcile the data directories as of `as_of` (epoch ms); with `out`, write the ids of
    missing and duplicated messages there (Parquet and CSV, replacing earlier output).

    Raises ValueError for a malformed list of data directories (see `normalize_data_dirs`) and
    NotADataDirectory for a path that is not a data directory, before Spark reads anything.
    """
    data_dirs = normalize_data_dirs(data_dirs)
    for data_dir in data_dirs:
        check_data_dir(data_dir)
    schedule = read_log(spark, SCHEDULE_LOG, data_dirs).drop("headers").persist(StorageLevel.MEMORY_AND_DISK)
    dispatch = read_log(spark, DISPATCH_LOG, data_dirs).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        messages = classify(schedule, dispatch, as_of).persist(StorageLevel.MEMORY_AND_DISK)
        try:
            damage, torn = _problems(schedule, dispatch)
            total, nodes, buckets = _figures(messages, orphans(schedule, dispatch), data_dirs)
            outputs = write_ids(messages, out) if out else {}
        finally:
            messages.unpersist()
    finally:
        schedule.unpersist()
        dispatch.unpersist()
    return Report(as_of, tuple(data_dirs), total, nodes, buckets, tuple(damage), tuple(torn), outputs)


def _dispatches(dispatch: DataFrame) -> DataFrame:
    """Per dispatched offset: how many records, first and last time, the broker groups."""
    return (dispatch.filter(F.col("record_type") == "DISPATCH")
            .groupBy("node", "bucket", F.col("schedule_offset").alias("offset"))
            .agg(F.count("*").alias("dispatches"),
                 F.min("dispatch_time").alias("first_dispatch_time"),
                 F.max("dispatch_time").alias("last_dispatch_time"),
                 F.concat_ws(",", F.array_sort(F.collect_set("broker_group"))).alias("broker_groups")))


def classify(schedule: DataFrame, dispatch: DataFrame, as_of: int) -> DataFrame:
    """One row per scheduled message with its `state` (dispatched, cancelled, missing, not_yet_due),
    its dispatch figures and `lateness` (first dispatch - schedule time, null if not dispatched)."""
    scheduled = schedule.filter(F.col("record_type") == "SCHEDULED")
    # A cancel applies to the earlier records of its key, so the latest cancel of a key decides.
    cancels = (schedule.filter(F.col("record_type") == "SCHEDULED_CANCEL")
               .groupBy("node", "bucket", "schedule_time", "message_id")
               .agg(F.max("offset").alias("last_cancel_offset")))
    joined = (scheduled.join(cancels, ["node", "bucket", "schedule_time", "message_id"], "left")
              .join(_dispatches(dispatch), KEY, "left")
              .fillna(0, ["dispatches"]))
    state = (F.when(F.col("dispatches") > 0, "dispatched")
             .when(F.col("last_cancel_offset") > F.col("offset"), "cancelled")
             .when(F.col("schedule_time") < F.lit(as_of), "missing")
             .otherwise("not_yet_due"))
    return joined.select(*MISSING_COLUMNS, "dispatches", "first_dispatch_time", "last_dispatch_time",
                         "broker_groups", state.alias("state"),
                         (F.col("first_dispatch_time") - F.col("schedule_time")).alias("lateness"))


def orphans(schedule: DataFrame, dispatch: DataFrame) -> DataFrame:
    """Dispatched offsets with no scheduled message: node, bucket, offset, dispatches."""
    scheduled = schedule.filter(F.col("record_type") == "SCHEDULED").select(*KEY)
    return _dispatches(dispatch).join(scheduled, KEY, "left_anti").select(*KEY, "dispatches")


def _problems(schedule: DataFrame, dispatch: DataFrame) -> tuple[list[Damage], list[Damage]]:
    columns = ["file", "offset", "record_type", "error"]
    rows = (schedule.filter(F.col("error").isNotNull()).select(*columns)
            .unionByName(dispatch.filter(F.col("error").isNotNull()).select(*columns))
            .orderBy("file", "offset").collect())
    found = [Damage(r.file, r.offset, r.record_type, r.error) for r in rows]
    return [d for d in found if d.kind == CORRUPT], [d for d in found if d.kind != CORRUPT]


def _figures(messages: DataFrame, orphaned: DataFrame, data_dirs: list[str]):
    """(total, per node, per (node, bucket)) Figures; every data directory appears in per node."""
    facts = (messages.select("node", "bucket", "state", "dispatches", "lateness")
             .unionByName(orphaned.select("node", "bucket", F.lit("orphan").alias("state"), "dispatches",
                                          F.lit(None).cast("bigint").alias("lateness"))))
    state = F.col("state")
    rows = (facts.rollup("node", "bucket")
            .agg(F.count_if(state != "orphan").alias("scheduled"),
                 F.count_if(state == "cancelled").alias("cancelled"),
                 F.count_if(state == "dispatched").alias("dispatched"),
                 F.count_if((state == "dispatched") & (F.col("dispatches") > 1)).alias("duplicated"),
                 F.count_if(state == "missing").alias("missing"),
                 F.count_if(state == "not_yet_due").alias("not_yet_due"),
                 F.coalesce(F.sum(F.when(state == "orphan", F.col("dispatches"))), F.lit(0))
                 .alias("orphan_dispatches"),
                 F.count_if(F.col("lateness") < 0).alias("early"),
                 F.percentile_approx("lateness", [p for _, p in PERCENTILES], PERCENTILE_ACCURACY).alias("pct"),
                 F.max("lateness").alias("max_lateness"),
                 F.grouping_id().alias("level"))
            .collect())
    total, nodes, buckets = Figures(), {d: Figures() for d in data_dirs}, {}
    for r in rows:
        figures = _to_figures(r)
        if r.level == 0:
            buckets[(r.node, r.bucket)] = figures
        elif r.level == 1:
            nodes[r.node] = figures
        else:
            total = figures
    return total, nodes, dict(sorted(buckets.items()))


def _to_figures(r) -> Figures:
    lateness = None
    if r.max_lateness is not None:
        lateness = {name: value for (name, _), value in zip(PERCENTILES, r.pct)} | {"max": r.max_lateness}
    return Figures(r.scheduled, r.cancelled, r.dispatched, r.duplicated, r.missing, r.not_yet_due,
                   r.orphan_dispatches, r.early, lateness)


def write_ids(messages: DataFrame, out: str) -> dict[str, dict[str, str]]:
    """Write OUT/{missing,duplicated}.{parquet,csv} (one file each, sorted by node, bucket, offset;
    written even when empty, so that a reader finds them); returns where."""
    out = out.rstrip("/")
    tables = {
        "missing": messages.filter(F.col("state") == "missing").select(*MISSING_COLUMNS),
        "duplicated": messages.filter((F.col("state") == "dispatched") & (F.col("dispatches") > 1))
                              .select(*DUPLICATED_COLUMNS),
    }
    written = {}
    for kind, frame in tables.items():
        # One shuffle into one partition keeps the upstream work parallel (coalesce would not).
        single = frame.repartition(1).sortWithinPartitions(*KEY)
        paths = {"parquet": f"{out}/{kind}.parquet", "csv": f"{out}/{kind}.csv"}
        single.write.mode("overwrite").parquet(paths["parquet"])
        single.write.mode("overwrite").option("header", True).csv(paths["csv"])
        written[kind] = paths
    return written
