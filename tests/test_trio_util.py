"""write_now: straight to a TCP socket what the kernel takes, nothing to any other stream.
receive_into: a socket's bytes read into the one shared buffer and handed on at once."""
from __future__ import annotations

import socket
import struct

import pytest
import trio
import trio.testing

from delayserver import trio_util
from delayserver.trio_util import receive_into, write_now


async def _pair():
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    client = await trio.open_tcp_stream("127.0.0.1", listener.socket.getsockname()[1])
    server = await listener.accept()
    await listener.aclose()
    return client, server


async def test_it_writes_what_the_kernel_takes_and_says_how_much():
    client, server = await _pair()
    async with client, server:
        assert write_now(client, b"hello") == 5
        assert await server.receive_some(100) == b"hello"
        client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        big = b"x" * (16 << 20)
        taken = write_now(client, big)
        assert 0 < taken < len(big)  # the rest is the caller's, through send_all


async def test_it_leaves_other_streams_and_closed_ones_alone():
    a, _ = trio.testing.memory_stream_pair()
    assert write_now(a, b"data") == 0
    client, server = await _pair()
    await client.aclose()
    assert write_now(client, b"data") == 0  # send_all then says it is closed
    with pytest.raises(trio.ClosedResourceError):
        await client.send_all(b"data")
    await server.aclose()


async def test_a_reset_connection_is_a_broken_resource():
    client, server = await _pair()
    async with client:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await server.aclose()  # linger 0: the peer is reset, not closed (on loopback, at once)
        with pytest.raises(trio.BrokenResourceError):
            write_now(client, b"data")


async def test_receive_into_hands_on_what_was_read_as_a_view_of_the_shared_buffer_and_zero_at_eof():
    client, server = await _pair()
    got, owners = bytearray(), []

    def feed(data) -> None:
        owners.append(data.obj)  # a memoryview: what it views
        got.extend(data)

    async with client, server:
        await client.send_all(b"first")
        assert await receive_into(server, feed, 65536) == 5
        await client.send_all(b"x" * 100)
        assert await receive_into(server, feed, 10) == 10  # never more than asked for
        while len(got) < 105:
            await receive_into(server, feed, 65536)
        await client.send_eof()
        assert await receive_into(server, feed, 65536) == 0
    assert bytes(got) == b"first" + b"x" * 100
    assert owners and all(o is trio_util._receive_buffer().obj for o in owners)  # no bytes object per read


async def test_receive_into_raises_as_receive_some_does_and_takes_other_streams_through_it():
    client, server = await _pair()
    async with client:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await server.aclose()  # the peer is reset
        with pytest.raises(trio.BrokenResourceError):
            await receive_into(client, lambda data: None, 65536)
    with pytest.raises(trio.ClosedResourceError):
        await receive_into(client, lambda data: None, 65536)  # closed on this side

    a, b = trio.testing.memory_stream_pair()
    got = []
    await a.send_all(b"through receive_some")
    assert await receive_into(b, got.append, 65536) == 20
    assert got == [b"through receive_some"]
    await a.aclose()
    assert await receive_into(b, got.append, 65536) == 0 and len(got) == 1


async def test_receive_into_keeps_the_bytes_of_many_connections_apart():
    """Every connection reads into the same buffer: each read must reach its own connection's
    bytes whole before another read lands there."""
    pairs = [await _pair() for _ in range(8)]
    payloads = [bytes([i]) * (300_000 + i) for i in range(len(pairs))]
    received = [bytearray() for _ in pairs]

    async def reader(i: int, server) -> None:
        while await receive_into(server, received[i].extend, 256 << 10):
            await trio.sleep(0)  # the other readers run between reads

    async def writer(i: int, client) -> None:
        for at in range(0, len(payloads[i]), 7_000):
            await client.send_all(payloads[i][at:at + 7_000])
        await client.send_eof()

    async with trio.open_nursery() as nursery:
        for i, (client, server) in enumerate(pairs):
            nursery.start_soon(reader, i, server)
            nursery.start_soon(writer, i, client)
    for client, server in pairs:
        await client.aclose()
        await server.aclose()
    assert [bytes(r) for r in received] == payloads


def test_receive_into_gives_each_trio_run_a_buffer_of_its_own():
    """Two trio runs in two threads of one process (two sync Producers) read at the same time."""
    import threading

    buffers = []

    def run() -> None:
        async def main():
            buffers.append(trio_util._receive_buffer().obj)
            assert trio_util._receive_buffer().obj is buffers[-1]  # the same for the whole run
        trio.run(main)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(buffers) == 2 and buffers[0] is not buffers[1]
