"""A real delay server delivering to a real broker that is killed (kill -9) while messages fall
due and comes back seconds later: every acknowledged message arrives, none early; JetStream's
dedupe keeps each id once, and RabbitMQ repeats at most what can have been in flight unconfirmed
(the sender's batches in flight for the group) at the kill."""
from __future__ import annotations

import collections
import contextlib
import time

import pytest

from bench import broker_readers
from bench.deliver import send_workload
from bench.harness import DelayServerProcess, now_ms
from bench.workload import SUBJECT, Workload
from tests.sender.conftest import restarted

pytestmark = pytest.mark.slow

WORKLOAD = Workload(n=3000, window_ms=3000, producers=4, batch=64)
BATCH, IN_FLIGHT = 128, 2
#: How long after the window all must have arrived: the outage, then the sender's back-off (30 s cap).
DRAIN_S = 90
#: How long the broker stays dead before its restart begins.
OUTAGE_S = 2


def deliver_through_an_outage(tmp_path, broker, group_config: str, reader) -> list:
    config = tmp_path / "server.toml"
    config.write_text(f"send_batch_size = {BATCH}\nsend_batches_in_flight = {IN_FLIGHT}\n"
                      f'[[broker_group]]\nname = "broker"\n{group_config}')
    with contextlib.ExitStack() as stack:
        server = DelayServerProcess(tmp_path / "data", config)
        stack.callback(server.stop)
        server.start()
        t0 = now_ms() + WORKLOAD.lead_ms
        load = send_workload(server.address, WORKLOAD, t0)
        assert load["acked"] == WORKLOAD.n
        with restarted(broker):
            time.sleep(max(0, t0 + WORKLOAD.window_ms // 3 - now_ms()) / 1000)
            broker.kill()
            killed = now_ms()
            time.sleep(OUTAGE_S)
        delivered, ids = [], set()
        deadline = time.monotonic() + DRAIN_S
        while len(ids) < WORKLOAD.n and time.monotonic() < deadline:
            new = reader()
            delivered += new
            ids.update(d.message_id for d in new)
            time.sleep(0.5)
    assert len(ids) == WORKLOAD.n, f"{WORKLOAD.n - len(ids)} acknowledged messages never arrived"
    assert all(d.dispatch_time >= d.schedule_time for d in delivered), "a message went out early"
    first, last = min(d.dispatch_time for d in delivered), max(d.dispatch_time for d in delivered)
    # Deliveries before the kill, and after the broker had been dead for the whole outage (the last
    # ones may go out while its restart finishes: it takes connections before it reports ready).
    assert first < killed and last > killed + OUTAGE_S * 1000, \
        f"the outage should fall inside the delivery: first {first - t0}, killed {killed - t0}, " \
        f"last {last - t0} ms after the window opened"
    return delivered


def test_rabbitmq_killed_while_messages_fall_due(tmp_path, rabbitmq):
    queue = f"through.{time.monotonic_ns()}"
    broker_readers.declare_queue(rabbitmq.url, queue)
    rabbitmq.persist_definitions()  # the broker's own definition must outlive the kill
    delivered = deliver_through_an_outage(
        tmp_path, rabbitmq, f'transport = "rabbitmq"\naddress = "{rabbitmq.url}"\noptions = {{ routing_key = "{queue}" }}\n',
        broker_readers.queue_reader(rabbitmq.url, queue))
    repeated = sum(n - 1 for n in collections.Counter(d.message_id for d in delivered).values())
    assert repeated <= BATCH * IN_FLIGHT


def test_nats_killed_while_messages_fall_due(tmp_path, nats):
    prefix = f"through{time.monotonic_ns()}"
    subject = f"{prefix}.{SUBJECT}"
    broker_readers.add_stream(nats.url, subject)
    delivered = deliver_through_an_outage(
        tmp_path, nats, f'transport = "nats"\naddress = "{nats.url}"\noptions = {{ subject_template = "{prefix}.{{subject}}" }}\n',
        broker_readers.stream_reader(nats.url, subject))
    assert len(delivered) == WORKLOAD.n, "JetStream stored an id twice"
