"""Real processes of the meta tier for end-to-end tests: meta servers over a shared PostgreSQL
store, and the TCP proxy that partitions one of them from the database."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import attrs

from tests.procs import wait_for

LISTENING = re.compile(r"meta server listening on 127\.0\.0\.1:(\d+)")


@attrs.define(eq=False)
class SharedMetaProcess:
    """`delayserver meta --store URL ...` on 127.0.0.1; `start(port)` brings it back on its port."""

    name: str
    log_dir: Path
    args: list[str]
    env: dict = attrs.field(factory=dict)
    process: subprocess.Popen | None = None
    port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.meta.log"

    def start(self, port: int = 0, timeout: float = 60.0) -> SharedMetaProcess:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "delayserver", "meta", "--listen", f"127.0.0.1:{port}", *self.args],
                stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, **self.env},
            )

        def listening():
            if self.process.poll() is not None:
                raise AssertionError(f"meta server {self.name} exited {self.process.returncode}: {self.log()[-3000:]}")
            return LISTENING.search(self.log()[offset:])

        match = wait_for(listening, timeout)
        assert match, f"meta server {self.name} did not start: {self.log()[-3000:]}"
        self.port = int(match.group(1))
        return self

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@attrs.define(eq=False)
class ProxyProcess:
    """`tests.meta.tcp_proxy` forwarding to `target`; `cut()` and `stall()` partition (by reset, by
    silence), `heal()` ends either."""

    target: str
    process: subprocess.Popen | None = None
    port: int = 0

    def start(self) -> ProxyProcess:
        root = Path(__file__).resolve().parents[2]
        self.process = subprocess.Popen([sys.executable, "-m", "tests.meta.tcp_proxy", self.target],
                                        stdout=subprocess.PIPE, cwd=root, text=True)
        line = self.process.stdout.readline()
        match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        assert match, f"the proxy did not start: {line!r}"
        self.port = int(match.group(1))
        return self

    def cut(self) -> None:
        self.process.send_signal(signal.SIGUSR1)
        assert self.process.stdout.readline().strip() == "cut"

    def stall(self) -> None:
        self.process.send_signal(signal.SIGHUP)
        assert self.process.stdout.readline().strip() == "stalled"

    def heal(self) -> None:
        self.process.send_signal(signal.SIGUSR2)
        assert self.process.stdout.readline().strip() == "healed"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
