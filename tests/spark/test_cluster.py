"""The reconciliation on a real standalone cluster: a Master and a Worker started with spark-class
from the pyspark install, executors whose Python has the declared dependencies but not this
project, and the job submitted with spark-submit from outside the repository. It runs because it
ships its own code (spark.session.ship); its totals must be exact."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pyspark
import pytest

from spark.report import Figures
from tests.spark.test_reconcile import AS_OF, REPO, TOTAL, nodes_in

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("JAVA_HOME") and not any(
        (Path(p) / "java").exists() for p in os.environ.get("PATH", "").split(os.pathsep)),
        reason="Spark needs Java 17 or newer (no java on PATH, no JAVA_HOME)"),
]

BIN = Path(sys.executable).parent
#: spark-class and spark-submit find their jars here (they would look for a `python` on PATH).
SPARK_HOME = str(Path(pyspark.__file__).parent)
#: Real processes on a shared machine: generous, and only for waiting on them.
START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def executor_python(tmp_path_factory) -> str:
    """A Python with this environment's packages but not this project: a venv whose site-packages
    lists this one's by a .pth line (the .pth files of a directory added so are not run, so the
    editable install of delayserver is not seen)."""
    env = tmp_path_factory.mktemp("executor") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ok = subprocess.run([str(python), "-c", "import pyarrow, numpy, pandas, crc32c, attrs, pyspark"], env=clean,
                        cwd=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    for name in ("delayserver", "spark"):
        missing = subprocess.run([str(python), "-c", f"import {name}"], env=clean, cwd=env, capture_output=True,
                                 text=True)
        assert f"No module named '{name}'" in missing.stderr
    return str(python)


def _json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.load(response)
    except OSError:
        return None


def _wait(what: str, ready, processes) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        for p in processes:
            assert p.poll() is None, f"{what}: a process exited with {p.returncode}"
        assert time.monotonic() < deadline, f"{what}: not ready after {START_TIMEOUT_S} s"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A standalone Master and one Worker on 127.0.0.1; yields the master URL."""
    root = tmp_path_factory.mktemp("cluster")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {
        "SPARK_HOME": SPARK_HOME, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_LOG_DIR": str(root / "logs"),
        "SPARK_WORKER_DIR": str(root / "work")}
    port, master_ui, worker_ui = free_port(), free_port(), free_port()
    processes = []
    try:
        with open(root / "master.log", "w") as log:
            processes.append(subprocess.Popen(
                [str(BIN / "spark-class"), "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                 "--port", str(port), "--webui-port", str(master_ui)],
                env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        status = f"http://127.0.0.1:{master_ui}/json/"
        _wait("master", lambda: (_json(status) or {}).get("status") == "ALIVE", processes)
        with open(root / "worker.log", "w") as log:
            processes.append(subprocess.Popen(
                [str(BIN / "spark-class"), "org.apache.spark.deploy.worker.Worker", f"spark://127.0.0.1:{port}",
                 "--host", "127.0.0.1", "--cores", "2", "--memory", "1g", "--work-dir", str(root / "work"),
                 "--webui-port", str(worker_ui)],
                env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        _wait("worker", lambda: (_json(status) or {}).get("aliveworkers", 0) >= 1, processes)
        yield f"spark://127.0.0.1:{port}"
    finally:
        for p in processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in processes:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_the_job_ships_its_code_to_executors_that_cannot_import_the_project(cluster, executor_python,
                                                                            tmp_path_factory):
    nodes = nodes_in(tmp_path_factory.mktemp("nodes"))
    away = tmp_path_factory.mktemp("elsewhere")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {
        "PYSPARK_PYTHON": executor_python, "PYSPARK_DRIVER_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_HOME": SPARK_HOME}
    result = subprocess.run(
        [str(BIN / "spark-submit"), "--master", cluster, "--executor-memory", "512m",
         "--conf", "spark.ui.enabled=false", "--conf", f"spark.pyspark.python={executor_python}",
         str(REPO / "spark" / "reconcile.py"), nodes["a"], nodes["b"], nodes["empty"],
         "--as-of", str(AS_OF), "--json", "--split-bytes", "200", "--out", str(away / "out")],
        env=env, cwd=away, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stderr[-5000:]
    report = json.loads(result.stdout)
    assert Figures(**{k: v for k, v in report["total"].items() if k != "lateness_histogram"}) == TOTAL
    assert [n["node"] for n in report["nodes"]] == [nodes["a"], nodes["b"], nodes["empty"]]
    assert list((away / "out" / "missing.parquet").glob("*.parquet"))
