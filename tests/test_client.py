"""The Python client at its edges, against a real node over real sockets: bad addresses fail fast,
bodies no node takes and times no node can hold are refused before sending, and a frame over a
node's own cap comes back as MESSAGE_TOO_LARGE, never as a connection reset to retry forever. One
peer here is not a node: it answers with a result too many or too few, as no node does, to hold
`send_many` to a result per message whatever comes back."""
from __future__ import annotations

import functools
import threading
import time

import pytest
import trio

from delayserver.client import AsyncProducer, Message, Producer
from delayserver.config import Config
from delayserver.message import AddressError, BadScheduleTime, Handle, MessageTooLarge
from delayserver.node.server import DelayServer

BIG = b"x" * (10 << 20)


def start_node(tmp_path, **options):
    """A node in a thread of its own (the blocking Producer is tested from this one)."""
    config = Config.from_dict({"data_dir": str(tmp_path / "data"), "listen": "127.0.0.1:0", **options})
    server = DelayServer(config)
    started = threading.Event()
    stop = {}

    async def main():
        async with trio.open_nursery() as nursery:
            stop["cancel"] = nursery.cancel_scope.cancel
            stop["token"] = trio.lowlevel.current_trio_token()
            await nursery.start(server.serve)
            started.set()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert started.wait(60)
    return server, lambda: (trio.from_thread.run_sync(stop["cancel"], trio_token=stop["token"]), thread.join())


@pytest.fixture
def node(tmp_path):
    server, stop = start_node(tmp_path)
    yield f"127.0.0.1:{server.port}", server
    stop()


@pytest.mark.timeout(60)
def test_an_address_that_is_not_host_port_fails_at_once():
    began = time.monotonic()
    with pytest.raises(AddressError):
        Producer("127.0.0.1:notaport")
    assert time.monotonic() - began < 10


@pytest.mark.timeout(60)
def test_nothing_listening_raises_connection_error_within_the_timeout(unused_port):
    with Producer(f"127.0.0.1:{unused_port}", timeout=1) as producer:
        with pytest.raises(ConnectionError):
            producer.send("orders.q", b"x")


@pytest.mark.timeout(120)
def test_a_body_no_node_takes_is_refused_before_sending(node):
    address, server = node
    with Producer(address) as producer:
        with pytest.raises(MessageTooLarge):
            producer.send("orders.q", BIG)
        results = producer.send_many([Message("orders.q", BIG, delay=0), Message("orders.q", b"fine", delay=10**6)])
    assert isinstance(results[0], MessageTooLarge) and isinstance(results[1], Handle)
    assert server.receiver.appended == 1  # the big one never reached the node


def test_messages_of_one_delay_share_one_time_spec_and_the_specs_kept_are_bounded(monkeypatch):
    from delayserver import client
    from delayserver.message import TimeSpec

    # A table of its own: the process's may be full already from other sends (then nothing more is kept).
    monkeypatch.setattr(client, "_DELAY_SPECS", {})
    first, second = (client._item("orders.q", b"x", None, 5_000, None, None, None) for _ in range(2))
    assert first.time is second.time and first.time == TimeSpec.delay(5_000)
    assert first.message_id != second.message_id and first.headers == {} and first.headers is not second.headers
    for delay in range(3_000):  # every delay its own: each item right, the table no larger than its bound
        assert client._item("orders.q", b"", None, delay, None, "id", {"k": "v"}).time == TimeSpec.delay(delay)
    assert len(client._DELAY_SPECS) <= 1024
    assert client._item("orders.q", b"", 7, None, None, "id", None).time == TimeSpec.at(7)


