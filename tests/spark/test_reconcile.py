"""The Spark reconciliation on a real local Spark session, over data directories written by the
real pipeline (message_log -> Replayer -> schedule_log, tick manager, dispatch_log records as the
sender writes them): every count exact at every level, every missing, duplicated and early id and
every orphan dispatch in the Parquet and CSV.

One session for the whole module (a session takes seconds to start); the CLI runs once as
`python spark/reconcile.py` and once under spark-submit, each starting its own.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import attrs
import psutil
import pyarrow.parquet as pq
import pytest

from delayserver.storage.buckets import bucket_name
from delayserver.storage.range_reader import CORRUPT, TORN_TAIL
from delayserver.storage.record import (
    Dispatch, Message, RecordType, encode_dispatch, encode_message, encode_record,
)
from delayserver.storage.store import Store
from spark import reconcile as cli
from spark.logs import DISPATCH_LOG, SCHEDULE_LOG
from spark.reconciliation import reconcile
from spark.report import Figures
from spark.session import get_session
from spark.source import register
from tests.damage import flip_bit, record_offsets, truncate
from tests.pipeline_node import GROUP, SCALE_MS, START_MS, Node

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("java") is None and "JAVA_HOME" not in os.environ,
                       reason="Spark needs Java 17 or newer (no java on PATH, no JAVA_HOME)"),
]

REPO = Path(__file__).resolve().parent.parent.parent
AS_OF = START_MS + 10 * 60_000
#: A second delivery of a message, as after a failover, recorded by another broker group's sender.
OTHER_GROUP = "brokers-b"


def bucket(t: int) -> str:
    return bucket_name(t - t % SCALE_MS)


@attrs.frozen
class Plan:
    """A message and what happens to it: delivered `lateness` ms after its time (once per entry),
    and a cancel before it is sent, after it is sent, or while it is in flight ("race")."""

    message_id: str
    schedule_time: int
    lateness: tuple[int, ...] = ()
    cancel: str | None = None


def write_node(root: Path, plans: list[Plan], headers: dict[str, str] | None = None) -> None:
    """Run the pipeline over `plans` with time jumping from delivery to delivery."""
    node = Node(root, START_MS)
    for p in plans:
        if p.cancel == "before":
            node.cancel(p.message_id, p.schedule_time)
    node.send([(p.message_id, p.schedule_time) for p in plans])
    if headers:
        extra = Message("with-headers", "orders.paid", b"body", START_MS + 2 * 3_600_000, headers, START_MS, 999)
        node.store.message_log.append(encode_record(RecordType.MESSAGE, encode_message(extra)))
    for p in plans:
        if p.cancel == "after":
            node.cancel(p.message_id, p.schedule_time)
    node.replay_all()
    in_flight = {}
    for at, n, p in sorted((p.schedule_time + late, n, p) for p in plans for n, late in enumerate(p.lateness)):
        node.now = at
        node.tick()
        in_flight.update((f.message.message_id, f) for f in node.take())
        fired = in_flight[p.message_id]
        if n == 0:
            if p.cancel == "race":
                node.cancel(p.message_id, p.schedule_time)
                node.replay_all()
            node.dispatch([fired])
        else:
            node.store.dispatch_log.append(fired.bucket, encode_record(
                RecordType.DISPATCH, encode_dispatch(Dispatch(fired.offset, at, OTHER_GROUP))))
    node.crash()


B1 = START_MS + 1_000
B2 = START_MS + SCALE_MS + 1_000
FUTURE = START_MS + 3_600_000

NODE_A = (
    [Plan(f"d-{i}", B1 + 10 * i, (100 * i,)) for i in range(10)]
    + [Plan(f"dup-{i}", B1 + 200 + 10 * i, (50, 5_000)) for i in range(2)]
    + [Plan(f"miss-{i}", B1 + 300 + 10 * i) for i in range(3)]
    + [Plan(f"c-{i}", B1 + 400 + 10 * i, cancel="after") for i in range(2)]
    + [Plan("race-0", B1 + 500, (30,), cancel="race"),
       Plan("early-cancel-0", B1 + 600, cancel="before"),  # a cancel applies to earlier records only
       Plan("d2-0", B2, (1_000,)), Plan("miss2-0", B2 + 10)]
    + [Plan(f"f-{i}", FUTURE + 10 * i) for i in range(4)]
    + [Plan("cf-0", FUTURE + 100, cancel="after")]
)
NODE_B = [Plan(f"b-{i}", B1 + 10 * i, (10 * (i + 1),)) for i in range(3)] + [Plan("miss-0", B1 + 300)]


def late(p50, p90, p99, p999, top) -> dict[str, int]:
    return {"p50": p50, "p90": p90, "p99": p99, "p999": p999, "max": top}


# Lateness is nearest rank: of 13 values 0 30 50 50 100 200 ... 900, P50 is the 7th, P90 the 12th.
A_B1 = Figures(scheduled=19, cancelled=2, dispatched=13, duplicated=2, missing=4,
               lateness_ms=late(300, 800, 900, 900, 900))
A_B2 = Figures(scheduled=2, dispatched=1, missing=1, lateness_ms=late(1000, 1000, 1000, 1000, 1000))
A_FUTURE = Figures(scheduled=5, cancelled=1, not_yet_due=4)
A_TOTAL = Figures(scheduled=26, cancelled=3, dispatched=14, duplicated=2, missing=5, not_yet_due=4,
                  lateness_ms=late(300, 900, 1000, 1000, 1000))
# In b, a dispatch record naming no message (an orphan) and one of "with-headers" 100 ms early.
ORPHAN_OFFSET = 10**9
EARLY_MS = -100
B_B1 = Figures(scheduled=4, dispatched=3, missing=1, orphan_dispatches=1, lateness_ms=late(20, 30, 30, 30, 30))
B_LATER = Figures(scheduled=1, dispatched=1, early=1, lateness_ms=late(*[EARLY_MS] * 5))
B_TOTAL = Figures(scheduled=5, dispatched=4, missing=1, orphan_dispatches=1, early=1,
                  lateness_ms=late(10, 30, 30, 30, 30))
# 18 first dispatches: -100 0 10 20 30 30 50 50 100 200 ... 900 1000; P50 the 9th, P90 the 17th.
TOTAL = Figures(scheduled=31, cancelled=3, dispatched=18, duplicated=2, missing=6, not_yet_due=4,
                orphan_dispatches=1, early=1, lateness_ms=late(100, 900, 1000, 1000, 1000))
#: Per bin of report.HISTOGRAM_BINS: early, [0, 1), [1, 2), ... [1000, 2000), ...
TOTAL_HISTOGRAM = (1, 1, 0, 0, 0, 1, 3, 2, 1, 3, 5, 1, 0, 0, 0, 0, 0, 0, 0)
SUBJECTS = {
    None: Figures(orphan_dispatches=1),
    "orders.created": Figures(scheduled=30, cancelled=3, dispatched=17, duplicated=2, missing=6, not_yet_due=4,
                              lateness_ms=late(200, 900, 1000, 1000, 1000)),
    "orders.paid": B_LATER,
}
BROKER_GROUPS = {
    None: Figures(scheduled=13, cancelled=3, missing=6, not_yet_due=4),
    GROUP: Figures(scheduled=17, dispatched=17, duplicated=2, orphan_dispatches=1,
                   lateness_ms=late(200, 900, 1000, 1000, 1000)),
    "brokers-b": B_LATER,
}
MISSING = {("a", "miss-0"), ("a", "miss-1"), ("a", "miss-2"), ("a", "early-cancel-0"), ("a", "miss2-0"),
           ("b", "miss-0")}


def plain(figures: dict) -> dict:
    """The figures without their histograms (checked on their own)."""
    return {k: attrs.evolve(f, lateness_histogram=None) for k, f in figures.items()}


@pytest.fixture(scope="session")
def session():
    spark, owned = get_session("local[2]")
    yield spark
    if owned:
        spark.stop()


@pytest.fixture(scope="session")
def nodes(tmp_path_factory) -> dict[str, str]:
    return nodes_in(tmp_path_factory.mktemp("nodes"))


def nodes_in(root: Path) -> dict[str, str]:
    """Data directories a, b and empty under `root`, as the figures above describe them."""
    write_node(root / "a", NODE_A)
    write_node(root / "b", NODE_B, headers={"trace": "t-1"})
    store = Store.open(root / "b", segment_scale_ms=SCALE_MS)
    store.dispatch_log.append(B1 - B1 % SCALE_MS, encode_record(RecordType.DISPATCH, encode_dispatch(
        Dispatch(ORPHAN_OFFSET, B1 + 5, GROUP))))
    later = START_MS + 2 * 3_600_000
    store.dispatch_log.append(later - later % SCALE_MS, encode_record(RecordType.DISPATCH, encode_dispatch(
        Dispatch(0, later + EARLY_MS, OTHER_GROUP))))  # "with-headers", the segment's first record
    store.close()
    Node(root / "empty", START_MS).crash()
    return {name: str(root / name) for name in ("a", "b", "empty")}


@pytest.fixture(scope="module")
def damaged(tmp_path_factory) -> dict:
    """A node with a corrupt schedule segment (the 3rd of 6 records) and a torn dispatch_log tail
    (the last of 3 records cut short)."""
    root = tmp_path_factory.mktemp("damaged") / "d"
    write_node(root, [Plan(f"s-{i}", B1 + 10 * i, (10,)) for i in range(6)]
               + [Plan(f"t-{i}", B2 + 10 * i, (10,)) for i in range(3)])
    schedule, dispatch = root / SCHEDULE_LOG / f"{bucket(B1)}.log", root / DISPATCH_LOG / f"{bucket(B2)}.log"
    corrupt_at = record_offsets(schedule)[2]
    flip_bit(schedule, corrupt_at + 30)
    torn_at = record_offsets(dispatch)[2]
    truncate(dispatch, torn_at + 5)
    return {"dir": str(root), "schedule": str(schedule), "corrupt_at": corrupt_at, "dispatch": str(dispatch),
            "torn_at": torn_at}


def test_the_data_sources_read_every_record_with_its_node_bucket_and_offset(session, nodes):
    register(session)
    schedule = session.read.format("delayserver.schedule_log").load([nodes["a"], nodes["b"], nodes["empty"]])
    rows = schedule.collect()
    cancels = sum(p.cancel is not None for p in NODE_A)
    assert len(rows) == len(NODE_A) + cancels + len(NODE_B) + 1  # and the message with headers in b
    by_node = {n: [r for r in rows if r.node == nodes[n]] for n in ("a", "b")}
    assert {r.bucket for r in by_node["a"]} == {bucket(B1), bucket(B2), bucket(FUTURE)}
    [with_headers] = [r for r in by_node["b"] if r.message_id == "with-headers"]
    assert with_headers.headers == {"trace": "t-1"} and with_headers.body_size == 4
    for r in by_node["a"]:
        assert r.file == f"{nodes['a']}/{SCHEDULE_LOG}/{r.bucket}.log" and r.error is None
    offsets = record_offsets(Path(nodes["a"]) / SCHEDULE_LOG / f"{bucket(B1)}.log")[:-1]
    assert sorted(r.offset for r in by_node["a"] if r.bucket == bucket(B1)) == offsets
    dispatch = (session.read.format("delayserver.dispatch_log")
                .option("data_dirs", json.dumps([nodes["a"], nodes["b"]])).option("split_bytes", "50").load())
    assert dispatch.rdd.getNumPartitions() > 3
    assert dispatch.filter("record_type = 'DISPATCH'").count() == 14 + 2 + 3 + 2
    assert session.read.format("delayserver.dispatch_log").load(nodes["empty"]).count() == 0
    bodies = (session.read.format("delayserver.schedule_log").schema("message_id STRING, body BINARY")
              .load(nodes["b"]).filter("message_id = 'with-headers'").collect())
    assert [bytes(r.body) for r in bodies] == [b"body"]
    indexed = (session.read.format("delayserver.dispatch_log").schema("node STRING, node_index INT")
               .load([nodes["b"], nodes["a"]]).distinct().collect())
    assert sorted((r.node_index, r.node) for r in indexed) == [(0, nodes["b"]), (1, nodes["a"])]


@pytest.fixture(scope="module")
def reconciled(session, nodes, tmp_path_factory):
    """The three nodes reconciled, split into ranges of 200 bytes, ids written: (report, output)."""
    out = tmp_path_factory.mktemp("reconciled") / "out"
    return reconcile(session, [nodes["a"], nodes["b"], nodes["empty"]], AS_OF, str(out), split_bytes=200), out


def test_counts_per_bucket_per_node_and_in_total_are_exact(reconciled, nodes):
    report, _ = reconciled
    assert plain(_rename_all(nodes, report.buckets)) == {
        ("a", bucket(B1)): A_B1, ("a", bucket(B2)): A_B2, ("a", bucket(FUTURE)): A_FUTURE,
        ("b", bucket(B1)): B_B1, ("b", bucket(START_MS + 2 * 3_600_000)): B_LATER,
    }
    assert plain(_rename_all(nodes, report.nodes)) == {"a": A_TOTAL, "b": B_TOTAL, "empty": Figures()}
    assert attrs.evolve(report.total, lateness_histogram=None) == TOTAL
    assert report.damage == () and report.torn_tails == () and report.exit_status == 1


def test_the_figures_are_the_same_when_the_cancels_are_joined_without_a_broadcast(session, nodes, reconciled):
    report, _ = reconciled
    session.conf.set("spark.sql.autoBroadcastJoinThreshold", "-1")
    try:
        unbroadcast = reconcile(session, [nodes["a"], nodes["b"], nodes["empty"]], AS_OF)
    finally:
        session.conf.unset("spark.sql.autoBroadcastJoinThreshold")
    assert (unbroadcast.total, unbroadcast.nodes, unbroadcast.buckets, unbroadcast.subjects,
            unbroadcast.broker_groups) == (report.total, report.nodes, report.buckets, report.subjects,
                                           report.broker_groups)
    assert unbroadcast.total.cancelled > 0


def test_counts_per_subject_and_per_broker_group_and_the_lateness_histogram(reconciled):
    report, _ = reconciled
    assert plain(report.subjects) == SUBJECTS
    assert plain(report.broker_groups) == BROKER_GROUPS
    assert report.total.lateness_histogram == TOTAL_HISTOGRAM
    chart = report.total.to_json()["lateness_histogram"]
    assert chart[0] == {"from_ms": None, "to_ms": 0, "count": 1}
    assert chart[11] == {"from_ms": 1000, "to_ms": 2000, "count": 1}
    assert chart[-1] == {"from_ms": 3_600_000, "to_ms": None, "count": 0}
    assert report.subjects[None].lateness_histogram is None
    text = report.render()
    assert "by subject" in text and "by broker group (of the first dispatch)" in text
    assert "EARLY: 1 messages were dispatched before their schedule time" in text


def _rename_all(nodes, figures: dict) -> dict:
    back = {v: k for k, v in nodes.items()}
    return {(back[k] if isinstance(k, str) else (back[k[0]], k[1])): f for k, f in figures.items()}


def read_ids(out: Path, kind: str, nodes) -> tuple[list[dict], list[dict]]:
    back = {v: k for k, v in nodes.items()}
    [parquet] = (out / f"{kind}.parquet").glob("*.parquet")
    [csv_file] = (out / f"{kind}.csv").glob("*.csv")
    from_parquet = pq.read_table(parquet).to_pylist()
    with open(csv_file, newline="") as f:
        from_csv = list(csv.DictReader(f))
    for row in from_parquet + from_csv:
        row["node"] = back[row["node"]]
    return from_parquet, from_csv


def test_every_missing_duplicated_and_early_id_and_every_orphan_is_written_as_parquet_and_csv(reconciled, nodes):
    report, out = reconciled
    assert report.outputs["missing"] == {"parquet": f"{out}/missing.parquet", "csv": f"{out}/missing.csv"}
    parquet, in_csv = read_ids(out, "missing", nodes)
    assert {(r["node"], r["message_id"]) for r in parquet} == MISSING
    assert [(r["node"], r["message_id"], str(r["schedule_time"])) for r in parquet] == [
        (r["node"], r["message_id"], r["schedule_time"]) for r in in_csv]
    parquet, in_csv = read_ids(out, "duplicated", nodes)
    assert [(r["node"], r["message_id"], r["dispatches"], r["broker_groups"]) for r in parquet] == [
        ("a", "dup-0", 2, f"{GROUP},{OTHER_GROUP}"), ("a", "dup-1", 2, f"{GROUP},{OTHER_GROUP}")]
    assert parquet[0]["first_dispatch_time"] == B1 + 200 + 50
    assert [r["message_id"] for r in in_csv] == ["dup-0", "dup-1"]
    parquet, in_csv = read_ids(out, "early", nodes)
    assert [(r["node"], r["message_id"], r["lateness"], r["broker_groups"]) for r in parquet] == [
        ("b", "with-headers", EARLY_MS, OTHER_GROUP)]
    parquet, in_csv = read_ids(out, "orphans", nodes)
    assert [(r["node"], r["bucket"], r["offset"], r["dispatches"]) for r in parquet] == [
        ("b", bucket(B1), ORPHAN_OFFSET, 1)]
    assert [r["offset"] for r in in_csv] == [str(ORPHAN_OFFSET)]
    [summary] = (out / "summary.parquet").glob("*.parquet")
    levels = {(r["level"], r["key"], r["sub_key"]): r for r in pq.read_table(summary).to_pylist()}
    assert len(levels) == 1 + 2 + 5 + 3 + 3  # the empty node has no row
    assert levels[("total", None, None)]["dispatched"] == 18
    assert json.loads(levels[("total", None, None)]["lateness_histogram"]) == list(TOTAL_HISTOGRAM)


def test_a_report_shows_at_most_max_rows_of_a_breakdown_and_says_so(session, nodes):
    report = reconcile(session, [nodes["a"]], AS_OF, max_rows=1)
    assert len(report.buckets) == 1 and len(report.subjects) == 1
    assert report.truncated == ("broker_group", "bucket")
    assert "more bucket rows than shown" in report.render()
    assert attrs.evolve(report.total, lateness_histogram=None) == A_TOTAL


def test_reconcile_py_of_an_empty_data_directory_exits_0_and_writes_empty_id_files(session, nodes, tmp_path,
                                                                                 capsys):
    assert cli.main([nodes["empty"], "--out", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert f"node {nodes['empty']}: no records" in text and "RESULT: nothing missing" in text
    assert read_ids(tmp_path / "out", "missing", nodes) == ([], [])
    assert read_ids(tmp_path / "out", "duplicated", nodes) == ([], [])
    assert read_ids(tmp_path / "out", "orphans", nodes) == ([], [])


def test_a_damaged_segment_is_reported_with_file_and_offset_and_the_records_around_it_are_counted(
        session, damaged, capsys):
    assert cli.main([damaged["dir"], "--as-of", str(AS_OF), "--json", "--split-bytes", "100"]) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    [damage] = report["damage"]
    assert damage["file"] == damaged["schedule"] and damage["offset"] == damaged["corrupt_at"]
    assert damage["kind"] == CORRUPT
    message = f"{damaged['schedule']}: corrupt record at offset {damaged['corrupt_at']}"
    assert message in damage["error"] and f"error: {message}" in captured.err
    [torn] = report["torn_tails"]
    assert (torn["file"], torn["offset"], torn["kind"]) == (damaged["dispatch"], damaged["torn_at"], TORN_TAIL)
    buckets = {b.pop("bucket"): Figures(**{k: v for k, v in b.items() if k not in ("node", "lateness_histogram")})
               for b in report["buckets"]}
    # Reading resumes after the corrupt record: only its dispatch names nothing readable.
    assert buckets[bucket(B1)] == Figures(scheduled=5, dispatched=5, orphan_dispatches=1,
                                          lateness_ms=late(10, 10, 10, 10, 10))
    # The torn dispatch record is not counted: that message shows as missing.
    assert buckets[bucket(B2)] == Figures(scheduled=3, dispatched=2, missing=1,
                                          lateness_ms=late(10, 10, 10, 10, 10))
    assert report["exit_status"] == 1


@attrs.frozen
class Script:
    """A run of spark/reconcile.py in the background; its output goes to files, not pipes, so
    that Spark's start-up chatter never blocks it."""

    process: subprocess.Popen
    stdout: Path
    stderr: Path
    out: Path
    tmp: Path  # its TMPDIR

    @classmethod
    def start(cls, directory: Path, command: list[str], *args: str) -> "Script":
        tmp = directory / "tmp"
        tmp.mkdir()
        env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "TMPDIR": str(tmp)}
        stdout, stderr = directory / "stdout", directory / "stderr"
        with open(stdout, "w") as out, open(stderr, "w") as err:
            process = subprocess.Popen([*command, str(REPO / "spark" / "reconcile.py"), *args], env=env, cwd=REPO,
                                       stdout=out, stderr=err, text=True)
        return cls(process, stdout, stderr, directory / "out", tmp)

    def finish(self) -> tuple[int, str, str]:
        """Its exit status, output and the end of its error output, once it exited; it left no
        temporary directory of its own behind (the zip of the code it ships)."""
        status = self.process.wait(timeout=300)
        assert not list(self.tmp.glob("delayserver-reconcile-*"))
        return status, self.stdout.read_text(), self.stderr.read_text()[-5000:]


