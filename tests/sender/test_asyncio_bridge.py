"""The trio -> asyncio bridge of the rabbitmq and nats transports."""
from __future__ import annotations

import asyncio
import threading

import pytest
import trio

from delayserver.sender.asyncio_bridge import AsyncioThread


async def test_runs_the_coroutine_on_its_own_asyncio_thread_and_returns_its_result():
    bridge = AsyncioThread("test")

    async def where(x):
        await asyncio.sleep(0)
        return x * 2, threading.current_thread().name, asyncio.get_running_loop()

    doubled, thread, loop = await bridge.run(where, 21)
    again = await bridge.run(where, 1)
    await bridge.close()
    assert doubled == 42 and thread == "asyncio test" and thread != threading.current_thread().name
    assert again[2] is loop, "one loop for the life of the bridge"


async def test_an_exception_comes_back_to_the_trio_task():
    bridge = AsyncioThread("test")

    async def fail():
        raise ConnectionResetError("gone")

    with pytest.raises(ConnectionResetError, match="gone"):
        await bridge.run(fail)
    await bridge.close()


async def test_cancelling_the_trio_task_cancels_the_asyncio_task():
    bridge = AsyncioThread("test")
    cancelled = threading.Event()

    async def forever():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with trio.move_on_after(0.2):
        await bridge.run(forever)
    assert cancelled.is_set()
    await bridge.close()


async def test_close_runs_the_final_coroutine_and_stops_the_thread():
    bridge = AsyncioThread("test")
    closed = []

    async def final():
        closed.append(True)

    await bridge.run(asyncio.sleep, 0)
    thread = bridge._thread
    await bridge.close(final)
    assert closed == [True]
    assert not thread.is_alive()
