"""delayctl inspect / verify / buckets, run as subprocesses on data directories written by the
storage code, healthy and damaged: their output and exit codes (0 ok, 1 damaged, 2 usage)."""
from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
from pathlib import Path

import crc32c
import pytest

from delayserver.ctl.progress import Progress
from delayserver.storage.buckets import DEFAULT_SCALE_MS, bucket_name, bucket_start, parse_bucket_name
from delayserver.storage.checkpoint import read_checkpoint, write_checkpoint
from delayserver.storage.record import (
    Cancel, Dispatch, RecordType, encode_cancel, encode_delivered, encode_dispatch, encode_message,
    encode_parked, encode_record, encode_scheduled,
)
from delayserver.storage.segment import Segment
from delayserver.storage.store import Store
from tests.damage import flip_bit, message, record_offsets, truncate, zero_fill

B0 = parse_bucket_name("202611221600")
MESSAGES = 12
#: Which messages are dispatched and which cancelled, per bucket (messages alternate buckets).
DISPATCHED = {0, 1, 2, 5}
CANCELLED = {4, 7}


def delayctl(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "delayserver.ctl", *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture
def data_dir(tmp_path):
    """A stopped node's data directory: MESSAGES messages over two buckets, replayed (as the
    replayer does it) and checkpointed, some dispatched, some cancelled, message_log in tiny
    segments."""
    root = tmp_path / "data"
    store = Store.open(root, message_log_segment_bytes=300)
    for i in range(MESSAGES):
        m = message(i, schedule_time=B0 + (i % 2) * DEFAULT_SCALE_MS + i * 1000)
        payload = encode_message(m)
        offset = store.message_log.append(encode_record(RecordType.MESSAGE, payload))
        bucket = bucket_start(m.schedule_time, DEFAULT_SCALE_MS)
        at = store.schedule_log.append(bucket, encode_record(RecordType.SCHEDULED, encode_scheduled(offset, payload)))
        if i in DISPATCHED:
            dispatch = Dispatch(at, m.schedule_time + 3, "group-a")
            store.dispatch_log.append(bucket, encode_record(RecordType.DISPATCH, encode_dispatch(dispatch)))
    for i in CANCELLED:
        m = message(i, schedule_time=B0 + (i % 2) * DEFAULT_SCALE_MS + i * 1000)
        cancel = encode_cancel(Cancel(m.message_id, m.schedule_time))
        offset = store.message_log.append(encode_record(RecordType.CANCEL, cancel))
        bucket = bucket_start(m.schedule_time, DEFAULT_SCALE_MS)
        store.schedule_log.append(bucket, encode_record(RecordType.SCHEDULED_CANCEL, encode_scheduled(offset, cancel)))
    store.message_log.sync()
    store.schedule_log.sync()
    store.dispatch_log.sync()
    write_checkpoint(store.checkpoint_dir / "replay.json", {
        "message_log_offset": store.message_log.end_offset,
        "schedule_sizes": {bucket_name(b): store.schedule_log.size(b) for b in store.schedule_log.buckets()},
        "max_sequence": MESSAGES - 1,
    })
    store.close()
    return root


def message_segments(root: Path) -> list[Path]:
    return sorted((root / "message_log").glob("*.log"))


def schedule_segment(root: Path, bucket: int = B0) -> Path:
    return root / "schedule_log" / f"{bucket_name(bucket)}.log"


def dispatch_segment(root: Path, bucket: int = B0) -> Path:
    return root / "dispatch_log" / f"{bucket_name(bucket)}.log"


def snapshot(root: Path) -> dict:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


# --- inspect ----------------------------------------------------------------------------------


def test_inspect_decodes_a_message_log_segment_as_json_lines(data_dir):
    path = message_segments(data_dir)[0]
    result = delayctl("inspect", path, "--json")
    assert result.returncode == 0, result.stderr
    rows = json_lines(result.stdout)
    assert [r["offset"] for r in rows] == record_offsets(path)[:-1]
    first = message(0, schedule_time=B0)
    assert rows[0]["type"] == "MESSAGE"
    assert {k: rows[0][k] for k in ("message_id", "subject", "schedule_time", "sequence", "headers")} == {
        "message_id": first.message_id, "subject": first.subject, "schedule_time": first.schedule_time,
        "sequence": first.sequence, "headers": dict(first.headers),
    }
    assert rows[0]["body_size"] == len(first.body) and rows[0]["body_crc32c"] == crc32c.crc32c(first.body)
    assert "body" not in rows[0]


def test_inspect_shows_bodies_in_base64_when_asked(data_dir):
    rows = json_lines(delayctl("inspect", schedule_segment(data_dir), "--json", "--bodies").stdout)
    scheduled = [r for r in rows if r["type"] == "SCHEDULED"]
    assert [base64.b64decode(r["body"]) for r in scheduled] == [
        message(i).body for i in range(0, MESSAGES, 2)
    ]
    assert all("message_log_offset" in r for r in rows)
    assert {r["type"] for r in rows} == {"SCHEDULED", "SCHEDULED_CANCEL"}


def test_inspect_prints_a_table_for_people(data_dir):
    result = delayctl("inspect", schedule_segment(data_dir))
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{schedule_segment(data_dir)}: schedule_log segment")
    assert lines[1].split() == ["OFFSET", "TYPE", "FIELDS"]
    assert "schedule_time=2026-11-22T16:00:00.000Z" in lines[2] and 'message_id="m-0"' in lines[2]
    assert lines[-1] == f"{len(record_offsets(schedule_segment(data_dir))) - 1} records"


def test_inspect_decodes_dispatch_spool_and_parked_segments(data_dir, tmp_path):
    rows = json_lines(delayctl("inspect", dispatch_segment(data_dir), "--json").stdout)
    assert [(r["type"], r["broker_group"]) for r in rows] == [("DISPATCH", "group-a")] * expected_counts(0)["dispatched"]
    payload = encode_message(message(1))
    spool = Segment.open(tmp_path / "spool.log")
    spool.append(encode_record(RecordType.DELIVERED, encode_delivered(B0 + 9, 2, payload)))
    spool.close()
    parked = Segment.open(tmp_path / "parked.log")
    parked.append(encode_record(RecordType.PARKED, encode_parked(B0 + 9, 16, 512, "rejected", encode_scheduled(77, payload))))
    parked.close()
    result = delayctl("inspect", tmp_path / "spool.log")
    assert result.stdout.startswith(f"{tmp_path / 'spool.log'}: spool segment") and "attempt=2" in result.stdout
    [row] = json_lines(delayctl("inspect", tmp_path / "parked.log", "--json").stdout)
    assert (row["type"], row["reason"], row["schedule_offset"], row["message_log_offset"], row["message_id"]) == (
        "PARKED", "rejected", 512, 77, "m-1")


def test_inspect_decodes_a_checkpoint(data_dir):
    path = data_dir / "checkpoint" / "replay.json"
    [doc] = json_lines(delayctl("inspect", path, "--json").stdout)
    assert doc == read_checkpoint(path)
    table = delayctl("inspect", path)
    assert table.returncode == 0 and "message_log_offset" in table.stdout


def test_inspect_of_a_damaged_checkpoint_exits_1(data_dir):
    path = data_dir / "checkpoint" / "replay.json"
    flip_bit(path, path.read_bytes().index(b"max_sequence") + 2)
    result = delayctl("inspect", path)
    assert result.returncode == 1 and str(path) in result.stderr and "corrupt checkpoint" in result.stderr


def test_inspect_prints_the_records_before_corruption_then_the_error(data_dir):
    path = schedule_segment(data_dir)
    offsets = record_offsets(path)
    flip_bit(path, offsets[3] + 20)
    result = delayctl("inspect", path, "--json")
    assert result.returncode == 1
    assert [r["offset"] for r in json_lines(result.stdout)] == offsets[:3]
    assert f"{path}: corrupt record at offset {offsets[3]}" in result.stderr


def test_inspect_reports_a_torn_tail_with_file_and_offset(data_dir):
    path = message_segments(data_dir)[-1]
    offsets = record_offsets(path)
    truncate(path, offsets[-1] - 3)
    result = delayctl("inspect", path, "--json")
    assert result.returncode == 1
    assert [r["offset"] for r in json_lines(result.stdout)] == offsets[:-2]
    assert f"{path}: torn tail at offset {offsets[-2]}" in result.stderr


def test_inspect_of_a_missing_file_fails(tmp_path):
    result = delayctl("inspect", tmp_path / "nothing.log")
    assert result.returncode == 1 and "nothing.log" in result.stderr


# --- verify -----------------------------------------------------------------------------------


def summary(stdout: str) -> dict[str, tuple[int, ...]]:
    """`message_log 3 segments 12 records 900 bytes` -> {"message_log": (3, 12, 900)}."""
    out = {}
    for line in stdout.splitlines():
        words = line.split()
        if words and words[0] in ("message_log", "schedule_log", "dispatch_log"):
            out[words[0]] = (int(words[1]), int(words[3]), int(words[5]))
    return out


def test_verify_of_a_healthy_data_dir_exits_0_with_a_summary_per_log(data_dir):
    result = delayctl("verify", data_dir)
    assert result.returncode == 0, result.stdout
    segments = message_segments(data_dir)
    assert summary(result.stdout) == {
        "message_log": (len(segments), MESSAGES + len(CANCELLED), sum(p.stat().st_size for p in segments)),
        "schedule_log": (2, MESSAGES + len(CANCELLED), sum(p.stat().st_size for p in (data_dir / "schedule_log").iterdir())),
        "dispatch_log": (2, len(DISPATCHED), sum(p.stat().st_size for p in (data_dir / "dispatch_log").iterdir())),
    }
    assert result.stdout.splitlines()[-1] == f"{data_dir}: healthy"
    assert "\r" not in result.stderr, "no progress bar when stderr is not a terminal"


@pytest.mark.parametrize("what", ["missing", "empty", "file"])
def test_verify_of_what_is_no_data_directory_is_a_usage_error_exit_2(tmp_path, what):
    path = tmp_path / "node"
    if what == "empty":
        path.mkdir()
    elif what == "file":
        path.write_text("x")
    result = delayctl("verify", path)
    assert result.returncode == 2 and str(path) in result.stderr
    assert ("not a directory" if what != "empty" else "not a data directory") in result.stderr


@pytest.mark.parametrize("where", ["message_log", "schedule_log", "dispatch_log"])
def test_verify_reports_a_torn_tail_as_a_warning_and_exits_0(data_dir, where):
    path = {"message_log": message_segments(data_dir)[-1], "schedule_log": schedule_segment(data_dir, B0 + DEFAULT_SCALE_MS),
            "dispatch_log": dispatch_segment(data_dir)}[where]
    end = path.stat().st_size
    zero_fill(path, end, 512)
    before = snapshot(data_dir)
    result = delayctl("verify", data_dir)
    assert result.returncode == 0, result.stdout
    assert (f"warning: {path}: torn tail at offset {end}: 512 bytes (unknown record type 0) "
            "(will be truncated at next start)") in result.stdout
    assert result.stdout.splitlines()[-1] == f"{data_dir}: healthy, 1 warning(s)"
    assert snapshot(data_dir) == before, "verify never writes"


def test_verify_reports_a_torn_last_record_of_the_active_segment(data_dir):
    path = message_segments(data_dir)[-1]
    offsets = record_offsets(path)
    truncate(path, offsets[-1] - 1)
    result = delayctl("verify", data_dir)
    # The checkpoint says replay reached the old end, which is now in the torn tail.
    assert f"{path}: torn tail at offset {offsets[-2]}" in result.stdout
    assert "replay.json: message_log offset" in result.stdout and "past the end of message_log" in result.stdout
    assert result.returncode == 1


def test_verify_of_a_bit_flip_in_a_sealed_segment_exits_1_naming_file_and_offset(data_dir):
    path = message_segments(data_dir)[1]
    offsets = record_offsets(path)
    flip_bit(path, offsets[-1] - 1)  # the last record of a sealed segment: corruption, not a torn tail
    result = delayctl("verify", data_dir)
    assert result.returncode == 1
    assert f"damage: {path}: corrupt record at offset {offsets[-2]}" in result.stdout
    assert result.stdout.splitlines()[-1].startswith(f"{data_dir}: DAMAGED")


def test_verify_of_a_truncated_sealed_segment_exits_1(data_dir):
    path = message_segments(data_dir)[0]
    truncate(path, record_offsets(path)[-2])
    result = delayctl("verify", data_dir)
    assert result.returncode == 1
    assert f"damage: {path}: sealed segment ends at offset" in result.stdout


def test_verify_of_corruption_inside_a_schedule_segment_exits_1(data_dir):
    path = schedule_segment(data_dir)
    offsets = record_offsets(path)
    zero_fill(path, offsets[1], offsets[2] - offsets[1])
    result = delayctl("verify", data_dir)
    assert result.returncode == 1
    assert f"damage: {path}: corrupt record at offset {offsets[1]}" in result.stdout


@pytest.mark.parametrize("change, expected", [
    ({"message_log_offset": 10**9}, "past the end of message_log"),
    ({"message_log_offset": 5}, "not at a record boundary"),
    ({"schedule_sizes": {"202611221600": 10**6}}, "past its"),
    ({"schedule_sizes": {"202611221600": 7}}, "not at a record boundary"),
    ({"message_log_offset": "12"}, "not a replay checkpoint"),
    ({"schedule_sizes": {"202611221600": -1}}, "not a replay checkpoint"),
])
def test_verify_of_a_checkpoint_pointing_outside_the_logs_exits_1(data_dir, change, expected):
    path = data_dir / "checkpoint" / "replay.json"
    write_checkpoint(path, {**read_checkpoint(path), **change})
    result = delayctl("verify", data_dir)
    assert result.returncode == 1 and expected in result.stdout and str(path) in result.stdout


def test_verify_of_a_damaged_checkpoint_exits_1(data_dir):
    path = data_dir / "checkpoint" / "replay.json"
    truncate(path, 10)
    result = delayctl("verify", data_dir)
    assert result.returncode == 1 and f"damage: {path}: corrupt checkpoint" in result.stdout


def test_verify_warns_of_a_temp_file_left_by_a_crash(data_dir):
    (data_dir / "checkpoint" / "replay.json.tmp").write_bytes(b'{"crc32c": 1')
    result = delayctl("verify", data_dir)
    assert result.returncode == 0 and "replay.json.tmp: left by an interrupted checkpoint write" in result.stdout


def test_verify_of_a_dispatch_naming_no_scheduled_message_exits_1(data_dir):
    store = Store.open(data_dir)
    store.dispatch_log.append(B0, encode_record(RecordType.DISPATCH, encode_dispatch(Dispatch(3, B0, "group-a"))))
    store.close()
    result = delayctl("verify", data_dir)
    assert result.returncode == 1 and "names schedule_log offset 3, which is not a scheduled message" in result.stdout


# --- buckets ----------------------------------------------------------------------------------


def expected_counts(parity: int) -> dict:
    ids = {i for i in range(MESSAGES) if i % 2 == parity}
    dispatched = len(ids & DISPATCHED)
    cancelled = len((ids & CANCELLED) - DISPATCHED)
    return {"scheduled": len(ids), "dispatched": dispatched, "cancelled": cancelled,
            "pending": len(ids) - dispatched - cancelled, "duplicate_dispatches": 0}


def test_buckets_counts_each_bucket_and_the_totals(data_dir):
    result = delayctl("buckets", data_dir, "--json")
    assert result.returncode == 0, result.stderr
    rows = json_lines(result.stdout)
    first, second = expected_counts(0), expected_counts(1)
    assert rows == [
        {"bucket": "202611221600", **first},
        {"bucket": "202611221700", **second},
        {"bucket": "total", **{k: first[k] + second[k] for k in first}},
    ]
    table = delayctl("buckets", data_dir).stdout.splitlines()
    assert table[0].split() == ["BUCKET", "SCHEDULED", "DISPATCHED", "CANCELLED", "PENDING", "DUPLICATES"]
    assert table[1].split() == ["202611221600", *map(str, first.values())]
    assert table[-1].split()[0] == "total"


def test_buckets_counts_up_to_a_torn_tail_without_truncating_it(data_dir):
    path = dispatch_segment(data_dir)
    offsets = record_offsets(path)
    truncate(path, offsets[-1] - 2)  # the last dispatch record is torn: that message is pending again
    before = snapshot(data_dir)
    result = delayctl("buckets", data_dir, "--json")
    assert result.returncode == 0
    row = json_lines(result.stdout)[0]
    assert (row["dispatched"], row["pending"]) == (expected_counts(0)["dispatched"] - 1, expected_counts(0)["pending"] + 1)
    assert "torn tail" in result.stderr and str(path) in result.stderr
    assert snapshot(data_dir) == before


def test_buckets_reports_a_corrupt_bucket_and_exits_1(data_dir):
    path = schedule_segment(data_dir)
    flip_bit(path, record_offsets(path)[0] + 30)
    result = delayctl("buckets", data_dir, "--json")
    assert result.returncode == 1
    assert [r["bucket"] for r in json_lines(result.stdout)] == ["202611221700", "total"]
    assert f"{path}: corrupt record at offset 0" in result.stderr


# --- the command line -------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [[], ["frobnicate"], ["inspect"], ["buckets", "x", "--nope"]])
def test_usage_errors_exit_2(argv):
    result = delayctl(*argv)
    assert result.returncode == 2 and "usage: delayctl" in result.stderr


def test_the_console_script_runs():
    script = Path(sys.executable).with_name("delayctl")
    if not script.exists():
        pytest.skip("delayctl is not installed in this environment")
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert all(name in result.stdout for name in ("inspect", "verify", "buckets"))


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_is_drawn_on_a_terminal_and_cleared():
    stream = FakeTerminal()
    with Progress(200, "scan", stream=stream) as progress:
        progress.advance(100)
    assert "[###############               ]  50% scan" in stream.getvalue()
    assert stream.getvalue().endswith("\r\x1b[K")


def test_progress_bar_is_silent_when_piped():
    stream = io.StringIO()
    with Progress(200, "scan", stream=stream) as progress:
        progress.advance(200)
    assert stream.getvalue() == ""
