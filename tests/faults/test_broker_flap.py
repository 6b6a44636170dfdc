"""A broker group flapping: a real redis-server stopped and started again and again while producers
send and messages come due.

redis-server runs without automatic persistence (the redis_server fixture); each stop is a
`SHUTDOWN SAVE`, so whatever redis acknowledged survives in its dump and is loaded when it starts
again. What is tested is the delay server: while the group is down its messages wait (retry with
back-off, circuit breaker), and once it is back they go out. Pass: every acknowledged id lands in
the redis streams (read with XRANGE) under the pass rule of harness.check_deliveries, where a
redelivery is allowed only for a batch in flight when redis went away; dispatch_log is complete
(`delayctl buckets --json` shows nothing pending); `delayctl verify` passes.

Knobs (environment): DELAYSERVER_FLAP_SECONDS (120: how long redis flaps), DELAYSERVER_FAULT_SEED.
"""
from __future__ import annotations

import socket

import pytest
import redis
import trio

from tests.faults.harness import (
    Ledger, assert_verify_passes, bucket_totals, check_deliveries, drive, env_int, now_ms, pending_buckets,
    redis_deliveries, seeded_rng, wait_until_delivered, write_config,
)
from tests.procs import ServerProcess

pytestmark = pytest.mark.slow

FLAP_SECONDS = env_int("DELAYSERVER_FLAP_SECONDS", 120)
SEND_BATCH_SIZE = 128
BATCHES_IN_FLIGHT = 2  # per broker group: at most this many batches acked by the broker, not yet recorded
#: A batch redis was writing when it shut down started at most this long before the shutdown.
IN_FLIGHT_WINDOW_MS = 2000
#: The sender's back-off is capped at 30 s: after the last outage, everything is out within that.
DRAIN_TIMEOUT_S = 60


def stop_keeping_data(server) -> None:
    """Stop redis-server with SHUTDOWN SAVE, so what it acknowledged is there when it starts again.

    Sent over a plain socket: redis-py would retry the connection the shutdown closes, with back-off,
    and so report the outage seconds after it began.
    """
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(b"SHUTDOWN SAVE\r\n")
        assert s.recv(1024) == b"", "redis-server did not shut down"
    server.process.wait(10)
    server.process = None


async def flap(server, rng, seconds: float, outages: list[int]) -> None:
    """Take redis down and up for `seconds`; each outage's start (epoch ms, once it is down) goes in `outages`."""
    deadline = trio.current_time() + seconds
    while trio.current_time() < deadline:
        await trio.sleep(rng.uniform(0.5, 3.0))
        await trio.to_thread.run_sync(stop_keeping_data, server)
        outages.append(now_ms())
        await trio.sleep(rng.uniform(0.5, 3.0))
        await trio.to_thread.run_sync(server.start)


async def test_a_flapping_broker_group_delays_its_messages_and_loses_none(tmp_path, redis_server):
    seed, rng = seeded_rng()
    config = write_config(tmp_path / "server.toml", {
        "segment_scale": "1m",
        "send_batch_size": SEND_BATCH_SIZE,
        "send_batches_in_flight": BATCHES_IN_FLIGHT,
    }, broker_groups=[{"name": "redis", "transport": "redis", "address": redis_server.address,
                       "options": {"timeout_ms": 1000}}])
    proc = ServerProcess(tmp_path / "data", args=["--config", str(config)])
    ledger = Ledger(prefix=f"flap{seed}")
    client = redis.Redis(host=redis_server.host, port=redis_server.port)
    outages: list[int] = []
    try:
        await trio.to_thread.run_sync(proc.start)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: drive(proc.address, ledger, rng, stop, producers=2, max_delay_ms=5000,
                                             batch=(1, 16), pause_ms=(10, 50), timeout=10))
            await flap(redis_server, rng, FLAP_SECONDS, outages)
            stop.set()
        assert ledger.unanswered == 0 and not ledger.refused, (ledger.unanswered, ledger.refused[:3])
        flapped_until = trio.current_time()
        await trio.to_thread.run_sync(
            lambda: wait_until_delivered(ledger, lambda: redis_deliveries(client), timeout_s=DRAIN_TIMEOUT_S,
                                         interval_s=1))
        print(f"everything delivered {trio.current_time() - flapped_until:.1f} s after the last outage ended")
        deliveries = redis_deliveries(client)
        assert await trio.to_thread.run_sync(proc.terminate) == 0, proc.log_text()[-3000:]
    finally:
        proc.kill()
        client.close()
    report = check_deliveries(ledger, deliveries, cuts=outages, window_ms=IN_FLIGHT_WINDOW_MS,
                              max_per_cut=SEND_BATCH_SIZE * BATCHES_IN_FLIGHT,
                              context=f"seed {seed}, {len(outages)} outages")
    print(report)
    assert len(outages) >= 3, "redis did not flap"
    late = sorted(d.dispatch_time - d.schedule_time for d in deliveries)
    print(f"lateness: median {late[len(late) // 2]} ms, worst {late[-1]} ms")
    assert late[-1] > 500, "no message waited for the broker group: the outages were never felt"
    assert pending_buckets(proc.data_dir, now_ms()) == []
    assert bucket_totals(proc.data_dir)["pending"] == 0
    assert_verify_passes(proc.data_dir)
