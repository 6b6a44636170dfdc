"""write_now: straight to a TCP socket what the kernel takes, nothing to any other stream."""
from __future__ import annotations

import socket
import struct

import pytest
import trio
import trio.testing

from delayserver.trio_util import write_now


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
