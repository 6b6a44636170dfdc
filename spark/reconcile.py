"""Reconcile schedule_log against dispatch_log on Spark (see spark/README.md).

    python spark/reconcile.py DATA_DIR [DATA_DIR ...] [--as-of TIME] [--out DIR] [--json]
    spark-submit spark/reconcile.py DATA_DIR [DATA_DIR ...] [...]

The same as `delayctl reconcile`; the code is `delayserver.spark`.
"""
import sys

from delayserver.spark.cli import main

if __name__ == "__main__":
    sys.exit(main())
