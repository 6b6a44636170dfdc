"""Stage failpoints: the server kills itself (SIGKILL) at an exact stage boundary, chosen from the
environment (DELAYSERVER_FAILPOINT=name@N: at the N-th time the boundary is crossed, so it trips
under traffic), then restarts without it; the pass rule of the crash loop applies.

Boundaries: after a message_log append before its fsync and ack; after the ack is released before
the replayer reads the batch; after the schedule segments' fsync before the replay checkpoint;
inside a checkpoint write before its rename; during a message_log segment roll; after a broker
acknowledged a batch before its dispatch_log records.
"""
from __future__ import annotations

import pytest
import trio

from delayserver.ctl.segments import SegmentFile
from delayserver.storage.record import RecordType
from tests.faults.harness import (
    Ledger, assert_verify_passes, bucket_totals, check_deliveries, drive, now_ms, seeded_rng, spool_deliveries,
    wait_until_delivered, write_config,
)
from tests.procs import ServerProcess

pytestmark = pytest.mark.slow

MAX_DELAY_MS = 3000
SEND_BATCH_SIZE = 128
BATCHES_IN_FLIGHT = 2  # per broker group: at most this many batches acked by the broker, not yet recorded
IN_FLIGHT_WINDOW_MS = 3000  # generous for a loaded machine; max_per_cut bounds the count

FAILPOINTS = [
    "after-append-before-ack@20",
    "after-ack-before-replay@20",
    "schedule-before-checkpoint@10",
    "checkpoint-before-rename@10",
    "segment-roll@5",
    "after-broker-ack@10",
]


def messages_in(data_dir, log: str, rtype: RecordType) -> dict[str, int]:
    """id -> schedule time of every `rtype` record in a log's segments, torn tails left out."""
    out = {}
    for path in sorted((data_dir / log).glob("*.log")):
        for _, t, value in SegmentFile(path).records():
            if t == rtype:
                message = value[1] if rtype == RecordType.SCHEDULED else value
                out[message.message_id] = message.schedule_time
    return out


async def run_until_killed(proc: ServerProcess, ledger: Ledger, rng, timeout_s: float = 60) -> int:
    """Drive producers until the process dies; returns when it died (epoch ms, right after)."""
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: drive(proc.address, ledger, rng, stop, max_delay_ms=MAX_DELAY_MS,
                                         batch=(1, 32), pause_ms=(2, 20)))
        with trio.move_on_after(timeout_s):
            while proc.process.poll() is None:
                await trio.sleep(0.005)
        died = now_ms()
        stop.set()
    assert proc.process.poll() == -9, (
        f"the failpoint did not kill the server within {timeout_s} s (returncode {proc.process.poll()}):\n"
        + proc.log_text()[-3000:])
    return died


@pytest.mark.parametrize("failpoint", FAILPOINTS)
async def test_kill_at_a_stage_boundary_loses_no_acknowledged_message(tmp_path, failpoint):
    seed, rng = seeded_rng()
    name = failpoint.partition("@")[0]
    config = write_config(tmp_path / "server.toml", {
        "message_log_segment_bytes": "64KiB",
        "segment_scale": "1m",
        "checkpoint_interval_ms": 200,
        "send_batch_size": SEND_BATCH_SIZE,
        "send_batches_in_flight": BATCHES_IN_FLIGHT,
    })
    proc = ServerProcess(tmp_path / "data", args=["--config", str(config), "--flush", "sync"],
                         env={"DELAYSERVER_FAILPOINT": failpoint})
    ledger = Ledger(prefix=f"fp{seed}")
    try:
        await trio.to_thread.run_sync(proc.start)
        died = await run_until_killed(proc, ledger, rng)
        assert not ledger.refused, f"refused: {ledger.refused[:5]}"

        if name == "after-ack-before-replay":
            # The kill came after the batch was durable and its acks released: count all of
            # message_log as acknowledged, and check that its last batch is in no schedule segment.
            stored = messages_in(proc.data_dir, "message_log", RecordType.MESSAGE)
            scheduled = messages_in(proc.data_dir, "schedule_log", RecordType.SCHEDULED)
            assert set(stored) - set(scheduled), "the kill left no acknowledged message that only message_log holds"
            for message_id, schedule_time in stored.items():
                ledger.acknowledge(message_id, schedule_time)

        proc.env = {}
        await trio.to_thread.run_sync(proc.start)
        last_due = max(s.not_before for s in ledger.sent.values())
        await trio.to_thread.run_sync(
            lambda: wait_until_delivered(ledger, lambda: spool_deliveries(proc.data_dir), timeout_s=60))
        await trio.sleep(max(0, last_due - now_ms()) / 1000 + 1)
        assert await trio.to_thread.run_sync(proc.terminate) == 0, proc.log_text()[-3000:]
    finally:
        proc.kill()

    report = check_deliveries(ledger, spool_deliveries(proc.data_dir), cuts=[died], window_ms=IN_FLIGHT_WINDOW_MS,
                              max_per_cut=SEND_BATCH_SIZE * BATCHES_IN_FLIGHT, context=f"seed {seed}, {failpoint}")
    print(report)
    if name == "after-broker-ack":
        assert report.redeliveries_per_cut, "the batch the broker acknowledged before the kill was not delivered again"
    assert_verify_passes(proc.data_dir)
    assert bucket_totals(proc.data_dir)["pending"] == 0
