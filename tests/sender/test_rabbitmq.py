"""The RabbitMQ transport against a real rabbitmq-server (the `rabbitmq` fixture, one per test run)."""
from __future__ import annotations

import asyncio
import collections
import itertools

import aio_pika
import pytest
import trio

from delayserver.sender.rabbitmq import RabbitMqTransport
from delayserver.sender.transport import OutboundMessage, Outcome, make_transport
from tests.sender.conftest import restarted

_names = itertools.count()


def fresh(prefix: str) -> str:
    """A queue or exchange name no other test uses (the broker lives for the whole test run)."""
    return f"{prefix}.{next(_names)}"


def outbound(i: int, subject: str, **changes) -> OutboundMessage:
    fields = dict(
        message_id=f"m{i}", subject=subject, body=b"\x00body\xff%d" % i, headers={"trace": f"t{i}", "k": "v"},
        schedule_time=1_700_000_000_000 + i, dispatch_time=1_700_000_000_500 + i, attempt=2,
    )
    fields.update(changes)
    return OutboundMessage(**fields)


def transport(rabbitmq, **options) -> RabbitMqTransport:
    return make_transport("rabbitmq", rabbitmq.url, options, data_dir=None)


def amqp(rabbitmq, fn):
    """Run `fn(channel)` (a coroutine function) on a fresh aio-pika connection: the consumer's side."""
    async def main():
        connection = await aio_pika.connect(rabbitmq.url)
        async with connection:
            return await fn(await connection.channel())
    return asyncio.run(main())


def declare_queue(rabbitmq, name: str, **arguments) -> None:
    async def declare(channel):
        await channel.declare_queue(name, durable=True, arguments=arguments or None)
    amqp(rabbitmq, declare)


def drain(rabbitmq, queue: str) -> list[aio_pika.IncomingMessage]:
    """Every message now in `queue`, taken off it."""
    async def get_all(channel):
        q = await channel.declare_queue(queue, durable=True, passive=True)
        out = []
        while (message := await q.get(no_ack=True, fail=False)) is not None:
            out.append(message)
        return out
    return amqp(rabbitmq, get_all)


async def test_batch_lands_with_body_headers_and_properties(rabbitmq):
    subject = fresh("orders")
    declare_queue(rabbitmq, subject)
    async with transport(rabbitmq) as t:
        results = await t.send_batch([outbound(1, subject), outbound(2, subject, headers={})])
    assert [r.outcome for r in results] == [Outcome.ACKED] * 2

    first, second = drain(rabbitmq, subject)
    assert first.body == b"\x00body\xff1" and second.body == b"\x00body\xff2"
    assert first.message_id == "m1" and first.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert first.headers == {
        "trace": "t1", "k": "v", "delayserver-id": "m1", "delayserver-subject": subject,
        "delayserver-schedule-time": 1_700_000_000_001, "delayserver-dispatch-time": 1_700_000_000_501,
        "delayserver-attempt": 2,
    }
    assert set(second.headers) == {"delayserver-id", "delayserver-subject", "delayserver-schedule-time",
                                   "delayserver-dispatch-time", "delayserver-attempt"}
    assert int(first.timestamp.timestamp()) == 1_700_000_000


async def test_exchange_and_routing_key_template_route_the_message(rabbitmq):
    exchange, queue = fresh("delays"), fresh("bound")

    async def topology(channel):
        ex = await channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC, durable=True)
        q = await channel.declare_queue(queue, durable=True)
        await q.bind(ex, "due.#")
    amqp(rabbitmq, topology)

    async with transport(rabbitmq, exchange=exchange, routing_key="due.{subject}") as t:
        results = await t.send_batch([outbound(1, "pay.events"), outbound(2, "orders")])
    assert [r.outcome for r in results] == [Outcome.ACKED] * 2
    assert [m.routing_key for m in drain(rabbitmq, queue)] == ["due.pay.events", "due.orders"]


async def test_unroutable_message_is_rejected_with_its_reason_and_the_rest_acked(rabbitmq):
    subject = fresh("routed")
    declare_queue(rabbitmq, subject)
    nowhere = fresh("nowhere")
    async with transport(rabbitmq) as t:
        results = await t.send_batch([outbound(1, subject), outbound(2, nowhere), outbound(3, subject)])
    assert [r.outcome for r in results] == [Outcome.ACKED, Outcome.REJECTED, Outcome.ACKED]
    assert "312 NO_ROUTE" in results[1].detail and repr(nowhere) in results[1].detail
    assert [m.message_id for m in drain(rabbitmq, subject)] == ["m1", "m3"]


