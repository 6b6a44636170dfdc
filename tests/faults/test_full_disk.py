"""Full disk: the data directory is a small tmpfs that the test mounts and fills.

The broker group is a real redis-server on another filesystem, so that delivery does not need the
full disk: what must keep working is the node's own bookkeeping (schedule_log, dispatch_log,
checkpoints), which lives on the released reserve (config `reserve_bytes`). The data directory is
the mount point itself, so the server's log (kept next to the data directory) is not on it.

Skipped, with the reason, only where the machine refuses the mount (not root, or a container that
forbids it).
"""
from __future__ import annotations

import errno
import os
import subprocess
import time

import pytest
import redis
import trio

from delayserver.client import AsyncProducer
from delayserver.message import DelayServerError, Handle, ResultCode
from tests.faults.harness import (
    Ledger, assert_verify_passes, check_deliveries, now_ms, redis_deliveries, seeded_rng, wait_until_delivered,
    write_config,
)
from tests.procs import ServerProcess

pytestmark = pytest.mark.slow

DISK_SIZE = "8m"
RESERVE = "1MiB"
LEFT_FREE = 256 << 10  # what the filler leaves for message_log to fill
SEND_BATCH_SIZE, BATCHES_IN_FLIGHT = 128, 2
IN_FLIGHT_MAX = SEND_BATCH_SIZE * BATCHES_IN_FLIGHT  # acked by the broker, not yet recorded, at a kill


@pytest.fixture
def small_disk(tmp_path):
    """A DISK_SIZE tmpfs mounted at tmp_path/data, unmounted at teardown."""
    mount_point = tmp_path / "data"
    mount_point.mkdir()
    try:
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE},mode=0755", "tmpfs",
                                 str(mount_point)], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no mount command on this machine: the full-disk test needs a small filesystem")
    if result.returncode != 0:
        pytest.skip(f"this machine forbids mounting a tmpfs ({result.stderr.strip() or result.returncode}); "
                    "the full-disk test needs it")
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], check=True)


def free_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path, leave: int) -> None:
    """Grow a filler file until no more than `leave` bytes are free, or the disk is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for chunk in (64 << 10, 4 << 10):
            while free_bytes(path.parent) >= leave + chunk:
                os.write(fd, b"\0" * chunk)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)


async def send_batch(producer: AsyncProducer, ledger: Ledger, rng, n: int, max_delay_ms: int) -> list:
    messages = [ledger.new_message(rng, max_delay_ms) for _ in range(n)]
    results = await producer.send_many(messages)
    ledger.record(messages, results)
    return results


def codes(results) -> set:
    return {ResultCode.OK if isinstance(r, Handle) else r.code if isinstance(r, DelayServerError) else type(r).__name__
            for r in results}


@pytest.mark.parametrize("how", ["filled-by-message-log", "killed-and-restarted-while-full",
                                 "filled-by-another-process"])
async def test_full_disk_refuses_new_messages_keeps_delivering_and_resumes_when_space_is_freed(
        small_disk, redis_server, tmp_path, how):
    seed, rng = seeded_rng()
    config = write_config(tmp_path / "server.toml", {
        "message_log_segment_bytes": "64KiB",
        "segment_scale": "1m",
        "reserve_bytes": RESERVE,
        "send_batch_size": SEND_BATCH_SIZE,
        "send_batches_in_flight": BATCHES_IN_FLIGHT,
    }, broker_groups=[{"name": "redis", "transport": "redis", "address": redis_server.address}])
    proc = ServerProcess(small_disk, args=["--config", str(config), "--flush", "sync"])
    ledger = Ledger(prefix=f"disk{seed}")
    client = redis.Redis(host=redis_server.host, port=redis_server.port)
    try:
        await trio.to_thread.run_sync(proc.start)
        async with AsyncProducer(proc.address, timeout=10) as producer:
            # Due 4 to 7 s from now: after the disk has filled up.
            due_later = [ledger.new_message(rng, 7000, min_delay_ms=4000) for _ in range(300)]
            ledger.record(due_later, await producer.send_many(due_later))
            assert len(ledger.acked) == 300, ledger.refused[:3]

            filler = small_disk / "filler"
            if how == "filled-by-another-process":
                fill(filler, 0)
                full_at = now_ms()
            else:
                fill(filler, LEFT_FREE)
                full_at = None
                for _ in range(1000):
                    results = await send_batch(producer, ledger, rng, 20, 1500)
                    if ResultCode.DISK_FULL in codes(results):
                        full_at = now_ms()
                        break
                assert full_at is not None, f"message_log never filled the disk ({free_bytes(small_disk)} bytes free)"
                assert codes(results) <= {ResultCode.OK, ResultCode.DISK_FULL}, ledger.refused[-3:]
        cuts = []
        if how == "killed-and-restarted-while-full":
            await trio.to_thread.run_sync(proc.kill)
            # A batch the broker acked just before the kill, whose dispatch record the full disk
            # refused, is delivered again after the restart: in flight at a kill.
            cuts.append(now_ms())
            await trio.to_thread.run_sync(proc.start)

        # Full: the messages already stored come due and go out, with no producer sending meanwhile
        # (a refused send must not be what makes room for delivery); then new messages are refused.
        expected = {m.message_id for m in due_later}
        while not expected <= {d.message_id for d in redis_deliveries(client)}:
            assert now_ms() < full_at + 20_000, (
                f"due messages were not delivered while the disk was full: {proc.log_text()[-2000:]}")
            await trio.sleep(0.2)
        came_due_while_full = {m.message_id for m in due_later if ledger.acked[m.message_id] > full_at}
        assert len(came_due_while_full) >= 100, "the disk took too long to fill: little came due while it was full"
        async with AsyncProducer(proc.address, timeout=10) as producer:
            assert codes(await send_batch(producer, ledger, rng, 5, 0)) == {ResultCode.DISK_FULL}

            filler.unlink()
            freed_at = time.monotonic()
            while ResultCode.OK not in codes(await send_batch(producer, ledger, rng, 1, 0)):
                assert time.monotonic() < freed_at + 10, "sends did not resume once space was free"
                await trio.sleep(0.1)
            results = await send_batch(producer, ledger, rng, 200, 1000)
            assert codes(results) == {ResultCode.OK}
        await trio.to_thread.run_sync(
            lambda: wait_until_delivered(ledger, lambda: redis_deliveries(client), timeout_s=30))
        assert await trio.to_thread.run_sync(proc.terminate) == 0, proc.log_text()[-3000:]
        deliveries = redis_deliveries(client)
    finally:
        proc.kill()
        client.close()
    refused = [e for e in ledger.refused if e.code != ResultCode.DISK_FULL]
    assert not refused, refused[:3]
    print(check_deliveries(ledger, deliveries, cuts=cuts, max_per_cut=IN_FLIGHT_MAX, context=f"seed {seed}"))
    assert_verify_passes(small_disk)
