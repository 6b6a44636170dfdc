"""The meta server over real sockets on 127.0.0.1, under trio's MockClock (autojump): requests and
errors, heartbeat expiry, promotion and epoch fencing, and the MetaAgent with its route cache."""
from __future__ import annotations

import contextlib
import functools
import json

import pytest
import trio

from delayserver.clock import TrioClock
from delayserver.message import ResultCode
from delayserver.meta.agent import MetaAgent
from delayserver.meta.client import MetaClient, MetaError, MetaUnavailable, discover_delay_groups
from delayserver.meta.server import serve_meta
from delayserver.meta.store import Role, SqliteMetaStore
from delayserver.protocol import NEED_DATA, Command, Frame, FrameDecoder, decode_error, decode_json, encode, encode_json

INTERVAL_MS = 1000
LEASE_S = 3 * INTERVAL_MS / 1000


async def inline(fn, *args):
    # Under autojump the mock clock would run ahead while a worker thread works.
    return fn(*args)


@pytest.fixture
def store(tmp_path):
    store = SqliteMetaStore.open(tmp_path / "meta.sqlite3")
    yield store
    store.close()


@contextlib.asynccontextmanager
async def meta_server(store, port=0, **options):
    """Serve `store`; yields the address. Leaving the block stops the server."""
    async with trio.open_nursery() as nursery:
        port = await nursery.start(functools.partial(
            serve_meta, store, "127.0.0.1", port, clock=TrioClock(1_700_000_000_000),
            heartbeat_interval_ms=INTERVAL_MS, missed_heartbeats=3, run_blocking=inline, **options,
        ))
        yield f"127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def client(address):
    async with MetaClient(address) as c:
        yield c


def agent(address, node_id, tmp_path, group="g1", **options):
    return MetaAgent(address, group, node_id, f"127.0.0.1:{20000 + ord(node_id[0])}", TrioClock(0),
                     tmp_path / f"{node_id}.routes.json", run_blocking=inline, **options)


@contextlib.asynccontextmanager
async def running(*agents):
    """Run the agents; yields a cancel scope per agent (cancel one: that node stops talking)."""
    async with trio.open_nursery() as nursery:
        scopes = []
        for a in agents:
            scope = trio.CancelScope()
            scopes.append(scope)

            async def run(a=a, scope=scope, task_status=trio.TASK_STATUS_IGNORED):
                with scope:
                    await a.run(task_status=task_status)

            await nursery.start(run)
        yield scopes
        nursery.cancel_scope.cancel()


async def expect_error(coro, code, match):
    with pytest.raises(MetaError, match=match) as info:
        await coro
    assert info.value.code == code


# --- registration and heartbeats ------------------------------------------------------------


async def test_first_node_is_master_at_epoch_1_and_the_next_is_its_slave(store, autojump_clock):
    async with meta_server(store) as address, client(address) as c:
        a = await c.request("register", group="g1", node_id="a", address="10.0.0.1:20801")
        assert (a["role"], a["epoch"], a["heartbeat_interval_ms"], a["missed_heartbeats"]) == ("master", 1, 1000, 3)
        b = await c.request("register", group="g1", node_id="b", address="10.0.0.2:20801")
        assert (b["role"], b["epoch"]) == ("slave", 1)
        assert b["master"] == {"node_id": "a", "address": "10.0.0.1:20801", "state": "up"}
        beat = await c.request("heartbeat", group="g1", node_id="b", session=b["session"])
        assert (beat["role"], beat["epoch"]) == ("slave", 1)
        nodes = (await c.request("list_nodes", group="g1"))["nodes"]
        assert [(n["node_id"], n["role"], n["state"], n["epoch"]) for n in nodes] == [
            ("a", "master", "up", 1), ("b", "slave", "up", 1)]
        assert "session" not in nodes[0]
        assert await discover_delay_groups(address) == [("g1", "10.0.0.1:20801")]


