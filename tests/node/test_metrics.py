"""Metrics: a scrape of a running node parsed with prometheus-client's own parser."""
from __future__ import annotations

import itertools

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from delayserver.client import AsyncProducer, Message
from delayserver.metrics import RecentHistogram
from tests.node.conftest import SECRET, node_config, start_node


async def scrape(port: int, token: str = SECRET) -> dict:
    async with httpx.AsyncClient() as client:
        r = await client.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(families: dict, name: str, suffix: str = "", **labels) -> float:
    family = families[name]
    matches = [s.value for s in family.samples if s.name == name + suffix and all(
        s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (name, suffix, labels, family.samples)
    return matches[0]


async def test_a_scrape_parses_and_its_figures_match_the_node(tmp_path, nursery):
    node = await start_node(nursery, node_config(tmp_path, auth_secret=SECRET, metrics_listen="127.0.0.1:0"))
    async with AsyncProducer(f"127.0.0.1:{node.port}", secret=SECRET) as producer:
        await producer.send_many([Message("m.now", b"x") for _ in range(5)])
        await producer.send_many([Message("m.later", b"x", delay=600_000) for _ in range(3)])
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {SECRET}"}) as client:
        r = await client.post(f"http://127.0.0.1:{node.http_port}/v1/messages", json={"subject": "m.h", "delay_ms": 600_000})
        assert r.status_code == 200
    with trio.fail_after(10):
        while node.sender.delivered < 5 or node.replayer.offset < node.receiver.durable_offset:
            await trio.sleep(0.01)
    await node.backlog.refresh()

    families = await scrape(node.http_port)
    for family in families.values():
        assert family.documentation, f"{family.name} has no HELP"
    assert families["delayserver_received"].type == "counter"
    assert value(families, "delayserver_received", "_total") == 9
    assert value(families, "delayserver_delivered", "_total") == 5
    assert value(families, "delayserver_broker_group_delivered", "_total", broker_group="spool") == 5
    assert value(families, "delayserver_broker_group_inflight", broker_group="spool") == 0
    assert value(families, "delayserver_broker_group_breaker", broker_group="spool", state="closed") == 1
    assert value(families, "delayserver_broker_group_breaker", broker_group="spool", state="open") == 0
    assert families["delayserver_lateness_seconds"].type == "histogram"
    assert value(families, "delayserver_lateness_seconds", "_count", broker_group="spool") == 5
    assert value(families, "delayserver_lateness_seconds", "_bucket", broker_group="spool", le="+Inf") == 5
    assert value(families, "delayserver_ack_latency_seconds", "_count", api="binary") == 2
    assert value(families, "delayserver_ack_latency_seconds", "_count", api="http") == 1
    assert value(families, "delayserver_pending") == 4
    pending = {s.labels["bucket"]: s.value for s in families["delayserver_bucket_pending"].samples}
    assert sum(pending.values()) == 4 and all(len(b) == 12 for b in pending)
    assert value(families, "delayserver_wheel_entries") == len(node.ticks.wheel)
    assert 1 <= value(families, "delayserver_dispatch_log_fsyncs", "_total") == node.sender.dispatch_fsyncs
    assert value(families, "delayserver_due_disk_reads", "_total") == node.sender.due.disk_reads
    assert value(families, "delayserver_load_disk_reads", "_total") == node.ticks.load_disk_reads
    assert value(families, "delayserver_due_read_ahead", "_total") == node.ticks.ahead.hits
    assert value(families, "delayserver_read_ahead_bytes") == node.ticks.ahead.held_bytes
    assert value(families, "delayserver_event_loop_slow_steps", "_total") == node.loop_watch.slow_steps
    assert value(families, "delayserver_event_loop_longest_step_seconds") == node.loop_watch.longest_s
    assert value(families, "delayserver_gc_pause_seconds", "_total") == node.loop_watch.gc_seconds
    assert node.loop_watch.on_gc in __import__("gc").callbacks  # the serving node times collections
    # Every fsync timed, per log (the process's: other tests' nodes may have added to them).
    assert families["delayserver_fsync_seconds"].type == "histogram"
    for log in ("message_log", "dispatch_log", "spool"):
        count = value(families, "delayserver_fsync_seconds", "_count", log=log)
        assert count >= 1 and value(families, "delayserver_fsync_seconds", "_bucket", log=log, le="+Inf") == count
        assert value(families, "delayserver_fsync_seconds", "_sum", log=log) > 0
    assert value(families, "delayserver_fsync_longest_seconds") > 0

    # The metrics port serves the same registry, open as before.
    async with httpx.AsyncClient() as client:
        r = await client.get(f"http://127.0.0.1:{node.metrics_port}/metrics")
    assert r.status_code == 200
    assert "delayserver_delivered_total 5.0" in r.text
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"http://127.0.0.1:{node.metrics_port}/other")).status_code == 404


async def test_replication_lag_is_exported_on_master_and_slave(tmp_path, nursery):
    master = await start_node(nursery, node_config(tmp_path / "m"))
    slave = await start_node(nursery, node_config(tmp_path / "s", replicate_from=f"127.0.0.1:{master.port}"))
    async with AsyncProducer(f"127.0.0.1:{master.port}") as producer:
        await producer.send("r.x", b"x", delay=600_000)
    with trio.fail_after(20):
        while slave.store.message_log.end_offset < master.receiver.durable_offset or not slave.slave.in_sync:
            await trio.sleep(0.02)
    on_slave = await scrape(slave.http_port)
    assert value(on_slave, "delayserver_replication_lag_bytes", peer=f"127.0.0.1:{master.port}") == 0
    assert value(on_slave, "delayserver_replication_lag_seconds", peer=f"127.0.0.1:{master.port}") == 0
    on_master = await scrape(master.http_port)
    [sample] = on_master["delayserver_replication_lag_bytes"].samples
    assert sample.value == 0


