"""schemathesis against the /openapi.json a live node serves: no 5xx, every status and body as
documented, schema-violating requests refused. SCHEMATHESIS_MAX_EXAMPLES (default 25) per operation."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.node.live import start_http_node

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_schema_conformance,negative_data_rejection")


@pytest.fixture
def live_node(tmp_path):
    node, base = start_http_node(tmp_path / "data", secret="schema-token")
    try:
        yield node, base
    finally:
        node.kill()


def test_the_served_openapi_document_holds_against_generated_requests(live_node, tmp_path):
    node, base = live_node
    st = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or shutil.which("schemathesis")
    assert st, "schemathesis is a test dependency (setup.cfg)"
    run = subprocess.run(
        [st, "run", f"{base}/openapi.json", "-H", "Authorization: Bearer schema-token", "--checks", CHECKS,
         "-n", os.environ.get("SCHEMATHESIS_MAX_EXAMPLES", "25"), "--no-color", "--generation-database", "none",
         "--request-timeout", "30", "--workers", "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout
    assert "Traceback" not in node.log_text(), node.log_text()[-3000:]
