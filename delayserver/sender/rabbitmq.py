"""The RabbitMQ transport: AMQP 0-9-1 publishes with publisher confirms.

Address: ``amqp://[user:password@]host[:port][/vhost]``, ``amqps://...`` (TLS), or ``host:port``.
Each message is published to `exchange` (default "": the default exchange, which routes to the
queue named by the routing key) with routing key `routing_key.format(subject=subject)` (default
"{subject}"), as a persistent message (delivery mode 2) with the `mandatory` flag, carrying:

    properties.message_id   the message id
    properties.timestamp    the dispatch time, in seconds
    headers                 the message's headers, then delayserver-id, delayserver-subject
                            (strings), delayserver-schedule-time, delayserver-dispatch-time
                            (epoch ms) and delayserver-attempt (1 on the first try), as integers
    body                    the body, byte for byte

The channel is in confirm mode: a message counts as delivered (ACKED, so the sender writes its
dispatch_log record) only once the broker has confirmed it, which for a persistent message in a
durable queue means written to disk. The rule for everything else:

- confirmed (basic.ack): ACKED.
- returned as unroutable (basic.return, 312 NO_ROUTE: no queue is bound for the routing key):
  REJECTED, so the message is parked with the reply text, exchange and routing key as its reason
  (redrive it once a queue is bound); with ``unroutable = "retry"`` it is RETRY instead, for
  setups where the queue is declared by a consumer that may not have started yet.
- negatively confirmed (basic.nack: the broker could not take it, e.g. a queue at its length
  limit with ``overflow = reject-publish``): RETRY.
- no confirm within `timeout_ms` (default 5000), the channel or connection closed (a missing
  exchange closes the channel with 404 NOT_FOUND), the broker unreachable or refusing the
  credentials: RETRY. Messages the broker had confirmed before the loss stay ACKED; only the
  unconfirmed ones are sent again, so only they can arrive twice.
- a routing key or header name longer than AMQP's 255 bytes: REJECTED (no broker takes it).

A lost connection is opened again by the next batch. Credentials come from the URL or the
`username` and `password` options; TLS from the amqps scheme or any of the `tls_ca_file`,
`tls_cert_file`, `tls_key_file` options (see `transport.tls_context`).

The client is aio-pika, an asyncio library: the connection and its channels live on the
transport's own asyncio thread (`asyncio_bridge`), and each batch crosses over once.
"""
from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any, Mapping, Sequence

import aio_pika
import aiormq
import attrs
import yarl

from delayserver.sender.asyncio_bridge import AsyncioThread, send_batch_on
from delayserver.sender.transport import (
    ACKED, DELAY_HEADERS, TLS_OPTIONS, DeliveryResult, OutboundMessage, Outcome, Transport, check_option_names,
    delay_header_values, int_option, str_option, template_option, tls_context,
)

log = logging.getLogger("delayserver.sender.rabbitmq")

DEFAULT_TIMEOUT_MS = 5000
DEFAULT_ROUTING_KEY = "{subject}"
UNROUTABLE_RULES = ("park", "retry")
#: AMQP's short strings (routing keys, header names) hold at most this many bytes.
MAX_SHORTSTR = 255
OPTIONS = {"exchange", "routing_key", "unroutable", "timeout_ms", "username", "password"} | TLS_OPTIONS


def amqp_headers(m: OutboundMessage) -> dict[str, Any]:
    """The headers table of the AMQP message for `m` (see the module docstring)."""
    headers: dict[str, Any] = dict(m.headers)
    headers.update(zip(DELAY_HEADERS, delay_header_values(m)))
    return headers


