"""`spark/reconcile.py` and `delayctl reconcile`: reconcile data directories, print, exit.

    reconcile DATA_DIR [DATA_DIR ...] [--as-of TIME] [--out DIR] [--json] [--master URL]

Exit status: 0 nothing missing and nothing damaged; 1 messages missing or a segment damaged (the
summary names file and offset); 2 bad arguments or a path that is not a data directory.
pyspark is imported only when a reconciliation runs, so that delayctl works without it.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time

from delayserver.spark.segments import check_data_dir, normalize_data_dirs

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
                        help="write the missing and duplicated messages' ids here, as Parquet and CSV "
                             "(any path Spark can write: a local directory, hdfs://, s3a://)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--master", metavar="URL",
                        help="Spark master when not run by spark-submit (default local[*])")


def run(args: argparse.Namespace) -> int:
    """Run the reconciliation `args` describe; returns the exit status."""
    from delayserver.spark.reconcile import reconcile
    from delayserver.spark.session import get_session

    as_of = args.as_of if args.as_of is not None else int(time.time() * 1000)
    # Checked before Spark starts: a typo gets its answer at once, not after a session's start-up.
    try:
        data_dirs = normalize_data_dirs(args.data_dirs)
        for data_dir in data_dirs:
            check_data_dir(data_dir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    spark, owned = get_session(args.master)
    try:
        report = reconcile(spark, data_dirs, as_of, args.out)
    finally:
        if owned:
            spark.stop()
    sys.stdout.write(json.dumps(report.to_json(), indent=2) + "\n" if args.json else report.render())
    # Said on stderr as well, so that a script reading the JSON cannot miss it.
    for damage in report.damage:
        print(f"error: {damage.error}", file=sys.stderr)
    return report.exit_status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="reconcile", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))
