"""A broker that stops acknowledging for a moment (its disk stalled) holds back none of the
batches falling due meanwhile: each is handed over, carrying its dispatch time, without waiting
for the acknowledgements before it.

The server runs in-process over real sockets, with its default settings, and delivers to the
spool; the spool's writes wait on an event the test holds."""
from __future__ import annotations

import trio

from delayserver.client import AsyncProducer
from delayserver.config import Config
from delayserver.node.server import DelayServer
from tests.sender.test_dispatch_sync import spooled_ids, wait_until


class AcksHeld:
    """Wraps a transport's `send_batch`: records the ids handed over (with their dispatch times);
    each batch is written, and acknowledged, only once `released` is set."""

    def __init__(self, send_batch):
        self.send_batch = send_batch
        self.handed: dict[str, int] = {}
        self.released = trio.Event()

    async def __call__(self, messages):
        self.handed.update((m.message_id, m.dispatch_time) for m in messages)
        await self.released.wait()
        return await self.send_batch(messages)


async def test_batches_falling_due_while_the_broker_holds_an_acknowledgement_are_handed_over(tmp_path, nursery):
    cfg = Config.from_dict(dict(data_dir=str(tmp_path / "data"), listen="127.0.0.1:0", send_wait_ms=1,
                                broker_group=[{"name": "spool", "transport": "spool"}]))
    server = DelayServer(cfg)
    await nursery.start(server.serve)
    group = server.sender.groups["spool"]
    held = AcksHeld(group.transport.send_batch)
    group.transport.send_batch = held
    try:
        async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
            first = await prod.send("slow.q", b"first", delay=0)
            await wait_until(lambda: first.message_id in held.handed)
            # Each message below falls due on its own and goes as a batch of its own. With two
            # batches in flight per group, as before, the third waited for the broker.
            later = []
            for i in range(10):
                h = await prod.send("slow.q", b"later %d" % i, delay=0)
                await wait_until(lambda: h.message_id in held.handed)
                assert held.handed[h.message_id] >= h.schedule_time
                later.append(h)
        assert spooled_ids(server, "slow.q") == set()
        assert server.sender.delivered == 0 and group.inflight == 11
        held.released.set()
        await wait_until(lambda: server.sender.delivered == 11)
        spooled = spooled_ids(server, "slow.q")
        assert spooled == {first.message_id} | {h.message_id for h in later}
        assert group.inflight == 0
    finally:
        held.released.set()
