"""The data directory records the segment_scale it was written under and refuses another; the
replay checkpoint bounds what recovery may take for a power-loss tail."""
from __future__ import annotations

import subprocess
import sys

import pytest

from delayserver.storage.checkpoint import write_checkpoint
from delayserver.storage.errors import CorruptSegment
from delayserver.storage.record import decode_message
from delayserver.storage.store import REPLAY_CHECKPOINT, LayoutMismatch, Store
from tests.damage import flip_bit, message_record, record_offsets


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


def test_damage_before_the_replay_checkpoint_is_never_cut_as_a_power_loss_tail(tmp_path):
    """Replay checkpoints only what an fsync covered: a bad record before that offset is
    corruption, found when read; it is not mistaken for a power-loss tail and cut with the
    acknowledged records after it."""
    store = Store.open(tmp_path)
    store.message_log.append(b"".join(message_record(i) for i in range(6)))
    store.message_log.sync()
    (path,) = sorted((tmp_path / "message_log").glob("*.log"))
    offsets = record_offsets(path)
    write_checkpoint(store.checkpoint_dir / REPLAY_CHECKPOINT, {"message_log_offset": offsets[4]})
    store.close()
    flip_bit(path, offsets[1] + 20)
    store = Store.open(tmp_path)
    assert store.message_log.end_offset == offsets[-1]
    with pytest.raises(CorruptSegment) as info:
        list(store.message_log.iter_from(0))
    assert info.value.offset == offsets[1]
    assert [decode_message(p).message_id for _, _, p in store.message_log.iter_from(offsets[2])] == \
        ["m-2", "m-3", "m-4", "m-5"]
    store.close()
