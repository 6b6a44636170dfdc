"""An asyncio event loop in its own thread, for client libraries that exist only for asyncio.

The RabbitMQ and NATS clients are asyncio libraries; the server runs on trio. Each of those
transports owns one `AsyncioThread`: a daemon thread running an asyncio loop, where the client's
connection lives and all its calls run. A trio task hands it a coroutine with `run` and sleeps
until the result comes back, so the trio loop is never blocked and asyncio never sees trio.

The cost of a crossing (one `run` of a coroutine that does nothing) is measured by
`ops/bench deliver --bridge`.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Awaitable, Callable

import trio


class AsyncioThread:
    """One asyncio loop on a daemon thread, started on first use and stopped by `close`."""

    def __init__(self, name: str):
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _start(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                started = threading.Event()

                def main() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(started.set)
                    loop.run_forever()
                    loop.close()

                self._thread = threading.Thread(target=main, name=f"asyncio {self.name}", daemon=True)
                self._thread.start()
                started.wait()
                self._loop = loop
            return self._loop

    async def run(self, async_fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """`await async_fn(*args)` on the asyncio loop; its result, or the exception it raised.

        Cancelling the trio task cancels the asyncio task and waits until it has finished, so
        nothing it does outlives the call.
        """
        loop = self._start()
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        started: list[asyncio.Task] = []

        def start() -> None:
            task = loop.create_task(async_fn(*args))
            task.add_done_callback(lambda _: token.run_sync_soon(done.set))
            started.append(task)

        loop.call_soon_threadsafe(start)
        try:
            await done.wait()
        except trio.Cancelled:
            # call_soon_threadsafe keeps order: start() has run by the time this does.
            loop.call_soon_threadsafe(lambda: started[0].cancel())
            with trio.CancelScope(shield=True):
                await done.wait()
            raise
        return started[0].result()

    async def close(self, final: Callable[[], Awaitable[Any]] | None = None) -> None:
        """Run `final()` on the loop if given (errors ignored), then stop the loop and its thread."""
        if self._loop is None:
            return
        if final is not None:
            try:
                await self.run(final)
            except Exception:  # closing a broken connection may fail; the loop goes anyway
                pass
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        loop.call_soon_threadsafe(loop.stop)
        await trio.to_thread.run_sync(thread.join)


async def send_batch_on(thread: "AsyncioThread", publish_batch, messages, name: str, unacked: str) -> list:
    """A transport's `send_batch` over its asyncio thread: one crossing for the batch, and one log
    line when some messages were not acknowledged (they are retried)."""
    from delayserver.sender.transport import Outcome

    if not messages:
        return []
    results = await thread.run(publish_batch, list(messages))
    failed = [r for r in results if r.outcome is Outcome.RETRY]
    if failed:
        logging.getLogger("delayserver.sender").warning(
            "%s: %d of %d %s, will retry: %s", name, len(failed), len(messages), unacked, failed[0].detail)
    return results
