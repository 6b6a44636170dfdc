"""Spark reconciliation: what was scheduled against what was dispatched, over many nodes.

- `segments`: find and decode schedule_log / dispatch_log segment files (no Spark; runs in workers).
- `source`: the PySpark data sources "delayserver.schedule_log" and "delayserver.dispatch_log".
- `reconcile`: the reconciliation itself, on DataFrames; `report`: its result, as text or JSON.
- `session`: the Spark session (local by default, or whatever spark-submit configured).
- `cli`: `spark/reconcile.py` and `delayctl reconcile`.

Only `source` and `segments` run in Spark's Python workers; they import nothing else from here.
The code lives inside the `delayserver` package, not in spark/, so that the workers and delayctl
import it from the one installed distribution.
"""
