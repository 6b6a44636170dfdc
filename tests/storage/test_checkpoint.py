"""Checkpoints: atomic replacement (a crash leaves the old document whole) and damage detection."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from delayserver.storage.checkpoint import CorruptCheckpoint, read_checkpoint, remove_stale_temp_files, write_checkpoint
from tests.damage import flip_bit, truncate

OLD = {"message_log_offset": 100, "schedule_sizes": {"202611221600": 4096}, "max_sequence": 7}
NEW = {"message_log_offset": 200, "schedule_sizes": {"202611221600": 8192}, "max_sequence": 9}


def test_checkpoint_round_trips_and_a_missing_one_reads_as_none(tmp_path):
    path = tmp_path / "replay.json"
    assert read_checkpoint(path) is None
    write_checkpoint(path, OLD)
    assert read_checkpoint(path) == OLD
    write_checkpoint(path, NEW)
    assert read_checkpoint(path) == NEW
    assert sorted(p.name for p in tmp_path.iterdir()) == ["replay.json"]


def test_crash_between_temp_write_and_rename_leaves_the_old_document(tmp_path):
    path = tmp_path / "replay.json"
    write_checkpoint(path, OLD)
    # What the crash leaves: a whole (or partial) temp file next to the untouched old one.
    (tmp_path / "replay.json.tmp").write_bytes(b'{"crc32c": 1, "da')
    assert read_checkpoint(path) == OLD
    write_checkpoint(path, NEW)
    assert read_checkpoint(path) == NEW
    remove_stale_temp_files(tmp_path)  # what opening the data directory does
    assert sorted(p.name for p in tmp_path.iterdir()) == ["replay.json"]


def test_process_killed_before_the_rename_leaves_the_old_document(tmp_path):
    path = tmp_path / "replay.json"
    write_checkpoint(path, OLD)
    script = (
        "import sys\n"
        "from delayserver.storage.checkpoint import write_checkpoint\n"
        f"write_checkpoint(sys.argv[1], {NEW!r})\n"
    )
    env = dict(os.environ, DELAYSERVER_FAILPOINT="checkpoint-before-rename")
    proc = subprocess.run([sys.executable, "-c", script, str(path)], env=env, timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert len(list(tmp_path.glob(".replay.json.*.tmp"))) == 1
    assert read_checkpoint(path) == OLD


@pytest.mark.parametrize("damage", ["truncated", "bit_flip_in_value", "bit_flip_in_crc", "empty", "not_json", "no_crc"])
def test_damaged_checkpoint_raises_corrupt_checkpoint(tmp_path, damage):
    path = tmp_path / "replay.json"
    write_checkpoint(path, OLD)
    raw = path.read_bytes()
    if damage == "truncated":
        truncate(path, len(raw) // 2)
    elif damage == "bit_flip_in_value":
        flip_bit(path, raw.index(b"4096"), bit=0)  # 4096 -> 5096: still JSON, wrong crc
    elif damage == "bit_flip_in_crc":
        flip_bit(path, raw.index(b'"crc32c": ') + len(b'"crc32c": '), bit=0)
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "not_json":
        path.write_bytes(b"\x00\x01binary")
    else:
        path.write_bytes(b'{"data": {"message_log_offset": 1}}')
    with pytest.raises(CorruptCheckpoint) as info:
        read_checkpoint(path)
    assert info.value.path == path and str(path) in str(info.value)
