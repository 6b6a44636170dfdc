"""The data sources' worker side without Spark: segments cut into byte ranges, each range read on
its own and decoded into Arrow columns, damage reported in a row (never skipped) by exactly one
range, and the same rows whatever the split. Also the CLI's checks made before Spark starts."""
from __future__ import annotations

import os

import pytest

from delayserver.storage.buckets import bucket_name
from delayserver.storage.range_reader import find_record, read_range
from delayserver.storage.record import (
    Dispatch, Message, RecordType, encode_dispatch, encode_message, encode_record, encode_scheduled,
)
from delayserver.storage.store import Store
from spark import reconcile as cli
from spark.logs import (
    COLUMNS, DISPATCH_LOG, SCHEDULE_LOG, NotADataDirectory, SegmentRange, parse_data_dirs, segment_ranges,
)
from spark.source import arrow_schema, read_batches
from tests.damage import flip_bit, record_offsets, truncate, zero_fill
from tests.pipeline_node import GROUP, SCALE_MS, START_MS, Node

T = START_MS + 1_000
BUCKET = bucket_name(T - T % SCALE_MS)
#: Splits from one byte (every range resynchronises) to the whole file.
SPLITS = (1, 7, 64, 333, 1 << 20)


def node_with(root, count: int, *, dispatched: int = 0, cancel: str | None = None, body: bytes = b"b") -> Node:
    """`count` messages m-0.. due at T + i, a cancel of `cancel` after them, the first
    `dispatched` delivered at T + 500; the files are left as a stopped node leaves them."""
    node = Node(root, START_MS)
    node.send([(f"m-{i}", T + i) for i in range(count)], body=body)
    if cancel is not None:
        node.cancel(cancel, T + int(cancel[2:]))
    node.replay_all()
    node.now = T + 500
    node.tick()
    node.dispatch(node.take()[:dispatched])
    node.crash()
    return node


def rows(root, log: str = SCHEDULE_LOG, split: int = 1 << 20, names: list[str] | None = None) -> list[dict]:
    """Every row of every range of `log`, in file order."""
    out = []
    for r in segment_ranges([str(root)], log, split):
        for batch in read_batches(r, names):
            out += batch.to_pylist()
    return sorted(out, key=lambda row: (row["file"], row["offset"]) if "offset" in row else ())


def test_scheduled_and_cancel_records_become_rows_with_every_field(tmp_path):
    node = node_with(tmp_path, 2, cancel="m-1")
    got = rows(tmp_path)
    assert all(list(r) == [name for name, _ in COLUMNS[SCHEDULE_LOG]] for r in got)
    offsets = record_offsets(tmp_path / SCHEDULE_LOG / f"{BUCKET}.log")
    assert [(r["offset"], r["record_type"]) for r in got] == [
        (offsets[0], "SCHEDULED"), (offsets[1], "SCHEDULED"), (offsets[2], "SCHEDULED_CANCEL")]
    m1 = got[1]
    assert (m1["node"], m1["bucket"], m1["file"]) == (str(tmp_path), BUCKET, str(tmp_path / SCHEDULE_LOG / f"{BUCKET}.log"))
    assert {k: m1[k] for k in ("store_time", "schedule_time", "sequence", "flags", "message_id", "subject",
                               "headers", "body_size", "error")} == {
        "store_time": START_MS, "schedule_time": T + 1, "sequence": 2, "flags": 0, "message_id": "m-1",
        "subject": "orders.created", "headers": [], "body_size": 1, "error": None}
    cancel = got[2]
    assert (cancel["schedule_time"], cancel["sequence"], cancel["flags"], cancel["message_id"]) == (T + 1, 3, None, "m-1")
    assert cancel["subject"] is None and cancel["body_size"] is None
    assert node.store.message_log.end_offset > cancel["message_log_offset"] > m1["message_log_offset"] > 0


