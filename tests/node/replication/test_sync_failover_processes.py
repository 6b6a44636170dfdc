"""replication = "sync" with real processes: kill -9 the master while producers are being
acknowledged, promote the slave, and every acknowledged id is on it (cancels included)."""
from __future__ import annotations

import trio

from delayserver.client import AsyncProducer
from delayserver.message import CancelOutcome, DelayServerError, MessageState, ResultCode

from tests.procs import ServerProcess

HOUR = 3_600_000
PRODUCERS = 4
KILL_AFTER = 200


async def test_every_id_acknowledged_in_sync_mode_survives_kill_9_of_the_master(tmp_path):
    config = tmp_path / "master.toml"
    config.write_text('replication = "sync"\nsync_timeout_ms = "60s"\n')
    master = ServerProcess(tmp_path / "m", ["--config", str(config)]).start()
    slave = ServerProcess(tmp_path / "s", ["--replicate-from", master.address]).start()
    acked, cancelled = [], []
    try:
        async def produce(k: int, killed: trio.Event) -> None:
            i = 0
            async with AsyncProducer(master.address, timeout=20) as prod:
                while not killed.is_set():
                    try:
                        handle = await prod.send("fo.q", f"p{k}-{i}".encode(), delay=HOUR)
                    except DelayServerError as e:
                        if e.code == ResultCode.NOT_ENOUGH_REPLICAS:  # the slave is not in sync yet
                            await trio.sleep(0.05)
                            continue
                        raise
                    acked.append(handle)
                    if i % 10 == 3 and await prod.cancel(handle) == CancelOutcome.CANCELLED:
                        cancelled.append(handle)
                    i += 1
                    if len(acked) >= KILL_AFTER and not killed.is_set():
                        master.kill()  # SIGKILL, with the other producers' requests in flight
                        killed.set()

        killed = trio.Event()
        with trio.fail_after(240):
            async with trio.open_nursery() as nursery:
                for k in range(PRODUCERS):
                    nursery.start_soon(_until_the_master_dies, produce, k, killed)
        slave.kill()
        promoted = ServerProcess(tmp_path / "s").start()
        try:
            async with AsyncProducer(promoted.address, timeout=60) as prod:
                cancelled_ids = {h.message_id for h in cancelled}
                for handle in acked:
                    state = (await prod.status(handle)).state
                    want = MessageState.CANCELLED if handle.message_id in cancelled_ids else MessageState.PENDING
                    assert state == want, (handle, state)
        finally:
            promoted.kill()
    finally:
        master.kill()
        slave.kill()
    assert len(acked) >= KILL_AFTER and cancelled


async def _until_the_master_dies(produce, k: int, killed: trio.Event) -> None:
    try:
        await produce(k, killed)
    except (OSError, ConnectionError, TimeoutError, DelayServerError, trio.BrokenResourceError):
        assert killed.is_set(), "a producer failed before the master was killed"
