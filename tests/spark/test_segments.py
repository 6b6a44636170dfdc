"""The data sources' worker side without Spark: finding segment files, decoding them into rows,
and damage reported in a row, never skipped. Also the reconcile CLI's checks made before Spark."""
from __future__ import annotations

import pytest

from delayserver.spark import cli
from delayserver.spark.segments import (
    COLUMNS, CORRUPT, DISPATCH_LOG, SCHEDULE_LOG, TORN_TAIL, NotADataDirectory, SegmentFile, parse_data_dirs,
    read_segment, segment_files,
)
from delayserver.storage.buckets import bucket_name
from delayserver.storage.record import (
    Dispatch, Message, RecordType, encode_dispatch, encode_message, encode_record,
)
from delayserver.storage.store import Store
from tests.damage import flip_bit, record_offsets, truncate
from tests.pipeline_node import GROUP, SCALE_MS, START_MS, Node

T = START_MS + 1_000
BUCKET = bucket_name(T - T % SCALE_MS)


def node_with(root, count: int, *, dispatched: int = 0, cancel: str | None = None) -> Node:
    """`count` messages m-0.. due at T + i, a cancel of `cancel` after them, the first
    `dispatched` delivered at T + 500; the files are left as a stopped node leaves them."""
    node = Node(root, START_MS)
    node.send([(f"m-{i}", T + i) for i in range(count)])
    if cancel is not None:
        node.cancel(cancel, T + int(cancel[2:]))
    node.replay_all()
    node.now = T + 500
    node.tick()
    node.dispatch(node.take()[:dispatched])
    node.crash()
    return node


def segment(root, log: str = SCHEDULE_LOG) -> SegmentFile:
    return SegmentFile(str(root), log, BUCKET, str(root / log / f"{BUCKET}.log"))


def test_scheduled_and_cancel_records_become_rows_with_every_field(tmp_path):
    node = node_with(tmp_path, 2, cancel="m-1")
    rows = list(read_segment(segment(tmp_path)))
    assert all(len(r) == len(COLUMNS[SCHEDULE_LOG]) - 3 for r in rows)
    offsets = record_offsets(tmp_path / SCHEDULE_LOG / f"{BUCKET}.log")
    assert [r[:2] for r in rows] == [(offsets[0], "SCHEDULED"), (offsets[1], "SCHEDULED"),
                                     (offsets[2], "SCHEDULED_CANCEL")]
    _, _, mlo, store_time, sched, seq, flags, mid, subject, headers, body_size, error = rows[1]
    assert (store_time, sched, seq, flags, mid, subject, headers, body_size, error) == (
        START_MS, T + 1, 2, 0, "m-1", "orders.created", {}, 1, None)
    assert mlo > 0
    cancel = rows[2]
    assert cancel[4:8] == (T + 1, 3, None, "m-1") and cancel[8:] == (None, None, None, None)
    assert node.store.message_log.end_offset > cancel[2] > mlo


def test_headers_and_body_size_are_read(tmp_path):
    store = Store.open(tmp_path, segment_scale_ms=SCALE_MS)
    message = Message("h-1", "orders.paid", b"x" * 300, T, {"trace": "abc", "k": "v"})
    payload = encode_record(RecordType.SCHEDULED, (7).to_bytes(8, "big") + encode_message(message))
    store.schedule_log.append(T - T % SCALE_MS, payload)
    store.close()
    [row] = read_segment(segment(tmp_path))
    assert row[2] == 7 and row[7:11] == ("h-1", "orders.paid", {"trace": "abc", "k": "v"}, 300)


def test_dispatch_records_become_rows(tmp_path):
    node_with(tmp_path, 3, dispatched=2)
    schedule = [r[0] for r in read_segment(segment(tmp_path))]
    rows = list(read_segment(segment(tmp_path, DISPATCH_LOG)))
    assert [r[1:] for r in rows] == [("DISPATCH", schedule[0], T + 500, GROUP, None),
                                     ("DISPATCH", schedule[1], T + 500, GROUP, None)]


def test_a_torn_tail_yields_the_valid_rows_then_a_torn_tail_row(tmp_path):
    node_with(tmp_path, 3)
    path = tmp_path / SCHEDULE_LOG / f"{BUCKET}.log"
    offsets = record_offsets(path)
    truncate(path, offsets[-1] - 5)
    rows = list(read_segment(segment(tmp_path)))
    assert [r[1] for r in rows] == ["SCHEDULED", "SCHEDULED", TORN_TAIL]
    assert rows[-1][0] == offsets[2]
    assert str(path) in rows[-1][-1] and "torn tail" in rows[-1][-1]