async def test_nodes_on_time_stay_up_and_a_silent_master_is_replaced(store, autojump_clock):
    async with meta_server(store) as address, client(address) as c:
        a = await c.request("register", group="g1", node_id="a", address="h:1")
        b = await c.request("register", group="g1", node_id="b", address="h:2")
        for _ in range(10):
            await trio.sleep(INTERVAL_MS / 1000)
            await c.request("heartbeat", group="g1", node_id="a", session=a["session"])
            await c.request("heartbeat", group="g1", node_id="b", session=b["session"])
        states = {n["node_id"]: n["state"] for n in (await c.request("list_nodes"))["nodes"]}
        assert states == {"a": "up", "b": "up"}
        # a goes silent; b goes on.
        start = trio.current_time()
        while True:
            await trio.sleep(INTERVAL_MS / 1000)
            beat = await c.request("heartbeat", group="g1", node_id="b", session=b["session"])
            if beat["role"] == "master":
                break
        assert beat["epoch"] == 2
        assert trio.current_time() - start > LEASE_S  # never before a whole lease
        old = await c.request("heartbeat", group="g1", node_id="a", session=a["session"])
        assert (old["role"], old["epoch"]) == ("slave", 2)
        groups = (await c.request("list_groups"))["groups"]
        b_node = next(n for n in (await c.request("list_nodes"))["nodes"] if n["node_id"] == "b")
        assert groups == [{"name": "g1", "read_only": False, "master_epoch": 2,
                           "lease_expires_ms": b_node["last_heartbeat_ms"] + LEASE_S * 1000,
                           "master": {"node_id": "b", "address": "h:2", "state": "up"}}]


async def test_a_dead_master_without_a_slave_leaves_its_group_out_of_discovery(store, autojump_clock):
    async with meta_server(store) as address, client(address) as c:
        await c.request("register", group="g1", node_id="a", address="h:1")
        g2 = await c.request("register", group="g2", node_id="x", address="h:9")
        assert [g for g, _ in await discover_delay_groups(address)] == ["g1", "g2"]
        for _ in range(5):
            await trio.sleep(INTERVAL_MS / 1000)
            await c.request("heartbeat", group="g2", node_id="x", session=g2["session"])
        assert await discover_delay_groups(address) == [("g2", "h:9")]
        nodes = (await c.request("list_nodes", group="g1"))["nodes"]
        assert (nodes[0]["role"], nodes[0]["state"]) == ("master", "down")


async def test_a_restarted_meta_server_gives_nodes_a_lease_before_marking_them_down(store, autojump_clock):
    async with meta_server(store) as address, client(address) as c:
        a = await c.request("register", group="g1", node_id="a", address="h:1")
        await c.request("register", group="g1", node_id="b", address="h:2")
    await trio.sleep(60)  # the meta server is down for a minute
    async with meta_server(store) as address, client(address) as c:
        await trio.sleep(LEASE_S * 0.9)
        beat = await c.request("heartbeat", group="g1", node_id="a", session=a["session"])
        assert (beat["role"], beat["epoch"]) == ("master", 1)


async def test_a_stale_session_is_told_to_register_again(store, autojump_clock):
    async with meta_server(store) as address, client(address) as c:
        first = await c.request("register", group="g1", node_id="a", address="h:1")
        second = await c.request("register", group="g1", node_id="a", address="h:1",
                                 previous_session=first["session"])
        assert (second["role"], second["epoch"]) == ("master", 2)
        await expect_error(c.request("heartbeat", group="g1", node_id="a", session=first["session"]),
                           ResultCode.NOT_FOUND, "registered again")
        await expect_error(c.request("heartbeat", group="g1", node_id="zz", session="x"),
                           ResultCode.NOT_FOUND, "not registered")


