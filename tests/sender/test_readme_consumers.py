"""README's consumer examples for the RabbitMQ and NATS JetStream broker groups, run as written
(only the broker's address moved) in a process of their own against the real brokers: a message
the transport delivers is printed by the example, with the fields the README says it carries."""
from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import aio_pika
import nats as nats_py
import trio
from nats.js.errors import NotFoundError

from delayserver.sender.transport import OutboundMessage, Outcome, make_transport

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
WAIT_S = 90  # a loaded machine starts a Python process and connects slowly


def consumer_example(title: str) -> str:
    """The python block of README's `### title` subsection."""
    heading = f"\n### {title}\n"
    start = README.index(heading) + len(heading)
    end = re.compile(r"^##+ ", re.M).search(README, start)
    [code] = re.findall(r"^```python\n(.*?)^```$", README[start:end.start() if end else None], re.M | re.S)
    return code


class Consumer:
    """The example running in a process of its own; its stdout lines collected as they come."""

    def __init__(self, code: str):
        self.process = subprocess.Popen([sys.executable, "-u", "-c", code], cwd=REPO, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def check_running(self) -> None:
        if self.process.poll() is not None:
            raise AssertionError(f"the example exited with {self.process.returncode}: {self.process.stderr.read()}")

    async def first_line(self) -> str:
        deadline = time.monotonic() + WAIT_S
        while not self.lines:
            self.check_running()
            assert time.monotonic() < deadline, "the example printed nothing"
            await trio.sleep(0.05)
        return self.lines[0]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stderr.close()


async def deliver_once_the_consumer_is_ready(consumer: Consumer, transport, message: OutboundMessage) -> None:
    """Send until the broker takes the message: until the example has declared its queue or
    stream, the transport answers RETRY (rabbitmq, `unroutable = "retry"`) or parks it (nats)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        [result] = await transport.send_batch([message])
        if result.outcome is Outcome.ACKED:
            return
        consumer.check_running()
        assert time.monotonic() < deadline, f"never delivered: {result}"
        await trio.sleep(0.2)


def outbound(message_id: str) -> OutboundMessage:
    return OutboundMessage(message_id=message_id, subject="orders.paid", body=b"paid 42", headers={"k": "v"},
                           schedule_time=1_700_000_000_000, dispatch_time=1_700_000_000_007, attempt=1)


async def test_the_rabbitmq_consumer_example_prints_what_is_delivered(rabbitmq):
    code = consumer_example("RabbitMQ")
    assert "amqp://delay:secret@127.0.0.1:5672/" in code
    consumer = Consumer(code.replace("amqp://delay:secret@127.0.0.1:5672/", rabbitmq.url))
    try:
        async with make_transport("rabbitmq", rabbitmq.url, {"unroutable": "retry"}, data_dir=None) as t:
            await deliver_once_the_consumer_is_ready(consumer, t, outbound("readme-rabbit"))
        assert await consumer.first_line() == "readme-rabbit 1700000000000 1 b'paid 42'"
    finally:
        consumer.stop()

        async def delete_queue():
            async with await aio_pika.connect(rabbitmq.url) as connection:
                await (await connection.channel()).queue_delete("orders.paid")
        asyncio.run(delete_queue())


async def test_the_nats_consumer_example_prints_what_is_delivered(nats):
    code = consumer_example("NATS JetStream")
    assert "nats://delay:secret@127.0.0.1:4222" in code
    consumer = Consumer(code.replace("nats://delay:secret@127.0.0.1:4222", nats.url))
    try:
        async with make_transport("nats", nats.url, {}, data_dir=None) as t:
            await deliver_once_the_consumer_is_ready(consumer, t, outbound("readme-nats"))
        assert await consumer.first_line() == "readme-nats 1700000000000 1 b'paid 42'"
    finally:
        consumer.stop()

        async def delete_stream():
            connection = await nats_py.connect(nats.url)
            try:
                await connection.jetstream().delete_stream("ORDERS")
            except NotFoundError:
                pass  # the example never got to add it
            finally:
                await connection.close()
        asyncio.run(delete_stream())