async def test_unroutable_rule_retry_keeps_it_for_later(rabbitmq):
    subject = fresh("later")
    async with transport(rabbitmq, unroutable="retry") as t:
        [result] = await t.send_batch([outbound(1, subject)])
        assert result.outcome is Outcome.RETRY and "NO_ROUTE" in result.detail
        declare_queue(rabbitmq, subject)  # the consumer starts and declares its queue
        [result] = await t.send_batch([outbound(1, subject)])
    assert result.outcome is Outcome.ACKED
    assert [m.message_id for m in drain(rabbitmq, subject)] == ["m1"]


async def test_nack_from_a_full_queue_is_retry(rabbitmq):
    subject = fresh("full")
    declare_queue(rabbitmq, subject, **{"x-max-length": 1, "x-overflow": "reject-publish"})
    async with transport(rabbitmq) as t:
        first = await t.send_batch([outbound(1, subject)])
        second = await t.send_batch([outbound(2, subject), outbound(3, subject)])
    assert [r.outcome for r in first] == [Outcome.ACKED]
    assert [r.outcome for r in second] == [Outcome.RETRY] * 2
    assert "nack" in second[0].detail.lower()


async def test_missing_exchange_is_retry_and_the_transport_recovers(rabbitmq):
    subject = fresh("after")
    declare_queue(rabbitmq, subject)
    exchange = fresh("absent")
    async with transport(rabbitmq, exchange=exchange) as t:
        results = await t.send_batch([outbound(1, subject), outbound(2, subject)])
        assert [r.outcome for r in results] == [Outcome.RETRY] * 2
        assert "NOT_FOUND" in results[0].detail

        async def create(channel):
            ex = await channel.declare_exchange(exchange, aio_pika.ExchangeType.DIRECT, durable=True)
            q = await channel.declare_queue(subject, durable=True, passive=True)
            await q.bind(ex, subject)
        amqp(rabbitmq, create)
        results = await t.send_batch([outbound(1, subject), outbound(2, subject)])
    assert [r.outcome for r in results] == [Outcome.ACKED] * 2


async def test_a_repeated_id_in_one_batch_is_published_twice(rabbitmq):
    subject = fresh("twice")
    declare_queue(rabbitmq, subject)
    async with transport(rabbitmq) as t:
        results = await t.send_batch([outbound(1, subject), outbound(1, subject, body=b"again"), outbound(2, "x." + subject)])
    assert [r.outcome for r in results] == [Outcome.ACKED, Outcome.ACKED, Outcome.REJECTED]
    assert [m.body for m in drain(rabbitmq, subject)] == [b"\x00body\xff1", b"again"]


async def test_routing_key_over_255_bytes_is_rejected(rabbitmq):
    async with transport(rabbitmq, routing_key="{subject}." + "k" * 250) as t:
        [result] = await t.send_batch([outbound(1, "orders")])
    assert result.outcome is Outcome.REJECTED and "255" in result.detail


async def test_wrong_password_is_retry_with_a_clear_detail(rabbitmq):
    async with transport(rabbitmq, password="wrong") as t:
        with trio.fail_after(30):
            [result] = await t.send_batch([outbound(1, "orders")])
    assert result.outcome is Outcome.RETRY
    assert "cannot connect" in result.detail and "ACCESS_REFUSED" in result.detail
    assert "wrong" not in result.detail


async def test_credentials_options_override_the_address(rabbitmq):
    subject = fresh("creds")
    declare_queue(rabbitmq, subject)
    address = f"amqp://{rabbitmq.address}/"
    async with make_transport("rabbitmq", address, {"username": "delay", "password": "secret"}, data_dir=None) as t:
        [result] = await t.send_batch([outbound(1, subject)])
    assert result.outcome is Outcome.ACKED


async def test_tls_with_a_private_ca(rabbitmq):
    subject = fresh("secure")
    declare_queue(rabbitmq, subject)
    ca_file = str(rabbitmq.tls[0])
    async with make_transport("rabbitmq", rabbitmq.tls_url, {"tls_ca_file": ca_file}, data_dir=None) as t:
        [result] = await t.send_batch([outbound(1, subject)])
    assert result.outcome is Outcome.ACKED
    async with make_transport("rabbitmq", rabbitmq.tls_url, {"timeout_ms": 2000}, data_dir=None) as t:
        with trio.fail_after(30):
            [result] = await t.send_batch([outbound(2, subject)])
    assert result.outcome is Outcome.RETRY and "CERTIFICATE_VERIFY_FAILED" in result.detail
    assert [m.message_id for m in drain(rabbitmq, subject)] == ["m1"]


