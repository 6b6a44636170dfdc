"""The node's own disk work (the message_log fsync an acknowledgement waits for, the dispatch_log
fsync a delivery is settled by) runs in worker threads of its own limiter: with every thread of
trio's default limiter taken by other blocking work, a message is still acknowledged, delivered
and settled.

The server runs in-process over real sockets with its default settings (flush = "sync") and
delivers to the spool."""
from __future__ import annotations

import trio

from delayserver.client import AsyncProducer
from delayserver.config import Config
from delayserver.node.server import DelayServer
from delayserver.storage.threads import DISK_THREADS, disk_limiter, run_disk
from tests.sender.test_dispatch_sync import spooled_ids, wait_until


async def test_acknowledged_and_delivered_while_the_default_threads_are_all_taken(tmp_path, nursery):
    cfg = Config.from_dict(dict(data_dir=str(tmp_path / "data"), listen="127.0.0.1:0",
                                broker_group=[{"name": "spool", "transport": "spool"}]))
    server = DelayServer(cfg)
    await nursery.start(server.serve)
    default = trio.to_thread.current_default_thread_limiter()
    holders = [object() for _ in range(int(default.total_tokens))]
    for holder in holders:  # other blocking work holds every default thread
        default.acquire_on_behalf_of_nowait(holder)
    try:
        async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
            with trio.fail_after(30):
                h = await prod.send("threads.q", b"body", delay=0)
        await wait_until(lambda: server.sender.delivered == 1)
        assert spooled_ids(server, "threads.q") == {h.message_id}
        assert default.borrowed_tokens == default.total_tokens  # none of them was given back meanwhile
    finally:
        for holder in holders:
            default.release_on_behalf_of(holder)


async def test_run_disk_uses_one_limiter_per_run_of_disk_threads():
    assert disk_limiter() is disk_limiter()
    assert disk_limiter().total_tokens == DISK_THREADS
    assert await run_disk(lambda a, b: a + b, 2, 3) == 5
