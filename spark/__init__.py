"""Spark reconciliation: what was scheduled against what was dispatched, over many nodes.

The job lives here, next to the package it reads, not inside it: `delayserver` ships what a node
runs, and a Spark job is not that (pyspark and a JVM are no dependency of a node). Its modules:

- `logs`: the logs' columns, data directories, and the byte ranges of segments tasks read.
- `columns`: a chunk of records decoded straight into Arrow columns (runs in Spark's workers).
- `source`: the PySpark data sources "delayserver.schedule_log" and "delayserver.dispatch_log".
- `reconciliation`: the reconciliation on DataFrames; `report`: its result, as text or JSON.
- `session`: the Spark session, and the zip of `spark` and `delayserver` shipped to executors;
  `jvm`: the driver JVM's class data sharing archive and compilers, when the job launches it.
- `reconcile`: the command line (`python spark/reconcile.py`, `spark-submit spark/reconcile.py`).

Workers run `source`, `columns` and `logs`, and from `delayserver` the storage layouts and the range
reader; they import them from the zip the job adds, so executors need only the dependencies.
"""
