"""The worker threads of the node's own disk work: the fsyncs that acknowledgements and deliveries
wait for, and the reads of records falling due.

They run under a limiter of their own (`DISK_THREADS`), not trio's default one, which every other
blocking call in the process shares (the backlog scan, dedupe saves, id-index merges, the meta
agent's files, library calls). However much of that work is under way, an acknowledgement never
waits for a thread. Each broker transport that blocks in threads has its own limiter too
(`delayserver.sender.transport.TRANSPORT_THREADS`).
"""
from __future__ import annotations

from typing import Any, Callable

import trio

#: Worker threads the node's fsyncs and due reads may hold at once.
DISK_THREADS = 16

_limiter: trio.lowlevel.RunVar = trio.lowlevel.RunVar("delayserver_disk_threads")


def disk_limiter() -> trio.CapacityLimiter:
    """This trio run's limiter for the node's disk work (made on first use)."""
    try:
        return _limiter.get()
    except LookupError:
        limiter = trio.CapacityLimiter(DISK_THREADS)
        _limiter.set(limiter)
        return limiter


async def run_disk(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a worker thread of the disk limiter."""
    return await trio.to_thread.run_sync(fn, *args, limiter=disk_limiter())