def test_only_the_columns_asked_for_are_built_and_bodies_only_on_request(tmp_path):
    store = Store.open(tmp_path, segment_scale_ms=SCALE_MS)
    message = Message("h-1", "orders.paid", b"x" * 300, T, {"trace": "abc", "k": "v"})
    store.schedule_log.append(T - T % SCALE_MS, encode_record(RecordType.SCHEDULED, encode_scheduled(
        7, encode_message(message))))
    store.close()
    [row] = rows(tmp_path)
    assert row["message_log_offset"] == 7 and row["body_size"] == 300 and "body" not in row
    assert dict(row["headers"]) == {"trace": "abc", "k": "v"}
    [row] = rows(tmp_path, names=["message_id", "body"])
    assert row == {"message_id": "h-1", "body": b"x" * 300}
    with pytest.raises(ValueError, match="schedule_log has no column color"):
        arrow_schema(SCHEDULE_LOG, ["message_id", "color"])


def test_dispatch_records_become_rows(tmp_path):
    node_with(tmp_path, 3, dispatched=2)
    schedule = [r["offset"] for r in rows(tmp_path)]
    got = rows(tmp_path, DISPATCH_LOG)
    assert [(r["record_type"], r["schedule_offset"], r["dispatch_time"], r["broker_group"], r["error"])
            for r in got] == [("DISPATCH", schedule[0], T + 500, GROUP, None),
                              ("DISPATCH", schedule[1], T + 500, GROUP, None)]


def test_a_big_segment_is_cut_into_ranges_and_every_split_reads_the_same_rows(tmp_path):
    node_with(tmp_path, 50, dispatched=50, body=b"z" * 40)
    path = tmp_path / SCHEDULE_LOG / f"{BUCKET}.log"
    size = path.stat().st_size
    ranges = segment_ranges([str(tmp_path)], SCHEDULE_LOG, 333)
    assert [(r.start, r.end) for r in ranges] == [(s, min(s + 333, size)) for s in range(0, size, 333)]
    whole = rows(tmp_path, split=1 << 20)
    assert len(whole) == 50 and [r["offset"] for r in whole] == record_offsets(path)[:-1]
    for split in SPLITS:
        assert rows(tmp_path, split=split) == whole, split
        assert rows(tmp_path, DISPATCH_LOG, split=split) == rows(tmp_path, DISPATCH_LOG), split


def test_a_range_streams_its_file_in_chunks_never_the_whole_file(tmp_path):
    node_with(tmp_path, 40, body=b"q" * 100)
    path = tmp_path / SCHEDULE_LOG / f"{BUCKET}.log"
    size = path.stat().st_size
    chunks = [item for item in read_range(path, 0, size, size, chunk_bytes=512) if hasattr(item, "positions")]
    assert len(chunks) > 10 and max(len(c.data) for c in chunks) <= 512
    assert sum(len(c.positions) for c in chunks) == 40


def damaged_rows(tmp_path, split: int) -> list[tuple]:
    return [(r["offset"], r["record_type"], r["message_id"]) for r in rows(tmp_path, split=split)]


def test_a_torn_tail_yields_the_valid_rows_then_one_torn_tail_row_whatever_the_split(tmp_path):
    node_with(tmp_path, 6)
    path = tmp_path / SCHEDULE_LOG / f"{BUCKET}.log"
    offsets = record_offsets(path)
    truncate(path, offsets[-2] + 5)
    expected = [(offsets[i], "SCHEDULED", f"m-{i}") for i in range(5)] + [(offsets[5], "TORN_TAIL", None)]
    for split in SPLITS:
        assert damaged_rows(tmp_path, split) == expected, split
    [torn] = [r for r in rows(tmp_path, split=7) if r["error"]]
    assert torn["error"].startswith(f"{path}: torn tail at offset {offsets[5]}: incomplete record")


def test_a_zero_filled_tail_is_a_torn_tail(tmp_path):
    node_with(tmp_path, 4)
    path = tmp_path / SCHEDULE_LOG / f"{BUCKET}.log"
    offsets = record_offsets(path)
    zero_fill(path, offsets[-1], 4096)
    for split in SPLITS:
        assert damaged_rows(tmp_path, split)[-1] == (offsets[-1], "TORN_TAIL", None), split
        assert len(damaged_rows(tmp_path, split)) == 5


