"""Talking to the meta server: `MetaClient` (one request at a time over one connection) and
`discover_delay_groups` (what a producer asks).

Errors: `MetaError` when the meta server answered with a result code other than OK (its `code`
and message are the server's); `MetaUnavailable` when it could not be reached, did not answer in
time, or broke the protocol.
"""
from __future__ import annotations

import itertools
from typing import Any

import trio

from delayserver.message import DelayServerError, ResultCode, parse_address
from delayserver.meta.wire import MAX_RESPONSE_BYTES
from delayserver.protocol import (
    NEED_DATA, Command, Frame, FrameDecoder, RemoteProtocolError, decode_error, decode_json, encode, encode_json,
)

DEFAULT_TIMEOUT_S = 5.0


class MetaError(DelayServerError):
    """The meta server refused a request; `code` says why (BAD_REQUEST, NOT_FOUND, ...)."""


class MetaUnavailable(Exception):
    """The meta server could not be reached or gave no usable answer; the request may or may not
    have been carried out."""


class _ConnectionClosed(Exception):
    pass


class MetaClient:
    """Requests to one meta server over one connection, opened when first needed and again after
    a failure. Safe to share between tasks: requests are sent one at a time.

    Use as an async context manager, or call `aclose()`.
    """

    def __init__(self, address: str, *, timeout_s: float = DEFAULT_TIMEOUT_S):
        """Raises ValueError for an address that is not HOST:PORT."""
        self.address = address
        self._host, self._port = parse_address(address)
        self.timeout_s = timeout_s
        self._stream: trio.SocketStream | None = None
        self._decoder = FrameDecoder(MAX_RESPONSE_BYTES)
        self._lock = trio.Lock()
        self._request_ids = itertools.count(1)

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
        `timeout_s` bounds the whole exchange, connecting included.
        """
        payload = encode_json({"op": op, **args})
        async with self._lock:
            may_retry = True
            while True:
                reused, may_retry = self._stream is not None and may_retry, False
                try:
                    with trio.fail_after(self.timeout_s if timeout_s is None else timeout_s):
                        return _checked(await self._exchange(payload))
                except (OSError, trio.BrokenResourceError, _ConnectionClosed) as exc:
                    await self.aclose()
                    # The server closes idle connections: one that closed while reused may simply
                    # have timed out between requests, so a new one gets one more try.
                    if not reused:
                        raise MetaUnavailable(f"meta server {self.address}: {exc or type(exc).__name__}") from exc
                except trio.TooSlowError:
                    await self.aclose()
                    raise MetaUnavailable(f"meta server {self.address}: no answer in time") from None
                except RemoteProtocolError as exc:
                    await self.aclose()
                    raise MetaUnavailable(f"meta server {self.address} broke the protocol: {exc}") from exc

    async def _exchange(self, payload: bytes) -> Any:
        done = False
        try:
            if self._stream is None:
                self._stream = await trio.open_tcp_stream(self._host, self._port)
                self._decoder = FrameDecoder(MAX_RESPONSE_BYTES)
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


async def discover_delay_groups(meta_address: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[tuple[str, str]]:
    """(group, master address) of each delay group a producer may send to: not read-only, with a
    master that is up. Raises MetaUnavailable or MetaError."""
    async with MetaClient(meta_address, timeout_s=timeout_s) as client:
        response = await client.request("live_delay_groups")
    return [(g["group"], g["address"]) for g in response["delay_groups"]]