def test_recent_histogram_keeps_only_its_window():
    now = [1000.0]
    h = RecentHistogram((0.01, 0.1), window_s=60, slice_s=10, clock=lambda: now[0])
    h.observe(0.005)
    h.observe(0.05)
    h.observe(5)
    assert h.counts() == [1, 1, 1]
    now[0] += 30
    h.observe(0.005)
    assert h.counts() == [2, 1, 1] and h.counts(within_s=10) == [1, 0, 0]
    now[0] += 45
    assert h.counts() == [1, 0, 0]
    now[0] += 60
    assert h.counts() == [0, 0, 0]


async def test_every_metric_the_grafana_dashboard_queries_is_exported(tmp_path, nursery, webhook_server):
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "ops" / "grafana" / "delayserver.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    wanted = {m for e in exprs for m in re.findall(r"\b(delayserver_[a-z_]+)\{", e)}
    assert len(wanted) > 15
    node = await start_node(nursery, node_config(tmp_path, auth_secret=SECRET))
    async with AsyncProducer(f"127.0.0.1:{node.port}", secret=SECRET) as producer:
        await producer.send("d.x", b"x")
    with trio.fail_after(10):
        while node.sender.delivered < 1:
            await trio.sleep(0.01)
    families = await scrape(node.http_port)
    # Sample names (with _total, _bucket suffixes) and family names (a labelled family may have no
    # sample yet: no bucket pending, no slave).
    exported = set(families) | {s.name for f in families.values() for s in f.samples}
    assert wanted - exported == set()


def test_the_lateness_histogram_observed_in_batches_scrapes_as_prometheus_clients_own():
    """Lateness is counted a batch at a time (a bisection per value, no lock): what a scrape shows
    is what prometheus-client's Histogram shows for the same values, bound for bound, per group,
    values on a bound included."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest
    from prometheus_client.utils import floatToGoString

    from delayserver.metrics import LATENESS_BUCKETS, NodeMetrics

    ours = NodeMetrics()
    registry = CollectorRegistry()
    reference = Histogram("delayserver_lateness_seconds", "Delivery time minus schedule time of delivered messages.",
                          ["broker_group"], buckets=LATENESS_BUCKETS, registry=registry)
    batches = {"spool": [0, 1, 2, 3, 5, 10, 25, 49, 50, 51, 999, 1000, 60_000, 61_000],
               "redis": [7] * 5 + [250, 2500]}
    for group, lateness_ms in batches.items():
        ours.delivered(group, lateness_ms)
        ours.delivered(group, lateness_ms[:3])
        for ms in lateness_ms + lateness_ms[:3]:
            reference.labels(group).observe(ms / 1000)

    def samples(registry):
        families = text_string_to_metric_families(generate_latest(registry).decode())
        return sorted((s.name, tuple(sorted(s.labels.items())), s.value) for f in families
                      if f.name == "delayserver_lateness_seconds" for s in f.samples if not s.name.endswith("_created"))

    mine, theirs = samples(ours.registry), samples(registry)
    assert [s[:2] for s in mine] == [s[:2] for s in theirs] and len(mine) == 2 * (len(LATENESS_BUCKETS) + 3)
    for (name, _, got), (_, _, expected) in zip(mine, theirs):
        # The sums add a batch at a time, in another order: equal but for float rounding.
        assert got == (pytest.approx(expected) if name.endswith("_sum") else expected)
    assert ours.recent_lateness.counts()[0] == 4  # 0 and 1 ms, in the whole batch and its first three
    # The recent histogram counts as the exported one does (both from one tally of each batch).
    recent = ours.recent_lateness.counts()
    exported = {s[1]: s[2] for s in mine if s[0].endswith("_bucket")}
    per_bound = [exported[(("broker_group", "redis"), ("le", b))] + exported[(("broker_group", "spool"), ("le", b))]
                 for b in [floatToGoString(x) for x in LATENESS_BUCKETS] + ["+Inf"]]
    assert list(itertools.accumulate(recent)) == per_bound


def test_lateness_is_tallied_in_milliseconds_at_the_bounds_it_has_in_seconds():
    from delayserver.metrics import LATENESS_BOUNDS_MS, LATENESS_BUCKETS, _tally, lateness_slots

    assert [b / 1000 for b in LATENESS_BOUNDS_MS] == list(LATENESS_BUCKETS)
    values = list(range(-3, 1003)) + [2499, 2500, 2501, 59_999, 60_000, 60_001, 10**9]
    expected = [0] * (len(LATENESS_BUCKETS) + 1)
    _tally(expected, LATENESS_BUCKETS, [ms / 1000 for ms in values])
    slots = lateness_slots(values)
    assert [slots.get(i, 0) for i in range(len(expected))] == expected
    for batch in (list(range(0, 1001)), [0, 1, 2, 3, 1000], [1001], [-1, 5], []):  # within the table, or not
        expected = [0] * (len(LATENESS_BUCKETS) + 1)
        _tally(expected, LATENESS_BUCKETS, [ms / 1000 for ms in batch])
        slots = lateness_slots(batch)
        assert [slots.get(i, 0) for i in range(len(expected))] == expected, batch