async def test_read_only_groups_are_not_offered_to_producers(store, autojump_clock):
    async with meta_server(store) as address, client(address) as c:
        await c.request("register", group="g1", node_id="a", address="h:1")
        reply = await c.request("set_group_read_only", group="g1", read_only=True)
        assert reply["group"] == {"name": "g1", "read_only": True, "master_epoch": 1}
        assert await discover_delay_groups(address) == []
        await expect_error(c.request("set_group_read_only", group="nope", read_only=True),
                           ResultCode.NOT_FOUND, "no delay group 'nope'")


# --- broker groups and routes ---------------------------------------------------------------


async def test_broker_groups_and_routes_resolve(store, autojump_clock):
    async with meta_server(store) as address, client(address) as c:
        await c.request("add_broker_group", name="spool", transport="spool", address="var/spool")
        await c.request("add_broker_group", name="r1", transport="redis", address="redis://127.0.0.1:6379/0",
                        weight=3, options={"stream": "delay:{subject}"})
        reply = await c.request("update_broker_group", name="r1", weight=5, options={"maxlen": 1000})
        assert reply["broker_group"]["options"] == {"stream": "delay:{subject}", "maxlen": 1000}
        reply = await c.request("update_broker_group", name="r1", options={"stream": None})
        assert reply["broker_group"]["options"] == {"maxlen": 1000}
        assert (await c.request("add_route", pattern="orders.*", broker_groups=["r1"]))["message"] == "route added"
        assert (await c.request("add_route", pattern="orders.*", broker_groups=["r1", "spool"]))["message"] == \
            "route replaced"
        resolved = await c.request("resolve", subject="orders.paid")
        assert resolved["route"] == "orders.*"
        assert [g["name"] for g in resolved["broker_groups"]] == ["r1", "spool"]
        everything = await c.request("resolve", subject="audit")
        assert everything["route"] is None
        assert [g["name"] for g in everything["broker_groups"]] == ["r1", "spool"]
        assert (await c.request("list_routes"))["routes"] == [{"pattern": "orders.*", "broker_groups": ["r1", "spool"]}]
        await expect_error(c.request("remove_broker_group", name="r1"), ResultCode.BAD_REQUEST,
                           "used by routes orders")
        await c.request("remove_route", pattern="orders.*")
        await c.request("remove_broker_group", name="r1")
        assert [g["name"] for g in (await c.request("list_broker_groups"))["broker_groups"]] == ["spool"]


@pytest.mark.parametrize("request_, code, match", [
    ({"op": "add_broker_group", "name": "x", "transport": "carrier-pigeon", "address": "a"},
     ResultCode.BAD_REQUEST, "transport must be one of spool, redis, http"),
    ({"op": "add_broker_group", "name": "x", "transport": "spool"}, ResultCode.BAD_REQUEST, "'address' is missing"),
    ({"op": "add_broker_group", "name": "x", "transport": "spool", "address": "a", "weight": 0},
     ResultCode.BAD_REQUEST, "weight must be 1 to"),
    ({"op": "add_broker_group", "name": "x", "transport": "spool", "address": "a", "weight": True},
     ResultCode.BAD_REQUEST, "must be an integer"),
    ({"op": "add_broker_group", "name": "b a d", "transport": "spool", "address": "a"},
     ResultCode.BAD_REQUEST, "must be 1 to 128 characters"),
    ({"op": "add_broker_group", "name": "spool", "transport": "spool", "address": "a"},
     ResultCode.BAD_REQUEST, "exists already"),
    ({"op": "update_broker_group", "name": "nope", "weight": 2}, ResultCode.NOT_FOUND, "no broker group 'nope'"),
    ({"op": "remove_broker_group", "name": "nope"}, ResultCode.NOT_FOUND, "no broker group 'nope'"),
    ({"op": "add_route", "pattern": "a b", "broker_groups": ["spool"]}, ResultCode.BAD_REQUEST, "bad route pattern"),
    ({"op": "add_route", "pattern": "a", "broker_groups": []}, ResultCode.BAD_REQUEST, "non-empty list"),
    ({"op": "add_route", "pattern": "a", "broker_groups": ["nope"]}, ResultCode.NOT_FOUND, "no broker group 'nope'"),
    ({"op": "remove_route", "pattern": "nope"}, ResultCode.NOT_FOUND, "no route 'nope'"),
    ({"op": "resolve", "subject": "not a subject"}, ResultCode.BAD_SUBJECT, "bad subject"),
    ({"op": "register", "group": "g", "node_id": "n", "address": "nowhere"}, ResultCode.BAD_REQUEST, "HOST:PORT"),
    ({"op": "register", "group": "g", "node_id": "n", "address": "h:1", "want_role": "boss"},
     ResultCode.BAD_REQUEST, "want_role"),
    ({"op": "list_routes", "typo": 1}, ResultCode.BAD_REQUEST, "unknown arguments 'typo'"),
    ({"op": "fly"}, ResultCode.BAD_REQUEST, "unknown op 'fly'"),
    ({"no": "op"}, ResultCode.BAD_REQUEST, "unknown op None"),
    ([1, 2], ResultCode.BAD_REQUEST, "must be a JSON object"),
])
async def test_bad_requests_get_clear_errors(store, autojump_clock, request_, code, match):
    async with meta_server(store) as address, client(address) as c:
        await c.request("add_broker_group", name="spool", transport="spool", address="var/spool")
        async with await connect(address) as stream:
            response = await exchange(stream, Frame(Command.META, 7, encode_json(request_)))
        assert response.command is Command.META and response.request_id == 7
        body = decode_json(response.payload)
        assert body["code"] == code
        assert match in body["message"]
        # The server is still serving.
        assert (await c.request("list_broker_groups"))["code"] == 0