def _url(address: Any, options: Mapping[str, Any]) -> yarl.URL:
    if not isinstance(address, str) or not address:
        raise ValueError("rabbitmq transport: address must be an amqp:// or amqps:// URL or host:port")
    try:
        url = yarl.URL(address if "://" in address else f"amqp://{address}")
        port = url.port
    except ValueError as e:
        raise ValueError(f"rabbitmq transport: bad address {_redacted_text(address)!r}: {e}") from None
    if url.scheme not in ("amqp", "amqps") or not url.host or port is None:
        raise ValueError(f"rabbitmq transport: address must be an amqp:// or amqps:// URL or host:port, "
                         f"got {_redacted_text(address)!r}")
    username = str_option("rabbitmq", options, "username", None)
    password = str_option("rabbitmq", options, "password", None)
    if username is not None:
        url = url.with_user(username)
    if password is not None:
        url = url.with_password(password)
    return url


def _redacted_text(address: str) -> str:
    return address.rpartition("@")[2] if "@" in address else address


@attrs.define(eq=False)
class RabbitMqTransport(Transport):
    """Publishes to one RabbitMQ broker (or cluster address) with publisher confirms."""

    url: yarl.URL
    exchange: str = ""
    routing_key: str = DEFAULT_ROUTING_KEY
    unroutable: str = "park"
    timeout_ms: int = DEFAULT_TIMEOUT_MS
    ssl_context: ssl.SSLContext | None = None
    _thread: AsyncioThread = attrs.field(init=False)
    _connection: Any = attrs.field(init=False, default=None)
    _connecting: asyncio.Lock | None = attrs.field(init=False, default=None)
    _channels: list = attrs.field(init=False, factory=list)

    def __attrs_post_init__(self) -> None:
        self._thread = AsyncioThread(self.name)

    @classmethod
    def from_config(cls, address: str, options: Mapping[str, Any]) -> RabbitMqTransport:
        """Raises ValueError naming the address or the option that is wrong."""
        check_option_names("rabbitmq", options, OPTIONS)
        url = _url(address, options)
        unroutable = options.get("unroutable", "park")
        if unroutable not in UNROUTABLE_RULES:
            raise ValueError(f"rabbitmq transport: option 'unroutable' must be 'park' or 'retry', got {unroutable!r}")
        exchange = str_option("rabbitmq", options, "exchange", "")
        if len(exchange.encode()) > MAX_SHORTSTR:
            raise ValueError(f"rabbitmq transport: option 'exchange' is longer than {MAX_SHORTSTR} bytes")
        return cls(
            url=url,
            exchange=exchange,
            routing_key=template_option("rabbitmq", options, "routing_key", DEFAULT_ROUTING_KEY),
            unroutable=unroutable,
            timeout_ms=int_option("rabbitmq", options, "timeout_ms", DEFAULT_TIMEOUT_MS),
            ssl_context=tls_context("rabbitmq", options, required=url.scheme == "amqps"),
        )

    @property
    def name(self) -> str:
        url = self.url.with_user(None)
        return f"rabbitmq {url} exchange {self.exchange or '(default)'} routing key {self.routing_key}"

    async def send_batch(self, messages: Sequence[OutboundMessage]) -> list[DeliveryResult]:
        return await send_batch_on(self._thread, self._publish_batch, messages, self.name, "not confirmed")

    # --- on the asyncio thread ---------------------------------------------------------------

    async def _publish_batch(self, messages: list[OutboundMessage]) -> list[DeliveryResult]:
        results: list[DeliveryResult | None] = [None] * len(messages)
        sendable = []
        for i, m in enumerate(messages):
            bad = self._unsendable(m)
            if bad:
                results[i] = DeliveryResult(Outcome.REJECTED, bad)
            else:
                sendable.append(i)
        try:
            channel = await self._take_channel()
        except Exception as e:  # anything the client raises while connecting is a broker failure
            detail = f"{self.name}: cannot connect: {type(e).__name__}: {e}"
            return [r or DeliveryResult(Outcome.RETRY, detail) for r in results]
        try:
            exchange = channel.default_exchange if not self.exchange else await channel.get_exchange(self.exchange, ensure=False)
            # aiormq matches a basic.return to its publish by message id, so no id may be in
            # flight twice on one channel: a batch holding an id again sends it in a later wave.
            while sendable:
                wave, later, ids = [], [], set()
                for i in sendable:
                    (later if messages[i].message_id in ids else wave).append(i)
                    ids.add(messages[i].message_id)
                sendable = later
                replies = await asyncio.gather(*(self._publish(exchange, messages[i]) for i in wave),
                                               return_exceptions=True)
                for i, reply in zip(wave, replies):
                    results[i] = self._result_of(reply)
        finally:
            if not channel.is_closed:
                self._channels.append(channel)
        return results

    def _unsendable(self, m: OutboundMessage) -> str:
        """Why AMQP cannot carry `m`, or "" when it can."""
        if len(self.routing_key_of(m).encode()) > MAX_SHORTSTR:
            return f"routing key {self.routing_key_of(m)!r} is longer than {MAX_SHORTSTR} bytes"
        for key in m.headers:
            if len(key.encode()) > MAX_SHORTSTR:
                return f"header name {key[:40]!r}... is longer than {MAX_SHORTSTR} bytes"
        return ""

    def routing_key_of(self, m: OutboundMessage) -> str:
        return self.routing_key.format(subject=m.subject)

    async def _publish(self, exchange, m: OutboundMessage):
        message = aio_pika.Message(
            bytes(m.body), headers=amqp_headers(m), message_id=m.message_id, timestamp=m.dispatch_time / 1000,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        return await exchange.publish(message, self.routing_key_of(m), mandatory=True, timeout=self.timeout_ms / 1000)

    def _result_of(self, reply: Any) -> DeliveryResult:
        if not isinstance(reply, BaseException):
            return ACKED
        if isinstance(reply, aiormq.exceptions.PublishError):
            delivery = reply.message.delivery
            detail = (f"unroutable: {delivery.reply_code} {delivery.reply_text} (exchange "
                      f"{delivery.exchange or '(default)'!r}, routing key {delivery.routing_key!r})")
            return DeliveryResult(Outcome.REJECTED if self.unroutable == "park" else Outcome.RETRY, detail)
        if isinstance(reply, aiormq.exceptions.DeliveryError):
            return DeliveryResult(Outcome.RETRY, f"{self.name}: the broker nacked the message ({reply})")
        if isinstance(reply, asyncio.TimeoutError):
            return DeliveryResult(Outcome.RETRY, f"{self.name}: no confirm within {self.timeout_ms} ms")
        return DeliveryResult(Outcome.RETRY, f"{self.name}: {type(reply).__name__}: {reply}")

    async def _take_channel(self):
        """A confirm-mode channel of its own for this batch (opening the connection if needed).

        A connection the broker closed may not know it yet: when it cannot open a channel, it is
        replaced by a new connection, once.
        """
        while self._channels:
            channel = self._channels.pop()
            if not channel.is_closed:
                return channel
        broken = None
        while True:
            connection = await self._connected(broken)
            try:
                return await asyncio.wait_for(
                    connection.channel(publisher_confirms=True, on_return_raises=True), self.timeout_ms / 1000
                )
            except Exception:
                if broken is not None:
                    raise
                broken = connection

    async def _connected(self, broken=None):
        """The open connection, or a new one if there is none or it is `broken`."""
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._connection is not None and (self._connection is broken or self._connection.is_closed):
                old, self._connection = self._connection, None
                self._channels.clear()
                try:
                    await asyncio.wait_for(old.close(), self.timeout_ms / 1000)
                except Exception:  # it is broken already; closing it only frees its resources
                    pass
            if self._connection is None:
                self._connection = await aio_pika.connect(
                    str(self.url), timeout=self.timeout_ms / 1000, ssl_context=self.ssl_context,
                    client_properties={"connection_name": "delayserver"},
                )
                log.info("%s: connected", self.name)
            return self._connection

    async def _close_connection(self) -> None:
        if self._connection is not None and not self._connection.is_closed:
            await self._connection.close()

    async def aclose(self) -> None:
        await self._thread.close(self._close_connection)
