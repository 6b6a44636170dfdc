"""The Redis Streams transport: one XADD per message, pipelined per batch.

Each message becomes one stream entry in the stream `stream_template.format(subject=subject)`
(default "{subject}"), with these fields, as XRANGE shows them:

    id              the message id (UTF-8)
    subject         the subject
    body            the body, byte for byte
    schedule_time   epoch ms, decimal
    dispatch_time   epoch ms, decimal
    attempt         decimal, 1 on the first try
    h:<key>         one field per header (the prefix keeps headers apart from the fields above)

Options: `stream_template`; `maxlen` (XADD MAXLEN ~ maxlen, approximate trimming; absent means
no trimming); `timeout_ms` (default 5000) for connecting and for every socket read and write, so a
dead or stuck server costs at most that long and never hangs the sender.

Outcomes: an XADD answered with a WRONGTYPE error is REJECTED (the key holds another type, so no
retry can succeed until an operator removes it); any other error of one XADD is RETRY for that
message. A connection error or timeout is RETRY for the whole batch (entries written before it
may then arrive twice: delivery is at least once). redis-py is blocking: each batch runs in a trio
worker thread, using the transport's own connection pool, and redis-py's own retries are off (the
sender retries with back-off).
"""
from __future__ import annotations

import logging
import urllib.parse
from typing import Any, Mapping, Sequence

import attrs
import redis
import trio
from redis.backoff import NoBackoff
from redis.retry import Retry

from delayserver.sender.transport import (
    ACKED, TRANSPORT_THREADS, DeliveryResult, OutboundMessage, Outcome, Transport, check_option_names, int_option,
)

log = logging.getLogger("delayserver.sender.redis")

DEFAULT_TIMEOUT_MS = 5000
DEFAULT_STREAM_TEMPLATE = "{subject}"
HEADER_PREFIX = "h:"
#: Error codes of one XADD that no retry can cure.
_REJECTING_ERRORS = ("WRONGTYPE",)


def stream_fields(m: OutboundMessage) -> dict[str, str | bytes | int]:
    """The fields of the stream entry for `m` (see the module docstring)."""
    fields: dict[str, str | bytes | int] = {
        "id": m.message_id,
        "subject": m.subject,
        "body": bytes(m.body),
        "schedule_time": m.schedule_time,
        "dispatch_time": m.dispatch_time,
        "attempt": m.attempt,
    }
    for key, value in m.headers.items():
        fields[HEADER_PREFIX + key] = value
    return fields


def _check_template(template: Any) -> str:
    if not isinstance(template, str) or not template:
        raise ValueError(f"redis transport: option 'stream_template' must be a non-empty string, got {template!r}")
    try:
        template.format(subject="subject")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"redis transport: option 'stream_template' {template!r} may use only {{subject}}: {e!r}"
        ) from None
    return template


def _connection_pool(address: str, timeout_s: float) -> redis.ConnectionPool:
    """A pool for "host:port" or a redis://, rediss:// or unix:// URL; ValueError naming the address."""
    settings = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
    if "://" in address:
        try:
            return redis.ConnectionPool.from_url(address, **settings)
        except ValueError as e:
            raise ValueError(f"redis transport: bad address {_redacted(address)!r}: {e}") from None
    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"redis transport: address must be host:port or a redis:// URL, got {address!r}")
    return redis.ConnectionPool(host=host, port=int(port), **settings)


def _redacted(address: str) -> str:
    """The address without its user and password, fit for logs."""
    parts = urllib.parse.urlsplit(address)
    if "@" not in parts.netloc:
        return address
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def _outcome_of(reply: Any) -> DeliveryResult:
    if not isinstance(reply, Exception):
        return ACKED
    detail = f"XADD failed: {reply}"
    if str(reply).startswith(_REJECTING_ERRORS):
        return DeliveryResult(Outcome.REJECTED, detail)
    return DeliveryResult(Outcome.RETRY, detail)


@attrs.define(eq=False)
class RedisTransport(Transport):
    """Delivers to Redis Streams through `pool`."""

    address: str
    pool: redis.ConnectionPool
    stream_template: str = DEFAULT_STREAM_TEMPLATE
    maxlen: int | None = None
    _client: redis.Redis = attrs.field(init=False)
    # The threads its round trips may hold (see TRANSPORT_THREADS); batches beyond wait for one.
    _threads: trio.CapacityLimiter = attrs.field(init=False, factory=lambda: trio.CapacityLimiter(TRANSPORT_THREADS))

    def __attrs_post_init__(self) -> None:
        self._client = redis.Redis(connection_pool=self.pool)

    @classmethod
    def from_config(cls, address: str, options: Mapping[str, Any]) -> RedisTransport:
        """Raises ValueError naming the address or the option that is wrong."""
        check_option_names("redis", options, {"stream_template", "maxlen", "timeout_ms"})
        if not isinstance(address, str) or not address:
            raise ValueError("redis transport: address must be host:port or a redis:// URL")
        timeout_ms = int_option("redis", options, "timeout_ms", DEFAULT_TIMEOUT_MS)
        return cls(
            address=address,
            pool=_connection_pool(address, timeout_ms / 1000),
            stream_template=_check_template(options.get("stream_template", DEFAULT_STREAM_TEMPLATE)),
            maxlen=int_option("redis", options, "maxlen", None),
        )

    @property
    def name(self) -> str:
        return f"redis {_redacted(self.address)} stream {self.stream_template}"

    def stream_name(self, subject: str) -> str:
        return self.stream_template.format(subject=subject)

    async def send_batch(self, messages: Sequence[OutboundMessage]) -> list[DeliveryResult]:
        if not messages:
            return []
        entries = [(self.stream_name(m.subject), stream_fields(m)) for m in messages]
        try:
            replies = await trio.to_thread.run_sync(self._xadd_all, entries, limiter=self._threads)
        except redis.RedisError as e:
            log.warning("%s: batch of %d failed, will retry: %r", self.name, len(messages), e)
            return [DeliveryResult(Outcome.RETRY, f"{self.name}: {type(e).__name__}: {e}")] * len(messages)
        return [_outcome_of(reply) for reply in replies]

    def _xadd_all(self, entries: list[tuple[str, dict]]) -> list[Any]:
        """Run in a worker thread: one pipelined round trip, a reply or an exception per entry."""
        with self._client.pipeline(transaction=False) as pipe:
            for stream, fields in entries:
                pipe.xadd(stream, fields, maxlen=self.maxlen, approximate=True)
            return pipe.execute(raise_on_error=False)

    async def aclose(self) -> None:
        await trio.to_thread.run_sync(self.pool.disconnect)