async def connect(address) -> trio.SocketStream:
    host, port = address.rsplit(":", 1)
    return await trio.open_tcp_stream(host, int(port))


async def exchange(stream, frame) -> Frame:
    await stream.send_all(encode(frame))
    return await read_frame(stream)


async def read_frame(stream, decoder=None) -> Frame | None:
    decoder = decoder or FrameDecoder()
    while (frame := decoder.next_frame()) is NEED_DATA:
        data = await stream.receive_some(65536)
        if not data:
            return None
        decoder.feed(data)
    return frame


async def test_a_payload_that_is_not_json_is_a_bad_request(store, autojump_clock):
    async with meta_server(store) as address:
        async with await connect(address) as stream:
            response = await exchange(stream, Frame(Command.META, 3, b"\xff{"))
            assert decode_json(response.payload)["code"] == ResultCode.BAD_REQUEST
            # Same connection, next request.
            response = await exchange(stream, Frame(Command.META, 4, encode_json({"op": "list_groups"})))
            assert decode_json(response.payload) == {"code": 0, "message": "ok", "groups": []}


async def test_another_command_gets_an_error_frame_and_the_connection_goes_on(store, autojump_clock):
    async with meta_server(store) as address:
        async with await connect(address) as stream:
            response = await exchange(stream, Frame(Command.PING, 9, b"hi"))
            assert response.command is Command.ERROR and response.request_id == 9
            assert "META requests only" in decode_error(response.payload).message
            response = await exchange(stream, Frame(Command.META, 10, encode_json({"op": "list_routes"})))
            assert decode_json(response.payload)["code"] == 0


@pytest.mark.parametrize("garbage, code", [
    (b"GET / HTTP/1.1\r\n\r\n", ResultCode.BAD_REQUEST),
    (encode(Frame(Command.META, 1, b"{}"))[:-1] + b"\x00", ResultCode.BAD_REQUEST),  # crc
    (encode(Frame(Command.META, 1, b""))[:11] + (64 * 1024 * 1024).to_bytes(4, "big"), ResultCode.MESSAGE_TOO_LARGE),
])
async def test_a_malformed_frame_gets_an_error_frame_and_the_connection_closes(store, autojump_clock, garbage, code):
    async with meta_server(store) as address:
        async with await connect(address) as stream:
            await stream.send_all(garbage)
            decoder = FrameDecoder()
            response = await read_frame(stream, decoder)
            # A frame refused for its size is answered for its request; unreadable ones for none.
            expected_request = 1 if code == ResultCode.MESSAGE_TOO_LARGE else 0
            assert response.command is Command.ERROR and response.request_id == expected_request
            assert decode_error(response.payload).code == code
            assert await read_frame(stream, decoder) is None  # closed


