"""The Spark session a reconciliation runs on, and the code it ships to the executors.

Under spark-submit (or in a process that already has a session) the job takes what is configured
there: master, executors, Python, logging. Run directly (`python spark/reconcile.py`), it starts a
session of its own: local[*] unless `--master` says otherwise, Python workers running this very
interpreter when local, no UI, logs at WARN, the parallel garbage collector when local, the driver
memory, shuffle partitions and other settings (`--conf`) given.

Either way `ship` packs the `spark` and `delayserver` packages into one zip and adds it with
`addPyFile`, so that executors whose Python has only the declared dependencies (pyarrow, numpy,
pandas, crc32c, attrs, pyspark) import the data sources and the record layouts from it.
"""
from __future__ import annotations

import importlib
import os
import sys
import tempfile
import zipfile
from pathlib import Path

from pyspark.sql import SparkSession

APP_NAME = "delayserver-reconcile"
LOCAL_MASTER = "local[*]"
DEFAULT_DRIVER_MEMORY = "2g"
DEFAULT_SHUFFLE_PARTITIONS = 8
LOCAL_CONF = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.log.level": "WARN",
    # A batch job in one JVM (the executors live in the driver): the throughput collector spent
    # about a sixth less CPU than the default G1 reconciling 10M records (`ops/bench reconcile`).
    "spark.driver.extraJavaOptions": "-XX:+UseParallelGC",
}
#: What executors import: the job's package and the project's own.
SHIPPED_PACKAGES = ("spark", "delayserver")


def get_session(master: str | None = None, *, driver_memory: str = DEFAULT_DRIVER_MEMORY,
                shuffle_partitions: int = DEFAULT_SHUFFLE_PARTITIONS,
                conf: dict[str, str] | None = None) -> tuple[SparkSession, bool]:
    """The session to run on, with the code shipped, and whether the caller started it (and so
    should stop it).

    `master` (a Spark master URL), `driver_memory` and `conf` (Spark settings, over the defaults
    here) apply only when a session is started here
    (spark-submit starts the driver's JVM itself: give it `--driver-memory` there); without a master,
    that is spark-submit's, or local[*] outside spark-submit. `shuffle_partitions` applies to any.
    """
    active = SparkSession.getActiveSession()
    owned = active is None
    spark = active if active is not None else _start(master, driver_memory, conf or {})
    spark.conf.set("spark.sql.shuffle.partitions", str(shuffle_partitions))
    ship(spark)
    return spark, owned


def _start(master: str | None, driver_memory: str, conf: dict[str, str]) -> SparkSession:
    builder = SparkSession.builder.appName(APP_NAME)
    # spark-submit hands its driver a gateway to a JVM it has already configured.
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        master = master or LOCAL_MASTER
        builder = builder.config("spark.driver.memory", driver_memory)
    if master is not None:
        builder = builder.master(master)
    if master is not None and master.startswith("local"):
        builder = _local(builder)
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    if spark.sparkContext.getConf().get("spark.log.level") is None:
        spark.sparkContext.setLogLevel("WARN")
    return spark


def _local(builder):
    # The context reads PYSPARK_PYTHON when it starts, and the JVM's own address when it launches.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = builder.config("spark.pyspark.python", sys.executable)
    for key, value in LOCAL_CONF.items():
        builder = builder.config(key, value)
    return builder


_shipped: dict[int, str] = {}


def ship(spark: SparkSession) -> str:
    """Add a zip of SHIPPED_PACKAGES to the session's Python path (once per context); returns it."""
    context = spark.sparkContext
    if id(context) in _shipped:
        return _shipped[id(context)]
    path = pack(Path(tempfile.mkdtemp(prefix="delayserver-reconcile-")) / "delayserver-reconcile.zip")
    context.addPyFile(str(path))
    _shipped[id(context)] = str(path)
    return str(path)


def pack(path: Path) -> Path:
    """Write the Python sources of SHIPPED_PACKAGES, as imported here, into the zip `path`."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in SHIPPED_PACKAGES:
            package = Path(importlib.import_module(name).__file__).resolve().parent
            for source in sorted(package.rglob("*.py")):
                zf.write(source, Path(name) / source.relative_to(package))
    return path