@pytest.fixture(scope="session", autouse=True)
def scripts(nodes, tmp_path_factory):
    """`spark/reconcile.py` run as a script and under spark-submit, started before anything else (an
    autouse fixture of the widest scope) so that their Spark start-up overlaps this process's."""
    python = tmp_path_factory.mktemp("python")
    submit = tmp_path_factory.mktemp("spark-submit")
    archives = tmp_path_factory.mktemp("class-archive")
    runs = {
        # The first run with this archive directory: its JVM writes the class archive as it exits.
        "python": Script.start(python, [sys.executable], nodes["a"], nodes["b"], nodes["empty"], "--as-of",
                               "2025-11-22T08:36:52.345Z", "--json", "--out", str(python / "out"),
                               "--split-bytes", "100", "--shuffle-partitions", "3", "--driver-memory", "1g",
                               "--class-archive", str(archives)),
        "spark-submit": Script.start(submit, [str(Path(sys.executable).parent / "spark-submit"), "--master",
                                              "local[2]", "--conf", "spark.ui.enabled=false"],
                                     nodes["a"], "--as-of", str(START_MS)),
    }
    runs["archives"] = archives
    yield runs
    for run in (runs["python"], runs["spark-submit"]):
        if run.process.poll() is None:
            run.process.kill()
            run.process.wait()


