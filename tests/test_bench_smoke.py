"""The end-to-end benchmarks (`ops/bench deliver`, `ops/bench compare`) run whole at a tiny size:
real server, real redis-servers, load generator and poller processes. Figures are not checked,
only that each run measures what it claims (everything delivered, nothing early, the kill -9 run
of the sorted-set queue without persistence loses what was pending, ours loses nothing)."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import attrs
import pytest

from bench.brokers import nats_executable, rabbitmq_installed
from bench.compare import compare, ratio_table, ratios, table
from bench.deliver import report, run_deliver, slow_fsyncs_between, worst_stretches
from bench.workload import Delivered, Workload

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (shutil.which("redis-server") or Path("/usr/bin/redis-server").exists()),
                       reason="redis-server is not installed (ops/test installs it)"),
]

TINY = Workload(n=300, window_ms=1000, producers=4, batch=16)


@pytest.mark.parametrize("transport", [
    "spool", "redis",
    pytest.param("rabbitmq", marks=pytest.mark.skipif(not rabbitmq_installed(), reason="rabbitmq-server is not installed")),
    pytest.param("nats", marks=pytest.mark.skipif(nats_executable() is None, reason="nats-server is not installed")),
])
def test_deliver_measures_every_message(transport):
    r = run_deliver(transport, TINY)
    assert (r["acked"], r["delivered"], r["missing"]) == (300, 300, 0)
    assert r["dispatch"]["early"] == 0
    assert (r["arrival"] is not None) == (transport in ("redis", "nats"))
    assert f"deliver {transport}:" in report(transport, TINY, r)
    assert "  disk: " in report(transport, TINY, r) and r["slow_fsyncs"][0] >= 0
    # The event loop's thread is a part of the process's CPU, and it did the delivering.
    assert 0 < r["loop_cpu_seconds"] <= r["cpu_seconds"] + 0.02
    assert "us of it on the event loop's thread" in report(transport, TINY, r)


@pytest.mark.parametrize("transport", ["spool", "redis"])
def test_deliver_with_headers_checks_each_message_carried_its_header(transport):
    w = attrs.evolve(TINY, headers=True)
    r = run_deliver(transport, w)
    assert (r["delivered"], r["missing"]) == (300, 0)
    assert r["headers_as_sent"] == (300, 300)
    assert "headers: 300 of the 300 deliveries carried the header sent" in report(transport, w, r)
    assert run_deliver(transport, TINY)["headers_as_sent"] is None


def test_headers_as_sent_counts_only_the_headers_each_message_was_given():
    from bench.workload import headers_as_sent, message_headers

    good = Delivered("bench-00000007", 1, 1, None, tuple(message_headers(7).items()))
    assert headers_as_sent([good, attrs.evolve(good, headers=()),
                            attrs.evolve(good, headers=tuple(message_headers(8).items()))]) == 1


def test_the_slow_fsyncs_a_server_logged_in_the_window_are_counted(tmp_path):
    import logging

    from delayserver.storage.segment import FsyncTimes

    # The lines as a server writes them: its own formatter, FsyncTimes' own messages.
    path = tmp_path / "server.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("delayserver.storage")
    logger.addHandler(handler)
    try:
        times = FsyncTimes()
        start = int(time.time() * 1000) - 1  # (the log's stamps are to the millisecond)
        times.observe("/d/spool/a.log", 0.120)
        for _ in range(3):  # within the second: counted in the next line
            times.observe("/d/spool/a.log", 0.400)
        times._slow_logged_at -= 2.0
        times.observe("/d/dispatch_log/1.log", 0.070)
    finally:
        logger.removeHandler(handler)
        handler.close()
    lines = path.read_text().splitlines()
    end = int(time.time() * 1000) + 1
    assert len(lines) == 2 and "(3 more slow fsyncs since the last warning)" in lines[1]
    assert slow_fsyncs_between(lines, start, end) == (5, 120)  # the longest of those logged
    assert slow_fsyncs_between(lines, end + 1000, end + 2000) == (0, 0)
    assert slow_fsyncs_between(["2026-11-28 13:57:44,227 WARNING delayserver.loop: event loop blocked"], 0, 2**62) == (0, 0)


def test_the_latest_stretches_of_the_window_are_found_by_their_median():
    t0 = 1_000_000
    # 100 ms stretches: the third (200 ms in) paused; the fifth has one late message, not a pause.
    delivered = [Delivered(f"m{i}", t0 + i, t0 + i + (40 if 200 <= i < 300 else 3)) for i in range(1000)]
    delivered.append(Delivered("late", t0 + 450, t0 + 450 + 90))
    worst = worst_stretches(delivered, t0, count=2)
    assert [(x["at_ms"], x["p50"], x["max"]) for x in worst] == [(200, 40, 40), (400, 3, 90)]
    assert worst[1]["n"] == 101 and worst_stretches([], t0) == []


def test_deliver_in_order_sends_the_same_times_in_the_order_they_fall_due():
    ordered = attrs.evolve(TINY, in_order=True)
    times = ordered.schedule(1_000)
    assert times == sorted(TINY.schedule(1_000)) and times != TINY.schedule(1_000)
    assert Workload.from_json(ordered.to_json()) == ordered
    r = run_deliver("spool", ordered)
    assert (r["acked"], r["delivered"], r["missing"], r["dispatch"]["early"]) == (300, 300, 0, 0)


def test_compare_runs_both_systems_and_their_kill_runs():
    results = compare(TINY, (200,))
    ours, theirs = results["ours"], results["zset"][200]
    assert ours.delivered == theirs.delivered == 300
    assert ours.lateness["early"] == theirs.lateness["early"] == 0
    assert results["ours_kill"].lost == 0
    # Killed at half the window, the queue without persistence forgets what was not due yet.
    assert results["zset_kill"].lost > 0
    assert results["zset_aof_kill"].acked == 300
    assert "| delay server, flush=sync |" in table(results)
    assert "acknowledged msg/s" in ratios(results)
    # The same durability as ours (appendfsync always), and the real rq-scheduler with its worker.
    first = results["rounds"][0]
    assert first["zset_always"].delivered == 300 and first["zset_always"].lateness["early"] == 0
    rq = first["rq"]
    assert (rq.acked, rq.delivered, rq.duplicates) == (300, 300, 0)
    assert "| rq-scheduler, interval 1 s, 1 RQ worker |" in ratio_table(results)


def test_proc_cpu_seconds_reads_the_process_own_cpu_time():
    import os
    import time

    import psutil

    from bench.harness import proc_cpu_seconds

    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    t = psutil.Process().cpu_times()
    assert abs(proc_cpu_seconds(os.getpid()) - (t.user + t.system)) < 0.05


def test_status_bench_compares_each_window_with_statuses_with_the_two_around_it():
    from bench.status import EDGE_S, window_changes

    start, length = 1000.0, 2.0
    # 1,000 messages acknowledged every 0.1 s in windows 0 and 2, 900 in window 1 (statuses),
    # plus acknowledgements inside the edges and outside the windows, which do not count.
    acks = [(start + k * length + EDGE_S + 0.1 * i, 900 if k == 1 else 1000) for k in range(3) for i in range(15)]
    acks += [(start + 0.1, 10**6), (start + length - 0.1, 10**6), (start - 1, 10**6), (start + 3 * length, 10**6)]
    rates, changes = window_changes(acks, start, length, 3)
    assert rates == [10_000.0, 9_000.0, 10_000.0]
    assert changes == [pytest.approx(-0.1)]


def test_storage_bench_replays_every_record_with_the_indexes_following(tmp_path):
    from bench import storage

    figures = storage.bench_replay(tmp_path / "replay", 2 * storage.BATCH)
    assert figures.records == 2 * storage.BATCH and figures.bytes > 2 * storage.BATCH * len(storage.BODY)
    assert not (tmp_path / "replay").exists()


def test_storage_bench_replays_batches_joined_a_pass_each(tmp_path, monkeypatch):
    from bench import storage
    from delayserver.replayer import Replayer

    passes = []
    replay_once = Replayer.replay_once
    monkeypatch.setattr(Replayer, "replay_once",
                        lambda self, *a, **kw: passes.append(replay_once(self, *a, **kw)) or passes[-1])
    figures = storage.bench_replay(tmp_path / "replay", 5 * storage.BATCH, joined=2)
    assert figures.records == 5 * storage.BATCH
    assert passes == [2 * storage.BATCH, 2 * storage.BATCH, storage.BATCH, 0]  # a pass per write, the last short


def test_storage_bench_takes_every_message_from_what_was_read_ahead(tmp_path, monkeypatch):
    """The take figure is of every message routed once and settled, each decoded from the
    records read ahead into memory (none read from its segment when taken)."""
    from bench import storage
    from delayserver.sender.sender import Sender

    records = 3 * storage.BATCH
    routed, from_memory = [], []
    real_route_taken = Sender.route_taken

    def recording(sender, batch, now):
        routed.extend(d.message.message_id for d in batch)
        from_memory.append(sender.due._ticks.ahead.hits)
        real_route_taken(sender, batch, now)

    monkeypatch.setattr(Sender, "route_taken", recording)
    figures = storage.bench_take(tmp_path / "take", records)
    assert figures.records == records and figures.bytes > records * len(storage.BODY)
    assert sorted(routed) == [f"msg-{i:012d}" for i in range(records)]
    assert from_memory[-1] == records and not (tmp_path / "take").exists()


def test_storage_bench_with_batches_in_flight_settles_each_after_that_many_more_were_taken(tmp_path, monkeypatch):
    """The in-flight take settles every message once, a batch only when `in_flight` more were
    taken after it (the last ones once nothing is left to take), under the node's collector
    thresholds, and leaves the collector as it found it."""
    import gc

    from bench import storage
    from delayserver.node.server import GC_THRESHOLDS
    from delayserver.sender.sender import Sender

    records, in_flight = 6 * storage.BATCH, 2
    events, thresholds = [], []
    real_route_taken, real_settle = Sender.route_taken, Sender._settle

    def taking(sender, batch, now):
        events.append(("take", batch[0].message.message_id))
        thresholds.append(gc.get_threshold())
        real_route_taken(sender, batch, now)

    def settling(sender, acked, group, now):
        events.append(("settle", acked[0].message.message_id))
        real_settle(sender, acked, group, now)

    monkeypatch.setattr(Sender, "route_taken", taking)
    monkeypatch.setattr(Sender, "_settle", settling)
    before = gc.get_threshold()
    figures = storage.bench_take(tmp_path / "take", records, in_flight)
    assert figures.records == records and gc.get_threshold() == before and gc.get_freeze_count() == 0
    assert set(thresholds) == {GC_THRESHOLDS}
    takes = [m for kind, m in events if kind == "take"]
    settles = [m for kind, m in events if kind == "settle"]
    assert settles == takes and len(takes) == records // storage.BATCH  # each batch settled once, in order
    for k, first in enumerate(settles[:-in_flight]):  # settled once `in_flight` more were taken
        at = events.index(("settle", first))
        assert events[:at].count(("take", takes[k + in_flight])) == 1


def test_storage_bench_receives_every_message_through_the_batch_path(tmp_path, monkeypatch):
    """The receive figure is of requests stored as the server stores them: each message whole in
    message_log, read back as it was sent."""
    from bench import storage
    from delayserver.storage.record import RecordType, decode_message, iter_records

    records = 2 * storage.REQUEST_BATCH
    seen = []
    real_close = storage.Store.close

    def read_then_close(store):  # what the receiver wrote, before the bench removes it
        data, _ = store.message_log.read(0, 1 << 24)
        seen.extend(decode_message(data, s, e) for _, rtype, s, e in iter_records(data) if rtype == RecordType.MESSAGE)
        real_close(store)

    monkeypatch.setattr(storage.Store, "close", read_then_close)
    figures = storage.bench_receive(tmp_path / "receive", records)
    assert figures.records == records and not (tmp_path / "receive").exists()
    assert [m.message_id for m in seen] == [f"msg-{n:08d}-{i:04d}" for n in range(2) for i in range(storage.REQUEST_BATCH)]
    assert all(m.body == storage.BODY and m.subject == "bench.ingest" for m in seen)


def test_page_cache_cost_is_the_cpu_of_writing_new_pages_per_kib(tmp_path, monkeypatch):
    import bench.harness as harness

    written, ticks = [], iter([10.0, 12.0])
    monkeypatch.setattr(harness.time, "process_time", lambda: next(ticks))
    real_write = harness.os.write
    monkeypatch.setattr(harness.os, "write", lambda fd, data: written.append(len(data)) or real_write(fd, data))
    # 2 s of CPU over 4 MiB: 2e6 us / 4096 KiB.
    assert harness.page_cache_cost(str(tmp_path), mib=4) == pytest.approx(2e6 / 4096)
    assert sum(written) == 4 << 20
    assert list(tmp_path.iterdir()) == []  # the probe's file is gone
    monkeypatch.undo()
    assert "us of CPU per KiB" in harness.memory_note(str(tmp_path))


def test_memory_warm_touches_whole_gib_within_what_is_available(monkeypatch, capsys):
    import bench.memory as memory

    assert memory.available_bytes() > 0
    assert memory.touch(memory.GIB + 12345) == memory.GIB
    assert memory.touch(memory.GIB - 1) == 0
    monkeypatch.setattr(memory, "available_bytes", lambda: 3 * memory.GIB)
    touched = []
    monkeypatch.setattr(memory, "touch", lambda n: touched.append(n) or n)
    memory.main(["--warm", "--leave-gib", "2"])
    assert touched == [memory.GIB]
    out = capsys.readouterr().out
    assert out.count("us of CPU per KiB") == 2 and "touched 1 GiB" in out


def test_a_rate_sweep_sums_up_each_rate_over_its_runs():
    from bench.deliver import sweep_summary

    once = sweep_summary("spool", 10, {30_000: [(True, 8, 27.6)], 50_000: [(False, 11, 18.7)]})
    assert once == [
        "deliver spool rate sweep over 10 s windows: 30,000/s P99 8 ms, 27.6 us CPU per message; "
        "50,000/s P99 11 ms, 18.7 us CPU per message",
        "  highest rate sustained with P99 <= 10 ms: 30,000 msg/s",
    ]
    # Several runs: median and range; a rate met in only some of its runs is not sustained.
    runs = {30_000: [(True, 8, 27.0), (True, 9, 26.0), (True, 7, 28.0)],
            40_000: [(True, 9, 22.0), (False, 44, 23.0), (True, 10, 21.0)],
            50_000: [(False, 11, 19.0), (False, 117, 21.5), (False, 68, 22.0)]}
    summary = sweep_summary("redis", 5, runs)
    assert summary[0] == (
        "deliver redis rate sweep over 5 s windows (median (min-max) over the runs): "
        "30,000/s P99 8 (7-9) ms, 27.0 (26.0-28.0) us CPU per message, met in 3 of 3 runs; "
        "40,000/s P99 10 (9-44) ms, 22.0 (21.0-23.0) us CPU per message, met in 2 of 3 runs; "
        "50,000/s P99 68 (11-117) ms, 21.5 (19.0-22.0) us CPU per message, met in 0 of 3 runs")
    assert summary[1] == "  highest rate sustained with P99 <= 10 ms in every run: 30,000 msg/s"
    assert sweep_summary("spool", 10, {50_000: [(False, 11, 19.0), (False, 12, 19.0)]})[1].endswith(
        "none of those measured")


@pytest.mark.parametrize("dedupe_window, deduplicated", [(None, True), ("0", False)])
def test_ingest_bench_runs_the_server_with_the_dedupe_window_asked_for(tmp_path, dedupe_window, deduplicated):
    """`ops/bench ingest --dedupe-window 0` measures a server without the table of accepted ids: a
    second send under the same id is stored again, not answered with the first one's handle."""
    import trio

    from bench.ingest import start_server
    from delayserver.client import AsyncProducer

    async def send_twice(address: str):
        async with AsyncProducer(address, timeout=30) as producer:
            first = await producer.send("bench.ingest", b"x", delay=3_600_000, message_id="same-id")
            second = await producer.send("bench.ingest", b"x", delay=7_200_000, message_id="same-id")
            return first, second

    server = start_server(tmp_path, "sync", dedupe_window)
    try:
        first, second = trio.run(send_twice, server.address)
    finally:
        server.stop()
    assert (second.schedule_time == first.schedule_time) == deduplicated


