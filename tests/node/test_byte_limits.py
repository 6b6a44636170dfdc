"""Byte limits in the connection pump: before AUTH, per connection, and in total. Real sockets."""
from __future__ import annotations

import trio

from delayserver import protocol as p
from delayserver.budget import ByteBudget
from delayserver.config import Config
from delayserver.message import ResultCode
from delayserver.node.server import MAX_BYTES_BEFORE_AUTH, DelayServer


def config(tmp_path, **kw) -> Config:
    return Config.from_dict(dict(data_dir=str(tmp_path / "data"), listen="127.0.0.1:0", **kw))


async def read_frames(stream, n: int) -> list[p.Frame]:
    decoder = p.FrameDecoder(max_frame_bytes=1 << 24)
    frames = []
    while len(frames) < n:
        data = await stream.receive_some(65536)
        if not data:
            break
        decoder.feed(data)
        while (frame := decoder.next_frame()) is not p.NEED_DATA:
            frames.append(frame)
    return frames


async def test_before_auth_a_connection_may_buffer_only_a_little(tmp_path, nursery):
    server = DelayServer(config(tmp_path, auth_secret="s3cret"))
    await nursery.start(server.serve)
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    big = p.encode(p.Frame(p.Command.SEND, 1, b"\0" * (4 << 20)))  # a 4 MiB frame, no AUTH first
    with trio.fail_after(30):
        sent = 0
        try:
            while sent < len(big):
                await stream.send_all(big[sent : sent + 65536])
                sent += 65536
        except trio.BrokenResourceError:
            pass  # the server closed the connection: good
        frames = await read_frames(stream, 1)
    assert frames and frames[0].command == p.Command.ERROR
    assert p.decode_error(frames[0].payload).code == ResultCode.UNAUTHORIZED
    assert sent < 1 << 20, "the server read megabytes from a connection that never authenticated"
    assert MAX_BYTES_BEFORE_AUTH <= 1 << 20
    await stream.aclose()


async def test_pipelined_requests_are_held_within_the_connection_and_total_byte_limits(tmp_path, nursery):
    limit = 400 << 10
    server = DelayServer(config(tmp_path, max_connection_bytes=300 << 10, max_buffered_bytes=limit))
    await nursery.start(server.serve)
    peak = 0

    async def watch():
        nonlocal peak
        while True:
            peak = max(peak, server.buffered.used)
            await trio.lowlevel.checkpoint()

    nursery.start_soon(watch)
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    n = 30
    requests = b"".join(
        p.encode(p.Frame(p.Command.SEND, i + 1, p.encode_send_request([
            p.SendItem(f"m{i}", "bytes.q", p.TimeSpec.delay(3_600_000), b"x" * (100 << 10))])))
        for i in range(n))
    with trio.fail_after(60):
        async with trio.open_nursery() as inner:
            inner.start_soon(stream.send_all, requests)  # all of it at once, pipelined
            frames = await read_frames(stream, n)
    assert len(frames) == n
    assert all(p.decode_send_response(f.payload)[0].code == ResultCode.OK for f in frames)
    assert 0 < peak <= limit
    assert server.buffered.used == 0
    await stream.aclose()


async def test_a_byte_budget_lets_one_oversized_request_through_alone():
    budget = ByteBudget(100)
    await budget.acquire(500)  # nothing held: it goes through
    assert not budget.fits(1)
    got = []

    async def second():
        await budget.acquire(50)
        got.append(50)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        budget.release(500)
    assert got == [50] and budget.used == 50