def test_corruption_yields_the_rows_before_it_then_a_corrupt_row_naming_file_and_offset(tmp_path):
    node_with(tmp_path, 4)
    path = tmp_path / SCHEDULE_LOG / f"{BUCKET}.log"
    offsets = record_offsets(path)
    flip_bit(path, offsets[1] + 30)
    rows = list(read_segment(segment(tmp_path)))
    assert [r[1] for r in rows] == ["SCHEDULED", CORRUPT]
    assert rows[1][0] == offsets[1]
    assert f"{path}: corrupt record at offset {offsets[1]}" in rows[1][-1]


def test_a_sound_record_that_does_not_decode_is_corruption(tmp_path):
    store = Store.open(tmp_path, segment_scale_ms=SCALE_MS)
    good = encode_record(RecordType.DISPATCH, encode_dispatch(Dispatch(0, T, GROUP)))
    store.dispatch_log.append(T - T % SCALE_MS, good + encode_record(RecordType.DISPATCH, b"\0" * 30) + good)
    store.close()
    rows = list(read_segment(segment(tmp_path, DISPATCH_LOG)))
    assert [r[:2] for r in rows] == [(0, "DISPATCH"), (len(good), CORRUPT)]
    assert "DISPATCH payload does not decode" in rows[1][-1]


def test_a_record_of_another_log_is_corruption(tmp_path):
    store = Store.open(tmp_path, segment_scale_ms=SCALE_MS)
    dispatch = encode_record(RecordType.DISPATCH, encode_dispatch(Dispatch(0, T, GROUP)))
    store.schedule_log.append(T - T % SCALE_MS, dispatch)
    store.close()
    [row] = read_segment(segment(tmp_path))
    assert row[:2] == (0, CORRUPT) and "a DISPATCH record does not belong in this log" in row[-1]


def test_segment_files_are_listed_by_data_directory_then_bucket(tmp_path):
    a, b, empty = tmp_path / "a", tmp_path / "b", tmp_path / "empty"
    node_with(a, 1)
    node = Node(b, START_MS)
    node.send([("x", T + SCALE_MS), ("y", T)])
    node.replay_all()
    node.crash()
    Store.open(empty).close()
    (b / SCHEDULE_LOG / "notes.log").write_text("not a segment")
    later = bucket_name(T + SCALE_MS - (T + SCALE_MS) % SCALE_MS)
    found = segment_files([str(b), str(a), str(empty)], SCHEDULE_LOG)
    assert [(f.node, f.bucket) for f in found] == [(str(b), BUCKET), (str(b), later), (str(a), BUCKET)]
    assert segment_files([str(empty)], DISPATCH_LOG) == []


def test_a_path_that_is_not_a_data_directory_is_refused(tmp_path):
    with pytest.raises(NotADataDirectory, match="no such directory"):
        segment_files([str(tmp_path / "nope")], SCHEDULE_LOG)
    with pytest.raises(NotADataDirectory, match="not a delay-server data directory"):
        segment_files([str(tmp_path)], SCHEDULE_LOG)


def test_data_directories_are_given_comma_separated_or_as_a_json_list():
    assert parse_data_dirs("/var/a/, /var/b") == ["/var/a", "/var/b"]
    assert parse_data_dirs('["/var/a", "/var/with,comma"]') == ["/var/a", "/var/with,comma"]
    for bad in ("", " , ", "/var/a,/var/a/", '["/var/a", 1]', '[]'):
        with pytest.raises(ValueError):
            parse_data_dirs(bad)


def test_as_of_is_epoch_ms_or_iso_8601_in_utc_unless_an_offset_is_given():
    assert cli.parse_time("1763800012345") == 1763800012345
    assert cli.parse_time("2025-11-22T08:26:52.345Z") == 1763800012345
    assert cli.parse_time("2025-11-22T08:26:52.345") == 1763800012345
    assert cli.parse_time("2025-11-22T09:26:52.345+01:00") == 1763800012345
    with pytest.raises(Exception, match="not epoch ms or ISO 8601"):
        cli.parse_time("yesterday")


def test_the_cli_refuses_a_path_that_is_not_a_data_directory_before_starting_spark(tmp_path, capsys):
    assert cli.main([str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
    Store.open(tmp_path / "a").close()
    assert cli.main([str(tmp_path / "a"), str(tmp_path / "a/")]) == 2
    assert "listed twice" in capsys.readouterr().err