def test_pump_bench_times_the_pump_and_each_answer_over_a_real_socket():
    """`ops/bench pump`: every request read, framed and answered once, over loopback from another
    process; the figures are CPU per request of the pump's steps and of the answer's."""
    from bench import pump

    r = pump.run(requests=50, batch=4)
    assert r["answer_steps"] == 1.0  # one answer task per request, answered at once
    assert r["pump_steps"] >= 1.0  # at least one read per request (a frame may come in pieces)
    assert r["pump_us"] > 0 and r["answer_us"] > 0


def test_a_threads_cpu_is_its_own_and_part_of_its_process_s():
    """`thread_cpu_seconds` (the ingest bench's event-loop figure) counts the CPU of the thread it
    names: a busy other thread does not move it, and it never passes its process's."""
    import os
    import threading

    from bench.harness import proc_cpu_seconds, thread_cpu_seconds

    pid, me = os.getpid(), threading.get_native_id()

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    mine_before, process_before = thread_cpu_seconds(pid, me), proc_cpu_seconds(pid)
    other = threading.Thread(target=spin, args=(0.4,))
    other.start()
    other.join()
    mine_between = thread_cpu_seconds(pid, me)
    spin(0.3)
    mine_after, process_after = thread_cpu_seconds(pid, me), proc_cpu_seconds(pid)
    assert mine_between - mine_before < 0.2  # the other thread's 0.4 s are not this one's
    assert mine_after - mine_between >= 0.25  # (clock ticks of 10 ms)
    assert process_after - process_before >= mine_after - mine_before + 0.35


