"""The HTTP API over real sockets against a running node: results, errors, auth, TLS, parked."""
from __future__ import annotations

import base64
import json
import ssl

import httpx
import pytest
import trio

from delayserver.client import AsyncProducer
from delayserver.message import Handle, MessageState
from delayserver.storage.store import bucket_stats
from tests.node.conftest import SECRET, node_config, start_node


def stored(node) -> tuple[int, int]:
    """What the node holds: messages accepted and message_log's end."""
    return node.receiver.appended, node.store.message_log.end_offset


async def wait_until(predicate, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


async def test_a_message_sent_over_http_is_stored_and_has_the_same_handle_on_both_protocols(node, api):
    r = await api.post("/v1/messages", json={"subject": "orders.expire", "body": "order 42", "delay_ms": 600_000,
                                             "id": "order/42", "headers": {"tenant": "acme"}})
    assert r.status_code == 200, r.text
    sent = r.json()
    assert sent["code"] == "OK" and sent["id"] == "order/42"
    handle = Handle.parse(sent["handle"])
    assert handle.message_id == "order/42"
    async with AsyncProducer(f"127.0.0.1:{node.port}", secret=SECRET) as producer:
        assert (await producer.status(handle)).state == MessageState.PENDING
    r = await api.get(f"/v1/messages/{sent['handle']}")
    assert r.status_code == 200 and r.json()["state"] == "pending"
    assert r.json()["schedule_time"] == handle.schedule_time


IDS = ["order/42", "50%off", "a%2Fb", "ünïcode ~ id", "x:y", "line\nbreak"]


@pytest.mark.parametrize("message_id", IDS)
async def test_a_handle_in_the_url_names_exactly_its_message(api, message_id):
    sent = (await api.post("/v1/messages", json={"subject": "h.x", "delay_ms": 600_000, "id": message_id})).json()
    for other in set(IDS) - {message_id}:
        await api.post("/v1/messages", json={"subject": "h.x", "deliver_at": sent["schedule_time"], "id": other})
    r = (await api.get(f"/v1/messages/{sent['handle']}")).json()
    assert (r["state"], r["id"]) == ("pending", message_id)
    assert (await api.delete(f"/v1/messages/{sent['handle']}")).json()["outcome"] == "cancelled"
    assert (await api.get(f"/v1/messages/{sent['handle']}")).json()["state"] == "cancelled"


async def test_cancel_over_http_wins_and_the_binary_protocol_sees_it(node, api):
    sent = (await api.post("/v1/messages", json={"subject": "s.c", "body": "x", "delay_ms": 600_000})).json()
    r = await api.delete(f"/v1/messages/{sent['handle']}")
    assert r.status_code == 200 and r.json()["outcome"] == "cancelled"
    r = await api.delete(f"/v1/messages/{sent['handle']}")
    assert r.json()["outcome"] == "already_cancelled"
    async with AsyncProducer(f"127.0.0.1:{node.port}", secret=SECRET) as producer:
        assert (await producer.status(Handle.parse(sent["handle"]))).state == MessageState.CANCELLED
    assert (await api.get(f"/v1/messages/{sent['handle']}")).json()["state"] == "cancelled"


async def test_a_due_message_is_delivered_and_its_status_names_the_broker_group(node, api):
    sent = (await api.post("/v1/messages", json={"subject": "s.now", "body_base64": base64.b64encode(b"\x00\xff").decode()})).json()
    await wait_until(lambda: node.sender.delivered == 1)
    r = (await api.get(f"/v1/messages/{sent['handle']}")).json()
    assert r["state"] == "delivered" and r["broker_group"] == "spool" and r["dispatch_time"] >= r["schedule_time"]
    from delayserver.sender.spool import iter_spool
    [(_, _, _, message)] = list(iter_spool(node.config.data_dir, "s.now"))
    assert message.body == b"\x00\xff"


async def test_a_batch_gets_one_result_per_message_and_stores_only_the_good_ones(node, api):
    before = stored(node)[0]
    r = await api.post("/v1/messages/batch", json={"messages": [
        {"subject": "b.ok", "body": "1", "delay_ms": 60_000},
        {"subject": "bad subject!", "body": "2"},
        {"subject": "b.ok", "delay_ms": -1},
        {"subject": "b.ok", "body": "4", "deliver_at": "2026-01-01T00:00:00Z", "id": "past"},
        {"subject": "b.ok", "delay_ms": 10 * 86_400_000},
    ]})
    assert r.status_code == 200
    codes = [x["code"] for x in r.json()["results"]]
    assert codes == ["OK", "BAD_SUBJECT", "BAD_SCHEDULE_TIME", "OK", "BAD_SCHEDULE_TIME"]
    assert r.json()["accepted"] == 2 and r.json()["refused"] == 3
    assert stored(node)[0] == before + 2


@pytest.mark.parametrize("batch", [
    {"messages": [{"subject": "b.ok"}, {"subject": "b.ok", "delay_ms": "soon"}]},
    {"messages": [{"subject": "b.ok"}, {"body": "no subject"}]},
    # schemathesis's case: a bad subject (a refusal of its own) and a null deliver_at (malformed)
    {"messages": [{"delay_ms": 25992, "subject": "\u00f5\u00ba\u00e8", "deliver_at": None}]},
    {"messages": []},
    {"messages": "none"},
    [{"subject": "b.ok"}],
])
async def test_a_malformed_batch_is_refused_whole_and_nothing_is_stored(node, api, batch):
    before = stored(node)
    r = await api.post("/v1/messages/batch", json=batch)
    assert (r.status_code, r.json()["code"]) == (400, "BAD_REQUEST")
    assert stored(node) == before


@pytest.mark.parametrize("body, status, code", [
    (b"{not json", 400, "BAD_REQUEST"),
    (b"\xff\xfe", 400, "BAD_REQUEST"),
    (b"[1, 2]", 400, "BAD_REQUEST"),
    (b'{"body": "no subject"}', 400, "BAD_REQUEST"),
    (b'{"subject": "s.x", "surprise": 1}', 400, "BAD_REQUEST"),
    (b'{"subject": "s.x", "delay_ms": 5, "delay_level": 2}', 400, "BAD_REQUEST"),
    (b'{"subject": "s.x", "delay_ms": -5}', 422, "BAD_SCHEDULE_TIME"),
    (b'{"subject": "s.x", "delay_level": 99}', 422, "BAD_SCHEDULE_TIME"),
    (b'{"subject": "s.x", "deliver_at": "tomorrow"}', 422, "BAD_SCHEDULE_TIME"),
    (b'{"subject": "", "body": "x"}', 422, "BAD_SUBJECT"),
    (b'{"subject": "s.x", "id": ""}', 422, "BAD_MESSAGE_ID"),
    (b'{"subject": "s.x", "headers": {"k": 1}}', 400, "BAD_REQUEST"),
    (b'{"subject": "s.x", "body_base64": "***"}', 400, "BAD_REQUEST"),
    # null is not "absent": the published schema allows none (found by schemathesis, which
    # expects a schema-violating request to be refused)
    (b'{"subject": "s.x", "deliver_at": null}', 400, "BAD_REQUEST"),
    (b'{"subject": "s.x", "delay_ms": 5, "deliver_at": null}', 400, "BAD_REQUEST"),
    (b'{"subject": "s.x", "delay_level": null}', 400, "BAD_REQUEST"),
    (b'{"subject": "s.x", "id": null}', 400, "BAD_REQUEST"),
    (b'{"subject": "s.x", "headers": null}', 400, "BAD_REQUEST"),
    (b'{"subject": "s.x", "headers": ""}', 400, "BAD_REQUEST"),
])
async def test_bad_input_gets_a_clear_code_and_nothing_is_stored(node, api, body, status, code):
    before = stored(node)
    r = await api.post("/v1/messages", content=body, headers={"Content-Type": "application/json"})
    assert (r.status_code, r.json()["code"]) == (status, code), r.text
    assert r.json()["message"]
    assert stored(node) == before


async def test_a_body_over_the_limit_is_refused_with_413_and_nothing_is_stored(node, api):
    before = stored(node)
    huge = json.dumps({"subject": "s.big", "body": "x" * (200 * 1024)}).encode()
    r = await api.post("/v1/messages", content=huge, headers={"Content-Type": "application/json"})
    assert (r.status_code, r.json()["code"]) == (413, "MESSAGE_TOO_LARGE")

    async def chunks():  # no Content-Length: the limit applies while reading
        for _ in range(100):
            yield b"x" * 4096

    r = await api.post("/v1/messages", content=chunks())
    assert (r.status_code, r.json()["code"]) == (413, "MESSAGE_TOO_LARGE")
    # Under the request limit but over max_message_bytes: the message limit speaks.
    r = await api.post("/v1/messages", json={"subject": "s.big", "body": "x" * 8000})
    assert (r.status_code, r.json()["code"]) == (413, "MESSAGE_TOO_LARGE")
    assert stored(node) == before
    assert (await api.get("/healthz")).status_code == 200


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {SECRET}"}])
async def test_a_wrong_or_missing_token_gets_401_and_nothing_is_stored(node, headers):
    before = stored(node)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{node.http_port}", headers=headers) as client:
        r = await client.post("/v1/messages", json={"subject": "s.x", "body": "x"})
        assert (r.status_code, r.json()["code"]) == (401, "UNAUTHORIZED")
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert (await client.get("/v1/overview")).status_code == 401
        assert (await client.get("/metrics")).status_code == 401
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/openapi.json")).status_code == 200
    assert stored(node) == before


@pytest.mark.parametrize("path, status", [
    ("/v1/messages/nonsense", 400),
    ("/v1/messages/12:", 400),
    ("/v1/messages/99999999999999999:x", 400),
    ("/v1/messages/1795323209529:nobody", 404),
    ("/v1/messages/%C2%95%0A%F4%85%80%98", 400),
    ("/v1/messages/1795323209529:a%0Ab", 404),
])
async def test_status_of_a_bad_or_unknown_handle(api, path, status):
    r = await api.get(path)
    assert r.status_code == status
    assert r.json()["code"] == ("NOT_FOUND" if status == 404 else "BAD_REQUEST")
    assert (await api.delete(path)).status_code == status


async def test_an_unknown_path_is_a_json_404(api):
    r = await api.get("/v1/nothing-here")
    assert (r.status_code, r.json()["code"]) == (404, "NOT_FOUND")


async def test_node_buckets_and_overview_match_what_the_node_holds(node, api):
    for delay in (0, 120_000, 120_000, 3_000_000):
        await api.post("/v1/messages", json={"subject": "o.x", "body": "x", "delay_ms": delay})
    cancel = (await api.post("/v1/messages", json={"subject": "o.x", "delay_ms": 120_000})).json()
    await api.delete(f"/v1/messages/{cancel['handle']}")
    await wait_until(lambda: node.sender.delivered == 1 and node.replayer.offset == node.receiver.durable_offset)
    with trio.fail_after(10):  # the backlog counts what was replayed, at most a few times a second
        while sum(r["pending"] for r in (await api.get("/v1/buckets")).json()["buckets"]) != 3:
            await trio.sleep(0.05)
    node_info = (await api.get("/v1/node")).json()
    assert node_info["role"] == "master" and node_info["message_log"]["end_offset"] == node.store.message_log.end_offset
    rows = (await api.get("/v1/buckets")).json()["buckets"]
    store = node.store
    for row in rows:
        expected = bucket_stats(store.schedule_log, store.dispatch_log, row["start"])
        assert (row["scheduled"], row["dispatched"], row["cancelled"], row["pending"]) == (
            expected.scheduled, expected.dispatched, expected.cancelled, expected.pending)
    assert sum(r["pending"] for r in rows) == 3
    ov = (await api.get("/v1/overview")).json()
    assert (ov["pending"], ov["due_next_minute"], ov["due_next_hour"]) == (3, 0, 3)
    assert ov["delivery"]["delivered"] == 1 and sum(ov["lateness"]["counts"]) == 1
    [group] = ov["broker_groups"]
    assert (group["name"], group["breaker"], group["delivered"]) == ("spool", "closed", 1)
    nodes = (await api.get("/v1/nodes")).json()["nodes"]
    assert [n["role"] for n in nodes] == ["master"]
    history = (await api.get("/v1/buckets/history")).json()["samples"]
    assert sum(history[-1]["pending"].values()) == 3


async def test_healthz_and_readyz_on_a_master_and_on_a_slave_that_never_synced(tmp_path, nursery, node, unused_port):
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{node.http_port}") as client:
        assert (await client.get("/readyz")).json() == {"status": "ready", "problems": []}
    slave = await start_node(nursery, node_config(tmp_path / "slave", replicate_from=f"127.0.0.1:{unused_port}"))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{slave.http_port}") as client:
        r = await client.get("/readyz")
        assert r.status_code == 503 and any("slave" in p for p in r.json()["problems"])
        assert (await client.get("/healthz")).status_code == 200
        before = stored(slave)
        r = await client.post("/v1/messages", json={"subject": "s.x", "body": "x"})
        assert (r.status_code, r.json()["code"]) == (421, "NOT_MASTER")
        assert stored(slave) == before
        assert (await client.get("/v1/node")).json()["role"] == "slave"


async def test_a_slave_in_sync_is_ready_and_reports_its_lag(tmp_path, nursery, node, api):
    await api.post("/v1/messages", json={"subject": "r.x", "body": "x", "delay_ms": 600_000})
    slave = await start_node(nursery, node_config(tmp_path / "slave", replicate_from=f"127.0.0.1:{node.port}",
                                                  auth_secret=SECRET))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{slave.http_port}",
                                 headers={"Authorization": f"Bearer {SECRET}"}) as client:
        with trio.fail_after(20):
            while (await client.get("/readyz")).status_code != 200:
                await trio.sleep(0.05)
        rep = (await client.get("/v1/node")).json()["replication"]["from_master"]
        assert rep["lag_bytes"] == 0 and rep["pulled_bytes"] == node.store.message_log.end_offset
    slaves = (await api.get("/v1/node")).json()["replication"]["slaves"]
    assert [s["lag_bytes"] for s in slaves] == [0]


