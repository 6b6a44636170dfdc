"""Dedupe, reschedules and schedules follow replication: a promoted slave answers a retried send
with the first handle, keeps a moved message at its new time, and has the schedules."""
from __future__ import annotations

import trio

from delayserver.client import AsyncProducer
from delayserver.config import Config
from delayserver.message import MessageState
from delayserver.node.server import DelayServer

HOUR = 3_600_000


def cfg(tmp_path, name, **kw) -> Config:
    return Config.from_dict({"data_dir": str(tmp_path / name), "listen": "127.0.0.1:0", **kw})


async def wait_until(predicate, timeout_s: float = 30) -> None:
    with trio.fail_after(timeout_s):  # real nodes replicating: generous on a loaded machine
        while not predicate():
            await trio.sleep(0.02)


async def test_a_promoted_slave_keeps_dedupe_reschedules_and_schedules(tmp_path):
    handles = {}
    async with trio.open_nursery() as nursery:
        master = DelayServer(cfg(tmp_path, "m"))
        await nursery.start(master.serve)
        slave = DelayServer(cfg(tmp_path, "s", replicate_from=f"127.0.0.1:{master.port}"))
        await nursery.start(slave.serve)
        async with AsyncProducer(f"127.0.0.1:{master.port}") as prod:
            handles["pay"] = await prod.send("payments.capture", b"17", delay=HOUR, message_id="payment-17")
            old = await prod.send("orders.expire", b"42", delay=HOUR, message_id="order-42")
            handles["old"] = old
            handles["moved"] = (await prod.reschedule(old, delay=2 * HOUR)).handle
            await prod.put_schedule("nightly", "reports.nightly", "0 2 * * *", timezone="Europe/Berlin")
        end = master.store.message_log.end_offset
        await wait_until(lambda: slave.replayer.offset == end)
        assert "nightly" in slave.schedules.schedules
        nursery.cancel_scope.cancel()  # the master is lost
    promoted = DelayServer(cfg(tmp_path, "s"))
    async with trio.open_nursery() as nursery:
        await nursery.start(promoted.serve)
        async with AsyncProducer(f"127.0.0.1:{promoted.port}") as prod:
            again = await prod.send("payments.capture", b"17", delay=HOUR, message_id="payment-17")
            assert again == handles["pay"]
            assert await prod.send("orders.expire", b"42", delay=HOUR, message_id="order-42") == handles["moved"]
            assert (await prod.status(handles["old"])).state == MessageState.CANCELLED
            assert (await prod.status(handles["moved"])).state == MessageState.PENDING
            [nightly] = await prod.schedules()
            assert nightly["name"] == "nightly" and nightly["next"] is not None
        nursery.cancel_scope.cancel()
