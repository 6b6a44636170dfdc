"""A node in-process with its HTTP API on a free 127.0.0.1 port, and an HTTP client for it."""
from __future__ import annotations

import httpx
import pytest

from delayserver.config import Config
from delayserver.node.server import DelayServer

SECRET = "s3cret-token"


def node_config(tmp_path, **kw) -> Config:
    base = dict(data_dir=str(tmp_path / "data"), listen="127.0.0.1:0", http_listen="127.0.0.1:0",
                max_message_bytes=4096, max_frame_bytes=64 * 1024, max_delay="1d", segment_scale="1m")
    base.update(kw)
    return Config.from_dict(base)


async def start_node(nursery, config: Config) -> DelayServer:
    server = DelayServer(config)
    await nursery.start(server.serve)
    return server


@pytest.fixture
async def node(tmp_path, nursery):
    return await start_node(nursery, node_config(tmp_path, auth_secret=SECRET))


@pytest.fixture
async def api(node):
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{node.http_port}", timeout=10,
                                 headers={"Authorization": f"Bearer {SECRET}"}) as client:
        yield client
