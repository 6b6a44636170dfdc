"""The Spark session a reconciliation runs on, and the code it ships to the executors.

Under spark-submit (or in a process that already has a session) the job takes what is configured
there: master, executors, Python, logging. Run directly (`python spark/reconcile.py`), it starts a
session of its own: local[*] unless `--master` says otherwise, Python workers running this very
interpreter when local, no UI, logs at WARN, the parallel garbage collector when local, in-memory
columns cached uncompressed, the driver memory, shuffle partitions and other settings (`--conf`)
given. When it launches the driver's JVM itself it can also give it a class data sharing archive
and a choice of compilers (`spark.jvm`); `stop` then ends the session.

Either way `ship` packs the `spark` and `delayserver` packages into one zip and adds it with
`addPyFile`, so that executors whose Python has only the declared dependencies (pyarrow, numpy,
pandas, crc32c, attrs, pyspark) import the data sources and the record layouts from it.
"""
from __future__ import annotations

import atexit
import importlib
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

from pyspark import SparkContext
from pyspark.find_spark_home import _find_spark_home
from pyspark.sql import SparkSession

from spark import jvm

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
#: Settings of every session started here (any master; `--conf` overrides them).
SESSION_CONF = {
    # The decoded logs are cached once and read three times. Spark's compression of its in-memory
    # columns cost more CPU than it saved: uncompressed, `ops/bench reconcile` took 13.6 to 14.6 s
    # at 1,000,400 records (15.9 to 16.6 s compressed) and 42.2 s at 10,004,000 (46.2 s). What
    # does not fit in memory spills to disk either way.
    "spark.sql.inMemoryColumnarStorage.compressed": "false",
}
#: What executors import: the job's package and the project's own.
SHIPPED_PACKAGES = ("spark", "delayserver")


def get_session(master: str | None = None, *, driver_memory: str = DEFAULT_DRIVER_MEMORY,
                shuffle_partitions: int = DEFAULT_SHUFFLE_PARTITIONS,
                conf: dict[str, str] | None = None,
                class_archive: Path | None = None, jvm_options: str = "") -> tuple[SparkSession, bool]:
    """The session to run on, with the code shipped, and whether the caller started it (and so
    should stop it, with `stop`).

    `master` (a Spark master URL), `driver_memory`, `conf` (Spark settings, over the defaults
    here) and `class_archive` (a directory for the driver JVM's class data sharing archive, see
    `spark.jvm`; None: no archive) and `jvm_options` (more options for the driver JVM, after any
    in `conf`) apply only when a session is started here and launches its JVM
    (spark-submit starts the driver's JVM itself: give it `--driver-memory` there); without a master,
    that is spark-submit's, or local[*] outside spark-submit. `shuffle_partitions` applies to any.
    """
    active = SparkSession.getActiveSession()
    owned = active is None
    spark = active if active is not None else _start(master, driver_memory, conf or {}, class_archive, jvm_options)
    spark.conf.set("spark.sql.shuffle.partitions", str(shuffle_partitions))
    ship(spark)
    return spark, owned


def _start(master: str | None, driver_memory: str, conf: dict[str, str],
           class_archive: Path | None, jvm_options: str) -> SparkSession:
    builder = SparkSession.builder.appName(APP_NAME)
    settings: dict[str, str] = dict(SESSION_CONF)
    # spark-submit hands its driver a gateway to a JVM it has already configured.
    launches = "PYSPARK_GATEWAY_PORT" not in os.environ and SparkContext._gateway is None
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        master = master or LOCAL_MASTER
        settings["spark.driver.memory"] = driver_memory
    if master is not None:
        builder = builder.master(master)
    if master is not None and master.startswith("local"):
        _local()
        settings |= LOCAL_CONF | {"spark.pyspark.python": sys.executable}
    settings |= conf
    archive = None
    if launches and class_archive is not None:
        archive = jvm.prepare(Path(class_archive), Path(_find_spark_home()) / "jars", settings)
    options = " ".join(o for o in (jvm_options if launches else "", archive.options if archive else "") if o)
    if options:
        key = "spark.driver.extraJavaOptions"
        settings[key] = f"{settings.get(key, '')} {options}".strip()
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    _archives[id(spark.sparkContext)] = archive
    if spark.sparkContext.getConf().get("spark.log.level") is None:
        spark.sparkContext.setLogLevel("WARN")
    return spark


def _local() -> None:
    # The context reads PYSPARK_PYTHON when it starts, and the JVM's own address when it launches.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


_shipped: dict[int, str] = {}
_archives: dict[int, jvm.Archive | None] = {}


def stop(spark: SparkSession) -> None:
    """Stop a session `get_session` started. When its JVM writes a class archive, also end the
    JVM and wait for it to write the archive (about 12 s here, once per machine), so that the
    archive is complete when it is put in place; the next session then launches a JVM of its own."""
    archive = _archives.pop(id(spark.sparkContext), None)
    _shipped.pop(id(spark.sparkContext), None)  # (a context started later may get the same id)
    spark.stop()
    if archive is not None and archive.pending is not None:
        jvm.finish(archive, SparkContext._gateway)
        SparkContext._gateway = None
        SparkContext._jvm = None


def ship(spark: SparkSession) -> str:
    """Add a zip of SHIPPED_PACKAGES to the session's Python path (once per context); returns it.
    The zip's temporary directory is removed when the process exits (a context may hand the zip
    to an executor at any time while it runs)."""
    context = spark.sparkContext
    if id(context) in _shipped:
        return _shipped[id(context)]
    directory = tempfile.mkdtemp(prefix="delayserver-reconcile-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    path = pack(Path(directory) / "delayserver-reconcile.zip")
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