def test_memory_fill_prints_the_cost_of_each_step_written(tmp_path, capsys):
    import bench.memory as memory

    memory.fill(4 / 1024, True, str(tmp_path), step=1 << 20)  # 4 MiB in steps of 1 MiB, given back
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" GiB")[0].strip() for line in lines] == ["0.0"] * 4 and len(lines) == 4
    assert all("us of CPU per KiB" in line for line in lines) and list(tmp_path.iterdir()) == []


def test_ingest_windows_count_each_acknowledgement_once_and_its_cpu_per_message():
    from bench.ingest import _windows

    samples = [(100.0, 1.0), (101.0, 1.5), (102.0, 1.5 + 40e-6)]
    acks = [(100.5, 10), (101.5, 16), (101.9, 4), (99.0, 7), (102.5, 3)]  # the last two outside
    assert _windows(samples, acks) == [(0.0, 10.0, 50_000.0), (1.0, 20.0, pytest.approx(2.0))]


def test_ingest_bench_with_windows_splits_a_real_run(tmp_path):
    from bench.ingest import bench

    r = bench("sync", 2, 2.0, 16, window=0.5)
    assert r["acked"] > 0 and len(r["windows"]) >= 3 and "acks" not in r
    assert sum(rate for _, rate, _ in r["windows"]) > 0


