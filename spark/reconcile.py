"""Reconcile schedule_log against dispatch_log on Spark: print the report, exit with its status.

    python spark/reconcile.py DATA_DIR [DATA_DIR ...] [--as-of TIME] [--out DIR] [--json]
        [--master URL] [--driver-memory SIZE] [--shuffle-partitions N] [--split-bytes N] [--conf KEY=VALUE]
        [--class-archive DIR|none] [--jit auto|quick|full]
    spark-submit [OPTIONS] spark/reconcile.py DATA_DIR [...]

Exit status: 0 nothing missing, nothing early and nothing damaged; 1 messages missing or early, or
a segment damaged (the summary names file and offset); 2 bad arguments or a path that is not a
data directory. The job ships its code to the executors itself (see `spark.session`).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from pathlib import Path

if __name__ == "__main__" and __package__ in (None, ""):
    # Run as a script (python or spark-submit), the directory on the path is spark/ itself: put
    # the one holding the `spark` package there instead, so that its modules import as spark.*.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from spark.logs import (  # noqa: E402
    DEFAULT_SPLIT_BYTES, LOGS, check_data_dir, normalize_data_dirs, segment_ranges,
)
from spark.reconciliation import DEFAULT_MAX_ROWS, reconcile  # noqa: E402
from spark import jvm  # noqa: E402
from spark.session import DEFAULT_DRIVER_MEMORY, DEFAULT_SHUFFLE_PARTITIONS, get_session, stop  # noqa: E402

DESCRIPTION = ("Reconcile schedule_log against dispatch_log on Spark: per bucket and in total, "
               "scheduled, cancelled, dispatched, missing, duplicated, not yet due, and lateness.")


def parse_time(value: str) -> int:
    """Epoch milliseconds, or ISO 8601 (a time without an offset is UTC, never local time)."""
    if value.isdigit():
        return int(value)
    try:
        t = _dt.datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not epoch ms or ISO 8601: {value!r}") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.timezone.utc)
    return int(t.timestamp() * 1000)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("data_dirs", nargs="+", metavar="DATA_DIR",
                        help="a node's data directory; one per node (readable by every executor)")
    parser.add_argument("--as-of", type=parse_time, default=None, metavar="TIME",
                        help="due before this counts as missing when undelivered: epoch ms or ISO 8601, "
                             "UTC unless an offset is given (default: now)")
    parser.add_argument("--out", metavar="DIR",
                        help="write the summaries, the damage and the ids of missing, duplicated and early "
                             "messages and of orphan dispatches here, as Parquet and CSV (any path Spark "
                             "can write: a local directory, hdfs://, s3a://)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--master", metavar="URL",
                        help="Spark master when not run by spark-submit (default local[*])")
    parser.add_argument("--driver-memory", default=DEFAULT_DRIVER_MEMORY, metavar="SIZE",
                        help="driver JVM heap when not run by spark-submit (give spark-submit its own "
                             f"--driver-memory); in local mode the executors live in it too "
                             f"(default {DEFAULT_DRIVER_MEMORY})")
    parser.add_argument("--shuffle-partitions", type=_positive, default=DEFAULT_SHUFFLE_PARTITIONS, metavar="N",
                        help=f"spark.sql.shuffle.partitions for the joins and aggregations "
                             f"(default {DEFAULT_SHUFFLE_PARTITIONS})")
    parser.add_argument("--split-bytes", type=_positive, default=DEFAULT_SPLIT_BYTES, metavar="N",
                        help=f"the most of a segment one task reads (default {DEFAULT_SPLIT_BYTES >> 20} MiB)")
    parser.add_argument("--conf", action="append", type=_setting, default=[], metavar="KEY=VALUE",
                        help="a Spark setting for the session the job starts when not run by spark-submit "
                             "(repeatable; give spark-submit its own --conf)")
    parser.add_argument("--class-archive", type=_archive_dir, default=jvm.default_dir(), metavar="DIR",
                        help="keep the driver JVM's class data sharing archive here, written by the first run "
                             "and mapped by the next ones (a faster start), when not run by spark-submit; "
                             f"'none' for no archive (default {jvm.default_dir()})")
    parser.add_argument("--jit", choices=jvm.JIT_MODES, default="auto",
                        help="the driver JVM's compilers when not run by spark-submit: quick, the client "
                             "compiler alone (a short job spends less on compiling); full, the JVM's default; "
                             f"auto, quick when the logs total less than {jvm.QUICK_BELOW_BYTES >> 20} MiB "
                             "(default auto)")
    parser.add_argument("--max-rows", type=_positive, default=DEFAULT_MAX_ROWS, metavar="N",
                        help=f"the most buckets, subjects and broker groups the report shows, each "
                             f"(all are in the summary written with --out; default {DEFAULT_MAX_ROWS})")


def _setting(value: str) -> tuple[str, str]:
    key, sep, setting = value.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {value!r}")
    return key.strip(), setting


def _archive_dir(value: str) -> Path | None:
    return None if value == "none" else Path(value)


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def run(args: argparse.Namespace) -> int:
    """Run the reconciliation `args` describe; returns the exit status."""
    as_of = args.as_of if args.as_of is not None else int(time.time() * 1000)
    # Checked before Spark starts: a typo gets its answer at once, not after a session's start-up.
    try:
        data_dirs = normalize_data_dirs(args.data_dirs)
        for data_dir in data_dirs:
            check_data_dir(data_dir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = sum(r.size for log in LOGS for r in segment_ranges(data_dirs, log, 1 << 62))
    spark, owned = get_session(args.master, driver_memory=args.driver_memory,
                               shuffle_partitions=args.shuffle_partitions, conf=dict(args.conf),
                               class_archive=args.class_archive,
                               jvm_options=jvm.compiler_options(args.jit, size))
    try:
        report = reconcile(spark, data_dirs, as_of, args.out, split_bytes=args.split_bytes,
                           max_rows=args.max_rows)
        # Said before the session stops: a first run's JVM then writes its class archive.
        sys.stdout.write(json.dumps(report.to_json(), indent=2) + "\n" if args.json else report.render())
        # Said on stderr as well, so that a script reading the JSON cannot miss it.
        for damage in report.damage:
            print(f"error: {damage.error}", file=sys.stderr)
        sys.stdout.flush()
    finally:
        if owned:
            stop(spark)
    return report.exit_status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="reconcile", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