async def test_the_api_speaks_tls_with_the_nodes_certificate(tmp_path, nursery):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(cert_path))
    cert.private_key_pem.write_to_path(str(key_path))
    server = await start_node(nursery, node_config(tmp_path, tls_cert=str(cert_path), tls_key=str(key_path)))
    context = ssl.create_default_context()
    ca.configure_trust(context)
    async with httpx.AsyncClient(base_url=f"https://127.0.0.1:{server.http_port}", verify=context) as client:
        r = await client.post("/v1/messages", json={"subject": "t.x", "body": "x", "delay_ms": 60_000})
        assert r.status_code == 200 and r.json()["code"] == "OK"
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as plain:
        with pytest.raises(httpx.HTTPError):
            await plain.get("/healthz")


async def test_a_parked_message_is_listed_and_redriven(tmp_path, nursery, webhook_server):
    webhook_server.respond(400, {"error": "no such queue"})
    server = await start_node(nursery, node_config(tmp_path, broker_group=[
        {"name": "hook", "transport": "http", "address": webhook_server.url}]))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as client:
        sent = (await client.post("/v1/messages", json={"subject": "p.x", "body": "x", "id": "p-1"})).json()
        await wait_until(lambda: server.sender.parked_count == 1)
        [parked] = (await client.get("/v1/parked")).json()["parked"]
        assert (parked["id"], parked["handle"]) == ("p-1", sent["handle"]) and "hook" in parked["reason"]
        with trio.fail_after(10):  # a parked message is settled: no longer pending
            while [(b["parked"], b["pending"]) for b in (await client.get("/v1/buckets")).json()["buckets"]] != [(1, 0)]:
                await trio.sleep(0.05)
        webhook_server.respond(200)
        r = await client.post("/v1/parked/redrive")
        assert r.json() == {"code": "OK", "redriven": 1, "remaining": 0}
        await wait_until(lambda: server.sender.delivered == 1)
        assert (await client.get("/v1/parked")).json()["parked"] == []
        assert [p["redriven"] for p in (await client.get("/v1/parked?all=true")).json()["parked"]] == [True]
    delivered = webhook_server.batches[-1]["messages"][0]
    assert delivered["id"] == "p-1" and delivered["headers"]["redriven-from"] == sent["handle"]


async def test_a_client_trickling_a_request_is_dropped_and_others_are_served(tmp_path, nursery):
    node = await start_node(nursery, node_config(tmp_path, frame_timeout_ms=300))
    stream = await trio.open_tcp_stream("127.0.0.1", node.http_port)
    await stream.send_all(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    with trio.fail_after(10):
        data = b""
        while chunk := await stream.receive_some(4096):
            data += chunk
    await stream.aclose()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{node.http_port}") as client:
        assert (await client.get("/healthz")).status_code == 200
    assert node.receiver.appended == 0
