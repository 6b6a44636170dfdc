"""I/O faults at every durable write site of a real server process (DELAYSERVER_IO_FAULT).

For each site (a write, fsync, rename or directory fsync of message_log, schedule_log,
dispatch_log, a checkpoint or the spool, failing with EIO or ENOSPC, once or for good), producers
send under load until the fault fires. Then:

- the ack ledger: the node logs the message_log durable offset at which it turned read-only; every
  message acknowledged OK lies before it in message_log, and none written past it was acknowledged
  (so nothing written since the last good fsync of a failed file was ever counted durable), and
  every refusal is READ_ONLY (DISK_FULL where a write found the disk full);
- the node stays up and answers status while read-only;
- after a kill -9 and a restart without the fault, every acknowledged message is delivered, none
  corrupt or early, and `delayctl verify` passes.

The first test is the fsync-once demo: one EIO at the fsync that seals a message_log segment
(a roll) while group commit has batches written to that segment and waiting for their fsync.
"""
from __future__ import annotations

import re

import pytest
import trio

from delayserver.client import AsyncProducer
from delayserver.ctl.segments import SegmentFile
from delayserver.message import ResultCode
from delayserver.message import Handle, MessageState
from delayserver.storage.record import RecordType
from tests.faults.harness import (
    Ledger, assert_verify_passes, check_deliveries, drive, now_ms, seeded_rng, spool_deliveries,
    wait_until_delivered, write_config,
)
from tests.procs import ServerProcess

pytestmark = pytest.mark.slow

MAX_DELAY_MS = 2000
READ_ONLY_AT = re.compile(r"read-only at message_log durable offset (\d+)")
FIRED = re.compile(r"failpoint fired: (\S+) (\S+) (\S+) (\S+) at (\d+)")

# (fault, whether the node must turn read-only, what refusals are allowed)
SITES = [
    ("fsync:message_log:EIO@20", True, {ResultCode.READ_ONLY}),
    ("fsync:message_log:ENOSPC@20", True, {ResultCode.READ_ONLY}),
    ("write:message_log:EIO@20", True, {ResultCode.READ_ONLY}),
    ("dirfsync:message_log:EIO@2", True, {ResultCode.READ_ONLY}),
    ("write:message_log:ENOSPC@20", False, {ResultCode.DISK_FULL}),
    ("fsync:schedule_log:EIO@5", True, {ResultCode.READ_ONLY}),
    ("write:schedule_log:EIO@5", True, {ResultCode.READ_ONLY}),
    ("dirfsync:schedule_log:EIO@1", True, {ResultCode.READ_ONLY}),
    ("fsync:checkpoint:EIO@3", True, {ResultCode.READ_ONLY}),
    ("rename:checkpoint:EIO@3", True, {ResultCode.READ_ONLY}),
    ("dirfsync:checkpoint:EIO@3", True, {ResultCode.READ_ONLY}),
    ("write:dispatch_log:EIO@3", True, {ResultCode.READ_ONLY}),
    ("fsync:dispatch_log:EIO@3+", True, {ResultCode.READ_ONLY}),
    ("write:spool:EIO@3", True, {ResultCode.READ_ONLY}),
    ("fsync:spool:EIO@3", True, {ResultCode.READ_ONLY}),
    ("write:spool:ENOSPC@3+", False, set()),
]


def message_log_offsets(data_dir) -> dict[str, int]:
    """id -> global message_log offset of every MESSAGE record on disk."""
    out = {}
    for path in sorted((data_dir / "message_log").glob("*.log")):
        base = int(path.name[:-4])
        for pos, rtype, value in SegmentFile(path).records():
            if rtype == RecordType.MESSAGE:
                out[value.message_id] = base + pos
    return out


