import functools

import hiredis
import pytest
import redis
import trio
import trio.testing

from delayserver.sender.redis_streams import RedisTransport, xadd_commands
from delayserver.sender.transport import OutboundMessage, Outcome, make_transport


def outbound(i: int, subject: str = "orders", **changes) -> OutboundMessage:
    fields = dict(
        message_id=f"m{i}", subject=subject, body=b"\x00body\xff%d" % i, headers={"trace": f"t{i}", "k": "v"},
        schedule_time=1_700_000_000_000 + i, dispatch_time=1_700_000_000_500 + i, attempt=2,
    )
    fields.update(changes)
    return OutboundMessage(**fields)


def transport(redis_server, **options) -> RedisTransport:
    return make_transport("redis", redis_server.address, options, data_dir=None)


def entries(redis_server, stream: str) -> list[dict[bytes, bytes]]:
    with redis.Redis.from_url(redis_server.url) as client:
        return [fields for _id, fields in client.xrange(stream)]


async def test_batch_lands_in_the_subject_streams_with_all_fields(redis_server):
    batch = [outbound(1, "orders"), outbound(2, "pay.events", headers={}), outbound(3, "orders")]
    async with transport(redis_server) as t:
        results = await t.send_batch(batch)

    assert [r.outcome for r in results] == [Outcome.ACKED] * 3
    assert entries(redis_server, "orders") == [
        {b"id": b"m1", b"subject": b"orders", b"body": b"\x00body\xff1", b"schedule_time": b"1700000000001",
         b"dispatch_time": b"1700000000501", b"attempt": b"2", b"h:trace": b"t1", b"h:k": b"v"},
        {b"id": b"m3", b"subject": b"orders", b"body": b"\x00body\xff3", b"schedule_time": b"1700000000003",
         b"dispatch_time": b"1700000000503", b"attempt": b"2", b"h:trace": b"t3", b"h:k": b"v"},
    ]
    assert [e[b"id"] for e in entries(redis_server, "pay.events")] == [b"m2"]


def redis_py_xadd(m: OutboundMessage, stream_template: str, maxlen) -> bytes:
    """What redis-py's own `xadd` sends for `m`: the reference for `xadd_commands`."""
    fields = {"id": m.message_id, "subject": m.subject, "body": bytes(m.body), "schedule_time": m.schedule_time,
              "dispatch_time": m.dispatch_time, "attempt": m.attempt}
    fields.update({"h:" + key: value for key, value in m.headers.items()})
    sent = []
    client = redis.Redis()
    client.execute_command = lambda *args, **options: sent.append(args)
    client.xadd(stream_template.format(subject=m.subject), fields, maxlen=maxlen, approximate=True)
    [args] = sent
    return b"".join(redis.connection.Connection().pack_command(*args))


@pytest.mark.parametrize("maxlen", [None, 1, 10_000])
@pytest.mark.parametrize("stream_template", ["{subject}", "delay:{subject}:out"])
def test_commands_are_the_ones_redis_py_sends(maxlen, stream_template):
    batch = [
        outbound(1),
        outbound(2, "pay.events", headers={}),
        outbound(3, "zahlung.\u00fc", message_id="id-\u00e9\u4e2d", headers={"cl\u00e9": "v\u00e4lue", "": ""}),
        outbound(4, body=b""),
        outbound(5, body=memoryview(b"\r\n$3\r\n" * 300)[3:]),
        outbound(6, schedule_time=0, dispatch_time=2**62, attempt=1_000_000),
        outbound(7),
    ]
    assert xadd_commands(batch, stream_template, maxlen) == b"".join(
        redis_py_xadd(m, stream_template, maxlen) for m in batch
    )
    assert xadd_commands([], stream_template, maxlen) == b""


async def test_a_large_batch_lands_whole_and_in_order(redis_server):
    batch = [outbound(i, f"s{i % 3}", body=bytes([i % 256]) * (i * 7 % 9000)) for i in range(3000)]
    async with transport(redis_server) as t:
        results = await t.send_batch(batch)
    assert [r.outcome for r in results] == [Outcome.ACKED] * len(batch)
    for k in range(3):
        landed = entries(redis_server, f"s{k}")
        assert [e[b"id"] for e in landed] == [m.message_id.encode() for m in batch if m.subject == f"s{k}"]
        assert [e[b"body"] for e in landed] == [m.body for m in batch if m.subject == f"s{k}"]