def test_the_benches_name_the_code_their_servers_run():
    """The first line of each bench says which tree its servers import delayserver from, and its
    commit: a comparison of two trees is one only if each side names its own."""
    import subprocess

    import delayserver
    from bench.harness import environment_note, server_code

    tree = str(Path(delayserver.__file__).resolve().parent.parent)
    head = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert server_code().startswith(f"delayserver from {tree} at {head}")
    assert environment_note().endswith(server_code())


def test_peak_rss_counts_the_file_pages_apart(tmp_path):
    """A file mapped and read shows in RSS as file pages: `peak_file` counts them apart (the
    deliver bench's peak RSS holds the segments the read-ahead maps)."""
    import mmap
    import os

    from bench.harness import PeakRss

    path = tmp_path / "pages"
    path.write_bytes(b"\1" * (64 << 20))
    with PeakRss(lambda: [os.getpid()]) as rss, open(path, "rb") as f:
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            assert sum(m[k] for k in range(0, len(m), 4096)) == (64 << 20) // 4096  # every page touched
            rss.sample()  # (as its thread does every `interval`)
    assert rss.peak_file >= 64 << 20 and rss.peak >= rss.peak_file


def test_remember_timed_gives_the_cpu_per_id_and_the_slowest_request():
    from bench.dedupe import remember_timed
    from delayserver.dedupe import DedupeTable

    table = DedupeTable(3_600_000)
    per_id, slowest = remember_timed(table, 1000)
    assert len(table) == 1000 and per_id > 0 and 0 < slowest < 10


