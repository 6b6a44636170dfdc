"""Fixtures that start real services on free 127.0.0.1 ports and stop them at teardown.

- `redis_server`: a real redis-server process (RedisServer: host, port, address, url, stop(), start()).
- `webhook_server`: a real HTTP server in a thread (WebhookServer: url, batches, request_headers,
  respond(...)).
- `unused_port`: a 127.0.0.1 port with nothing listening (connections are refused).
- `silent_server`: a 127.0.0.1 "host:port" that accepts connections and never answers.
"""
from __future__ import annotations

import http.server
import json
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import pytest

LOCALHOST = "127.0.0.1"


def free_port() -> int:
    """A port that was free a moment ago (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        return s.getsockname()[1]


@pytest.fixture
def unused_port() -> int:
    return free_port()


@pytest.fixture
def silent_server():
    """The "host:port" of a socket that listens but never accepts: connects succeed, no reply ever comes."""
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        s.listen(16)
        yield f"{LOCALHOST}:{s.getsockname()[1]}"


# --- redis -------------------------------------------------------------------------------------


@attrs.define(eq=False)
class RedisServer:
    """A redis-server child process; `stop()` and `start()` take it down and bring it back on the same port."""

    executable: str
    directory: Path
    port: int
    host: str = LOCALHOST
    process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        """Start the server and return once it answers PING; RuntimeError (with its log) if it does not."""
        assert self.process is None, "redis-server is already running"
        log = open(self.directory / "redis.log", "ab")
        with log:
            self.process = subprocess.Popen(
                [self.executable, "--save", "", "--appendonly", "no", "--port", str(self.port),
                 "--bind", self.host, "--dir", str(self.directory)],
                stdout=log, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while not self._answers_ping():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}:\n{self.log_tail()}")
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s) and wait for it to exit."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def log_tail(self) -> str:
        return (self.directory / "redis.log").read_text(errors="replace")[-2000:]

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False


@pytest.fixture
def redis_server(tmp_path_factory):
    executable = shutil.which("redis-server") or ("/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None)
    if executable is None:
        pytest.skip("redis-server is not installed (ops/test installs it)")
    directory = tmp_path_factory.mktemp("redis")
    # A port picked free can be taken before redis binds it; a fresh one is tried then.
    for attempt in range(3):
        server = RedisServer(executable, directory, free_port())
        try:
            server.start()
            break
        except RuntimeError:
            if attempt == 2:
                raise
    try:
        yield server
    finally:
        server.stop()


# --- webhook -----------------------------------------------------------------------------------


@attrs.define(eq=False)
class WebhookServer:
    """A real HTTP server recording each POSTed batch and answering as `respond` last said."""

    url: str = ""
    batches: list[Any] = attrs.field(factory=list)
    request_headers: list[dict[str, str]] = attrs.field(factory=list)
    status: int = 200
    body: Any = None
    delay_ms: int = 0
    closing: threading.Event = attrs.field(factory=threading.Event)

    def respond(self, status: int = 200, body: Any = None, delay_ms: int = 0) -> None:
        """Answer later requests with `status` after `delay_ms`. `body` is None (empty), bytes (as is),
        a JSON-able value, or a callable taking the received batch and returning one of those."""
        self.status, self.body, self.delay_ms = status, body, delay_ms

    def answer(self, batch: Any) -> tuple[int, bytes]:
        body = self.body(batch) if callable(self.body) else self.body
        if body is None:
            return self.status, b""
        if isinstance(body, bytes):
            return self.status, body
        return self.status, json.dumps(body).encode()


def _webhook_handler(webhook: WebhookServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                batch = json.loads(raw)
            except ValueError:
                batch = raw
            webhook.batches.append(batch)
            webhook.request_headers.append(dict(self.headers))
            if webhook.delay_ms:
                webhook.closing.wait(webhook.delay_ms / 1000)
            status, body = webhook.answer(batch)
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except OSError:
                pass  # the client gave up (a timeout test); there is no one to answer

        def log_message(self, *args) -> None:
            pass

    return Handler


@pytest.fixture
def webhook_server():
    webhook = WebhookServer()
    httpd = http.server.ThreadingHTTPServer((LOCALHOST, 0), _webhook_handler(webhook))
    httpd.daemon_threads = True
    webhook.url = f"http://{LOCALHOST}:{httpd.server_address[1]}/hook"
    # A short poll interval keeps shutdown() at teardown from waiting half a second.
    thread = threading.Thread(target=httpd.serve_forever, args=(0.01,), name="webhook_server", daemon=True)
    thread.start()
    try:
        yield webhook
    finally:
        webhook.closing.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join()