async def xadd_replies(stream, number: int):
    """For a fake Redis, connection `number`: per read of `stream`, the replies a Redis would give
    to the XADD commands in it, entry ids "<number>-<k>" counted over the connection; every other
    command answered at once as Redis 7 answers redis-py's handshake (RESP3 for HELLO, +OK else)."""
    commands = hiredis.Reader()
    xadds = 0
    while data := await stream.receive_some():
        commands.feed(data)
        replies = []
        while (command := commands.gets()) is not False:
            if command[0].upper() == b"HELLO":
                await stream.send_all(b"%1\r\n$5\r\nproto\r\n:3\r\n")
            elif command[0].upper() != b"XADD":
                await stream.send_all(b"+OK\r\n")
            else:
                xadds += 1
                entry = b"%d-%d" % (number, xadds)
                replies.append(b"$%d\r\n%b\r\n" % (len(entry), entry))
        yield replies


async def test_a_server_that_stops_answering_midway_costs_its_connection(nursery):
    """The first connection gets one reply of three and then silence: every message of that batch
    is RETRY, and the next batch goes out on a new connection, whose replies are its own."""
    connections = []

    async def serve(stream):
        number = len(connections)
        connections.append(stream)
        sent = 0
        async for replies in xadd_replies(stream, number):
            for reply in replies:
                if number == 0 and sent:
                    continue  # silence after the first reply
                sent += 1
                await stream.send_all(reply)

    [listener] = await nursery.start(functools.partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
    port = listener.socket.getsockname()[1]
    async with make_transport("redis", f"127.0.0.1:{port}", {"timeout_ms": 300}, data_dir=None) as t:
        with trio.fail_after(5):
            first = await t.send_batch([outbound(1), outbound(2), outbound(3)])
        assert [r.outcome for r in first] == [Outcome.RETRY] * 3
        assert "Timeout" in first[0].detail
        with trio.fail_after(5):
            second = await t.send_batch([outbound(4), outbound(5)])
    assert [r.outcome for r in second] == [Outcome.ACKED] * 2
    assert len(connections) == 2


async def test_pushes_between_replies_are_skipped_and_a_surplus_reply_costs_the_connection(nursery):
    """A batch's replies are read in bulk: a RESP3 push among them (a server's notice, an array no
    XADD answers with) is not taken for a reply, and a reply more than the batch asked for is not
    left on the connection for the next batch to take as one of its own."""
    connections = []

    async def serve(stream):
        number = len(connections)
        connections.append(stream)
        async for replies in xadd_replies(stream, number):
            if replies and number == 0:  # a push first, an error for the first, the rest, and one more
                replies = [b">2\r\n$7\r\nMOVING!\r\n:1\r\n", b"-ERR not now\r\n", *replies[1:], b"$3\r\n0-9\r\n"]
            if replies:
                # In two writes, the first cut inside a reply: one split across reads is put together again.
                data = b"".join(replies)
                await stream.send_all(data[:7])
                await stream.send_all(data[7:])

    [listener] = await nursery.start(functools.partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
    port = listener.socket.getsockname()[1]
    async with make_transport("redis", f"127.0.0.1:{port}", {"timeout_ms": 2000}, data_dir=None) as t:
        with trio.fail_after(5):
            first = await t.send_batch([outbound(1), outbound(2)])
            second = await t.send_batch([outbound(3)])
    assert [r.outcome for r in first] == [Outcome.RETRY, Outcome.ACKED] and "not now" in first[0].detail
    assert [r.outcome for r in second] == [Outcome.ACKED]
    assert len(connections) == 2  # the first one, with a reply left over, was not used again


async def test_replies_that_come_a_few_bytes_at_a_time_are_scanned_whole(nursery):
    """The compiled scan of a batch's replies goes on from read to read: replies written five bytes
    at a time are all acknowledged, and none is left over (the next batch uses the same connection)."""
    connections = []

    async def serve(stream):
        number = len(connections)
        connections.append(stream)
        async for replies in xadd_replies(stream, number):
            data = b"".join(replies)
            for k in range(0, len(data), 5):
                await stream.send_all(data[k:k + 5])
                await trio.sleep(0)

    [listener] = await nursery.start(functools.partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
    port = listener.socket.getsockname()[1]
    async with make_transport("redis", f"127.0.0.1:{port}", {"timeout_ms": 2000}, data_dir=None) as t:
        with trio.fail_after(5):
            first = await t.send_batch([outbound(i) for i in range(40)])
            second = await t.send_batch([outbound(i) for i in range(40, 43)])
    assert [r.outcome for r in first] == [Outcome.ACKED] * 40
    assert [r.outcome for r in second] == [Outcome.ACKED] * 3
    assert len(connections) == 1


async def test_an_error_after_ids_scanned_over_several_reads_is_that_messages_alone(nursery):
    """Replies scanned as entry ids over two reads, then an error in a third: hiredis parses the
    batch's replies from the first, and only the refused XADD is RETRY."""
    connections = []

    async def serve(stream):
        number = len(connections)
        connections.append(stream)
        async for replies in xadd_replies(stream, number):
            if replies:
                await stream.send_all(b"".join(replies[:2]))
                await trio.sleep(0.05)
                await stream.send_all(b"".join(replies[2:-1]))
                await trio.sleep(0.05)
                await stream.send_all(b"-OOM command not allowed\r\n")

    [listener] = await nursery.start(functools.partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
    port = listener.socket.getsockname()[1]
    async with make_transport("redis", f"127.0.0.1:{port}", {"timeout_ms": 2000}, data_dir=None) as t:
        with trio.fail_after(5):
            results = await t.send_batch([outbound(i) for i in range(6)])
    assert [r.outcome for r in results] == [Outcome.ACKED] * 5 + [Outcome.RETRY]
    assert "OOM" in results[5].detail


async def test_a_server_that_is_not_redis_gives_retry(nursery):
    """A peer that answers +OK to everything, the handshake included: redis-py raises on its
    reply (not a RedisError); the batch is RETRY and the sender goes on."""

    async def serve(stream):
        while await stream.receive_some():
            await stream.send_all(b"+OK\r\n")

    [listener] = await nursery.start(functools.partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
    port = listener.socket.getsockname()[1]
    async with make_transport("redis", f"127.0.0.1:{port}", {"timeout_ms": 300}, data_dir=None) as t:
        with trio.fail_after(5):
            results = await t.send_batch([outbound(1), outbound(2)])
    assert [r.outcome for r in results] == [Outcome.RETRY] * 2
    assert "unexpected" in results[0].detail


async def test_stream_template_names_the_stream(redis_server):
    async with transport(redis_server, stream_template="delay:{subject}:out") as t:
        [result] = await t.send_batch([outbound(1)])
    assert result.outcome is Outcome.ACKED
    assert [e[b"id"] for e in entries(redis_server, "delay:orders:out")] == [b"m1"]
    assert entries(redis_server, "orders") == []


async def test_maxlen_trims_the_stream(redis_server):
    async with transport(redis_server, maxlen=10) as t:
        for k in range(10):
            await t.send_batch([outbound(100 * k + i) for i in range(100)])
    with redis.Redis.from_url(redis_server.url) as client:
        # Approximate trimming drops whole stream nodes (100 entries by default).
        assert 10 <= client.xlen("orders") < 1000


async def test_wrong_type_key_is_rejected_and_the_rest_acked(redis_server):
    with redis.Redis.from_url(redis_server.url) as client:
        client.set("plain", "not a stream")
    async with transport(redis_server) as t:
        results = await t.send_batch([outbound(1, "orders"), outbound(2, "plain"), outbound(3, "orders")])
    assert [r.outcome for r in results] == [Outcome.ACKED, Outcome.REJECTED, Outcome.ACKED]
    assert "WRONGTYPE" in results[1].detail


async def test_a_connection_without_a_plain_socket_reads_its_replies_through_redis_py(redis_server, monkeypatch):
    """The bulk read needs the connection's socket; a connection that keeps none where redis-py's
    own do gets the same outcomes, read one reply at a time."""
    from delayserver.sender import redis_streams

    monkeypatch.setattr(redis_streams, "_plain_socket", lambda connection: None)
    with redis.Redis.from_url(redis_server.url) as client:
        client.set("plain", "not a stream")
    async with transport(redis_server) as t:
        results = await t.send_batch([outbound(1, "orders"), outbound(2, "plain"), outbound(3, "orders")])
    assert [r.outcome for r in results] == [Outcome.ACKED, Outcome.REJECTED, Outcome.ACKED]
    assert [e[b"id"] for e in entries(redis_server, "orders")] == [b"m1", b"m3"]


async def test_server_out_of_memory_gives_retry_per_message(redis_server):
    with redis.Redis.from_url(redis_server.url) as client:
        client.config_set("maxmemory", 1)
    async with transport(redis_server) as t:
        results = await t.send_batch([outbound(1), outbound(2)])
    assert [r.outcome for r in results] == [Outcome.RETRY] * 2
    assert all("OOM" in r.detail or "maxmemory" in r.detail for r in results)


async def test_server_down_gives_retry_for_all_then_acked_once_back(redis_server):
    async with transport(redis_server, timeout_ms=1000) as t:
        assert [r.outcome for r in await t.send_batch([outbound(1)])] == [Outcome.ACKED]

        redis_server.stop()
        with trio.fail_after(3):
            results = await t.send_batch([outbound(2), outbound(3)])
        assert [r.outcome for r in results] == [Outcome.RETRY] * 2
        assert "ConnectionError" in results[0].detail

        redis_server.start()
        results = await t.send_batch([outbound(2), outbound(3)])
    assert [r.outcome for r in results] == [Outcome.ACKED] * 2
    # The restarted server is empty (no persistence): only what it acknowledged is there.
    assert [e[b"id"] for e in entries(redis_server, "orders")] == [b"m2", b"m3"]


async def test_server_that_never_answers_times_out_with_retry(silent_server):
    async with make_transport("redis", silent_server, {"timeout_ms": 200}, data_dir=None) as t:
        with trio.fail_after(3):
            results = await t.send_batch([outbound(1), outbound(2)])
    assert [r.outcome for r in results] == [Outcome.RETRY] * 2
    assert "Timeout" in results[0].detail


async def test_connection_refused_gives_retry(unused_port):
    async with make_transport("redis", f"127.0.0.1:{unused_port}", {}, data_dir=None) as t:
        with trio.fail_after(3):
            results = await t.send_batch([outbound(1)])
    assert [r.outcome for r in results] == [Outcome.RETRY]


async def test_redis_url_address(redis_server):
    async with make_transport("redis", redis_server.url, {}, data_dir=None) as t:
        [result] = await t.send_batch([outbound(1)])
    assert result.outcome is Outcome.ACKED


def test_name_hides_the_password():
    t = make_transport("redis", "redis://user:secret@127.0.0.1:6379/0", {}, data_dir=None)
    assert "secret" not in t.name and "127.0.0.1:6379" in t.name


@pytest.mark.parametrize(
    "address, options, field",
    [
        ("", {}, "address"),
        ("localhost", {}, "address"),
        ("localhost:port", {}, "address"),
        ("localhost:70000", {}, "address"),
        ("http://localhost:6379", {}, "address"),
        ("redis://localhost:abc", {}, "address"),
        ("localhost:6379", {"stream_template": "{topic}"}, "stream_template"),
        ("localhost:6379", {"stream_template": ""}, "stream_template"),
        ("localhost:6379", {"maxlen": 0}, "maxlen"),
        ("localhost:6379", {"timeout_ms": "5000"}, "timeout_ms"),
        ("localhost:6379", {"timeout_ms": True}, "timeout_ms"),
        ("localhost:6379", {"stream": "x"}, "'stream'"),
    ],
)
def test_bad_redis_config_names_the_field(address, options, field):
    with pytest.raises(ValueError, match=field):
        make_transport("redis", address, options, data_dir=None)


def test_ipv6_host_port_address():
    t = make_transport("redis", "[::1]:6379", {}, data_dir=None)
    assert t.pool.connection_kwargs["host"] == "::1"


async def test_a_silent_server_holds_only_the_transports_own_threads(silent_server):
    """Batches to a Redis that stops answering hold at most TRANSPORT_THREADS worker threads, none
    of trio's default limiter, which the rest of the process shares."""
    from delayserver.sender.transport import TRANSPORT_THREADS as THREADS

    default = trio.to_thread.current_default_thread_limiter()
    async with make_transport("redis", silent_server, {"timeout_ms": 1000}, data_dir=None) as t:
        results = []

        async def send(i):
            results.append(await t.send_batch([outbound(i)]))

        async with trio.open_nursery() as nursery:
            for i in range(THREADS + 12):
                nursery.start_soon(send, i)
            await trio.testing.wait_all_tasks_blocked()
            assert t._threads.busy == t._threads.threads == THREADS
            assert t._threads.queued == 12
            assert default.borrowed_tokens == 0
    assert [r[0].outcome for r in results] == [Outcome.RETRY] * (THREADS + 12)
