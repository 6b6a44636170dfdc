"""The connection pump: bytes from a stream through the FrameDecoder to a responder and back.

One pump serves every framed connection, the delay server's and the meta server's alike:

- it reads with a deadline: `idle_timeout_s` between frames, `frame_timeout_s` for the rest of a
  frame once part of it is in (so a peer trickling bytes cannot hold a connection forever);
- frames go to `respond`, up to `max_in_flight` at a time (1: one after another, in order), and
  each answer is written whole under one lock, within `send_timeout_s` (a peer that does not read
  its answers does not hold the task forever). On a TCP stream, an answer the kernel takes at once
  while no other is being sent is written straight to the socket: no trip through the scheduler
  (trio's `send_all` yields after each send), so a request and its answer cost two task steps
  where they cost five;
- a request that `respond_now` answers at once (a status) is answered in line, while no other
  request of its connection is in flight: no task, and one pass of the event loop for the request
  and its answer;
- an optional `gate` sees every frame, in line, until it lets the connection in (AUTH): it answers
  the frame itself and returns True (let in), False (refused: close) or None (answered, not in
  yet: the next frame goes to the gate too, as the meta server's open requests before AUTH do);
  until it lets a connection in, that connection may buffer at most `max_bytes_before_gate` (a
  peer that streams data without authenticating is refused, not buffered);
- byte limits: each frame's payload is taken from the connection's own budget
  (`max_connection_bytes`) and from an optional shared `budget` (the node's total) before it is
  started, and given back once answered; while either is full the connection is not read, so TCP
  pushes back on the producer instead of the process buffering without bound;
- a peer that breaks the protocol (bad magic, a declared length over the cap, a bad crc) gets an
  ERROR frame with the code of its RemoteProtocolError and the connection is closed; for a frame
  refused for its size (MESSAGE_TOO_LARGE, naming its request) the rest of it is read and dropped
  first (up to LINGER_BYTES), so that the peer reads the answer instead of a reset connection. The abuse is
  logged once per connection, and at most `ABUSE_LOG_PER_MINUTE` lines a minute per process (the
  rest are counted and the count is logged with the next line that goes out), so an operator sees
  it and a flood of bad connections cannot flood the log.
"""
from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable

import attrs
import trio

from delayserver import protocol as p
from delayserver.budget import ByteBudget
from delayserver.message import ResultCode
from delayserver.trio_util import receive_into, send_whole

log = logging.getLogger("delayserver.connections")

ABUSE_LOG_PER_MINUTE = 20
#: The most of a refused frame read and dropped before closing (see `_drop`).
LINGER_BYTES = 64 * 1024 * 1024

Respond = Callable[[p.Frame], Awaitable[bytes]]
RespondNow = Callable[[p.Frame], bytes | None]
Gate = Callable[[p.Frame, Callable[[bytes], Awaitable[None]]], Awaitable[bool | None]]


@attrs.frozen
class PumpLimits:
    max_frame_bytes: int
    idle_timeout_s: float
    #: Time allowed for the rest of a frame once its first bytes are in (None: the idle timeout).
    frame_timeout_s: float | None = None
    send_timeout_s: float = 30.0
    #: Requests of one connection answered concurrently (1: in order, one at a time).
    max_in_flight: int = 256
    #: Say "timed out" in an ERROR frame before closing an idle connection.
    say_timeout: bool = True
    #: Bytes a connection may buffer before its gate admits it (None: no cap but the frame's).
    max_bytes_before_gate: int | None = None
    #: Request bytes of one connection held (read, not answered yet) at once (None: no cap).
    max_connection_bytes: int | None = None
    #: Bytes asked of the socket per read once the gate let the connection in (64 KiB before):
    #: a producer's batch of 64 messages of 1 KiB is one read, not two.
    receive_bytes: int = 256 << 10


@attrs.define(eq=False)
class AbuseLog:
    """Rate-limited warnings about peers that break the protocol (a token bucket per minute)."""

    per_minute: int = ABUSE_LOG_PER_MINUTE
    clock: Callable[[], float] = time.monotonic
    _tokens: float = attrs.field(init=False, default=0.0)
    _stamp: float | None = attrs.field(init=False, default=None)
    suppressed: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._tokens = float(self.per_minute)

    def warn(self, what: str, peer: str, error: Exception) -> None:
        now = self.clock()
        if self._stamp is not None:
            self._tokens = min(float(self.per_minute), self._tokens + (now - self._stamp) * self.per_minute / 60)
        self._stamp = now
        if self._tokens < 1:
            self.suppressed += 1
            return
        self._tokens -= 1
        more = f" ({self.suppressed} more not logged)" if self.suppressed else ""
        self.suppressed = 0
        log.warning("%s from %s broke the protocol: %s; closing it%s", what, peer, error, more)


#: The process's one abuse log (every listener shares its budget).
ABUSE = AbuseLog()


def peer_name(stream) -> str:
    """HOST:PORT of the peer, or "a peer" when the stream has no socket (TLS wraps it)."""
    sock = getattr(stream, "socket", None) or getattr(getattr(stream, "transport_stream", None), "socket", None)
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except (AttributeError, OSError, ValueError, TypeError):
        return "a peer"