async def test_idle_connections_are_closed_and_the_client_reconnects(store, autojump_clock):
    async with meta_server(store, idle_timeout_s=5) as address, client(address) as c:
        await c.request("list_groups")
        async with await connect(address) as idle:
            await trio.sleep(6)
            assert await idle.receive_some(10) == b""
        assert (await c.request("list_groups"))["code"] == 0  # its connection was closed too


async def test_an_unreachable_meta_server_raises_meta_unavailable(autojump_clock):
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    await listener.aclose()
    with pytest.raises(MetaUnavailable):
        await discover_delay_groups(f"127.0.0.1:{port}")


async def test_a_silent_meta_server_times_out(autojump_clock):
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    with pytest.raises(MetaUnavailable, match="no answer in time"):
        await discover_delay_groups(f"127.0.0.1:{port}", timeout_s=2)
    await listener.aclose()


# --- the agent ------------------------------------------------------------------------------


async def test_agents_take_roles_and_fetch_and_cache_routes(store, tmp_path, autojump_clock):
    async with meta_server(store) as address:
        async with client(address) as c:
            await c.request("add_broker_group", name="spool", transport="spool", address="var/spool")
            await c.request("add_broker_group", name="r1", transport="redis", address="redis://h:1/0")
            await c.request("add_route", pattern="orders.*", broker_groups=["r1"])
        a, b = agent(address, "a", tmp_path), agent(address, "b", tmp_path)
        async with running(a, b):
            assert (a.role, a.epoch, a.may_deliver()) == (Role.MASTER, 1, True)
            assert (b.role, b.epoch, b.may_deliver()) == (Role.SLAVE, 1, False)
            assert b.master_address == a.advertised_address
            assert [g.name for g in a.resolve("orders.paid")] == ["r1"]
            assert [g.name for g in a.resolve("audit")] == ["r1", "spool"]
            cached = json.loads((tmp_path / "a.routes.json").read_text())["data"]
            assert cached["routes"] == [{"pattern": "orders.*", "broker_groups": ["r1"]}]
            # A route change reaches the agents within a refresh interval, with a notification.
            changed = a.changed
            async with client(address) as c:
                await c.request("add_route", pattern="audit", broker_groups=["spool"])
            with trio.fail_after(31):
                await changed.wait()
            assert [g.name for g in a.resolve("audit")] == ["spool"]
            await trio.sleep(60)
            assert a.may_deliver() and a.epoch == 1  # heartbeats keep the lease


async def test_an_old_master_is_fenced_and_never_delivers_after_a_newer_epoch(store, tmp_path, autojump_clock):
    async with meta_server(store) as address:
        a, b = agent(address, "a", tmp_path), agent(address, "b", tmp_path)
        overlap = []

        async def watch():
            # Sample both nodes every 10 ms of mock time: never both allowed to deliver.
            while True:
                if a.may_deliver() and b.may_deliver():
                    overlap.append(trio.current_time())
                await trio.sleep(0.01)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            async with running(a, b) as (a_link, _):
                assert a.may_deliver()
                a_link.cancel()  # a is cut off from the meta server (a pause, a partition)
                with trio.fail_after(10):
                    while not b.may_deliver():
                        await b.changed.wait()
                assert (b.role, b.epoch) == (Role.MASTER, 2)
                assert not a.may_deliver()
                assert a.role is Role.MASTER and a.epoch == 1  # it has heard nothing yet
                # a comes back: it is told it is a slave at epoch 2, and stays one.
                async with running(a):
                    assert (a.role, a.epoch, a.may_deliver()) == (Role.SLAVE, 2, False)
                    await trio.sleep(30)
                    assert not a.may_deliver() and b.may_deliver()
            nursery.cancel_scope.cancel()
        assert overlap == []


