"""`delayctl reconcile DATA_DIR [DATA_DIR ...]`: the Spark reconciliation of schedule_log against
dispatch_log (the same job as `spark/reconcile.py`; see delayserver.spark.cli). Needs pyspark and
pyarrow (the `spark` extra) and Java 17 or newer.

Exit codes: 0 nothing missing, 1 messages missing or a segment damaged, 2 a usage error.
"""
from __future__ import annotations

from delayserver.spark import cli


def register(subparsers) -> None:
    p = subparsers.add_parser("reconcile", help="reconcile schedule_log against dispatch_log on Spark",
                              description=cli.DESCRIPTION)
    cli.add_arguments(p)
    p.set_defaults(run=cli.run)
