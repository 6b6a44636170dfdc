"""Nodes in-process on free 127.0.0.1 ports for the replication tests."""
from __future__ import annotations

import trio

from delayserver.config import Config
from delayserver.node.server import DelayServer
from delayserver.sender.spool import iter_spool


def cfg(tmp_path, name, **kw) -> Config:
    return Config.from_dict({"data_dir": str(tmp_path / name), "listen": "127.0.0.1:0", **kw})


async def start(nursery, config: Config) -> DelayServer:
    server = DelayServer(config)
    await nursery.start(server.serve)
    return server


async def wait_until(predicate, timeout_s: float = 30) -> None:
    """Real sockets and threads: generous, for a loaded machine."""
    with trio.fail_after(timeout_s):
        while not predicate():
            await trio.sleep(0.02)


def spooled_ids(server_or_dir, subject: str) -> list[str]:
    data_dir = getattr(getattr(server_or_dir, "config", None), "data_dir", server_or_dir)
    return [m.message_id for _, _, _, m in iter_spool(data_dir, subject)]
