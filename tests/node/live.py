"""A real `delayserver serve` process with its HTTP API on a free port, for tests that drive it
from outside (schemathesis, a browser)."""
from __future__ import annotations

import httpx

from tests.conftest import free_port
from tests.procs import ServerProcess, wait_for


def start_http_node(data_dir, secret: str = "", extra_args: tuple[str, ...] = ()) -> tuple[ServerProcess, str]:
    """Start the node and wait until /readyz answers 200; returns it and its HTTP base URL."""
    http_port = free_port()
    env = {"DELAYSERVER_SECRET": secret} if secret else {}
    node = ServerProcess(data_dir, ["--http-listen", f"127.0.0.1:{http_port}", *extra_args], env).start()
    base = f"http://127.0.0.1:{http_port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    if not wait_for(ready, timeout=30):
        node.kill()
        raise RuntimeError(f"the node's HTTP API did not become ready; log: {node.log_text()[-3000:]}")
    return node, base
