"""Small trio helpers shared by the clients."""
from __future__ import annotations

import contextlib

import trio


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
