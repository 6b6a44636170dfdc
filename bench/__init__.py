"""Benchmarks (not shipped with the package), run by name: ``ops/bench NAME [ARGS]`` is ``python -m bench NAME [ARGS]``.

Each benchmark is a module with ``main(argv)`` that runs it and prints its figures. BENCHMARKS maps
a name to that module, which is imported only when its benchmark runs.
"""
from __future__ import annotations

import os
from pathlib import Path

# bench/ is not installed with the package: the benchmarks start helper processes with
# `python -m bench.X`, which find it through PYTHONPATH.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)

BENCHMARKS = {
    "storage": "bench.storage",
    "ingest": "bench.ingest",
    "wheel": "bench.wheel",
    "deliver": "bench.deliver",
    "compare": "bench.compare",
    "status": "bench.status",
    "meta": "bench.meta",
    "reconcile": "bench.reconcile",
    "http": "bench.http",
    "browse": "bench.browse",
    "dedupe": "bench.dedupe",
    "transactions": "bench.transactions",
    "replication": "bench.replication",
    "index": "bench.index",
    "memory": "bench.memory",
    "pump": "bench.pump",
    "crc": "bench.crc",
    "threads": "bench.threads",
}