def test_corruption_mid_segment_is_reported_once_and_reading_resumes_at_the_next_record(tmp_path):
    node_with(tmp_path, 8)
    path = tmp_path / SCHEDULE_LOG / f"{BUCKET}.log"
    offsets = record_offsets(path)
    flip_bit(path, offsets[3] + 30)
    expected = ([(offsets[i], "SCHEDULED", f"m-{i}") for i in range(3)] + [(offsets[3], "CORRUPT", None)]
                + [(offsets[i], "SCHEDULED", f"m-{i}") for i in range(4, 8)])
    # The splits put the damage inside a range, at a range's start and across ranges.
    for split in SPLITS + (offsets[3], offsets[3] + 1, offsets[4] - offsets[3]):
        assert damaged_rows(tmp_path, split) == expected, split
    [corrupt] = [r for r in rows(tmp_path, split=64) if r["error"]]
    assert corrupt["error"] == (f"{path}: corrupt record at offset {offsets[3]}: crc mismatch; valid records "
                                f"follow at {offsets[4]}: {offsets[4] - offsets[3]} bytes not read")


def test_a_damaged_header_at_a_split_point_is_reported_by_the_range_before_it(tmp_path):
    node_with(tmp_path, 6)
    path = tmp_path / SCHEDULE_LOG / f"{BUCKET}.log"
    offsets = record_offsets(path)
    zero_fill(path, offsets[2], 9)  # a header of zeros: type 0 is no record type
    got = damaged_rows(tmp_path, offsets[2] + 3)  # the next range starts inside the damage
    assert got == ([(offsets[i], "SCHEDULED", f"m-{i}") for i in range(2)] + [(offsets[2], "CORRUPT", None)]
                   + [(offsets[i], "SCHEDULED", f"m-{i}") for i in range(3, 6)])


def test_a_body_that_frames_a_whole_record_at_a_split_point_is_reported_not_miscounted(tmp_path):
    store = Store.open(tmp_path, segment_scale_ms=SCALE_MS)
    inner = encode_record(RecordType.SCHEDULED, encode_scheduled(1, encode_message(Message("inner", "s", b"", T))))
    outer = encode_record(RecordType.SCHEDULED, encode_scheduled(2, encode_message(
        Message("outer", "s", b"\xff" * 20 + inner, T))))
    after = encode_record(RecordType.SCHEDULED, encode_scheduled(3, encode_message(Message("after", "s", b"", T))))
    store.schedule_log.append(T - T % SCALE_MS, outer + after)
    store.close()
    inner_at = len(outer) - len(inner)
    assert [r["message_id"] for r in rows(tmp_path)] == ["outer", "after"]
    got = rows(tmp_path, split=inner_at - 5)  # the second range resynchronises inside "outer"
    assert [(r["offset"], r["record_type"]) for r in got if r["error"]] == [(inner_at, "AMBIGUOUS_SPLIT")]
    assert "read this segment unsplit" in [r for r in got if r["error"]][0]["error"]


def test_a_sound_record_that_does_not_decode_is_one_corrupt_row_and_the_rest_are_read(tmp_path):
    store = Store.open(tmp_path, segment_scale_ms=SCALE_MS)
    good = encode_record(RecordType.DISPATCH, encode_dispatch(Dispatch(0, T, GROUP)))
    bad_utf8 = encode_record(RecordType.DISPATCH, encode_dispatch(Dispatch(5, T, "g")).replace(b"g", b"\xff"))
    records = [good, encode_record(RecordType.DISPATCH, b"\0" * 30), good, bad_utf8, good]
    store.dispatch_log.append(T - T % SCALE_MS, b"".join(records))
    store.close()
    got = [(r["offset"], r["record_type"], r["error"]) for r in rows(tmp_path, DISPATCH_LOG)]
    at = [sum(len(r) for r in records[:i]) for i in range(len(records))]
    assert [g[:2] for g in got] == [(at[0], "DISPATCH"), (at[1], "CORRUPT"), (at[2], "DISPATCH"),
                                    (at[3], "CORRUPT"), (at[4], "DISPATCH")]
    assert "DISPATCH payload does not decode (fields do not add up to its length)" in got[1][2]
    assert "DISPATCH payload does not decode (a string is not UTF-8)" in got[3][2]


