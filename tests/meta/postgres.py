"""A real PostgreSQL server for tests, from Debian's packages: `initdb` into a fresh directory and
`postgres` on a free 127.0.0.1 port, run as the `postgres` system user when the tests run as root
(PostgreSQL refuses root). `stop()`, `start()` and `kill()` act on the same data directory and port."""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import attrs

from tests.conftest import free_port


def bindir() -> Path | None:
    """The directory of `initdb` and `postgres` (any installed major version), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    try:
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    path = Path(out.strip())
    return path if (path / "postgres").exists() else None


def _run_as() -> list[str]:
    """The command prefix that runs PostgreSQL's programs as a user it accepts."""
    if os.geteuid() != 0:
        return []
    return ["runuser", "-u", "postgres", "--"]


@attrs.define(eq=False)
class PostgresServer:
    bin: Path
    directory: Path
    port: int
    host: str = "127.0.0.1"
    process: subprocess.Popen | None = None

    @property
    def data_dir(self) -> Path:
        return self.directory / "data"

    @property
    def log_path(self) -> Path:
        return self.directory / "postgres.log"

    def url(self, dbname: str = "postgres", port: int | None = None) -> str:
        return f"postgresql://postgres@{self.host}:{port or self.port}/{dbname}"

    @classmethod
    def create(cls) -> PostgresServer:
        pg_bin = bindir()
        directory = Path(tempfile.mkdtemp(prefix="delayserver-pg-"))
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(directory, user.pw_uid, user.pw_gid)
        subprocess.run([*_run_as(), str(pg_bin / "initdb"), "-D", str(directory / "data"), "-U", "postgres",
                        "--auth=trust", "--no-sync", "-E", "UTF8"],
                       check=True, capture_output=True)
        return cls(pg_bin, directory, free_port())

    def start(self, timeout: float = 60.0) -> None:
        assert self.process is None, "postgres is already running"
        log = open(self.log_path, "ab")
        with log:
            self.process = subprocess.Popen(
                [*_run_as(), str(self.bin / "postgres"), "-D", str(self.data_dir), "-p", str(self.port),
                 "-h", self.host, "-k", str(self.directory), "-c", "fsync=off", "-c", "max_connections=50",
                 "-c", "shared_buffers=16MB"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not self.accepts():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"postgres did not start on port {self.port}:\n{self.log_tail()}")
            time.sleep(0.05)

    def accepts(self) -> bool:
        result = subprocess.run([str(self.bin / "pg_isready"), "-q", "-h", self.host, "-p", str(self.port)],
                                capture_output=True)
        return result.returncode == 0

    def stop(self) -> None:
        """A fast shutdown (SIGINT: sessions are ended), waited for."""
        if self.process is None:
            return
        self._signal(signal.SIGINT)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()
        self.process = None

    def kill(self) -> None:
        if self.process is None:
            return
        self._signal(signal.SIGKILL)
        self.process.wait()
        self.process = None

    def _signal(self, sig) -> None:
        # runuser forwards signals to its child; postgres's own children follow their postmaster.
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def remove(self) -> None:
        self.kill()
        shutil.rmtree(self.directory, ignore_errors=True)


def tcp_accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False
