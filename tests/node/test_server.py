"""The server in-process over real sockets: result codes, protocol abuse, limits, fsync and disk faults."""
from __future__ import annotations

import errno
import os
import struct

import pytest
import trio

from delayserver import protocol as p
from delayserver.client import AsyncProducer, Message
from delayserver.config import Config
from delayserver.message import (
    BadMessageId, BadScheduleTime, BadSubject, CancelOutcome, DelayServerError, MessageState, MessageTooLarge,
    ResultCode,
)
from delayserver.node.server import GC_THRESHOLDS, SWITCH_INTERVAL_S, DelayServer
from delayserver.storage.message_log import MessageLog
from delayserver.storage.record import RecordType


def config(tmp_path, **kw) -> Config:
    base = dict(data_dir=str(tmp_path / "data"), listen="127.0.0.1:0", max_message_bytes=1024,
                idle_timeout_ms=2000, frame_timeout_ms=300, max_delay="1d")
    base.update(kw)
    return Config.from_dict(base)


@pytest.fixture
async def node(tmp_path, nursery):
    server = DelayServer(config(tmp_path))
    await nursery.start(server.serve)
    return server


async def producer_for(server, nursery) -> AsyncProducer:
    prod = AsyncProducer(f"127.0.0.1:{server.port}", timeout=5)
    await nursery.start(_hold, prod)
    return prod


async def _hold(prod, task_status=trio.TASK_STATUS_IGNORED):
    async with prod:
        task_status.started()
        await trio.sleep_forever()