@pytest.mark.timeout(60)
def test_new_ids_are_distinct_ordered_by_their_time_and_fresh_in_a_forked_child():
    import os

    from delayserver import client

    now = time.time_ns() // 1_000_000
    ids = [client.new_message_id(now) for _ in range(1000)] + [client.new_message_id(now + 1) for _ in range(1000)]
    assert len(set(ids)) == 2000 and all(len(i) == 28 for i in ids)
    assert {i[:12] for i in ids[:1000]} == {f"{now:012x}"} and {i[:12] for i in ids[1000:]} == {f"{now + 1:012x}"}
    assert int(client.new_message_id()[:12], 16) >= now  # the clock's, when no time is given
    # A forked child draws its own random part: its ids of the same millisecond are not the parent's.
    parent = client.new_message_id(now)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, client.new_message_id(now).encode())
        os._exit(0)
    os.close(write)
    with open(read, "rb") as pipe:
        child = pipe.read().decode()
    os.waitpid(pid, 0)
    assert child[:12] == parent[:12] == f"{now:012x}" and child[12:22] != parent[12:22] == ids[0][12:22]


def _counting_clock(monkeypatch) -> list:
    """The client's clock replaced by one whose n-th read is n ms; the list of its reads."""
    from delayserver import client

    reads = []

    class Clock:
        @staticmethod
        def time_ns():
            reads.append(None)
            return len(reads) * 1_000_000

    monkeypatch.setattr(client, "time", Clock)
    return reads


