import base64

import pytest
import trio

from delayserver.sender.http_webhook import HttpTransport
from delayserver.sender.transport import OutboundMessage, Outcome, make_transport


def outbound(i: int, subject: str = "orders", **changes) -> OutboundMessage:
    fields = dict(
        message_id=f"m{i}", subject=subject, body=b"\x00body\xff%d" % i, headers={"trace": f"t{i}"},
        schedule_time=1_700_000_000_000 + i, dispatch_time=1_700_000_000_500 + i, attempt=1,
    )
    fields.update(changes)
    return OutboundMessage(**fields)


def webhook(url: str, **options) -> HttpTransport:
    return make_transport("http", url, options, data_dir=None)


async def send(url: str, messages, **options):
    async with webhook(url, **options) as t:
        with trio.fail_after(5):
            return await t.send_batch(messages)


def outcomes(results):
    return [r.outcome for r in results]


async def test_ok_acks_the_batch_and_posts_every_field(webhook_server):
    batch = [outbound(1), outbound(2, "pay.events", attempt=3, headers={})]

    results = await send(webhook_server.url, batch, headers={"Authorization": "Bearer token"})

    assert outcomes(results) == [Outcome.ACKED] * 2
    assert webhook_server.batches == [
        {"messages": [
            {"id": "m1", "subject": "orders", "body": base64.b64encode(b"\x00body\xff1").decode(),
             "headers": {"trace": "t1"}, "schedule_time": 1_700_000_000_001, "dispatch_time": 1_700_000_000_501,
             "attempt": 1},
            {"id": "m2", "subject": "pay.events", "body": base64.b64encode(b"\x00body\xff2").decode(),
             "headers": {}, "schedule_time": 1_700_000_000_002, "dispatch_time": 1_700_000_000_502, "attempt": 3},
        ]}
    ]
    [headers] = webhook_server.request_headers
    assert headers["Authorization"] == "Bearer token"
    assert headers["Content-Type"] == "application/json"


async def test_per_message_results_are_matched_by_id(webhook_server):
    webhook_server.respond(200, {"results": [
        {"id": "m3", "status": "rejected", "detail": "no such topic"},
        {"id": "m1", "status": "ok"},
        {"id": "m2", "status": "retry", "detail": "busy"},
        {"id": "m5", "status": "lost"},
    ]})

    results = await send(webhook_server.url, [outbound(i) for i in range(1, 6)])

    assert outcomes(results) == [Outcome.ACKED, Outcome.RETRY, Outcome.REJECTED, Outcome.RETRY, Outcome.RETRY]
    assert results[1].detail == "busy"
    assert results[2].detail == "no such topic"
    assert results[3].detail == "no result for this message"
    assert "lost" in results[4].detail


@pytest.mark.parametrize("status", [[1], {"ok": 1}, None, 3])
async def test_a_status_that_is_not_a_string_gives_retry_for_its_message(webhook_server, status):
    webhook_server.respond(200, {"results": [{"id": "m1", "status": status}, {"id": "m2", "status": "ok"}]})
    results = await send(webhook_server.url, [outbound(1), outbound(2)])
    assert outcomes(results) == [Outcome.RETRY, Outcome.ACKED]
    assert "unknown status" in results[0].detail


async def test_a_2xx_body_nested_deeper_than_the_parser_goes_acks_all(webhook_server):
    webhook_server.respond(200, b"[" * 200_000 + b"]" * 200_000)
    results = await send(webhook_server.url, [outbound(1), outbound(2)])
    assert outcomes(results) == [Outcome.ACKED] * 2


async def test_results_computed_from_the_received_batch(webhook_server):
    webhook_server.respond(200, lambda batch: {"results": [
        {"id": m["id"], "status": "ok" if m["subject"] == "orders" else "rejected"} for m in batch["messages"]
    ]})
    results = await send(webhook_server.url, [outbound(1), outbound(2, "other")])
    assert outcomes(results) == [Outcome.ACKED, Outcome.REJECTED]


