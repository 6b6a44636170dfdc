"""A TCP proxy process that a test can cut, to partition what connects through it.

    python -m tests.meta.tcp_proxy TARGET_HOST:TARGET_PORT

Prints ``proxy listening on 127.0.0.1:PORT`` once it listens, then forwards each connection to the
target. SIGUSR1 cuts: every forwarded connection is closed and new ones are closed as soon as they
are accepted (a partition the peer sees at once, as a firewall rejecting packets makes it).
SIGHUP stalls: connections stay open but nothing is forwarded either way, and new ones wait (a
partition the peer only sees by its timeouts, as one dropping packets makes it). SIGUSR2 heals
either. SIGTERM stops it.
"""
from __future__ import annotations

import signal
import sys

import trio


class Proxy:
    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.cut = False
        self.flowing = trio.Event()
        self.flowing.set()
        self.scopes: set[trio.CancelScope] = set()

    async def handle(self, client: trio.SocketStream) -> None:
        await self.flowing.wait()
        if self.cut:
            await trio.aclose_forcefully(client)
            return
        try:
            upstream = await trio.open_tcp_stream(self.host, self.port)
        except OSError:
            await trio.aclose_forcefully(client)
            return
        with trio.CancelScope() as scope:
            self.scopes.add(scope)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self.pump, client, upstream, scope)
                    nursery.start_soon(self.pump, upstream, client, scope)
            finally:
                self.scopes.discard(scope)
        await trio.aclose_forcefully(client)
        await trio.aclose_forcefully(upstream)

    async def pump(self, source, sink, scope: trio.CancelScope) -> None:
        try:
            while data := await source.receive_some(65536):
                await self.flowing.wait()
                await sink.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        scope.cancel()

    async def follow_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGTERM) as signals:
            async for signum in signals:
                if signum == signal.SIGTERM:
                    raise SystemExit(0)
                if signum == signal.SIGHUP:
                    self.flowing = trio.Event()
                    print("stalled", flush=True)
                    continue
                self.cut = signum == signal.SIGUSR1
                self.flowing.set()
                print("cut" if self.cut else "healed", flush=True)
                if self.cut:
                    for scope in list(self.scopes):
                        scope.cancel()


async def main(target: str) -> None:
    host, _, port = target.rpartition(":")
    proxy = Proxy(host, int(port))
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(proxy.follow_signals)
        await nursery.start(trio.serve_listeners, proxy.handle, listeners)
        print(f"proxy listening on 127.0.0.1:{listeners[0].socket.getsockname()[1]}", flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
