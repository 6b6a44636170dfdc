"""message_log never runs more than `max_unsynced_bytes` past its last completed fsync.

Recovery relies on this bound to tell a power-loss tail from corruption (storage/message_log.py).
A node in this process takes concurrent sends while each fsync is slowed down (so that group
commit piles writes up behind it); every append is checked against the bound, and a request too
large to ever fit is refused with MESSAGE_TOO_LARGE.
"""
from __future__ import annotations

import time

import trio

from delayserver.client import AsyncProducer, Message
from delayserver.config import Config
from delayserver.message import ResultCode
from delayserver.node.server import DelayServer
from delayserver.storage import message_log as message_log_module
from delayserver.storage.store import Store

MAX_UNSYNCED = 4096


async def test_writes_wait_for_the_fsync_in_progress_rather_than_run_past_the_bound(tmp_path, monkeypatch):
    real_open = Store.open.__func__
    monkeypatch.setattr(Store, "open", classmethod(
        lambda cls, root, **kw: real_open(cls, root, **{"max_unsynced_bytes": MAX_UNSYNCED, **kw})))
    real_fsync = message_log_module.fsync_path

    def slow_fsync(path):
        time.sleep(0.02)  # a slow disk: the group commit writes on meanwhile
        real_fsync(path)

    monkeypatch.setattr(message_log_module, "fsync_path", slow_fsync)
    server = DelayServer(Config.from_dict(dict(data_dir=str(tmp_path / "node"), listen="127.0.0.1:0",
                                               flush="sync", reserve_bytes=0, max_delay="1d")))
    worst = []

    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        message_log = server.store.message_log
        real_append = message_log.append

        def checked_append(data, epoch=None):
            offset = real_append(data, epoch)
            worst.append(message_log.end_offset - server.receiver.durable_offset)
            return offset

        message_log.append = checked_append

        async def produce(n):
            async with AsyncProducer(f"127.0.0.1:{server.port}") as p:
                for i in range(15):
                    results = await p.send_many([Message("q", b"x" * 100, delay=60_000, message_id=f"p{n}-{i}-{j}")
                                                 for j in range(5)])
                    assert all(not isinstance(r, Exception) for r in results), results

        async with trio.open_nursery() as producers:
            for n in range(8):
                producers.start_soon(produce, n)

        async with AsyncProducer(f"127.0.0.1:{server.port}") as p:
            too_big = await p.send_many([Message("q", b"y" * 1000, delay=0, message_id=f"big-{j}") for j in range(8)])
        assert {getattr(r, "code", None) for r in too_big} == {ResultCode.MESSAGE_TOO_LARGE}
        nursery.cancel_scope.cancel()
    assert max(worst) <= MAX_UNSYNCED, max(worst)
    assert sum(1 for w in worst if w > MAX_UNSYNCED // 2) > 0, "the load never came near the bound"