@pytest.mark.parametrize("body", [{"results": "all fine"}, {"results": [{"status": "ok"}]}, {"results": [7]}])
async def test_malformed_results_give_retry_for_all(webhook_server, body):
    webhook_server.respond(200, body)
    results = await send(webhook_server.url, [outbound(1), outbound(2)])
    assert outcomes(results) == [Outcome.RETRY] * 2
    assert "malformed" in results[0].detail


@pytest.mark.parametrize("status, body", [(200, b"accepted"), (204, None), (202, {"queued": 2}), (200, [1, 2])])
async def test_2xx_without_results_acks_all(webhook_server, status, body):
    webhook_server.respond(status, body)
    assert outcomes(await send(webhook_server.url, [outbound(1), outbound(2)])) == [Outcome.ACKED] * 2


@pytest.mark.parametrize("status", [500, 502, 503, 408, 429, 302])
async def test_server_errors_throttling_and_redirects_give_retry(webhook_server, status):
    webhook_server.respond(status, b"try later")
    results = await send(webhook_server.url, [outbound(1), outbound(2)])
    assert outcomes(results) == [Outcome.RETRY] * 2
    assert f"HTTP {status}: try later" == results[0].detail


@pytest.mark.parametrize("status", [400, 401, 404, 422])
async def test_client_errors_give_rejected(webhook_server, status):
    webhook_server.respond(status, {"error": "unknown subject"})
    results = await send(webhook_server.url, [outbound(1), outbound(2)])
    assert outcomes(results) == [Outcome.REJECTED] * 2
    assert f"HTTP {status}" in results[0].detail and "unknown subject" in results[0].detail


async def test_slow_server_beyond_the_timeout_gives_retry(webhook_server):
    webhook_server.respond(200, delay_ms=2000)
    with trio.fail_after(1):
        results = await send(webhook_server.url, [outbound(1)], timeout_ms=100)
    assert outcomes(results) == [Outcome.RETRY]
    assert "no response within 100 ms" in results[0].detail


async def test_server_that_never_answers_gives_retry(silent_server):
    with trio.fail_after(1):
        results = await send(f"http://{silent_server}/hook", [outbound(1)], timeout_ms=100)
    assert outcomes(results) == [Outcome.RETRY]


async def test_connection_refused_gives_retry(unused_port):
    results = await send(f"http://127.0.0.1:{unused_port}/hook", [outbound(1), outbound(2)])
    assert outcomes(results) == [Outcome.RETRY] * 2
    assert "ConnectError" in results[0].detail


async def test_one_transport_serves_many_batches(webhook_server):
    async with webhook(webhook_server.url) as t:
        for i in range(3):
            assert outcomes(await t.send_batch([outbound(i)])) == [Outcome.ACKED]
    assert [b["messages"][0]["id"] for b in webhook_server.batches] == ["m0", "m1", "m2"]


async def test_empty_batch_posts_nothing(webhook_server):
    assert await send(webhook_server.url, []) == []
    assert webhook_server.batches == []


def test_name_hides_credentials_and_query():
    t = webhook("https://user:pw@hooks.example/in?token=secret")
    assert t.name == "http https://hooks.example/in"


@pytest.mark.parametrize(
    "address, options, field",
    [
        ("ftp://example/x", {}, "address"),
        ("example.com/hook", {}, "address"),
        ("", {}, "address"),
        ("http://example/x", {"timeout_ms": 0}, "timeout_ms"),
        ("http://example/x", {"headers": {"X-Token": 5}}, "headers"),
        ("http://example/x", {"headers": "X-Token: 5"}, "headers"),
        ("http://example/x", {"retries": 3}, "'retries'"),
    ],
)
def test_bad_http_config_names_the_field(address, options, field):
    with pytest.raises(ValueError, match=field):
        make_transport("http", address, options, data_dir=None)
