"""The real `delayserver serve` process: what its start leaves behind once it serves."""
from __future__ import annotations

import re
import socket
import urllib.request

from delayserver.client import Producer
from tests.procs import ServerProcess


def gc_seconds(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return float(re.search(r"^delayserver_gc_pause_seconds_total (\S+)$", text, re.M).group(1))


def test_garbage_is_collected_again_once_the_process_serves(tmp_path, unused_port):
    """Collection is off from the start of the command until the node serves (delayserver/cli.py),
    and on again after (with the node's thresholds, GC_THRESHOLDS)."""
    server = ServerProcess(tmp_path / "data", args=["--metrics-listen", f"127.0.0.1:{unused_port}"])
    try:
        server.start()
        with Producer(server.address) as producer:
            for i in range(300):
                producer.send("q.gc", b"x" * 100, delay=3_600_000, message_id=f"m-{i}")
        # Requests answered leave little behind; a connection refused for breaking the protocol
        # leaves reference cycles (its task's error and traceback), which only a collection frees.
        host, port = server.address.rsplit(":", 1)
        for _ in range(1000):
            with socket.create_connection((host, int(port)), timeout=10) as peer:
                peer.sendall(b"\xde\xad\xbe\xef" * 8)
                assert peer.recv(4096)  # the ERROR frame, then the server closes
        assert gc_seconds(unused_port) > 0
        assert server.terminate() == 0
    finally:
        server.kill()
