"""Structured logs: log_format = "json" writes one JSON object per line."""
from __future__ import annotations

import json
import logging

from tests.node.live import start_http_node


def test_json_logs_are_one_object_per_line():
    import io

    from delayserver.logs import configure

    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure("INFO", "json", stream)
        logging.getLogger("delayserver.test").warning("disk %s", "full", extra={"bucket": "202611221600"})
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("delayserver.test").exception("failed")
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])
    first, second = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert first["level"] == "WARNING" and first["logger"] == "delayserver.test"
    assert first["message"] == "disk full" and first["bucket"] == "202611221600"
    assert first["time"].endswith("+00:00")
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exception"]


def test_a_node_started_with_log_format_json_logs_json_lines(tmp_path):
    node, base = start_http_node(tmp_path / "data", extra_args=("--log-format", "json"))
    node.terminate()
    lines = [line for line in node.log_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]
    assert any(r["logger"] == "delayserver.server" and r["message"].startswith("serving on") for r in records)
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