async def test_connection_refused_is_retry(unused_port):
    async with make_transport("rabbitmq", f"127.0.0.1:{unused_port}", {"timeout_ms": 1000}, data_dir=None) as t:
        with trio.fail_after(30):
            [result] = await t.send_batch([outbound(1, "orders")])
    assert result.outcome is Outcome.RETRY and "cannot connect" in result.detail


async def test_broker_that_never_answers_times_out_with_retry(silent_server):
    async with make_transport("rabbitmq", silent_server, {"timeout_ms": 300}, data_dir=None) as t:
        with trio.fail_after(30):
            results = await t.send_batch([outbound(1, "orders"), outbound(2, "orders")])
    assert [r.outcome for r in results] == [Outcome.RETRY] * 2


@pytest.mark.slow
async def test_broker_down_then_back_loses_nothing(rabbitmq):
    subject = fresh("flap")
    declare_queue(rabbitmq, subject)
    async with transport(rabbitmq, timeout_ms=2000) as t:
        assert [r.outcome for r in await t.send_batch([outbound(1, subject)])] == [Outcome.ACKED]
        with restarted(rabbitmq):
            await trio.to_thread.run_sync(rabbitmq.stop)
            with trio.fail_after(30):
                results = await t.send_batch([outbound(2, subject), outbound(3, subject)])
            assert [r.outcome for r in results] == [Outcome.RETRY] * 2
        results = await t.send_batch([outbound(2, subject), outbound(3, subject)])
    assert [r.outcome for r in results] == [Outcome.ACKED] * 2
    assert [m.message_id for m in drain(rabbitmq, subject)] == ["m1", "m2", "m3"]


@pytest.mark.slow
async def test_broker_killed_mid_batch_loses_nothing_and_repeats_only_unconfirmed(rabbitmq):
    """kill -9 of the broker while batches are in flight: every message it confirmed is in the
    queue after the restart; sending the unconfirmed ones again delivers everything, and only an
    unconfirmed message can be there twice."""
    subject = fresh("crash")
    declare_queue(rabbitmq, subject)
    rabbitmq.persist_definitions()  # the broker's own definition must outlive the kill
    batches = [[outbound(b * 1000 + i, subject, body=b"x" * 512) for i in range(1000)] for b in range(20)]
    results: dict[str, Outcome] = {}

    async def send(t, batch):
        for m, r in zip(batch, await t.send_batch(batch)):
            results[m.message_id] = r.outcome

    async with transport(rabbitmq, timeout_ms=5000) as t:
        await send(t, batches[0])  # connected and flowing before the kill
        with restarted(rabbitmq):
            async with trio.open_nursery() as nursery:
                for batch in batches[1:]:
                    nursery.start_soon(send, t, batch)
                await trio.sleep(0.3)
                await trio.to_thread.run_sync(rabbitmq.kill)
        confirmed = {i for i, o in results.items() if o is Outcome.ACKED}
        unconfirmed = [m for batch in batches for m in batch if results[m.message_id] is Outcome.RETRY]
        assert len(confirmed) + len(unconfirmed) == 20_000
        assert confirmed and unconfirmed, "the kill should land mid-stream; make the batches bigger"

        arrived = [m.message_id for m in drain(rabbitmq, subject)]
        assert confirmed <= set(arrived), "a confirmed message was lost"
        for attempt in range(10):  # as the sender does: the unconfirmed again, in batches
            retry = []
            for k in range(0, len(unconfirmed), 1000):
                retry += await t.send_batch(unconfirmed[k:k + 1000])
            unconfirmed = [m for m, r in zip(unconfirmed, retry) if r.outcome is not Outcome.ACKED]
            if not unconfirmed:
                break
    arrived += [m.message_id for m in drain(rabbitmq, subject)]
    assert set(arrived) == {m.message_id for batch in batches for m in batch}
    twice = {i for i, n in collections.Counter(arrived).items() if n > 1}
    assert not twice & confirmed, "a message confirmed the first time was delivered again"
