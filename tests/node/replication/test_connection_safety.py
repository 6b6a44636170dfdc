"""No replication request can stop a node: bad sizes, bad offsets, garbage, unexpected errors get a
coded answer on that connection, and the node and its other connections go on (live server)."""
from __future__ import annotations

import functools
import logging
import random
import struct

import pytest
import trio

from delayserver import protocol as p
from delayserver.client import AsyncProducer, Message
from delayserver.message import DelayServerError, ResultCode
from delayserver.node.replication import wire

from tests.node.replication.helpers import cfg, spooled_ids, start, wait_until



def dispatch_request(sizes: dict[int, int]) -> bytes:
    return wire.encode_dispatch_log_request(wire.DispatchLogRequest("probe", sizes))


def message_log_request(offset: int) -> bytes:
    return wire.encode_message_log_request(wire.MessageLogRequest(offset, 1 << 20, 0, "probe"))


@pytest.fixture
async def delivered(tmp_path, nursery):
    """A master that delivered 20 messages: one dispatch_log bucket, message_log with records."""
    master = await start(nursery, cfg(tmp_path, "m"))
    async with AsyncProducer(f"127.0.0.1:{master.port}") as prod:
        await prod.send_many([Message("safe.q", f"m{i}".encode(), delay=0) for i in range(20)])
    await wait_until(lambda: len(spooled_ids(master, "safe.q")) == 20)
    await wait_until(lambda: sum(master.store.dispatch_log.size(b) for b in master.store.dispatch_log.buckets()) > 0)
    return master


async def expect_code(conn, command, payload, code) -> str:
    with pytest.raises(DelayServerError) as err:
        await conn.request(command, payload)
    assert err.value.code == code, err.value
    return str(err.value)


async def test_a_dispatch_log_size_inside_a_record_is_refused_and_the_master_goes_on(delivered):
    master = delivered
    (bucket,) = master.store.dispatch_log.buckets()
    size = master.store.dispatch_log.size(bucket)
    async with AsyncProducer(f"127.0.0.1:{master.port}") as bystander, \
            AsyncProducer(f"127.0.0.1:{master.port}") as conn:
        text = await expect_code(conn, p.Command.SYNC_DISPATCH_LOG, dispatch_request({bucket: 5}),
                                 ResultCode.BAD_REQUEST)
        assert "not where a record starts" in text
        await expect_code(conn, p.Command.SYNC_DISPATCH_LOG, dispatch_request({bucket: size + 1}),
                          ResultCode.DIVERGED)  # the asker wrote records this master never had
        # The same connection and another one are still served.
        assert await conn.ping(b"alive") == b"alive"
        assert await bystander.ping(b"still") == b"still"
        whole = await conn.request(p.Command.SYNC_DISPATCH_LOG, dispatch_request({}))
        [(got_bucket, start, data)] = wire.decode_dispatch_log_response(whole)
        assert (got_bucket, start, len(data)) == (bucket, 0, size)


async def test_message_log_offsets_inside_a_record_or_past_the_end_are_refused(delivered):
    # Inside a record: a bad request. Past the end: the asker holds records this master never had
    # (DIVERGED: it must find where the histories part, node/divergence.py).
    master = delivered
    end = master.receiver.durable_offset
    async with AsyncProducer(f"127.0.0.1:{master.port}") as conn:
        await expect_code(conn, p.Command.SYNC_MESSAGE_LOG, message_log_request(3), ResultCode.BAD_REQUEST)
        await expect_code(conn, p.Command.SYNC_MESSAGE_LOG, message_log_request(end + 1), ResultCode.DIVERGED)
        await expect_code(conn, p.Command.SYNC_MESSAGE_LOG, message_log_request(2**64 - 1), ResultCode.DIVERGED)
        reply = await conn.request(p.Command.SYNC_MESSAGE_LOG, message_log_request(0))
        assert wire.ML_RESP.unpack_from(reply, 0) == (0, end)
        assert await conn.ping(b"x") == b"x"


async def test_malformed_sync_requests_get_bad_request(delivered):
    master = delivered
    cases = [
        b"",
        b"\x00",
        struct.pack(">H", 0) + struct.pack(">I", 0),  # empty node id
        struct.pack(">H", 200) + b"short",  # node id cut short
        struct.pack(">H", 2) + b"\xff\xfe" + struct.pack(">I", 0),  # not UTF-8
        struct.pack(">H", 1) + b"n" + struct.pack(">I", 0xFFFFFFFF),  # four billion buckets, no bytes
        struct.pack(">H", 1) + b"n" + struct.pack(">I", 1) + b"\x00" * 7,  # one size cut short
        dispatch_request({0: 0}) + b"trailing",
    ]
    async with AsyncProducer(f"127.0.0.1:{master.port}") as conn:
        for payload in cases:
            await expect_code(conn, p.Command.SYNC_DISPATCH_LOG, payload, ResultCode.BAD_REQUEST)
            await expect_code(conn, p.Command.SYNC_MESSAGE_LOG, payload, ResultCode.BAD_REQUEST)
        await expect_code(conn, p.Command.SYNC_MESSAGE_LOG, message_log_request(0) + b"x", ResultCode.BAD_REQUEST)
        assert await conn.ping(b"x") == b"x"


