"""Talking to the meta servers: `MetaClient` (one request at a time over one connection, to one
of a list of meta servers) and `discover_delay_groups` (what a producer asks).

A client given several meta servers (``a:20800,b:20800``) sends each request to the one that last
answered; when that one cannot be reached, does not answer in time, breaks the protocol, or
answers UNAVAILABLE (it cannot reach its database), the request goes to the next, round the list
once. Any meta server over the same store answers any request alike.

Errors: `MetaError` when a meta server answered with a result code other than OK (its `code`
and message are the server's); `MetaUnavailable` when none could be reached or gave a usable
answer.
"""
from __future__ import annotations

import itertools
import logging
import ssl
from typing import Any, Sequence

import trio

from delayserver.message import DelayServerError, ResultCode, parse_address
from delayserver.meta.wire import MAX_RESPONSE_BYTES, parse_address_list
from delayserver.protocol import (
    NEED_DATA, Command, Frame, FrameDecoder, RemoteProtocolError, decode_error, decode_json, encode, encode_json,
)

DEFAULT_TIMEOUT_S = 5.0

log = logging.getLogger("delayserver.meta.client")


class MetaError(DelayServerError):
    """The meta server refused a request; `code` says why (BAD_REQUEST, NOT_FOUND, ...)."""


class MetaUnavailable(Exception):
    """The meta server could not be reached or gave no usable answer; the request may or may not
    have been carried out."""


class _ConnectionClosed(Exception):
    pass


class MetaClient:
    """Requests to a list of meta servers over one connection at a time, opened when first needed
    and again after a failure. Safe to share between tasks: requests are sent one at a time.

    Use as an async context manager, or call `aclose()`.
    """

    def __init__(self, addresses: str | Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 secret: str = "", tls: ssl.SSLContext | None = None):
        """`addresses`: ``HOST:PORT[,HOST:PORT...]`` or a list. `secret`: the cluster secret,
        given on each connection (AUTH) when set. `tls`: connect with TLS, checking the meta
        servers' certificates with this context. Raises ValueError for a bad address list."""
        self.addresses = parse_address_list(addresses)
        self.timeout_s = timeout_s
        self.secret = secret
        self.tls = tls
        self._current = 0
        self._stream: trio.abc.Stream | None = None
        self._decoder = FrameDecoder(MAX_RESPONSE_BYTES)
        self._lock = trio.Lock()
        self._request_ids = itertools.count(1)

    @property
    def address(self) -> str:
        """The meta server requests go to now (the last that answered)."""
        return self.addresses[self._current]

    async def __aenter__(self) -> MetaClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await trio.aclose_forcefully(stream)

    async def request(self, op: str, /, *, timeout_s: float | None = None, **args: Any) -> dict:
        """Send ``{"op": op, **args}``; the response object (code OK, message, results).

        Raises MetaError for any other code and MetaUnavailable as the module docstring says.
        `timeout_s` bounds the exchange with each meta server, connecting included.
        """
        payload = encode_json({"op": op, **args})
        async with self._lock:
            failures = []
            for _ in range(len(self.addresses)):
                try:
                    return await self._request_one(payload, self.timeout_s if timeout_s is None else timeout_s)
                except MetaUnavailable as exc:
                    failures.append(str(exc))
                except MetaError as exc:
                    if exc.code is not ResultCode.UNAVAILABLE:
                        raise
                    failures.append(f"meta server {self.address}: {exc}")
                await self.aclose()
                self._current = (self._current + 1) % len(self.addresses)
                if len(self.addresses) > 1:
                    log.info("%s; trying meta server %s", failures[-1], self.address)
            raise MetaUnavailable("; ".join(failures))

    async def _request_one(self, payload: bytes, timeout_s: float) -> dict:
        may_retry = True
        while True:
            reused, may_retry = self._stream is not None and may_retry, False
            try:
                with trio.fail_after(timeout_s):
                    return _checked(await self._exchange(payload))
            except (OSError, trio.BrokenResourceError, _ConnectionClosed) as exc:
                await self.aclose()
                # The server closes idle connections: one that closed while reused may simply
                # have timed out between requests, so a new one gets one more try.
                if not reused:
                    cause = exc.__cause__ if isinstance(exc.__cause__, ssl.SSLError) else exc
                    raise MetaUnavailable(f"meta server {self.address}: {cause or type(exc).__name__}") from exc
            except trio.TooSlowError:
                await self.aclose()
                raise MetaUnavailable(f"meta server {self.address}: no answer in time") from None
            except RemoteProtocolError as exc:
                await self.aclose()
                raise MetaUnavailable(f"meta server {self.address} broke the protocol: {exc}") from exc

    async def _connect(self) -> None:
        host, port = parse_address(self.address)
        stream = await trio.open_tcp_stream(host, port)
        if self.tls is not None:
            stream = trio.SSLStream(stream, self.tls, server_hostname=host)
        self._stream = stream
        self._decoder = FrameDecoder(MAX_RESPONSE_BYTES)
        if self.secret:
            await self._stream.send_all(encode(Frame(Command.AUTH, 0, self.secret.encode("utf-8"))))
            frame = await self._receive_frame()
            if frame.command is Command.ERROR:
                error = decode_error(frame.payload)
                raise MetaError(f"meta server {self.address}: {error.message}", code=_code(error.code))
            if frame.command is not Command.AUTH or not frame.is_response:
                raise RemoteProtocolError(f"unexpected {frame.command.name} frame in answer to AUTH")

    async def _exchange(self, payload: bytes) -> Any:
        done = False
        try:
            if self._stream is None:
                await self._connect()
            request_id = next(self._request_ids) & 0xFFFFFFFF
            await self._stream.send_all(encode(Frame(Command.META, request_id, payload)))
            frame = await self._receive_frame()
            if frame.command is Command.ERROR:
                error = decode_error(frame.payload)
                raise MetaError(error.message, code=_code(error.code))
            if frame.command is not Command.META or not frame.is_response or frame.request_id != request_id:
                raise RemoteProtocolError(f"unexpected {frame.command.name} frame for request {frame.request_id}")
            response = decode_json(frame.payload)
            done = True
            return response
        finally:
            # Cancelled or failed half way, the connection may hold a late answer: never reuse it.
            if not done:
                await self.aclose()

    async def _receive_frame(self) -> Frame:
        while (frame := self._decoder.next_frame()) is NEED_DATA:
            data = await self._stream.receive_some(65536)
            if not data:
                raise _ConnectionClosed("connection closed by the meta server")
            self._decoder.feed(data)
        return frame


def _code(raw: int) -> ResultCode:
    return ResultCode(raw) if raw in ResultCode._value2member_map_ else ResultCode.INTERNAL


def _checked(response: Any) -> dict:
    if not isinstance(response, dict) or not isinstance(response.get("code"), int):
        raise RemoteProtocolError(f"a meta response must be an object with a code, not {response!r}")
    if response["code"] != ResultCode.OK:
        raise MetaError(str(response.get("message") or ""), code=_code(response["code"]))
    return response


async def discover_delay_groups(meta_addresses: str | Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S,
                                tls: ssl.SSLContext | None = None) -> list[tuple[str, str]]:
    """(group, master address) of each delay group a producer may send to: not read-only, with a
    master that is up. Asks the meta servers in turn (see MetaClient). Raises MetaUnavailable or
    MetaError."""
    async with MetaClient(meta_addresses, timeout_s=timeout_s, tls=tls) as client:
        response = await client.request("live_delay_groups")
    return [(g["group"], g["address"]) for g in response["delay_groups"]]
