"""Small trio helpers shared by the clients and the connection pump."""
from __future__ import annotations

import contextlib
import math
import os

import trio


def write_now(stream: trio.abc.Stream, data) -> int:
    """Write to a TCP stream's socket what the kernel takes of `data` at once, without waiting;
    how many bytes went: all, some (a full send buffer), or 0 (a full buffer, a closed stream, or
    a stream that is not a plain `trio.SocketStream`, TLS among them). Raises
    trio.BrokenResourceError when the peer reset the connection, as `send_all` would. Callers
    use `send_whole`, which keeps frames whole."""
    if type(stream) is not trio.SocketStream:
        return 0
    fd = stream.socket.fileno()
    if fd < 0:
        return 0
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0
    except OSError as e:
        raise trio.BrokenResourceError(f"socket connection broken: {e}") from e


#: The one buffer every connection's socket reads land in (`receive_into`), before they are
#: copied to the connection's own: a read is taken whole into its reader before anything else
#: runs. One per trio run: two runs in two threads of one process (two sync Producers) read at
#: the same time.
_RECEIVE_BUFFER = trio.lowlevel.RunVar("delayserver_receive_buffer")
RECEIVE_BUFFER_BYTES = 1 << 20


def _receive_buffer() -> memoryview:
    try:
        return _RECEIVE_BUFFER.get()
    except LookupError:
        buffer = memoryview(bytearray(RECEIVE_BUFFER_BYTES))
        _RECEIVE_BUFFER.set(buffer)
        return buffer


async def receive_into(stream: trio.abc.Stream, feed, max_bytes: int) -> int:
    """Wait until the stream has bytes, read at most `max_bytes` of them and hand them to
    `feed` (which copies them: it is given a view of a shared buffer, valid only during the
    call); returns how many were read, 0 at EOF. Raises as `receive_some` does.

    trio's `receive_some` makes a new bytes object of `max_bytes` for every read (a large one
    costs the allocator, and the pages it touches, more than the read), and on a socket that
    has bytes already it passes through the scheduler once more after the read. For a plain
    `trio.SocketStream` this reads into one buffer shared by every connection of the trio run
    instead, once the socket is readable (one pass through the scheduler per read, as when
    `receive_some` had to wait); any other stream (TLS) goes through `receive_some`."""
    if type(stream) is not trio.SocketStream or max_bytes > RECEIVE_BUFFER_BYTES:
        data = await stream.receive_some(max_bytes)
        if data:
            feed(data)
        return len(data)
    sock = stream.socket
    if sock.fileno() < 0:
        raise trio.ClosedResourceError("this socket was already closed")
    await trio.lowlevel.wait_readable(sock)
    into = [_receive_buffer()[:max_bytes]]
    while True:
        fd = sock.fileno()  # (-1 once another task closed it while this one waited)
        if fd < 0:
            raise trio.ClosedResourceError("this socket was already closed")
        try:
            n = os.readv(fd, into)  # the socket does not block: this never waits
        except BlockingIOError:  # readable, then taken (or a spurious wakeup): wait again
            await trio.lowlevel.wait_readable(sock)
            continue
        except OSError as e:
            raise trio.BrokenResourceError(f"socket connection broken: {e}") from e
        if n:
            feed(into[0][:n])
        return n


async def send_whole(stream: trio.abc.Stream, lock: trio.Lock, data: bytes, timeout_s: float | None = None) -> None:
    """Send one frame whole, its bytes never mixed with another's sent under the same `lock`.

    trio's `send_all` passes through the scheduler after every send, even when the kernel took it
    all: one more task step per request and per answer. So while no other frame is being sent,
    what the kernel takes at once is written straight to the socket (`write_now`); the rest goes
    through `send_all` under the lock, within `timeout_s` when given (then it returns, the frame
    cut short: the connection is past using). Raises as `send_all` does."""
    if not lock.locked():
        written = write_now(stream, data)
        if written == len(data):
            return
        data = memoryview(data)[written:]  # the rest, without a copy
    with trio.CancelScope(deadline=math.inf if timeout_s is None else trio.current_time() + timeout_s):
        async with lock:
            await stream.send_all(data)


@contextlib.asynccontextmanager
async def background_nursery(on_exit=None):
    """A nursery for an object's background tasks, cancelled when the `async with` body ends.

    An exception from the body is re-raised as itself, outside the nursery, instead of wrapped in
    an ExceptionGroup, so a caller of `async with Client() as c:` sees the error it would expect.
    `on_exit` (an async callable) runs shielded before the tasks are cancelled.
    """
    error = None
    async with trio.open_nursery() as nursery:
        try:
            yield nursery
        except Exception as e:
            error = e
        finally:
            if on_exit is not None:
                with trio.CancelScope(shield=True):
                    await on_exit()
            nursery.cancel_scope.cancel()
    if error is not None:
        raise error


class BackgroundTasks:
    """Mixin for clients with background tasks: ``async with client:`` opens `self._nursery`
    (see `background_nursery`), and `_closing()` runs shielded before the tasks are cancelled."""

    _nursery: trio.Nursery

    async def _closing(self) -> None:
        """Override to close connections when the `async with` block ends."""

    async def __aenter__(self):
        self._session = background_nursery(on_exit=self._closing)
        self._nursery = await self._session.__aenter__()
        return self

    async def __aexit__(self, *exc):
        return await self._session.__aexit__(*exc)
