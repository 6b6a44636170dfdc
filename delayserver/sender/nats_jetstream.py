"""The NATS JetStream transport: a JetStream publish per message, each waiting for its ack.

Address: ``nats://host:port``, ``tls://host:port`` (TLS), or ``host:port``; several servers of
one cluster separated by commas. Each message is published to the NATS subject
`subject_template.format(subject=subject)` (default "{subject}") with these headers:

    Nats-Msg-Id                  the message id: JetStream drops a second publish of the same id
                                 within the stream's duplicate window (default 2 minutes), so a
                                 batch retried after a lost ack is not stored twice
    delayserver-id, delayserver-subject, delayserver-schedule-time, delayserver-dispatch-time
    (epoch ms), delayserver-attempt (1 on the first try)
    and the message's own headers (ours win on a clash)

and the body as the payload. The rule for each message:

- a JetStream publish acknowledgement (also one saying "duplicate"): ACKED.
- no stream captures the subject (the publish has no responders): REJECTED, parked with the
  reason "no JetStream stream for subject ..." (redrive it once a stream captures the subject).
- a header NATS cannot carry (a name with a colon, a space or a control character; a value with
  CR or LF), or a payload over the server's max_payload: REJECTED with that reason.
- no acknowledgement within `timeout_ms` (default 5000), a JetStream error (a stream at its
  limits with discard=new, no quorum), or no connection: RETRY. What JetStream had acknowledged
  stays ACKED; only the rest is sent again.

The connection reconnects by itself after a loss (nats-py's reconnect, forever); the first
connection is tried for at most `timeout_ms` per batch. Credentials: user and password in the
URL (``nats://user:password@host:4222``), or the `username` and `password`, `token`, or
`creds_file` (a JWT .creds file) options; TLS from the tls scheme or any of `tls_ca_file`,
`tls_cert_file`, `tls_key_file` (see `transport.tls_context`).

The client is nats-py, an asyncio library: the connection lives on the transport's own asyncio
thread (`asyncio_bridge`), and each batch crosses over once.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import ssl
import urllib.parse
from typing import Any, Mapping, Sequence

import attrs
import nats
import nats.errors
import nats.js.errors

from delayserver.sender.asyncio_bridge import AsyncioThread, send_batch_on
from delayserver.sender.transport import (
    ACKED, DELAY_HEADERS, TLS_OPTIONS, DeliveryResult, OutboundMessage, Outcome, Transport, check_option_names,
    delay_header_values, int_option, str_option, template_option, tls_context,
)

log = logging.getLogger("delayserver.sender.nats")

DEFAULT_TIMEOUT_MS = 5000
DEFAULT_SUBJECT_TEMPLATE = "{subject}"
OPTIONS = {"subject_template", "timeout_ms", "username", "password", "token", "creds_file"} | TLS_OPTIONS
#: A header name NATS can carry: printable ASCII without a colon or a space.
_HEADER_NAME = re.compile(r"[!-9;-~]+")
_SCHEMES = ("nats", "tls")


def nats_headers(m: OutboundMessage) -> dict[str, str]:
    """The NATS headers of the publish of `m` (see the module docstring)."""
    headers = dict(m.headers)
    headers.update(zip(DELAY_HEADERS, map(str, delay_header_values(m))))
    headers["Nats-Msg-Id"] = m.message_id
    return headers


def header_problem(headers: Mapping[str, str]) -> str:
    """Why NATS cannot carry `headers`, or "" when it can."""
    for key, value in headers.items():
        if not _HEADER_NAME.fullmatch(key):
            return f"header name {key[:60]!r} cannot be carried by NATS (no colon, space or control character)"
        if "\r" in value or "\n" in value:
            return f"header {key[:60]!r} has a CR or LF in its value, which NATS cannot carry"
    return ""


def _servers(address: Any) -> tuple[str, ...]:
    if not isinstance(address, str) or not address.strip():
        raise ValueError("nats transport: address must be nats://host:port, tls://host:port or host:port")
    servers = []
    for part in address.split(","):
        part = part.strip()
        url = part if "://" in part else f"nats://{part}"
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port
        except ValueError as e:
            raise ValueError(f"nats transport: bad server address {_redacted(part)!r}: {e}") from None
        if parts.scheme not in _SCHEMES or not parts.hostname or port is None:
            raise ValueError(f"nats transport: a server address must be nats://host:port, tls://host:port or "
                             f"host:port, got {_redacted(part)!r}")
        servers.append(url)
    return tuple(servers)


def _redacted(url: str) -> str:
    return url.rpartition("@")[2] if "@" in url else url


@attrs.define(eq=False)
class NatsJetStreamTransport(Transport):
    """Publishes to JetStream through one NATS connection."""

    servers: tuple[str, ...]
    subject_template: str = DEFAULT_SUBJECT_TEMPLATE
    timeout_ms: int = DEFAULT_TIMEOUT_MS
    credentials: Mapping[str, str] = attrs.field(factory=dict)
    ssl_context: ssl.SSLContext | None = None
    _thread: AsyncioThread = attrs.field(init=False)
    _client: Any = attrs.field(init=False, default=None)
    _jetstream: Any = attrs.field(init=False, default=None)
    _connecting: asyncio.Lock | None = attrs.field(init=False, default=None)
    _last_error: str = attrs.field(init=False, default="")
    #: The last error the server itself stated (a refused login), kept when a connection reset
    #: that follows it becomes the last error.
    _server_error: str = attrs.field(init=False, default="")

    def __attrs_post_init__(self) -> None:
        self._thread = AsyncioThread(self.name)

    @classmethod
    def from_config(cls, address: str, options: Mapping[str, Any]) -> NatsJetStreamTransport:
        """Raises ValueError naming the address or the option that is wrong."""
        check_option_names("nats", options, OPTIONS)
        servers = _servers(address)
        credentials = {}
        for key, nats_key in (("username", "user"), ("password", "password"), ("token", "token"),
                              ("creds_file", "user_credentials")):
            value = str_option("nats", options, key, None)
            if value is not None:
                credentials[nats_key] = value
        creds = credentials.get("user_credentials")
        if creds is not None and not os.access(creds, os.R_OK):
            raise ValueError(f"nats transport: option 'creds_file' {creds!r} is not a readable file")
        return cls(
            servers=servers,
            subject_template=template_option("nats", options, "subject_template", DEFAULT_SUBJECT_TEMPLATE),
            timeout_ms=int_option("nats", options, "timeout_ms", DEFAULT_TIMEOUT_MS),
            credentials=credentials,
            ssl_context=tls_context("nats", options, required=any(s.startswith("tls:") for s in servers)),
        )

    @property
    def name(self) -> str:
        return f"nats {','.join(map(_redacted, self.servers))} subject {self.subject_template}"

    def subject_of(self, m: OutboundMessage) -> str:
        return self.subject_template.format(subject=m.subject)

    async def send_batch(self, messages: Sequence[OutboundMessage]) -> list[DeliveryResult]:
        return await send_batch_on(self._thread, self._publish_batch, messages, self.name, "not acknowledged")

    # --- on the asyncio thread ---------------------------------------------------------------

    async def _publish_batch(self, messages: list[OutboundMessage]) -> list[DeliveryResult]:
        headers = [nats_headers(m) for m in messages]
        problems = [header_problem(h) for h in headers]
        try:
            js = await self._connected()
        except Exception as e:  # anything the client raises while connecting is a broker failure
            detail = f"{self.name}: cannot connect: {type(e).__name__}: {e}"
            if self._last_error:
                detail += f" (last error: {self._last_error})"
            if self._server_error and self._server_error != self._last_error:
                detail += f" (the server said: {self._server_error})"
            return [DeliveryResult(Outcome.REJECTED, p) if p else DeliveryResult(Outcome.RETRY, detail) for p in problems]
        replies = await asyncio.gather(
            *(self._publish(js, m, h, p) for m, h, p in zip(messages, headers, problems)), return_exceptions=True
        )
        return [self._result_of(m, reply) for m, reply in zip(messages, replies)]

    async def _publish(self, js, m: OutboundMessage, headers: dict[str, str], problem: str):
        if problem:
            return DeliveryResult(Outcome.REJECTED, problem)
        # nats-py bounds only the wait for the ack: a publish while reconnecting can block on the
        # client's buffer, so the whole call is bounded here too.
        timeout = self.timeout_ms / 1000
        return await asyncio.wait_for(js.publish(self.subject_of(m), bytes(m.body), timeout=timeout, headers=headers),
                                      timeout)

    def _result_of(self, m: OutboundMessage, reply: Any) -> DeliveryResult:
        if isinstance(reply, DeliveryResult):
            return reply
        if not isinstance(reply, BaseException):
            return ACKED
        if isinstance(reply, nats.js.errors.NoStreamResponseError):
            return DeliveryResult(Outcome.REJECTED, f"no JetStream stream for subject {self.subject_of(m)!r}")
        if isinstance(reply, nats.errors.MaxPayloadError):
            return DeliveryResult(Outcome.REJECTED, f"{len(m.body)} bytes are over the server's max_payload: {reply}")
        if isinstance(reply, (nats.errors.TimeoutError, asyncio.TimeoutError)):
            return DeliveryResult(Outcome.RETRY, f"{self.name}: no JetStream ack within {self.timeout_ms} ms")
        return DeliveryResult(Outcome.RETRY, f"{self.name}: {type(reply).__name__}: {reply}")

    async def _connected(self):
        """The JetStream context of the connection, connecting first if there is none (or it was
        closed for good); raises whatever the client raises, or TimeoutError after `timeout_ms`."""
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._client is not None and self._client.is_closed:
                self._client = self._jetstream = None
            if self._client is None:
                client = nats.NATS()
                try:
                    await asyncio.wait_for(self._connect(client), self.timeout_ms / 1000)
                except BaseException:
                    await self._close_quietly(client)
                    raise
                self._client, self._jetstream = client, client.jetstream(timeout=self.timeout_ms / 1000)
                self._last_error = self._server_error = ""
                log.info("%s: connected", self.name)
            return self._jetstream

    async def _connect(self, client) -> None:
        async def error(e: Exception) -> None:
            self._last_error = f"{type(e).__name__}: {e}"
            if isinstance(e, nats.errors.Error) and not isinstance(e, nats.errors.TimeoutError):
                self._server_error = self._last_error
            log.debug("%s: %s", self.name, self._last_error)

        async def disconnected() -> None:
            log.warning("%s: disconnected, reconnecting", self.name)

        async def reconnected() -> None:
            log.warning("%s: reconnected", self.name)

        await client.connect(
            servers=list(self.servers), name="delayserver", connect_timeout=self.timeout_ms / 1000,
            allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=0.5, tls=self.ssl_context,
            error_cb=error, disconnected_cb=disconnected, reconnected_cb=reconnected, **self.credentials,
        )

    @staticmethod
    async def _close_quietly(client) -> None:
        try:
            await asyncio.wait_for(client.close(), 5)
        except Exception:  # a client that never connected may fail to close; nothing is lost
            pass

    async def _close(self) -> None:
        if self._client is not None:
            await self._close_quietly(self._client)
            self._client = self._jetstream = None

    async def aclose(self) -> None:
        await self._thread.close(self._close)