def test_the_ingest_bench_counts_the_steps_that_held_the_event_loop():
    from bench.harness import loop_stalls_ms

    log = "\n".join([
        "2026-11-30 00:01:02 WARNING delayserver.loop: event loop blocked for 112 ms by task receiver",
        "2026-11-30 00:01:03 INFO delayserver: something else",
        "2026-11-30 00:01:09 WARNING delayserver.loop: event loop blocked for 240 ms by task replayer, 30 ms of it "
        "in garbage collection (generation 2) (2 more slow steps since the last warning)",
    ])
    assert loop_stalls_ms(log) == [112, 240, 240, 240] and loop_stalls_ms("") == []


def test_the_crc_bench_times_each_way_of_the_kernels_crc(capsys):
    import bench.crc as crc
    from delayserver.native import records
    crc.main(["--rounds", "2000"])
    out = capsys.readouterr().out
    assert all(f"{size:>6,} bytes:" in out for size in crc.SIZES)
    assert out.count("three streams") == (len(crc.SIZES) if records.CRC32C_HARDWARE else 0)
    # The loop it times computes what one call does, round after round.
    import crc32c
    data = b"x" * 1100
    value = 0
    for _ in range(3):
        value = crc32c.crc32c(data, value=value)
    assert records.crc32c_rounds(data, 3, 0 if records.CRC32C_HARDWARE else 2) == value