async def _drop(stream, count: int, timeout_s: float) -> None:
    """Read and drop `count` bytes (the rest of a frame refused for its size), within `timeout_s`.

    Closing at once would leave the peer's unsent bytes unread, and the kernel then resets the
    connection, destroying the ERROR already sent: the peer would see "connection reset" for a
    message that is merely too large, and could send it again forever."""
    with trio.move_on_after(timeout_s):
        while count > 0:
            try:
                data = await stream.receive_some(min(count, 1 << 20))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            count -= len(data)


def error_frame(request_id: int, code: int, message: str) -> bytes:
    return p.encode(p.Frame(p.Command.ERROR, request_id, p.encode_error(p.ErrorResult(code, message)),
                            is_response=True))


async def pump(stream: trio.abc.Stream, limits: PumpLimits, respond: Respond, *, gate: Gate | None = None,
               what: str = "a connection", budget: ByteBudget | None = None,
               on_send: Callable[[Callable[[bytes], Awaitable[None]]], None] | None = None,
               respond_now: RespondNow | None = None) -> None:
    """Serve one connection until EOF, a timeout, a protocol error or a refused gate; does not
    close the stream. Requests already read when EOF comes are answered first. `budget`, when
    given, is shared with other connections: the bytes of requests read and not answered yet.
    `on_send`, when given, is called with the connection's send function, so that this side may
    send requests of its own over it (the server's TXN_CHECK). `respond_now`, when given, is
    offered each frame while no other request of the connection is in flight: the answer it
    returns is sent in line, with no task (a status the indexes answer at once); when it returns
    None the frame goes to `respond` as any other."""
    decoder = p.FrameDecoder(max_frame_bytes=limits.max_frame_bytes)
    lock = trio.Lock()

    async def send(data: bytes) -> None:
        try:
            await send_whole(stream, lock, data, limits.send_timeout_s)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    if on_send is not None:
        on_send(send)

    async def answer(frame: p.Frame, size: int) -> None:
        try:
            data = await respond(frame)
            if data:  # empty: the frame was an answer to this side's own request
                await send(data)
        finally:
            slots.release()
            if held is not None:
                held.release(size)
            if budget is not None:
                budget.release(size)

    slots = trio.Semaphore(limits.max_in_flight)
    held = ByteBudget(limits.max_connection_bytes) if limits.max_connection_bytes is not None else None
    admitted = gate is None
    partial_since = None
    async with trio.open_nursery() as nursery:
        while True:
            now = trio.current_time()
            if decoder.buffered_bytes and limits.frame_timeout_s is not None:
                partial_since = partial_since if partial_since is not None else now
                timeout = partial_since + limits.frame_timeout_s - now
            else:
                partial_since = None
                timeout = limits.idle_timeout_s
            with trio.CancelScope(deadline=now + max(timeout, 0)) as scope:
                try:
                    received = await receive_into(stream, decoder.feed,
                                                  limits.receive_bytes if admitted else 65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                    log.info("%s from %s lost: %r", what, peer_name(stream), e)
                    break
            if scope.cancelled_caught:
                # Idle or trickling: drop the connection, it holds a slot others may need.
                log.info("closing %s from %s: timed out", what, peer_name(stream))
                if limits.say_timeout:
                    await send(error_frame(0, ResultCode.BAD_REQUEST, "timed out"))
                nursery.cancel_scope.cancel()
                return
            if not received:
                if decoder.buffered_bytes:
                    log.info("%s from %s closed inside a frame (%d bytes)", what, peer_name(stream),
                             decoder.buffered_bytes)
                break
            if not admitted and limits.max_bytes_before_gate is not None \
                    and decoder.buffered_bytes > limits.max_bytes_before_gate:
                log.warning("refused %s from %s: %d bytes before AUTH", what, peer_name(stream),
                            decoder.buffered_bytes)
                await send(error_frame(0, ResultCode.UNAUTHORIZED, "authenticate first: AUTH with the shared secret"))
                nursery.cancel_scope.cancel()
                return
            while True:
                try:
                    frame = decoder.next_frame()
                except p.RemoteProtocolError as e:
                    ABUSE.warn(what, peer_name(stream), e)
                    await send(error_frame(e.request_id, e.code, str(e)))
                    if 0 < e.unread <= LINGER_BYTES:
                        await _drop(stream, e.unread, limits.frame_timeout_s or limits.idle_timeout_s)
                    nursery.cancel_scope.cancel()
                    return
                if frame is p.NEED_DATA:
                    break
                if not admitted:
                    # In line, before any later frame of the same connection.
                    verdict = await gate(frame, send)
                    if verdict is False:
                        nursery.cancel_scope.cancel()
                        return
                    admitted = verdict is True
                    continue
                if respond_now is not None and slots.value == limits.max_in_flight:
                    data = respond_now(frame)  # nothing in flight: no answer to keep order with
                    if data is not None:
                        await send(data)
                        continue
                if slots.value:
                    slots.acquire_nowait()  # no trip through the scheduler while there is room
                else:
                    await slots.acquire()
                # Byte limits: this connection's and the shared one. While either is full, this
                # connection is not read (TCP pushes back on the producer).
                size = len(frame.payload)
                if held is not None:
                    await held.acquire(size)
                if budget is not None:
                    await budget.acquire(size)
                nursery.start_soon(answer, frame, size)
        # EOF: let requests already read finish and answer.
