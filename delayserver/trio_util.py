"""Small trio helpers shared by the clients and the connection pump."""
from __future__ import annotations

import contextlib
import os

import trio


def write_now(stream: trio.abc.Stream, data: bytes) -> int:
    """Write to a TCP stream's socket what the kernel takes of `data` at once, without waiting.

    trio's `send_all` passes through the scheduler after every send even when the kernel took it
    all: one more task step per request and per answer. This writes straight to the socket and
    returns how many bytes went: all of them, some (a full send buffer), or 0 (a full buffer, a
    closed stream, or a stream that is not a plain `trio.SocketStream`, TLS among them). The
    caller sends the rest with `send_all`, under whatever lock keeps its frames whole, and must
    not call this while another of its sends is under way. Raises trio.BrokenResourceError when
    the peer reset the connection, as `send_all` would."""
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