def test_a_record_of_another_log_is_corruption(tmp_path):
    store = Store.open(tmp_path, segment_scale_ms=SCALE_MS)
    store.schedule_log.append(T - T % SCALE_MS, encode_record(RecordType.DISPATCH, encode_dispatch(Dispatch(0, T, GROUP))))
    store.close()
    [row] = rows(tmp_path)
    assert (row["offset"], row["record_type"]) == (0, "CORRUPT")
    assert "a DISPATCH record does not belong in this log" in row["error"]


def test_a_segment_removed_after_planning_fails_the_read_rather_than_count_as_empty(tmp_path):
    node_with(tmp_path, 2)
    [r] = segment_ranges([str(tmp_path)], SCHEDULE_LOG)
    (tmp_path / SCHEDULE_LOG / f"{BUCKET}.log").unlink()
    with pytest.raises(FileNotFoundError):
        list(read_batches(r))


def test_a_resync_finds_the_first_whole_record_at_or_after_an_offset(tmp_path):
    node_with(tmp_path, 3)
    path = tmp_path / SCHEDULE_LOG / f"{BUCKET}.log"
    offsets = record_offsets(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert [find_record(fd, offsets[-1], at) for at in (0, 1, offsets[1], offsets[2] + 1)] == [
            0, offsets[1], offsets[1], None]
    finally:
        os.close(fd)


def test_segment_ranges_are_listed_by_data_directory_then_bucket(tmp_path):
    a, b, empty = tmp_path / "a", tmp_path / "b", tmp_path / "empty"
    node_with(a, 1)
    node = Node(b, START_MS)
    node.send([("x", T + SCALE_MS), ("y", T)])
    node.replay_all()
    node.crash()
    Store.open(empty).close()
    (b / SCHEDULE_LOG / "notes.log").write_text("not a segment")
    later = bucket_name(T + SCALE_MS - (T + SCALE_MS) % SCALE_MS)
    found = segment_ranges([str(b), str(a), str(empty)], SCHEDULE_LOG)
    assert [(f.node, f.bucket, f.start) for f in found] == [(str(b), BUCKET, 0), (str(b), later, 0), (str(a), BUCKET, 0)]
    assert all(isinstance(f, SegmentRange) and f.end == f.size for f in found)
    assert segment_ranges([str(empty)], DISPATCH_LOG) == []


def test_a_path_that_is_not_a_data_directory_is_refused(tmp_path):
    with pytest.raises(NotADataDirectory, match="no such directory"):
        segment_ranges([str(tmp_path / "nope")], SCHEDULE_LOG)
    with pytest.raises(NotADataDirectory, match="not a delay-server data directory"):
        segment_ranges([str(tmp_path)], SCHEDULE_LOG)


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
    with pytest.raises(SystemExit):
        cli.main([str(tmp_path / "a"), "--split-bytes", "0"])


def test_dispatch_records_with_and_without_their_message_log_offset_are_read(tmp_path):
    store = Store.open(tmp_path, segment_scale_ms=SCALE_MS)
    records = [encode_record(RecordType.DISPATCH, encode_dispatch(Dispatch(0, T, GROUP))),
               encode_record(RecordType.DISPATCH, encode_dispatch(Dispatch(9, T + 1, GROUP, 123)))]
    store.dispatch_log.append(T - T % SCALE_MS, b"".join(records))
    store.close()
    got = [(r["record_type"], r["schedule_offset"], r["broker_group"], r["error"])
           for r in rows(tmp_path, DISPATCH_LOG)]
    assert got == [("DISPATCH", 0, GROUP, None), ("DISPATCH", 9, GROUP, None)]