async def test_a_stopped_meta_server_fences_the_master_after_its_lease_but_routes_stay(store, tmp_path, autojump_clock):
    async with meta_server(store) as address, client(address) as c:
        await c.request("add_broker_group", name="spool", transport="spool", address="var/spool")
    port = int(address.rsplit(":", 1)[1])
    a = agent(address, "a", tmp_path)
    async with running(a):
        async with meta_server(store, port=port):
            await trio.sleep(6)  # the first retry after the failed registration
            assert a.may_deliver()
        stopped = trio.current_time()
        changed = a.changed
        with trio.fail_after(10):
            await changed.wait()
        assert not a.may_deliver()
        assert trio.current_time() - stopped <= LEASE_S
        assert [g.name for g in a.resolve("any.subject")] == ["spool"]
        await trio.sleep(20)
        assert [g.name for g in a.resolve("any.subject")] == ["spool"]
        # The meta server is back: the session it stored is still good, and a is master again.
        async with meta_server(store, port=port):
            with trio.fail_after(10):
                while not a.may_deliver():
                    await a.changed.wait()
            assert (a.role, a.epoch) == (Role.MASTER, 1)


async def test_through_an_outage_a_master_may_go_on_delivering_when_so_configured(store, tmp_path, autojump_clock):
    async with meta_server(store) as address:
        port = int(address.rsplit(":", 1)[1])
    a = agent(address, "a", tmp_path, deliver_through_meta_outage=True)
    async with running(a):
        async with meta_server(store, port=port):
            await trio.sleep(6)  # the first retry after the failed registration
            assert a.may_deliver()
        await trio.sleep(60)
        assert a.may_deliver()


async def test_the_agent_registers_again_with_a_meta_server_that_lost_its_store(tmp_path, autojump_clock):
    first = SqliteMetaStore.open(tmp_path / "first.sqlite3")
    second = SqliteMetaStore.open(tmp_path / "second.sqlite3")
    try:
        async with meta_server(first) as address:
            port = int(address.rsplit(":", 1)[1])
        a = agent(address, "a", tmp_path)
        async with running(a):
            async with meta_server(first, port=port):
                await trio.sleep(6)  # the first retry after the failed registration
                assert a.may_deliver()
            async with meta_server(second, port=port) as address, client(address) as c:
                await trio.sleep(5)
                nodes = (await c.request("list_nodes"))["nodes"]
                assert [(n["node_id"], n["role"], n["state"]) for n in nodes] == [("a", "master", "up")]
                assert a.may_deliver()
    finally:
        first.close()
        second.close()


async def test_a_node_restarted_during_an_outage_has_its_routes_but_no_role(store, tmp_path, autojump_clock):
    async with meta_server(store) as address:
        async with client(address) as c:
            await c.request("add_broker_group", name="r1", transport="redis", address="redis://h:1/0")
            await c.request("add_broker_group", name="spool", transport="spool", address="var/spool")
            await c.request("add_route", pattern="orders.*", broker_groups=["r1"])
        async with running(agent(address, "a", tmp_path)):
            pass
    restarted = agent(address, "a", tmp_path)
    async with running(restarted):
        assert [g.name for g in restarted.resolve("orders.x")] == ["r1"]
        assert [g.name for g in restarted.broker_groups()] == ["r1", "spool"]
        assert restarted.role is None and not restarted.may_deliver()


async def test_a_damaged_route_cache_is_ignored(store, tmp_path, autojump_clock):
    (tmp_path / "a.routes.json").write_text("{not json")
    async with meta_server(store) as address:
        a = agent(address, "a", tmp_path)
        async with running(a):
            assert a.broker_groups() == [] and a.may_deliver()