async def raw_exchange(port: int, data: bytes) -> list[p.Frame]:
    """Send raw bytes, read frames until the server closes the connection."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(data)
    decoder, frames = p.FrameDecoder(), []
    with trio.fail_after(5):
        while chunk := await stream.receive_some(65536):
            decoder.feed(chunk)
            while (f := decoder.next_frame()) is not p.NEED_DATA:
                frames.append(f)
    await stream.aclose()
    return frames


async def test_each_bad_message_gets_its_code_and_good_ones_in_the_batch_are_stored(node, nursery):
    prod = await producer_for(node, nursery)
    results = await prod.send_many([
        Message("ok.subject", b"fine", delay=3_600_000),
        Message("bad subject", b"x"),
        Message("ok.subject", b"x" * 2000),
        Message("ok.subject", b"x", message_id="i" * 129),
        Message("ok.subject", b"x", delay=2 * 86_400_000),
        Message("ok.subject", b"x", delay_level=19),
        Message("ok.subject", b"x", delay=-5),
        Message("ok.subject", b"x", deliver_at=2**62),
    ])
    assert isinstance(results[0], p.Handle)
    assert [type(r) for r in results[1:]] == [BadSubject, MessageTooLarge, BadMessageId, BadScheduleTime,
                                              BadScheduleTime, BadScheduleTime, BadScheduleTime]
    assert results[4].code == ResultCode.BAD_SCHEDULE_TIME and "max_delay" in str(results[4])
    assert (await prod.status(results[0])).state == MessageState.PENDING


async def test_past_delivery_time_is_delivered_at_once_and_levels_follow_the_table(node, nursery):
    prod = await producer_for(node, nursery)
    now = node.clock.now_ms()
    past = await prod.send("t.now", b"x", deliver_at=now - 10_000)
    assert now <= past.schedule_time <= node.clock.now_ms()
    level = await prod.send("t.level", b"x", delay_level=3)
    assert level.schedule_time - now in range(10_000, 11_000)
    with trio.fail_after(5):
        while (await prod.status(past)).state != MessageState.DELIVERED:
            await trio.sleep(0.01)


async def test_cancel_reports_what_happened_and_a_cancelled_message_is_never_delivered(node, nursery):
    prod = await producer_for(node, nursery)
    pending = await prod.send("c.x", b"x", delay=60_000)  # in the loaded window: in the wheel
    await prod.status(pending)  # replayed
    assert len(node.ticks.wheel) == 1
    assert await prod.cancel(pending) == CancelOutcome.CANCELLED
    assert len(node.ticks.wheel) == 0  # taken out at once, not left to be dropped when due
    assert await prod.cancel(pending) == CancelOutcome.ALREADY_CANCELLED
    assert (await prod.status(pending)).state == MessageState.CANCELLED
    now = await prod.send("c.x", b"y", delay=0)
    with trio.fail_after(5):
        while (await prod.status(now)).state != MessageState.DELIVERED:
            await trio.sleep(0.01)
    assert await prod.cancel(now) == CancelOutcome.ALREADY_DELIVERED
    assert await prod.cancel(p.Handle(pending.schedule_time, "never-sent")) == CancelOutcome.UNKNOWN
    status = await prod.status(now)
    assert status.broker_group == "spool" and status.dispatch_time >= now.schedule_time


def _one_frame(data: bytes) -> p.Frame:
    decoder = p.FrameDecoder()
    decoder.feed(data)
    frame = decoder.next_frame()
    assert decoder.next_frame() is p.NEED_DATA
    return frame


async def test_a_status_answered_in_line_says_what_its_task_would_in_every_state(node, nursery):
    """The pump answers a status (and a PING) in line when `answer_now` can (no task); its answer
    is the one `respond` gives, for each state, a half message, a bad handle, a PING. While replay is behind what is
    durable it answers only PENDING and DELIVERED (no acknowledged record replay has yet to apply
    changes those) and steps aside (None) for the rest, so a status never misses a message or a
    second send of a cancelled handle already acknowledged."""
    prod = await producer_for(node, nursery)
    pending = await prod.send("s.x", b"x", delay=60_000)
    cancelled = await prod.send("s.x", b"y", delay=60_000)
    assert await prod.cancel(cancelled) == CancelOutcome.CANCELLED
    delivered = await prod.send("s.x", b"z", delay=0)
    with trio.fail_after(5):
        while (await prod.status(delivered)).state != MessageState.DELIVERED:
            await trio.sleep(0.01)
    half = await prod.prepare("s.x", b"h", group="orders", delay=60_000)
    unknown = p.Handle(pending.schedule_time, "never-sent")
    peer = node.requests.connection()
    states = []
    for handle in (pending, cancelled, delivered, half, unknown):
        frame = p.Frame(p.Command.STATUS, 7, p.encode_handle(handle))
        now = peer.answer_now(frame)
        assert now is not None and now == await peer.respond(frame)
        states.append(p.decode_status_response(_one_frame(now).payload).state)
    assert states == [MessageState.PENDING, MessageState.CANCELLED, MessageState.DELIVERED,
                      MessageState.PREPARED, MessageState.UNKNOWN]
    bad = p.Frame(p.Command.STATUS, 8, b"\xff")
    assert peer.answer_now(bad) == await peer.respond(bad)
    assert _one_frame(peer.answer_now(bad)).command == p.Command.ERROR
    ping = p.Frame(p.Command.PING, 9, b"token")
    assert peer.answer_now(ping) is not None and peer.answer_now(ping) == await peer.respond(ping)
    assert peer.answer_now(p.Frame(p.Command.CANCEL, 9, p.encode_handle(pending))) is None
    durable = node.receiver.durable_offset
    node.receiver.durable_offset = node.replayer.offset + 1  # no checkpoint until restored
    try:
        behind = [peer.answer_now(p.Frame(p.Command.STATUS, 10, p.encode_handle(h)))
                  for h in (pending, cancelled, delivered, half, unknown)]
    finally:
        node.receiver.durable_offset = durable
    assert [b is not None for b in behind] == [True, False, True, False, False]
    assert [p.decode_status_response(_one_frame(b).payload).state for b in behind if b is not None] == \
        [MessageState.PENDING, MessageState.DELIVERED]


async def test_garbage_gets_an_error_frame_and_the_connection_closes_while_others_are_served(node, nursery):
    prod = await producer_for(node, nursery)
    frames = await raw_exchange(node.port, b"GET / HTTP/1.1\r\n\r\n" + os.urandom(64))
    assert [f.command for f in frames] == [p.Command.ERROR]
    assert p.decode_error(frames[0].payload).code == ResultCode.BAD_REQUEST
    assert await prod.ping(b"alive") == b"alive"


async def test_declared_length_over_the_cap_is_refused_from_the_header_alone(node):
    header = p.HEADER.pack(p.MAGIC, p.VERSION, p.Command.SEND, 0, 7, 2**31)
    frames = await raw_exchange(node.port, header)
    assert p.decode_error(frames[0].payload).code == ResultCode.MESSAGE_TOO_LARGE


async def test_bad_crc_closes_the_connection(node):
    raw = bytearray(p.encode(p.Frame(p.Command.PING, 1, b"hello")))
    raw[-1] ^= 0xFF
    frames = await raw_exchange(node.port, bytes(raw))
    assert [f.command for f in frames] == [p.Command.ERROR]


async def test_malformed_payload_gets_bad_request_and_the_connection_stays_usable(node):
    stream = await trio.open_tcp_stream("127.0.0.1", node.port)
    await stream.send_all(p.encode(p.Frame(p.Command.SEND, 5, b"\x00\x00\x00\x09junk")))
    await stream.send_all(p.encode(p.Frame(p.Command.PING, 6, b"still here")))
    decoder, frames = p.FrameDecoder(), []
    with trio.fail_after(5):
        while len(frames) < 2:
            decoder.feed(await stream.receive_some(65536))
            while (f := decoder.next_frame()) is not p.NEED_DATA:
                frames.append(f)
    await stream.aclose()
    by_id = {f.request_id: f for f in frames}
    assert by_id[5].command == p.Command.ERROR
    assert p.decode_error(by_id[5].payload).code == ResultCode.BAD_REQUEST
    assert by_id[6].payload == b"still here"


async def test_a_client_trickling_bytes_is_dropped_and_does_not_hold_back_others(node, nursery):
    prod = await producer_for(node, nursery)
    stream = await trio.open_tcp_stream("127.0.0.1", node.port)
    frame = p.encode(p.Frame(p.Command.PING, 1, b"x" * 100))
    closed = False
    with trio.fail_after(5):
        for byte in frame:
            try:
                await stream.send_all(bytes([byte]))
            except trio.BrokenResourceError:
                closed = True
                break
            assert await prod.ping(b"ok") == b"ok"
            await trio.sleep(0.05)
    if not closed:
        data = b""
        with trio.fail_after(5):
            while chunk := await stream.receive_some(4096):
                data += chunk
        closed = True
    assert closed
    await stream.aclose()


async def test_connections_over_the_limit_get_busy(tmp_path, nursery):
    server = DelayServer(config(tmp_path, max_connections=2))
    await nursery.start(server.serve)
    held = [await trio.open_tcp_stream("127.0.0.1", server.port) for _ in range(2)]
    await trio.sleep(0.1)
    frames = await raw_exchange(server.port, b"")
    assert p.decode_error(frames[0].payload).code == ResultCode.BUSY
    for s in held:
        await s.aclose()


async def test_disk_full_refuses_new_messages_then_writes_resume_and_the_log_stays_intact(node, nursery, monkeypatch):
    prod = await producer_for(node, nursery)
    before = await prod.send("d.x", b"before", delay=3_600_000)
    real_pwrite = os.pwrite

    def full(fd, data, offset):
        if fd == node.store.message_log.active.fd:
            real_pwrite(fd, bytes(data)[:5], offset)  # a partial write, then no space
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(DelayServerError) as err:
        await prod.send("d.x", b"during", delay=3_600_000)
    assert err.value.code == ResultCode.DISK_FULL
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    after = await prod.send("d.x", b"after", delay=3_600_000)
    ids = [m for _, rtype, m in node.store.message_log.iter_from(0) if rtype == RecordType.MESSAGE]
    assert len(ids) == 2
    assert (await prod.status(before)).state == (await prod.status(after)).state == MessageState.PENDING


async def test_a_failed_fsync_stops_all_acknowledging(node, nursery, monkeypatch):
    prod = await producer_for(node, nursery)
    await prod.send("f.x", b"ok", delay=3_600_000)
    real_fsync = os.fsync

    def failing(fd):
        if "/message_log/" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing)
    for _ in range(2):
        with pytest.raises(DelayServerError) as err:
            await prod.send("f.x", b"lost?", delay=3_600_000)
        assert err.value.code == ResultCode.READ_ONLY
    monkeypatch.setattr(os, "fsync", real_fsync)
    with pytest.raises(DelayServerError) as err:
        await prod.send("f.x", b"still refused", delay=3_600_000)
    assert err.value.code == ResultCode.READ_ONLY


async def test_restart_resumes_sequences_above_the_highest_written(tmp_path, nursery):
    cfg = config(tmp_path)
    async with trio.open_nursery() as inner:
        server = DelayServer(cfg)
        await inner.start(server.serve)
        async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
            for i in range(5):
                await prod.send("s.x", b"x", delay=3_600_000)
        inner.cancel_scope.cancel()
    server = DelayServer(cfg)
    await nursery.start(server.serve)
    async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
        await prod.send("s.x", b"x", delay=3_600_000)
    log = MessageLog.open(tmp_path / "data" / "message_log")
    seqs = [struct.unpack_from(">Q", payload, 16)[0] for _, rtype, payload in log.iter_from(0)
            if rtype == RecordType.MESSAGE]
    assert seqs == [1, 2, 3, 4, 5, 6]


async def test_metrics_are_served_in_prometheus_text_format(tmp_path, nursery):
    from prometheus_client.parser import text_string_to_metric_families

    server = DelayServer(config(tmp_path, metrics_listen="127.0.0.1:0"))
    await nursery.start(server.serve)
    async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
        await prod.send("m.x", b"x", delay=3_600_000)
    stream = await trio.open_tcp_stream("127.0.0.1", server.metrics_port)
    await stream.send_all(b"GET /metrics HTTP/1.0\r\n\r\n")
    data = b""
    with trio.fail_after(5):
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = data.decode().partition("\r\n\r\n")
    assert head.split(" ", 2)[1] == "200"
    families = {f.name: f for f in text_string_to_metric_families(body)}
    assert families["delayserver_received"].type == "counter"
    assert families["delayserver_received"].samples[0].value == 1
    assert families["delayserver_wheel_entries"].type == "gauge"
    assert families["delayserver_lateness_seconds"].type == "histogram"


async def test_an_error_inside_the_producer_block_reaches_the_caller_unwrapped(node):
    with pytest.raises(BadSubject):
        async with AsyncProducer(f"127.0.0.1:{node.port}") as prod:
            await prod.send("not a subject", b"x")


def test_retry_targets_follow_rocketmq():
    from delayserver.client import retry_target
    assert retry_target("billing", 0) == ("%RETRY%billing", 3)
    assert retry_target("billing", 5) == ("%RETRY%billing", 8)
    assert retry_target("billing", 15) == ("%RETRY%billing", 18)
    assert retry_target("billing", 16) == ("%DLQ%billing", None)
    assert retry_target("billing", 2, max_reconsume_times=2) == ("%DLQ%billing", None)


async def test_a_failed_message_comes_back_on_the_retry_subject_then_the_dead_letter_subject(node, nursery):
    prod = await producer_for(node, nursery)
    now = node.clock.now_ms()
    retry = await prod.send_back("billing", "order-7", b"charge", reconsume_times=1, subject="billing.charge")
    assert retry.message_id == "order-7"
    assert retry.schedule_time - now in range(30_000, 31_000)  # level 4: 30 s
    dead = await prod.send_back("billing", "order-7", b"charge", reconsume_times=16)
    with trio.fail_after(5):
        while (await prod.status(dead)).state != MessageState.DELIVERED:
            await trio.sleep(0.01)
    from delayserver.sender.spool import iter_spool
    (_, _, _, m), = list(iter_spool(node.config.data_dir, "%DLQ%billing"))
    assert m.headers["reconsume-times"] == "17"


async def test_the_cleaner_deletes_what_is_delivered_and_replayed_once_retention_has_passed(tmp_path, nursery):
    from delayserver.clock import TrioClock

    clock = TrioClock(epoch_ms=node_epoch_now())
    server = DelayServer(config(tmp_path, segment_scale="1m", message_log_segment_bytes=4096, retention_ms=1000,
                                cleaner_interval_ms=50, checkpoint_interval_ms=20), clock=clock)
    await nursery.start(server.serve)
    async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
        done = []
        for _ in range(6):  # one commit each, so that message_log rolls over several segments
            done += await prod.send_many([Message("clean.q", b"x" * 200, delay=0) for _ in range(10)])
        kept = await prod.send("clean.q", b"later", delay=3_600_000)
    with trio.fail_after(10):
        while server.sender.delivered < 60:
            await trio.sleep(0.01)
    delivered_buckets = {h.schedule_time - h.schedule_time % 60_000 for h in done}
    # message_log spans several 4 KiB segments (the cleaner may have taken some already on a slow
    # machine: retention is a second).
    assert server.store.message_log.end_offset >= 3 * 4096
    clock.step(5 * 60_000)  # the delivered buckets end well past the retention
    with trio.fail_after(10):
        while delivered_buckets & set(server.store.schedule_log.buckets()):
            await trio.sleep(0.02)
        while len(server.store.message_log.segments) > 1:
            await trio.sleep(0.02)
    async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
        assert (await prod.status(kept)).state == MessageState.PENDING
        assert (await prod.status(done[0])).state == MessageState.UNKNOWN  # its bucket is gone


def node_epoch_now() -> int:
    import time
    return time.time_ns() // 1_000_000


async def test_with_a_shared_secret_only_authenticated_connections_are_served(tmp_path, nursery):
    server = DelayServer(config(tmp_path, auth_secret="s3cret"))
    await nursery.start(server.serve)
    address = f"127.0.0.1:{server.port}"
    async with AsyncProducer(address, secret="s3cret") as prod:
        handle = await prod.send("auth.q", b"x", delay=3_600_000)
        assert (await prod.status(handle)).state == MessageState.PENDING
    for secret in ("wrong", ""):
        with pytest.raises(DelayServerError) as err:
            async with AsyncProducer(address, secret=secret) as prod:
                await prod.send("auth.q", b"x", delay=0)
        assert err.value.code == ResultCode.UNAUTHORIZED
    frames = await raw_exchange(server.port, p.encode(p.Frame(p.Command.SEND, 9, b"")))
    assert [p.decode_error(f.payload).code for f in frames] == [ResultCode.UNAUTHORIZED]
    assert server.receiver.appended == 1


@pytest.fixture
def tls_files(tmp_path):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert_path, key_path, ca_path = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(cert_path))
    cert.private_key_pem.write_to_path(str(key_path))
    ca.cert_pem.write_to_path(str(ca_path))
    return cert_path, key_path, ca_path


async def test_tls_for_producers_and_for_replication(tmp_path, nursery, tls_files):
    import ssl
    cert, key, ca = map(str, tls_files)
    master = DelayServer(config(tmp_path, tls_cert=cert, tls_key=key, auth_secret="k"))
    await nursery.start(master.serve)
    trusted = ssl.create_default_context(cafile=ca)
    async with AsyncProducer(f"127.0.0.1:{master.port}", tls=trusted, secret="k") as prod:
        handle = await prod.send("tls.q", b"over tls", delay=3_600_000)
    with pytest.raises(ConnectionError, match="TLS"):
        async with AsyncProducer(f"127.0.0.1:{master.port}", tls=True, secret="k") as prod:
            await prod.ping()  # the system trust store does not know this CA
    frames = await raw_exchange(master.port, p.encode(p.Frame(p.Command.PING, 1, b"plain")))
    assert frames == []  # plain bytes on a TLS port: the handshake fails and the connection closes
    slave = DelayServer(Config.from_dict({"data_dir": str(tmp_path / "slave"), "listen": "127.0.0.1:0",
                                          "replicate_from": f"127.0.0.1:{master.port}", "tls_ca": ca,
                                          "auth_secret": "k"}))
    await nursery.start(slave.serve)
    with trio.fail_after(10):
        while slave.store.message_log.end_offset != master.store.message_log.end_offset:
            await trio.sleep(0.02)
    assert handle.message_id


async def test_a_serving_node_tunes_the_collector_and_the_switch_interval_then_gives_them_back(tmp_path):
    """While the node serves, young collections run every GC_THRESHOLDS[0] new objects (Python's
    700 collected a batch's objects over and over) and a worker thread back from an fsync or a
    broker's reply waits SWITCH_INTERVAL_S for the interpreter's lock, not Python's 5 ms; the
    process gets its own settings back when the node stops."""
    import gc
    import sys

    saved = gc.get_threshold(), sys.getswitchinterval()
    gc.set_threshold(600, 9, 8)
    sys.setswitchinterval(0.004)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(DelayServer(config(tmp_path)).serve)
            assert gc.get_threshold() == GC_THRESHOLDS and GC_THRESHOLDS[0] >= 5_000
            assert sys.getswitchinterval() == SWITCH_INTERVAL_S and SWITCH_INTERVAL_S <= 0.001
            nursery.cancel_scope.cancel()
        assert gc.get_threshold() == (600, 9, 8)
        assert sys.getswitchinterval() == 0.004
    finally:
        gc.set_threshold(*saved[0])
        sys.setswitchinterval(saved[1])


async def test_the_page_floor_is_what_was_replayed_and_what_the_slaves_holding_back_the_cleaner_pulled(node, nursery):
    """The receiver hands back message_log's pages below the node's page floor (receiver.py,
    `_sync_message_log`): the replayer's offset (a batch it misses in memory is read back on the
    event loop), and below it the offset of every slave that holds back the cleaner (a slave in step
    is answered from the page cache on the event loop); a slave too far behind no longer holds it."""
    prod = await producer_for(node, nursery)
    await prod.send_many([Message("orders.q", b"x" * 100, delay=3_600_000) for _ in range(20)])
    with trio.fail_after(10):
        while node.replayer.offset < node.receiver.durable_offset:
            await trio.sleep(0.01)
    replayed = node.replayer.offset
    assert replayed > 0 and node.receiver.page_floor() == replayed
    slaves = node.master.slaves
    assert slaves.pulled_message_log("slave-1", 100, node.receiver.durable_offset)
    assert node.receiver.page_floor() == 100
    slaves.max_lag_bytes = 50  # now too far behind to hold anything back
    assert node.receiver.page_floor() == replayed
