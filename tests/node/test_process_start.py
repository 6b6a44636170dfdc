"""The real `delayserver serve` process: what its start leaves behind once it serves."""
from __future__ import annotations

import re
import urllib.request

from delayserver.client import Producer
from tests.procs import ServerProcess


def gc_seconds(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return float(re.search(r"^delayserver_gc_pause_seconds_total (\S+)$", text, re.M).group(1))


def test_garbage_is_collected_again_once_the_process_serves(tmp_path, unused_port):
    """Collection is off from the start of the command until the node serves (delayserver/cli.py),
    and on again after."""
    server = ServerProcess(tmp_path / "data", args=["--metrics-listen", f"127.0.0.1:{unused_port}"])
    try:
        server.start()
        with Producer(server.address) as producer:
            for i in range(300):  # each request allocates: young collections follow
                producer.send("q.gc", b"x" * 100, delay=3_600_000, message_id=f"m-{i}")
        assert gc_seconds(unused_port) > 0
        assert server.terminate() == 0
    finally:
        server.kill()