@pytest.mark.timeout(60)
async def test_send_many_reads_the_clock_for_new_ids_once_per_65536_messages(monkeypatch):
    """Once per call would let the ids' 24-bit counter come round under one time in a call of
    more than 16,777,216 messages; once per message is the cost this saves. The checked path."""
    from delayserver import client
    from delayserver.message import InvalidMessage

    seen = []

    def item(*args):  # what send_many asks of each message, refused so that nothing is sent
        seen.append(args[-1])
        raise InvalidMessage("not sent")

    reads = _counting_clock(monkeypatch)
    monkeypatch.setattr(client, "_item", item)
    monkeypatch.setattr(client, "_native_encode_messages", None)
    out = await AsyncProducer("127.0.0.1:1").send_many([Message("s.x", b"")] * 200_000)
    assert len(out) == 200_000 and all(isinstance(e, InvalidMessage) for e in out[:3])
    assert len(reads) == 4 and seen == [1 + i // 65_536 for i in range(200_000)]


def test_the_compiled_requests_make_the_ids_new_message_id_makes(monkeypatch):
    """The compiled kernel reads the clock as often, and each id it makes is the one
    `new_message_id` makes at that time from the same counter."""
    import itertools

    from delayserver import client
    from delayserver.protocol import decode_send_request

    if client._native_encode_messages is None:
        pytest.skip("the compiled kernels are not built")
    reads = _counting_clock(monkeypatch)
    monkeypatch.setattr(client, "_id_counter", itertools.count())
    messages = [Message("s.x", b"")] * 200_000
    messages[65_536] = Message("s.x", b"", message_id="given")  # a run's first message may bring its own id
    requests = client._requests_fast(messages, 1024)
    ids = [item.message_id for payload, _, _, _ in requests for item in decode_send_request(payload)]
    assert len(reads) == 4 and ids[65_536] == "given"
    monkeypatch.setattr(client, "_id_counter", itertools.count())
    assert ids[:65_536] + ids[65_537:] == [client.new_message_id(1 + i // 65_536)
                                           for i in range(200_000) if i != 65_536]


@pytest.mark.timeout(120)
def test_times_that_are_no_whole_64_bit_number_are_refused_as_bad_schedule_time(node):
    address, _ = node
    with Producer(address) as producer:
        for kw in ({"delay": 2**70}, {"delay": 1.5}, {"deliver_at": -(2**64)}, {"delay_level": 2.0}):
            with pytest.raises(BadScheduleTime):
                producer.send("orders.q", b"x", **kw)
        results = producer.send_many([Message("orders.q", b"x", delay=2**70), Message("orders.q", b"y", delay=5),
                                      Message("orders.q", b"z", delay=1.5), Message("orders.q", b"w", delay=5)])
    assert [type(r) for r in results] == [BadScheduleTime, Handle, BadScheduleTime, Handle]


@pytest.mark.timeout(180)
def test_a_frame_over_the_nodes_own_cap_is_message_too_large_every_time(tmp_path):
    server, stop = start_node(tmp_path, max_frame_bytes=65536, max_message_bytes=1 << 20)
    try:
        with Producer(f"127.0.0.1:{server.port}") as producer:
            for _ in range(5):  # no race with the close: the node reads the frame out before closing
                with pytest.raises(MessageTooLarge):
                    producer.send("orders.q", b"x" * (1 << 20))
            assert isinstance(producer.send("orders.q", b"small", delay=1000), Handle)  # and it goes on
    finally:
        stop()


async def test_send_many_cuts_batches_by_bytes_as_well_as_count(tmp_path, nursery):
    server = DelayServer(Config.from_dict({"data_dir": str(tmp_path / "data"), "listen": "127.0.0.1:0"}))
    await nursery.start(server.serve)
    body = b"y" * (3 << 20)  # three of these pass one frame: they must go in separate requests
    async with AsyncProducer(f"127.0.0.1:{server.port}") as producer:
        results = await producer.send_many([Message("orders.q", body, delay=10**6) for _ in range(5)])
    assert all(isinstance(r, Handle) for r in results) and server.receiver.appended == 5


@pytest.mark.parametrize("extra", [-1, 1])
async def test_an_answer_with_a_result_too_few_or_too_many_fails_its_batch_as_unanswered(nursery, extra):
    """Each message of a batch gets its own result or the batch's error, never None and never
    another's: an answer with a result more or less than the request carried (not a node's, a
    broken peer's) is a ConnectionError for the whole batch, which the caller may send again. A
    message refused before sending keeps its own error, and is not counted among those sent."""
    from delayserver import protocol as p
    from delayserver.message import ResultCode

    async def peer(stream):  # answers each SEND with one result more or fewer than it carried
        decoder = p.FrameDecoder()
        async for data in stream:
            decoder.feed(data)
            while (frame := decoder.next_frame()) is not p.NEED_DATA:
                n = len(p.decode_send_request(frame.payload)) + extra
                results = [p.SendResult(ResultCode.OK, "stored", 1, f"m{i}") for i in range(n)]
                await stream.send_all(p.encode(p.Frame(frame.command, frame.request_id,
                                                       p.encode_send_response(results), is_response=True)))

    listeners = await nursery.start(functools.partial(trio.serve_tcp, peer, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    async with AsyncProducer(f"127.0.0.1:{port}", timeout=10) as producer:
        two = await producer.send_many([Message("s.x", b"a"), Message("s.x", b"b")])
        gap = await producer.send_many([Message("s.x", b"a"), Message("s.x", b"b", delay=1.5), Message("s.x", b"c")])
        after = await producer.send_many([Message("s.x", b"d")] * 3, batch=2)
    assert [type(r) for r in two] == [ConnectionError, ConnectionError]
    assert [type(r) for r in gap] == [ConnectionError, BadScheduleTime, ConnectionError]
    assert [type(r) for r in after] == [ConnectionError] * 3


async def test_a_connection_the_server_ended_is_closed_on_this_side_too(nursery):
    """When the server ends a connection (an idle timeout, a restart, a refusal), the producer
    closes its socket there and then, and its next request opens a new one. (It let go of the
    socket without closing it: one descriptor held per reconnection until the garbage collector
    came by, and a ResourceWarning then.)"""
    from delayserver import protocol as p

    async def peer(stream):  # answers one PING, then hangs up
        decoder = p.FrameDecoder()
        async for data in stream:
            decoder.feed(data)
            frame = decoder.next_frame()
            if frame is not p.NEED_DATA:
                await stream.send_all(p.encode(p.Frame(frame.command, frame.request_id, frame.payload,
                                                       is_response=True)))
                await stream.aclose()
                return

    listeners = await nursery.start(functools.partial(trio.serve_tcp, peer, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    async with AsyncProducer(f"127.0.0.1:{port}", timeout=10) as producer:
        first = await producer._connect()
        assert await producer.ping(b"one") == b"one"
        deadline = time.monotonic() + 10  # (the clock may be a test's own: wall time bounds this)
        while producer._stream is first and time.monotonic() < deadline:  # until its reader saw the end
            await trio.lowlevel.checkpoint()
        assert first.socket.fileno() == -1, "the ended connection's socket is still open"
        assert await producer.ping(b"two") == b"two"
        assert producer._stream is not first
