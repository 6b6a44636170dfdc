"""The connection pump: abuse of the port is refused with a typed ERROR and logged, once per
connection and at most so many lines a minute; the delay and meta servers share it."""
from __future__ import annotations

import logging
import struct

import pytest
import trio
import trio.testing

from delayserver import protocol as p
from delayserver.config import Config
from delayserver.message import ResultCode
from delayserver.node import pump as pump_module
from delayserver.node.pump import AbuseLog
from delayserver.node.server import DelayServer


@pytest.fixture
async def node(tmp_path, nursery):
    server = DelayServer(Config.from_dict({"data_dir": str(tmp_path / "data"), "listen": "127.0.0.1:0",
                                           "max_frame_bytes": 4096}))
    await nursery.start(server.serve)
    return server


@pytest.fixture
def abuse(monkeypatch):
    fresh = AbuseLog()
    monkeypatch.setattr(pump_module, "ABUSE", fresh)
    return fresh


async def answer_to(port: int, data: bytes) -> p.ErrorResult:
    """Send `data` on a new connection; the ERROR the server answers, after which it closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        decoder, received = p.FrameDecoder(), b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                received += chunk
        decoder.feed(received)
        frame = decoder.next_frame()
        assert frame.command == p.Command.ERROR and decoder.next_frame() is p.NEED_DATA
        return p.decode_error(frame.payload)


def abuse_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "broke the protocol" in r.getMessage()]


async def test_bad_magic_is_answered_with_bad_request_and_logged_once(node, abuse, caplog):
    caplog.set_level(logging.WARNING, "delayserver.connections")
    error = await answer_to(node.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 10)
    assert error.code == ResultCode.BAD_REQUEST and "bad magic" in error.message
    (line,) = abuse_lines(caplog)
    assert "127.0.0.1:" in line and "bad magic" in line


async def test_an_oversize_declared_length_is_refused_before_any_payload_and_logged(node, abuse, caplog):
    caplog.set_level(logging.WARNING, "delayserver.connections")
    header = p.HEADER.pack(p.MAGIC, p.VERSION, p.Command.SEND, 0, 7, 1 << 30)
    error = await answer_to(node.port, header)
    assert error.code == ResultCode.MESSAGE_TOO_LARGE
    (line,) = abuse_lines(caplog)
    assert "declared payload of 1073741824 bytes" in line


async def test_a_flood_of_bad_connections_is_logged_at_a_bounded_rate(node, abuse, caplog):
    caplog.set_level(logging.WARNING, "delayserver.connections")
    for _ in range(pump_module.ABUSE_LOG_PER_MINUTE + 15):
        await answer_to(node.port, struct.pack(">I", 0xDEADBEEF) * 4)
    assert len(abuse_lines(caplog)) == pump_module.ABUSE_LOG_PER_MINUTE
    assert abuse.suppressed == 15


def test_the_abuse_log_refills_and_says_how_many_lines_it_kept_back(caplog):
    caplog.set_level(logging.WARNING, "delayserver.connections")
    now = [0.0]
    limiter = AbuseLog(per_minute=2, clock=lambda: now[0])
    for _ in range(5):
        limiter.warn("a connection", "peer", ValueError("bad"))
    assert limiter.suppressed == 3 and len(caplog.records) == 2
    now[0] = 30.0  # half a minute: one line's worth back
    limiter.warn("a connection", "peer", ValueError("bad"))
    assert "(3 more not logged)" in caplog.records[-1].getMessage() and limiter.suppressed == 0


async def _pump_frames(frames: list[p.Frame], gate) -> tuple[list[p.Frame], list[str]]:
    """Run the pump over an in-memory connection carrying `frames`, then EOF; the frames it
    answered and who answered each (the gate or the responder)."""
    client, server = trio.testing.memory_stream_pair()
    by: list[str] = []

    async def respond(frame: p.Frame) -> bytes:
        by.append("respond")
        return p.encode(p.Frame(frame.command, frame.request_id, b"in:" + frame.payload, is_response=True))

    async def gated(frame, send):
        by.append("gate")
        return await gate(frame, send)

    limits = pump_module.PumpLimits(4096, idle_timeout_s=10, max_in_flight=1, say_timeout=False)
    async with trio.open_nursery() as nursery:
        async def serve():
            async with server:  # the pump does not close the stream; its caller does
                await pump_module.pump(server, limits, respond, gate=gated)

        nursery.start_soon(serve)
        answers = await _exchange(client, frames)
    return answers, by


async def _exchange(client, frames: list[p.Frame], max_frame_bytes: int = p.DEFAULT_MAX_FRAME_BYTES) -> list[p.Frame]:
    """Send `frames` in one write, then EOF; every frame answered until the server closes."""
    await client.send_all(b"".join(p.encode(f) for f in frames))
    await client.send_eof()
    decoder = p.FrameDecoder(max_frame_bytes=max_frame_bytes)
    with trio.fail_after(10):
        while chunk := await client.receive_some(65536):
            decoder.feed(chunk)
    answers = []
    while (frame := decoder.next_frame()) is not p.NEED_DATA:
        answers.append(frame)
    return answers


async def test_a_gate_may_answer_frames_and_keep_the_connection_outside_until_auth():
    async def gate(frame, send):
        if frame.command == p.Command.AUTH:
            ok = frame.payload == b"secret"
            await send(p.encode(p.Frame(p.Command.AUTH if ok else p.Command.ERROR, frame.request_id, b"",
                                        is_response=True)))
            return ok
        await send(p.encode(p.Frame(frame.command, frame.request_id, b"out:" + frame.payload, is_response=True)))
        return None  # answered; not let in

    meta = lambda rid, body: p.Frame(p.Command.META, rid, body)  # noqa: E731
    answers, by = await _pump_frames(
        [meta(1, b"a"), meta(2, b"b"), p.Frame(p.Command.AUTH, 3, b"secret"), meta(4, b"c")], gate)
    assert [(f.request_id, f.payload) for f in answers] == [(1, b"out:a"), (2, b"out:b"), (3, b""), (4, b"in:c")]
    assert by == ["gate", "gate", "gate", "respond"]

    # A refusal closes the connection: nothing after it is read or answered.
    answers, by = await _pump_frames([meta(1, b"a"), p.Frame(p.Command.AUTH, 2, b"guess"), meta(3, b"b")], gate)
    assert [(f.command, f.request_id) for f in answers] == [(p.Command.META, 1), (p.Command.ERROR, 2)]
    assert by == ["gate", "gate"]


async def test_an_answer_the_kernel_takes_in_part_goes_out_whole_before_the_next():
    """Answers go straight to a TCP socket when nothing else is being sent; one the kernel takes
    only in part is finished under the send lock, and an answer ready meanwhile waits for it
    instead of being written into the middle of it."""
    big = bytes(range(256)) * (8 * 1024)  # 2 MiB: more than the socket's send buffer holds
    big_answered = trio.Event()

    async def respond(frame: p.Frame) -> bytes:
        if frame.request_id == 1:
            big_answered.set()
            return p.encode(p.Frame(frame.command, 1, big, is_response=True))
        await big_answered.wait()  # ready while the big answer is still going out
        return p.encode(p.Frame(frame.command, frame.request_id, b"small:%d" % frame.request_id, is_response=True))

    limits = pump_module.PumpLimits(4096, idle_timeout_s=10, say_timeout=False)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with trio.open_nursery() as nursery:
        async def serve():
            async with listeners[0], await listeners[0].accept() as server:
                server.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_SNDBUF, 64 * 1024)
                await pump_module.pump(server, limits, respond)

        nursery.start_soon(serve)
        port = listeners[0].socket.getsockname()[1]
        client = await trio.open_tcp_stream("127.0.0.1", port)
        async with client:
            # All in one write: the pump starts every answer in the same turn of the loop.
            answers = await _exchange(client, [p.Frame(p.Command.PING, rid, b"") for rid in (1, 2, 3, 4)],
                                      max_frame_bytes=4 * len(big))
    assert answers[0].request_id == 1 and answers[0].payload == big
    assert sorted((f.request_id, f.payload) for f in answers[1:]) == \
        [(2, b"small:2"), (3, b"small:3"), (4, b"small:4")]


@pytest.mark.parametrize("max_in_flight", [1, 256])
async def test_respond_now_answers_in_line_only_while_nothing_else_of_the_connection_is_in_flight(max_in_flight):
    """A frame `respond_now` answers goes out without a task, in its turn: a frame read while an
    earlier request of the same connection is still in flight goes to `respond`, so that with one
    request at a time the answers keep the requests' order."""
    client, server = trio.testing.memory_stream_pair()
    by: list[tuple[str, int]] = []

    async def respond(frame: p.Frame) -> bytes:
        by.append(("respond", frame.request_id))
        return p.encode(p.Frame(frame.command, frame.request_id, b"later", is_response=True))

    def respond_now(frame: p.Frame) -> bytes | None:
        if frame.command != p.Command.STATUS or frame.payload == b"must wait":
            return None
        by.append(("now", frame.request_id))
        return p.encode(p.Frame(frame.command, frame.request_id, b"now", is_response=True))

    spawned = []

    class Spawns(trio.abc.Instrument):
        def task_spawned(self, task):
            spawned.append(task.name)

    limits = pump_module.PumpLimits(4096, idle_timeout_s=10, max_in_flight=max_in_flight, say_timeout=False)
    status = lambda rid, body=b"": p.Frame(p.Command.STATUS, rid, body)  # noqa: E731
    async with trio.open_nursery() as nursery:
        async def serve():
            async with server:
                await pump_module.pump(server, limits, respond, respond_now=respond_now)

        nursery.start_soon(serve)
        await trio.testing.wait_all_tasks_blocked()
        trio.lowlevel.add_instrument(instrument := Spawns())
        try:
            # One write: the pump reads all of them in one turn; PING 3 is still in flight when
            # STATUS 4 is read.
            answers = await _exchange(client, [status(1), status(2, b"must wait"), p.Frame(p.Command.PING, 3, b""),
                                               status(4)])
        finally:
            trio.lowlevel.remove_instrument(instrument)
    # (Tasks started in one turn run in an order trio picks.)
    assert by[0] == ("now", 1) and sorted(by[1:]) == [("respond", 2), ("respond", 3), ("respond", 4)]
    assert [(f.request_id, f.payload) for f in answers][:1] == [(1, b"now")]
    assert sorted(f.request_id for f in answers) == [1, 2, 3, 4]
    if max_in_flight == 1:
        assert [f.request_id for f in answers] == [1, 2, 3, 4]
    assert len([n for n in spawned if n.endswith("answer")]) == 3  # none for the status answered in line
