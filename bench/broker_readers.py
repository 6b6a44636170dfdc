"""What the deliver benchmark reads back from RabbitMQ and NATS JetStream, with the brokers' own
clients (aio-pika, nats-py), and the cost of one trio -> asyncio crossing of the transports."""
from __future__ import annotations

import asyncio
import time

import aio_pika
import nats
import trio
import nats.errors
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from bench.workload import Delivered
from delayserver.sender.asyncio_bridge import AsyncioThread


def declare_queue(url: str, queue: str) -> None:
    """A durable queue named after the subject (the default exchange routes the subject to it)."""
    async def main():
        async with await aio_pika.connect(url) as connection:
            await (await connection.channel()).declare_queue(queue, durable=True)
    asyncio.run(main())


def queue_reader(url: str, queue: str):
    """A function returning what arrived in `queue` since its last call (consumed and acked).

    Each message is acked once it is taken: a message the broker had pushed to this consumer when
    the call ends goes back to the queue, for the next call (with `no_ack`, one pushed just as the
    call ended was dropped by the client: "lost for consumer with no_ack")."""
    def more() -> list[Delivered]:
        async def main():
            out = []
            async with await aio_pika.connect(url) as connection:
                channel = await connection.channel()
                await channel.set_qos(prefetch_count=2000)
                q = await channel.declare_queue(queue, durable=True)
                async with q.iterator() as messages:
                    while True:
                        try:
                            m = await asyncio.wait_for(messages.__anext__(), 0.5)
                        except asyncio.TimeoutError:
                            return out
                        h = m.headers
                        out.append(Delivered(m.message_id, int(h["delayserver-schedule-time"]),
                                             int(h["delayserver-dispatch-time"])))
                        await m.ack()
        return asyncio.run(main())
    return more


def add_stream(url: str, subject: str) -> None:
    async def main():
        nc = await nats.connect(url)
        try:
            await nc.jetstream().add_stream(StreamConfig(name=subject.replace(".", "_"), subjects=[subject]))
        finally:
            await nc.close()
    asyncio.run(main())


def stream_reader(url: str, subject: str):
    """A function returning what JetStream stored on `subject` since its last call (through a
    durable pull consumer without acks); the arrival time is the stream's own timestamp."""
    def more() -> list[Delivered]:
        async def main():
            nc = await nats.connect(url)
            out = []
            try:
                js = nc.jetstream()
                consumer = await js.pull_subscribe(subject, durable="bench", stream=subject.replace(".", "_"),
                                                   config=ConsumerConfig(ack_policy=AckPolicy.NONE))
                while True:
                    try:
                        messages = await consumer.fetch(5000, timeout=0.5)
                    except (nats.errors.TimeoutError, asyncio.TimeoutError):  # fetch raises either
                        return out
                    for m in messages:
                        h = m.headers
                        out.append(Delivered(h["Nats-Msg-Id"], int(h["delayserver-schedule-time"]),
                                             int(h["delayserver-dispatch-time"]),
                                             int(m.metadata.timestamp.timestamp() * 1000)))
            finally:
                await nc.close()
        return asyncio.run(main())
    return more


def bridge_cost(n: int = 20_000) -> tuple[float, float]:
    """(microseconds per sequential crossing, crossings per second with 64 trio tasks at once) of
    AsyncioThread.run with a coroutine that does nothing."""
    async def nothing():
        return None

    async def main():
        bridge = AsyncioThread("bench")
        await bridge.run(nothing)
        start = time.perf_counter()
        for _ in range(n):
            await bridge.run(nothing)
        sequential = (time.perf_counter() - start) / n * 1e6

        async def worker(k):
            for _ in range(k):
                await bridge.run(nothing)
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(64):
                nursery.start_soon(worker, n // 64)
        parallel = (n // 64 * 64) / (time.perf_counter() - start)
        await bridge.close()
        return sequential, parallel
    return trio.run(main)