async def test_random_sync_requests_never_stop_the_node(delivered):
    master = delivered
    rng = random.Random(1234)
    buckets = master.store.dispatch_log.buckets()
    end = master.receiver.durable_offset
    codes = set()
    async with AsyncProducer(f"127.0.0.1:{master.port}") as conn:
        for i in range(600):
            kind = rng.randrange(6)
            if kind == 0:
                payload = rng.randbytes(rng.randrange(0, 64))
            elif kind == 1:
                payload = message_log_request(rng.randrange(0, end + 50))
            elif kind == 2:
                payload = dispatch_request({rng.choice(buckets + [rng.randrange(-2**63, 2**63)]):
                                            rng.randrange(0, 2**64) if rng.random() < 0.3 else rng.randrange(0, 300)})
            elif kind == 3:
                payload = bytearray(dispatch_request({buckets[0]: 0}))
                payload[rng.randrange(len(payload))] ^= 1 << rng.randrange(8)
                payload = bytes(payload)
            else:  # snapshot requests: a manifest, or a segment's bytes from anywhere
                offset = rng.randrange(0, 400)
                payload = wire.encode_snapshot_request(wire.SnapshotRequest(
                    rng.randrange(3), rng.choice(buckets + [rng.randrange(-2**63, 2**63)]), offset,
                    offset + rng.randrange(0, 400), "probe"))
                if kind == 5:
                    payload = payload[: rng.randrange(len(payload) + 1)] + rng.randbytes(rng.randrange(3))
            command = rng.choice([p.Command.SYNC_MESSAGE_LOG, p.Command.SYNC_DISPATCH_LOG, p.Command.SYNC_SNAPSHOT,
                                  p.Command.SYNC_DISPATCH_DIGEST, p.Command.SYNC_EPOCH_END])
            try:
                await conn.request(command, payload)
                codes.add(ResultCode.OK)
            except DelayServerError as e:
                assert e.code in (ResultCode.BAD_REQUEST, ResultCode.NOT_FOUND, ResultCode.DIVERGED), e
                codes.add(e.code)
        assert await conn.ping(b"x") == b"x"
    assert {ResultCode.OK, ResultCode.BAD_REQUEST} <= codes
    async with AsyncProducer(f"127.0.0.1:{master.port}") as prod:
        await prod.send("safe.q", b"after", delay=0)
    await wait_until(lambda: len(spooled_ids(master, "safe.q")) == 21)


async def test_an_unexpected_exception_is_answered_internal_and_logged_once(delivered, monkeypatch, caplog):
    master = delivered

    async def broken(payload):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(master.master, "dispatch_log", broken)
    caplog.set_level(logging.ERROR, logger="delayserver.node")
    async with AsyncProducer(f"127.0.0.1:{master.port}") as conn:
        for _ in range(3):
            await expect_code(conn, p.Command.SYNC_DISPATCH_LOG, dispatch_request({}), ResultCode.INTERNAL)
        assert await conn.ping(b"x") == b"x"
    assert sum("unexpected error" in r.getMessage() for r in caplog.records) == 1
    async with AsyncProducer(f"127.0.0.1:{master.port}") as other:
        assert await other.ping(b"y") == b"y"


async def test_a_slave_survives_a_master_that_answers_garbage(tmp_path, nursery):
    """The slave's side of the same rule: its connection to the master cannot stop it either."""
    answered = []

    async def garbage_master(stream):
        decoder = p.FrameDecoder()
        async for data in stream:
            decoder.feed(data)
            while (frame := decoder.next_frame()) is not p.NEED_DATA:
                payload = {p.Command.SYNC_MESSAGE_LOG: b"abc",
                           p.Command.SYNC_DISPATCH_LOG: b"\x00\x00\x00\x05garbage"}.get(frame.command, b"")
                answered.append(frame.command)
                await stream.send_all(p.encode(p.Frame(frame.command, frame.request_id, payload, is_response=True)))

    listeners = await nursery.start(functools.partial(trio.serve_tcp, garbage_master, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    slave = await start(nursery, cfg(tmp_path, "s", replicate_from=f"127.0.0.1:{port}"))
    await wait_until(lambda: answered.count(p.Command.SYNC_MESSAGE_LOG) >= 2)
    async with AsyncProducer(f"127.0.0.1:{slave.port}") as conn:
        assert await conn.ping(b"alive") == b"alive"
    assert slave.store.message_log.end_offset == 0
    assert not slave.slave.stopped_reason


async def test_a_slave_answers_no_replication_request(tmp_path, nursery, unused_port):
    # A slave's copy may still be cut back at a divergence: another node must never pull from it.
    slave = await start(nursery, cfg(tmp_path, "s", replicate_from=f"127.0.0.1:{unused_port}"))
    async with AsyncProducer(f"127.0.0.1:{slave.port}") as conn:
        await expect_code(conn, p.Command.SYNC_MESSAGE_LOG, message_log_request(0), ResultCode.NOT_MASTER)
        await expect_code(conn, p.Command.SYNC_DISPATCH_LOG, dispatch_request({}), ResultCode.NOT_MASTER)
        assert await conn.ping(b"x") == b"x"
