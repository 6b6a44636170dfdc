"""Crash loop: the real server killed with SIGKILL at random moments, restarted on the same data.

Each round starts the server (flush=sync, 64 KiB message_log segments so that rolls happen all the
time, frequent checkpoints), runs concurrent producers sending messages due 0 to 10 s later, and
kills it at a random moment: while it serves, and in one round of eight while it is still
recovering from the previous kill. Messages sent in earlier rounds come due during later ones, so
kills land in every stage: append, ack, replay, checkpoint, load, delivery. A last life runs until
everything has come due, then stops with SIGTERM, and the spool is checked with the pass rule of
harness.check_deliveries, then the data directory with `delayctl verify` and `delayctl buckets`.

Knobs (environment): DELAYSERVER_CRASH_ROUNDS (50), DELAYSERVER_CRASH_MAX_DELAY_MS (10000),
DELAYSERVER_CRASH_ROUND_MS (2000: the longest round), DELAYSERVER_FAULT_SEED.
"""
from __future__ import annotations

import threading
import time

import pytest
import trio

from tests.faults.harness import (
    Ledger, assert_verify_passes, bucket_totals, check_deliveries, drive, env_int, now_ms, seeded_rng,
    spool_deliveries, wait_until_delivered, write_config,
)
from tests.procs import ServerProcess

pytestmark = pytest.mark.slow

ROUNDS = env_int("DELAYSERVER_CRASH_ROUNDS", 50)
MAX_DELAY_MS = env_int("DELAYSERVER_CRASH_MAX_DELAY_MS", 10_000)
ROUND_MS = env_int("DELAYSERVER_CRASH_ROUND_MS", 2000)
SEND_BATCH_SIZE = 128
BATCHES_IN_FLIGHT = 2  # per broker group: at most this many batches acked by the broker, not yet recorded
#: A delivery the sender had not recorded in dispatch_log when the kill came happened at most this
#: long before the kill (one spool append and one dispatch_log append, each with its fsync).
IN_FLIGHT_WINDOW_MS = 3000  # generous for a loaded machine; max_per_cut bounds the count


def start_and_kill_while_recovering(proc: ServerProcess, after_s: float) -> bool:
    """Start the server and kill it `after_s` seconds after spawning, serving or not; True if it
    was still starting up when killed."""
    proc.process = None

    def killer():
        deadline = time.monotonic() + after_s
        while proc.process is None:
            time.sleep(0.001)
        time.sleep(max(0.0, deadline - time.monotonic()))
        proc.process.kill()

    thread = threading.Thread(target=killer)
    thread.start()
    try:
        proc.start()
        recovering = False
    except RuntimeError:
        recovering = True
    thread.join()
    proc.kill()
    return recovering


async def test_acknowledged_messages_survive_repeated_kill_9_and_are_delivered_on_time(tmp_path):
    seed, rng = seeded_rng()
    config = write_config(tmp_path / "server.toml", {
        "message_log_segment_bytes": "64KiB",
        "segment_scale": "1m",
        "checkpoint_interval_ms": 200,
        "send_batch_size": SEND_BATCH_SIZE,
        "send_batches_in_flight": BATCHES_IN_FLIGHT,
    })
    proc = ServerProcess(tmp_path / "data", args=["--config", str(config), "--flush", "sync"])
    ledger = Ledger(prefix=f"crash{seed}")
    cuts, recovering_kills = [], 0
    began = time.monotonic()
    try:
        for round_no in range(ROUNDS):
            if round_no % 8 == 7:
                recovering_kills += await trio.to_thread.run_sync(
                    start_and_kill_while_recovering, proc, rng.uniform(0.05, 0.6))
                cuts.append(now_ms())
                continue
            await trio.to_thread.run_sync(proc.start)
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: drive(proc.address, ledger, rng, stop, max_delay_ms=MAX_DELAY_MS,
                                                         batch=(1, 32), pause_ms=(5, 40)))
                await trio.sleep(rng.uniform(0.1, ROUND_MS / 1000))
                await trio.to_thread.run_sync(proc.kill)
                cuts.append(now_ms())
                stop.set()
        assert not ledger.refused, f"refused: {ledger.refused[:5]}"
        assert len(ledger.acked) > 50 * ROUNDS, f"too little traffic to mean anything: {len(ledger.acked)} acked"

        print(f"{ROUNDS} rounds in {time.monotonic() - began:.1f} s")
        await trio.to_thread.run_sync(proc.start)
        last_due = max(s.not_before for s in ledger.sent.values())
        timeout = max(0, last_due - now_ms()) / 1000 + 60
        await trio.to_thread.run_sync(
            lambda: wait_until_delivered(ledger, lambda: spool_deliveries(proc.data_dir), timeout_s=timeout,
                                         interval_s=2))
        # Messages stored but never acknowledged (the kill took the answer) come due too.
        await trio.sleep(max(0, last_due - now_ms()) / 1000 + 1)
        assert await trio.to_thread.run_sync(proc.terminate) == 0, proc.log_text()[-3000:]
        print(f"last life done at {time.monotonic() - began:.1f} s")
    finally:
        proc.kill()

    report = check_deliveries(ledger, spool_deliveries(proc.data_dir), cuts=cuts, window_ms=IN_FLIGHT_WINDOW_MS,
                              max_per_cut=SEND_BATCH_SIZE * BATCHES_IN_FLIGHT,
                              context=f"seed {seed}, {ROUNDS} rounds ({recovering_kills} killed while recovering)")
    print(report)
    assert_verify_passes(proc.data_dir)
    totals = bucket_totals(proc.data_dir)
    assert totals["pending"] == 0, f"seed {seed}: messages still pending after everything came due: {totals}"
