"""The meta server's cluster secret, TLS, and node ids bound to their session, over real sockets
(SQLite store, trio's MockClock)."""
from __future__ import annotations

import contextlib
import functools
import ssl

import pytest
import trio
import trustme

from delayserver.clock import TrioClock
from delayserver.message import ResultCode
from delayserver.meta.agent import MetaAgent
from delayserver.meta.client import MetaClient, MetaError, MetaUnavailable, discover_delay_groups
from delayserver.meta.server import serve_meta
from delayserver.meta.store import Role, SqliteMetaStore
from delayserver.protocol import Command, Frame, FrameDecoder, NEED_DATA, decode_error, encode, encode_json

SECRET = "cluster-secret-of-the-test"
INTERVAL_MS = 1000
LEASE_S = 3 * INTERVAL_MS / 1000


async def inline(fn, *args):
    return fn(*args)


@pytest.fixture
def store(tmp_path):
    store = SqliteMetaStore.open(tmp_path / "meta.sqlite3")
    yield store
    store.close()


@contextlib.asynccontextmanager
async def meta_server(store, **options):
    async with trio.open_nursery() as nursery:
        port = await nursery.start(functools.partial(
            serve_meta, store, "127.0.0.1", 0, clock=TrioClock(1_700_000_000_000),
            heartbeat_interval_ms=INTERVAL_MS, missed_heartbeats=3, run_blocking=inline, **options,
        ))
        yield f"127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


async def refused(coro, code: ResultCode, match: str):
    with pytest.raises(MetaError, match=match) as info:
        await coro
    assert info.value.code == code


# --- the cluster secret ------------------------------------------------------------------------


async def test_without_the_secret_nothing_changes_and_producers_still_find_groups(store, autojump_clock):
    async with meta_server(store, cluster_secret=SECRET) as address:
        async with MetaClient(address) as anonymous, MetaClient(address, secret=SECRET) as member:
            # The attack of the issue: a broker group with a "*" route receiving every message.
            await refused(anonymous.request("add_broker_group", name="evil", transport="http",
                                            address="http://attacker/hook"), ResultCode.UNAUTHORIZED, "cluster secret")
            await refused(anonymous.request("add_route", pattern="*", broker_groups=["evil"]),
                          ResultCode.UNAUTHORIZED, "cluster secret")
            for op, args in [("register", dict(group="g1", node_id="x", address="h:1")),
                             ("heartbeat", dict(group="g1", node_id="x", session="s")),
                             ("set_group_read_only", dict(group="g1", read_only=True)),
                             ("list_broker_groups", {}), ("list_nodes", {}), ("resolve", dict(subject="a"))]:
                await refused(anonymous.request(op, **args), ResultCode.UNAUTHORIZED, "authenticate first")
            assert store.list_broker_groups() == [] and store.list_routes() == [] and store.list_groups() == []

            reply = await member.request("register", group="g1", node_id="a", address="10.0.0.1:20801")
            assert reply["role"] == "master"
            await member.request("add_broker_group", name="local", transport="spool", address="var/spool")
            # Producers have no cluster secret and need none to find delay groups.
            assert await discover_delay_groups(address) == [("g1", "10.0.0.1:20801")]


async def test_a_wrong_secret_is_refused_and_the_connection_closed(store, autojump_clock):
    async with meta_server(store, cluster_secret=SECRET) as address:
        async with MetaClient(address, secret="guess") as wrong:
            await refused(wrong.request("list_groups"), ResultCode.UNAUTHORIZED, "wrong cluster secret")
        # On the wire: ERROR UNAUTHORIZED, then the server closes the connection.
        stream = await trio.open_tcp_stream("127.0.0.1", int(address.rsplit(":", 1)[1]))
        async with stream:
            await stream.send_all(encode(Frame(Command.AUTH, 7, b"guess")))
            decoder, frames = FrameDecoder(1 << 20), []
            while data := await stream.receive_some(65536):
                decoder.feed(data)
                while (frame := decoder.next_frame()) is not NEED_DATA:
                    frames.append(frame)
            # Closed: nothing more is read from it.
            with pytest.raises(trio.BrokenResourceError):
                for _ in range(10):
                    await stream.send_all(encode(Frame(Command.META, 8, encode_json({"op": "list_groups"}))))
                    await trio.sleep(0.05)
        assert [(f.command, f.request_id) for f in frames] == [(Command.ERROR, 7)]
        assert decode_error(frames[0].payload).code == ResultCode.UNAUTHORIZED


async def test_a_node_with_the_secret_registers_and_one_without_never_becomes_master(store, tmp_path, autojump_clock):
    async with meta_server(store, cluster_secret=SECRET) as address:
        good = MetaAgent(address, "g1", "good", "10.0.0.1:20801", TrioClock(0), tmp_path / "good.json",
                         cluster_secret=SECRET, run_blocking=inline)
        bad = MetaAgent(address, "g1", "bad", "10.0.0.2:20801", TrioClock(0), tmp_path / "bad.json",
                        run_blocking=inline)
        async with trio.open_nursery() as nursery:
            await nursery.start(bad.run)
            await nursery.start(good.run)
            await trio.sleep(5 * LEASE_S)
            assert (good.role, good.may_deliver()) == (Role.MASTER, True)
            assert (bad.role, bad.may_deliver()) == (None, False)
            assert [n.node_id for n in store.list_nodes()] == ["good"]
            nursery.cancel_scope.cancel()


# --- node ids ----------------------------------------------------------------------------------


