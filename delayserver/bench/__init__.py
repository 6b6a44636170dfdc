"""Benchmarks, run by name: ``ops/bench NAME [ARGS]`` is ``python -m delayserver.bench NAME [ARGS]``.

Each benchmark is a module with ``main(argv)`` that runs it and prints its figures. BENCHMARKS maps
a name to that module, which is imported only when its benchmark runs.
"""
from __future__ import annotations

BENCHMARKS = {
    "storage": "delayserver.bench.storage",
    "ingest": "delayserver.bench.ingest",
    "wheel": "delayserver.bench.wheel",
    "deliver": "delayserver.bench.deliver",
    "compare": "delayserver.bench.compare",
}
