"""Real RabbitMQ and NATS servers on free 127.0.0.1 ports, each in its own directory, for the
benchmarks and the tests: start, stop (graceful), kill (SIGKILL), start again on the same port
with the same data.

RabbitMQ comes from Debian's rabbitmq-server package (the real server script is
/usr/lib/rabbitmq/bin/rabbitmq-server; /usr/sbin's wrapper would switch to the rabbitmq user). Every
instance has its own node name, AMQP port, Erlang distribution port, epmd port, mnesia and log
directories, config file and HOME (for the Erlang cookie), so that it shares nothing with another
instance or a system broker. NATS is Debian's nats-server with JetStream on (`-js -sd DIR`).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import attrs

LOCALHOST = "127.0.0.1"
RABBITMQ_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"
#: The start of an AMQP 0-9-1 connection; a ready broker answers it with a connection.start frame.
AMQP_HEADER = b"AMQP\x00\x00\x09\x01"


def free_port() -> int:
    """A port that was free a moment ago (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        return s.getsockname()[1]


def rabbitmq_installed() -> bool:
    return os.access(RABBITMQ_SERVER, os.X_OK)


def nats_executable() -> str | None:
    return shutil.which("nats-server") or ("/usr/sbin/nats-server" if os.access("/usr/sbin/nats-server", os.X_OK) else None)


def _stop(process: subprocess.Popen, sig: int, timeout: float) -> None:
    if process.poll() is None:
        process.send_signal(sig)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@attrs.define(eq=False)
class RabbitMqProcess:
    """A RabbitMQ node; the user `delay` with password `secret` may use the vhost "/"."""

    directory: Path
    port: int = attrs.field(factory=free_port)
    dist_port: int = attrs.field(factory=free_port)
    epmd_port: int = attrs.field(factory=free_port)
    username: str = "delay"
    password: str = "secret"
    #: (CA file, certificate file, key file) for an AMQPS listener on `tls_port`, or None.
    tls: tuple[Path, Path, Path] | None = None
    tls_port: int = attrs.field(factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{LOCALHOST}:{self.port}"

    @property
    def tls_url(self) -> str:
        return f"amqps://{self.username}:{self.password}@{LOCALHOST}:{self.tls_port}/"

    @property
    def url(self) -> str:
        return f"amqp://{self.username}:{self.password}@{LOCALHOST}:{self.port}/"

    def _env(self) -> dict[str, str]:
        d = self.directory
        return {
            **os.environ,
            "HOME": str(d),
            "RABBITMQ_NODENAME": f"delaytest{self.port}@localhost",
            "RABBITMQ_NODE_IP_ADDRESS": LOCALHOST,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "ERL_EPMD_PORT": str(self.epmd_port),
            "ERL_EPMD_ADDRESS": LOCALHOST,
            "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
            "RABBITMQ_LOG_BASE": str(d / "log"),
            "RABBITMQ_LOGS": str(d / "log" / "rabbit.log"),
            "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(d / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(d / "rabbit.pid"),
        }

    def start(self, timeout: float = 120.0) -> RabbitMqProcess:
        """Start the node; return once it answers AMQP. RuntimeError (with its log) if it does not."""
        assert self.process is None, "rabbitmq-server is already running"
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = {LOCALHOST}:{self.port}\n"
            f"default_user = {self.username}\ndefault_pass = {self.password}\n"
            "disk_free_limit.absolute = 1MB\n"
            + (f"listeners.ssl.default = {LOCALHOST}:{self.tls_port}\nssl_options.cacertfile = {self.tls[0]}\n"
               f"ssl_options.certfile = {self.tls[1]}\nssl_options.keyfile = {self.tls[2]}\n"
               "ssl_options.verify = verify_none\nssl_options.fail_if_no_peer_cert = false\n" if self.tls else "")
        )
        (self.directory / "advanced.config").write_text("[].\n")
        (self.directory / "enabled_plugins").write_text("[].\n")
        with open(self.directory / "server.out", "ab") as out:
            self.process = subprocess.Popen([RABBITMQ_SERVER], env=self._env(), stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self.answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"rabbitmq-server did not start on port {self.port}:\n{self.log_tail()}")
            time.sleep(0.1)
        return self

    def answers(self) -> bool:
        try:
            with socket.create_connection((LOCALHOST, self.port), timeout=1) as s:
                s.sendall(AMQP_HEADER)
                return s.recv(1)[:1] == b"\x01"
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the node gracefully (SIGTERM) and its epmd."""
        self._end(signal.SIGTERM)
        self._kill_epmd()

    def kill(self) -> None:
        """Kill the node at once (SIGKILL to its whole process group): an unclean crash."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self.process = None

    def _end(self, sig: int) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None

    def _kill_epmd(self) -> None:
        epmd = shutil.which("epmd")
        if epmd:
            subprocess.run([epmd, "-kill"], env=self._env(), capture_output=True, timeout=30)

    def persist_definitions(self) -> None:
        """Write the queues, exchanges and bindings declared so far into the node's table files.

        This RabbitMQ keeps them in Mnesia. A durable queue declared just before a kill -9 was
        missing after the restart here (1 of 3 tries with 200,000 messages stored), so a test that
        kills the node first makes its queues survive it, as queues declared long before would."""
        self.ctl("eval", "mnesia:dump_log().")

    def ctl(self, *args: str) -> str:
        """Run rabbitmqctl against this node; its output."""
        return subprocess.run(["/usr/lib/rabbitmq/bin/rabbitmqctl", "-n", f"delaytest{self.port}@localhost", *args],
                              env=self._env(), capture_output=True, text=True, timeout=120, check=True).stdout

    def log_tail(self) -> str:
        text = ""
        for name in ("server.out", "log/rabbit.log"):
            path = self.directory / name
            if path.exists():
                text += path.read_text(errors="replace")[-2000:]
        return text


@attrs.define(eq=False)
class NatsProcess:
    """A nats-server with JetStream, storing in `directory`; optionally with a user and password."""

    executable: str
    directory: Path
    port: int = attrs.field(factory=free_port)
    username: str = ""
    password: str = ""
    extra_args: list[str] = attrs.field(factory=list)
    process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{LOCALHOST}:{self.port}"

    @property
    def url(self) -> str:
        auth = f"{self.username}:{self.password}@" if self.username else ""
        return f"nats://{auth}{LOCALHOST}:{self.port}"

    def start(self, timeout: float = 30.0) -> NatsProcess:
        assert self.process is None, "nats-server is already running"
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [self.executable, "-js", "-sd", str(self.directory / "jetstream"), "-a", LOCALHOST, "-p", str(self.port),
                *self.extra_args]
        if self.username:
            args += ["--user", self.username, "--pass", self.password]
        with open(self.directory / "server.out", "ab") as out:
            self.process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self.answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"nats-server did not start on port {self.port}:\n{self.log_tail()}")
            time.sleep(0.05)
        return self

    def answers(self) -> bool:
        try:
            with socket.create_connection((LOCALHOST, self.port), timeout=1) as s:
                return s.recv(4) == b"INFO"
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None:
            _stop(self.process, signal.SIGTERM, 30)
            self.process = None

    def kill(self) -> None:
        if self.process is not None:
            _stop(self.process, signal.SIGKILL, 30)
            self.process = None

    def log_tail(self) -> str:
        path = self.directory / "server.out"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""
