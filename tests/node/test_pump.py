"""The connection pump: abuse of the port is refused with a typed ERROR and logged, once per
connection and at most so many lines a minute; the delay and meta servers share it."""
from __future__ import annotations

import logging
import struct

import pytest
import trio

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
