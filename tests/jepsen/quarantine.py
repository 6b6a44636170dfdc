"""The message ids a node's quarantine files name.

A node that truncates a divergent suffix of its message_log first copies it to a quarantine file
naming every message id in it. The workload's ids (`j-` and seven digits) are distinctive, so they
are found in any file under the data directory whose path says "quarantine", whatever its layout
(a listing or a copy of the records).
"""
from __future__ import annotations

import re
from pathlib import Path

WORKLOAD_ID = re.compile(rb"j-\d{7}")


def quarantine_files(data_dir: Path) -> list[Path]:
    return sorted(p for p in Path(data_dir).rglob("*")
                  if p.is_file() and "quarantine" in str(p.relative_to(data_dir)).lower())


def quarantined_ids(data_dir: Path) -> set[str]:
    return {m.decode() for p in quarantine_files(data_dir) for m in WORKLOAD_ID.findall(p.read_bytes())}
