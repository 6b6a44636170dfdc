"""The replay checkpoint is written as often as `checkpoint_interval_ms` says, in the real process."""
from __future__ import annotations

import time

from delayserver.client import Producer
from tests.procs import ServerProcess


def test_checkpoint_interval_ms_from_the_config_sets_how_often_replay_checkpoints(tmp_path):
    config = tmp_path / "server.toml"
    config.write_text("checkpoint_interval_ms = 100\n")
    proc = ServerProcess(tmp_path / "data", args=["--config", str(config)]).start()
    try:
        checkpoint = tmp_path / "data" / "checkpoint" / "replay.json"
        writes, deadline = set(), time.monotonic() + 1.5
        with Producer(proc.address) as producer:
            while time.monotonic() < deadline:
                producer.send("checkpoint.interval", b"x", delay=60_000)
                if checkpoint.exists():
                    writes.add(checkpoint.stat().st_mtime_ns)
        # Every 100 ms under steady sends: about 15; the default of 1000 ms would give 1 or 2.
        assert len(writes) >= 6, f"{len(writes)} checkpoint writes in 1.5 s"
    finally:
        proc.kill()
