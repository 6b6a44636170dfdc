"""Serving an ASGI app from the node's trio nursery with hypercorn's trio worker."""
from __future__ import annotations

import functools
import logging

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve


async def serve_asgi(app, host: str, port: int, *, certfile: str = "", keyfile: str = "",
                     read_timeout_s: float = 10.0, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` on host:port (TLS with certfile and keyfile); `task_status.started(port)` once
    bound, with the port actually bound (port 0 picks a free one). A client that sends nothing
    for `read_timeout_s` in the middle of a request is dropped (slow-trickle clients)."""
    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("delayserver.http.server")
    config.graceful_timeout = 1.0
    config.read_timeout = read_timeout_s
    if certfile:
        config.certfile, config.keyfile = certfile, keyfile
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(functools.partial(serve, app, config))
        bound = int(binds[0].rsplit(":", 1)[1])
        task_status.started(bound)
