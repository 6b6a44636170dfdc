"""The message ids a node's quarantine names.

A node that finds its message_log diverged from its master's copies the divergent suffix to
``DATA_DIR/quarantine/diverged/<offset>-<time>.log`` with a listing ``.json`` beside it that
names every message (and cancel) in it, before truncating; these are read here.
"""
from __future__ import annotations

import json
from pathlib import Path

DIVERGED = Path("quarantine") / "diverged"


def quarantined_ids(data_dir: Path) -> set[str]:
    """The ids of the messages in every divergent-suffix listing of `data_dir`."""
    directory = Path(data_dir) / DIVERGED
    listings = sorted(directory.glob("*.json")) if directory.is_dir() else []
    return {m["message_id"] for path in listings for m in json.loads(path.read_text())["messages"]}