async def run_with_fault(tmp_path, fault: str, *, read_only: bool, allowed: set, batch=(1, 32),
                         segment_bytes: str = "64KiB", producers: int = 4, pause_ms=(0, 5)) -> dict:
    seed, rng = seeded_rng()
    config = write_config(tmp_path / "server.toml", {
        "message_log_segment_bytes": segment_bytes,
        "segment_scale": "1m",
        "checkpoint_interval_ms": 100,
        "send_batch_size": 64,
        "reserve_bytes": "1MiB",
    })
    proc = ServerProcess(tmp_path / "data", args=["--config", str(config), "--flush", "sync"],
                         env={"DELAYSERVER_IO_FAULT": fault})
    ledger = Ledger(prefix=f"io{seed}")
    try:
        await trio.to_thread.run_sync(proc.start)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: drive(proc.address, ledger, rng, stop, max_delay_ms=MAX_DELAY_MS,
                                             producers=producers, batch=batch, pause_ms=pause_ms))
            # Generous: a loaded machine is slow, and a fault may need a checkpoint or a delivery.
            with trio.move_on_after(60):
                while "failpoint fired" not in proc.log_text() or (read_only and not READ_ONLY_AT.search(
                        proc.log_text())) or (read_only and not ledger.refused):
                    await trio.sleep(0.05)
            await trio.sleep(0.5)  # traffic goes on after the fault
            stop.set()
        log_text = proc.log_text()
        assert FIRED.search(log_text), f"{fault}: the fault never fired:\n{log_text[-3000:]}"
        assert proc.process.poll() is None, f"{fault}: the node stopped:\n{log_text[-3000:]}"
        codes = {e.code for e in ledger.refused}
        assert codes <= allowed, f"{fault}: refusals {codes}, expected only {allowed}: {ledger.refused[:3]}"
        if read_only:
            assert codes, f"{fault}: nothing was refused after the fault"
            # Still serving: status of an acknowledged message is answered while read-only.
            some_id, schedule_time = next(iter(ledger.acked.items()))
            async with AsyncProducer(proc.address, timeout=30) as producer:
                status = await producer.status(Handle(schedule_time, some_id))
            assert status.state in (MessageState.PENDING, MessageState.DELIVERED)
        proc.kill()
        killed = now_ms()

        offsets = message_log_offsets(proc.data_dir)
        assert set(ledger.acked) <= set(offsets), "an acknowledged message is missing from message_log"
        if read_only:
            (durable,) = {int(m) for m in READ_ONLY_AT.findall(log_text)}
            late = sorted(i for i in ledger.acked if offsets[i] >= durable)
            assert not late, (f"{fault}: {len(late)} messages written after the last good fsync "
                              f"(offset {durable}) were acknowledged: {late[:10]}")

        proc.env = {}
        await trio.to_thread.run_sync(proc.start)
        await trio.to_thread.run_sync(
            lambda: wait_until_delivered(ledger, lambda: spool_deliveries(proc.data_dir), timeout_s=90))
        last_due = max(s.not_before for s in ledger.sent.values())
        await trio.sleep(max(0, last_due - now_ms()) / 1000 + 0.5)
        assert await trio.to_thread.run_sync(proc.terminate) == 0, proc.log_text()[-3000:]
    finally:
        proc.kill()
    # Redeliveries are allowed (dispatch records that were never durable): only loss, damage and
    # earliness are checked.
    report = check_deliveries(ledger, spool_deliveries(proc.data_dir), cuts=[killed], window_ms=1 << 40,
                              max_per_cut=1 << 40, context=f"seed {seed}, {fault}")
    print(fault, report)
    assert_verify_passes(proc.data_dir)
    return {"log": log_text, "ledger": ledger}


async def test_one_eio_at_a_segment_roll_fsync_acknowledges_nothing_written_to_that_segment_since(tmp_path):
    """The demo: before the fix, batches written to the segment being sealed were fsynced again
    through a new descriptor (which succeeds) and acknowledged OK after READ_ONLY replies."""
    # Many producers without pauses: group commit always has batches written and waiting.
    result = await run_with_fault(tmp_path, "fsync:roll:EIO@2", read_only=True, allowed={ResultCode.READ_ONLY},
                                  batch=(16, 64), segment_bytes="256KiB", producers=12, pause_ms=(0, 0))
    assert FIRED.search(result["log"]).group(1, 2) == ("fsync", "roll")


@pytest.mark.parametrize("fault,read_only,allowed", SITES, ids=[s[0] for s in SITES])
async def test_an_io_fault_acknowledges_nothing_after_it_and_loses_nothing_acknowledged(tmp_path, fault, read_only,
                                                                                      allowed):
    result = await run_with_fault(tmp_path, fault, read_only=read_only, allowed=allowed)
    # The fault fired, and every message acknowledged around it was delivered after the restart.
    assert FIRED.search(result["log"])
    delivered = {d.message_id for d in spool_deliveries(tmp_path / "data")}
    assert set(result["ledger"].acked) <= delivered
