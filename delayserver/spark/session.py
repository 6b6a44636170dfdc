"""The Spark session a reconciliation runs on.

Under spark-submit (or in a process that already has a session) the job takes what is configured
there: master, executors, Python, logging. Run directly (`python spark/reconcile.py`), it starts a
small local session: local[*], workers running this very interpreter (the system python3 has
neither pyarrow nor this project), no UI, few shuffle partitions, logs at WARN.
"""
from __future__ import annotations

import os
import sys

from pyspark.sql import SparkSession

APP_NAME = "delayserver-reconcile"
LOCAL_MASTER = "local[*]"
LOCAL_CONF = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.log.level": "WARN",
}


def get_session(master: str | None = None) -> tuple[SparkSession, bool]:
    """The session to run on, and whether the caller started it (and so should stop it).

    `master` (a Spark master URL) applies only when a session is started here; without it, that is
    spark-submit's master, or local[*] outside spark-submit.
    """
    active = SparkSession.getActiveSession()
    if active is not None:
        return active, False
    builder = SparkSession.builder.appName(APP_NAME)
    # spark-submit hands its driver a gateway to a JVM it has already configured.
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        master = master or LOCAL_MASTER
    if master is not None:
        builder = builder.master(master)
    if master is not None and master.startswith("local"):
        builder = _local(builder)
    spark = builder.getOrCreate()
    if spark.sparkContext.getConf().get("spark.log.level") is None:
        spark.sparkContext.setLogLevel("WARN")
    return spark, True


def _local(builder):
    # The context reads PYSPARK_PYTHON when it starts, and the JVM's own address when it launches.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = builder.config("spark.pyspark.python", sys.executable)
    for key, value in LOCAL_CONF.items():
        builder = builder.config(key, value)
    return builder
