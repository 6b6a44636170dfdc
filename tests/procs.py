"""Real delay-server processes for end-to-end tests: start, wait until serving, kill, restart."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest

from delayserver.message import DelayServerError, ResultCode
from delayserver.sender.spool import iter_spool, list_spool_subjects

SERVING = re.compile(r"serving on ([\d.]+):(\d+)")


@attrs.define(eq=False)
class ServerProcess:
    data_dir: Path
    args: list[str] = attrs.field(factory=list)
    env: dict = attrs.field(factory=dict)
    process: subprocess.Popen | None = None
    port: int = 0
    log_path: Path | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerProcess":
        """Start `delayserver serve` on a free port and wait for its "serving on" line."""
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}.server.log"
        log = open(self.log_path, "ab")
        env = {**os.environ, **self.env}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "delayserver", "serve", "--data-dir", str(self.data_dir),
             "--listen", "127.0.0.1:0", *self.args],
            stdout=subprocess.PIPE, stderr=log, env=env,
        )
        deadline = time.monotonic() + timeout
        line = b""
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                break
            m = SERVING.search(line.decode())
            if m:
                self.port = int(m.group(2))
                return self
        self.kill()
        raise RuntimeError(f"server did not start: {line!r}; log: {self.log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def terminate(self, timeout: float = 30.0) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path and self.log_path.exists() else ""


def spooled(data_dir: Path) -> list:
    """Every message in every spool subject: (dispatch_time, attempt, Message)."""
    out = []
    for subject in list_spool_subjects(data_dir):
        out.extend((t, a, m) for _, t, a, m in iter_spool(data_dir, subject))
    return out


def wait_for(predicate, timeout: float, interval: float = 0.05):
    """Poll `predicate` until it returns a truthy value or `timeout` passes (real processes only)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def send_while_roles_settle(producer, subject: str, body: bytes, timeout: float = 15.0, **kw):
    """`producer.send`, asked again while the node answers NOT_MASTER or FENCED: a node waiting
    for its role, or a master whose lease renewal a loaded machine delayed, refuses writes for a
    moment, and a producer sending to one node directly sees that refusal."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return producer.send(subject, body, **kw)
        except DelayServerError as e:
            if e.code not in (ResultCode.NOT_MASTER, ResultCode.FENCED) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.fixture
def nodes():
    """ServerProcesses a test starts (append them): resumed if paused, then killed at the end."""
    started: list[ServerProcess] = []
    yield started
    for node in started:
        if node.process is not None and node.process.poll() is None:
            node.process.send_signal(signal.SIGCONT)
        node.kill()