def test_reconcile_py_runs_as_a_script_and_exits_1_with_the_report_as_json(scripts, nodes):
    status, stdout, stderr = scripts["python"].finish()
    assert status == 1, stderr
    report = json.loads(stdout)
    assert report["as_of"] == AS_OF
    assert Figures(**{k: v for k, v in report["total"].items() if k != "lateness_histogram"}) == TOTAL
    parquet, _ = read_ids(scripts["python"].out, "missing", nodes)
    assert {(r["node"], r["message_id"]) for r in parquet} == MISSING


def test_the_first_run_writes_a_class_archive_and_the_next_one_maps_it(scripts, nodes, tmp_path):
    status, stdout, stderr = scripts["python"].finish()
    assert status == 1, stderr
    json.loads(stdout)  # writing the archive said nothing on stdout, where the report goes
    archives = scripts["archives"]
    written = list(archives.iterdir())
    assert len(written) == 1 and written[0].suffix == ".jsa" and written[0].stat().st_size > 1 << 20, written
    again = Script.start(tmp_path, [sys.executable], nodes["a"], "--as-of", str(START_MS), "--json",
                         "--class-archive", str(archives))
    mapped = False
    try:
        while again.process.poll() is None and not mapped:
            mapped = any(str(written[0]) in maps for maps in _java_maps(again.process.pid))
            time.sleep(0.2)
    finally:
        status, stdout, stderr = again.finish()
    assert mapped, "the second run's JVM did not map the archive"
    assert status == 0, stderr
    assert json.loads(stdout)["total"]["scheduled"] > 0
    assert list(archives.iterdir()) == written  # used, not written again


def _java_maps(pid: int) -> list[str]:
    """The memory maps of the java processes under `pid`."""
    out = []
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for child in children:
        try:
            if child.name() == "java":
                out.append(Path(f"/proc/{child.pid}/maps").read_text())
        except (psutil.Error, OSError):
            continue
    return out


def test_reconcile_py_runs_unchanged_under_spark_submit_and_exits_0_when_nothing_is_missing(scripts, nodes):
    status, stdout, stderr = scripts["spark-submit"].finish()
    assert status == 0, stderr
    # As of the start, nothing is due yet, so nothing can be missing (node a alone: b has an early one).
    assert f"node {nodes['a']}" in stdout
    assert ("total: 26 scheduled, 3 cancelled, 14 dispatched (2 more than once), 0 missing, 9 not yet due"
            in stdout)
    assert "RESULT: nothing missing" in stdout
