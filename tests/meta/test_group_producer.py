"""The group producer against a real node whose role changes under it."""
from __future__ import annotations

import trio

from delayserver import group_producer
from delayserver.config import Config
from delayserver.group_producer import AsyncGroupProducer
from delayserver.message import DelayServerError, ResultCode
from delayserver.node.server import DelayServer


async def test_a_group_answering_not_master_is_asked_again_after_a_wait_not_set_aside(tmp_path, monkeypatch):
    """A node whose lease is being renewed, or whose group is choosing a master, answers FENCED or
    NOT_MASTER for a moment. The producer set it aside for its cool-down and, the only group, gave
    up at once (NoDelayGroup in a clean-clone run of tests/meta/test_cluster.py)."""
    monkeypatch.setattr(group_producer, "ROLE_CHANGE_WAIT_S", 0.05)
    server = DelayServer(Config.from_dict({"data_dir": str(tmp_path / "n"), "listen": "127.0.0.1:0",
                                           "reserve_bytes": 0}))
    refusals = []
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        server.role.replicate_from = "127.0.0.1:1"  # not the master for a moment: NOT_MASTER
        # No meta server answers (port 1): the group producer keeps the groups it knows.
        async with AsyncGroupProducer("127.0.0.1:1", timeout=1.0) as producer:
            producer._groups = [("g", f"127.0.0.1:{server.port}")]
            producer._refreshed_at = trio.current_time()

            async def send(member):
                try:
                    return await member.send("role.q", b"x", delay=60_000)
                except DelayServerError as e:
                    refusals.append(e.code)
                    server.role.replicate_from = ""  # the node is master again
                    raise

            handle = await producer._each_group(send)
        assert refusals == [ResultCode.NOT_MASTER]
        assert handle.message_id
        await server.drain()
        nursery.cancel_scope.cancel()
