"""The data directory records the segment_scale it was written under and refuses another."""
from __future__ import annotations

import subprocess
import sys

import pytest

from delayserver.storage.store import LayoutMismatch, Store


def test_a_data_directory_keeps_its_segment_scale(tmp_path):
    Store.open(tmp_path, segment_scale_ms=60_000).close()
    Store.open(tmp_path, segment_scale_ms=60_000).close()  # the same scale: fine
    with pytest.raises(LayoutMismatch, match=r'segment_scale = 1m.*configured with 60m.*segment_scale = "1m"'):
        Store.open(tmp_path, segment_scale_ms=3_600_000)


def test_the_node_refuses_to_start_under_another_segment_scale_with_exit_2(tmp_path):
    data = tmp_path / "data"
    Store.open(data, segment_scale_ms=5 * 60_000).close()
    config = tmp_path / "node.toml"
    config.write_text(f'data_dir = "{data}"\nlisten = "127.0.0.1:0"\nsegment_scale = "1h"\n')
    done = subprocess.run([sys.executable, "-m", "delayserver", "serve", "--config", str(config)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "written with segment_scale = 5m" in done.stderr and "configured with 60m" in done.stderr
    assert not (data / "schedule_log").exists() or not any((data / "schedule_log").iterdir())