async def test_a_live_node_id_cannot_be_taken_over_by_registering_again(store, autojump_clock):
    async with meta_server(store, cluster_secret=SECRET) as address, MetaClient(address, secret=SECRET) as c:
        a = await c.request("register", group="g1", node_id="a", address="10.0.0.1:20801")
        await refused(c.request("register", group="g1", node_id="a", address="10.6.6.6:20801"),
                      ResultCode.NODE_ID_TAKEN, "held by a live node")
        await refused(c.request("register", group="g1", node_id="a", address="10.6.6.6:20801",
                                previous_session="made-up"), ResultCode.NODE_ID_TAKEN, "previous session")
        # The holder still heartbeats as master at epoch 1, at its own address.
        beat = await c.request("heartbeat", group="g1", node_id="a", session=a["session"])
        assert (beat["role"], beat["epoch"], beat["master"]["address"]) == ("master", 1, "10.0.0.1:20801")
        # The node itself, restarted, proves it is the same node with its previous session.
        again = await c.request("register", group="g1", node_id="a", address="10.0.0.1:20801",
                                previous_session=a["session"])
        assert (again["role"], again["epoch"]) == ("master", 2)
        # Once the holder has been silent for a lease, the id is free again.
        await trio.sleep(LEASE_S + 0.001)
        taken = await c.request("register", group="g1", node_id="a", address="10.0.0.9:20801")
        assert taken["master"]["address"] == "10.0.0.9:20801"


async def test_a_registration_retried_with_its_session_is_the_same_registration(store, autojump_clock):
    proposed = "0123456789abcdef" * 2
    async with meta_server(store) as address, MetaClient(address) as c:
        first = await c.request("register", group="g1", node_id="a", address="h:1", session=proposed)
        # Its answer was lost: the node asks again (maybe another meta server) with the same session.
        retry = await c.request("register", group="g1", node_id="a", address="h:1", session=proposed)
        assert (first["session"], first["epoch"]) == (retry["session"], retry["epoch"]) == (proposed, 1)
        assert retry["role"] == "master" and [e for e, _, _ in store.list_epochs("g1")] == [1]
        await refused(c.request("register", group="g1", node_id="a", address="h:9", session="f" * 32),
                      ResultCode.NODE_ID_TAKEN, "held by a live node")
        await refused(c.request("register", group="g1", node_id="b", address="h:2", session="not-hex"),
                      ResultCode.BAD_REQUEST, "32 hex digits")


async def test_a_restarted_node_registers_again_at_once_with_its_kept_session(store, tmp_path, autojump_clock):
    async with meta_server(store) as address:
        def agent():
            return MetaAgent(address, "g1", "a", "10.0.0.1:20801", TrioClock(0), tmp_path / "meta_cache.json",
                             run_blocking=inline)

        first = agent()
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(first.run)
                assert (first.role, first.epoch) == (Role.MASTER, 1)
                scope.cancel()
        second = agent()  # a new process: nothing in memory, the session file on disk
        async with trio.open_nursery() as nursery:
            await nursery.start(second.run)
            assert (second.role, second.epoch) == (Role.MASTER, 2)
            nursery.cancel_scope.cancel()
        assert second.session_path.exists()


# --- TLS ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ca():
    return trustme.CA()


@pytest.fixture
def server_tls(ca):
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    return context


def client_tls(ca) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


async def test_tls_with_the_secret_and_nothing_in_clear(store, ca, server_tls, autojump_clock):
    async with meta_server(store, cluster_secret=SECRET, ssl_context=server_tls) as address:
        async with MetaClient(address, secret=SECRET, tls=client_tls(ca)) as c:
            reply = await c.request("register", group="g1", node_id="a", address="10.0.0.1:20801")
            assert reply["role"] == "master"
        assert await discover_delay_groups(address, tls=client_tls(ca)) == [("g1", "10.0.0.1:20801")]
        # A plain connection gets nowhere; nor does TLS that does not trust the server's CA.
        async with MetaClient(address, secret=SECRET, timeout_s=2) as plain:
            with pytest.raises(MetaUnavailable):
                await plain.request("list_groups")
        async with MetaClient(address, secret=SECRET, tls=client_tls(trustme.CA())) as untrusting:
            with pytest.raises(MetaUnavailable, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
                await untrusting.request("list_groups")


# --- a list of meta servers --------------------------------------------------------------------


async def test_the_client_moves_past_a_dead_meta_server_and_stays_with_the_live_one(store, unused_port, autojump_clock):
    async with meta_server(store) as address:
        dead = f"127.0.0.1:{unused_port}"
        async with MetaClient(f"{dead},{address}") as c:
            await c.request("register", group="g1", node_id="a", address="10.0.0.1:20801")
            assert c.address == address
            await c.request("list_groups")
            assert c.address == address
        assert await discover_delay_groups([dead, address]) == [("g1", "10.0.0.1:20801")]
    async with MetaClient(f"{dead},{address}", timeout_s=1) as c:
        with pytest.raises(MetaUnavailable, match=f"{dead}.*; .*{address}"):
            await c.request("list_groups")


def test_bad_address_lists_are_refused():
    for text in ["", "a:1,", "a:1,a:1", "a", "a:1,b"]:
        with pytest.raises(ValueError):
            MetaClient(text)


# --- a node's HTTP API asks the meta servers with the cluster secret ----------------------------


async def test_the_http_api_lists_the_group_from_a_meta_server_that_wants_the_secret(store, tmp_path, nursery):
    import httpx

    from tests.node.conftest import node_config, start_node

    async with meta_server(store, cluster_secret=SECRET) as address:
        node = await start_node(nursery, node_config(tmp_path, meta=address, group="g1", node_id="n1",
                                                     cluster_secret=SECRET))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{node.http_port}", timeout=30) as api:
            r = await api.get("/v1/nodes")
        assert r.status_code == 200, r.text
        assert [(n["node_id"], n["role"], n["source"]) for n in r.json()["nodes"]] == [("n1", "master", "meta")]
        nursery.cancel_scope.cancel()
