"""The NATS JetStream transport against a real nats-server with JetStream (the `nats` fixture, one per test run)."""
from __future__ import annotations

import asyncio
import collections
import itertools
import ssl

import nats
import pytest
import trio
import trustme
from nats.js.api import DiscardPolicy, StreamConfig

from bench.brokers import NatsProcess, nats_executable
from delayserver.sender.nats_jetstream import NatsJetStreamTransport
from delayserver.sender.transport import OutboundMessage, Outcome, make_transport
from tests.sender.conftest import restarted

_names = itertools.count()


def fresh(prefix: str) -> str:
    """A subject (and stream) name no other test uses (the server lives for the whole test run)."""
    return f"{prefix}{next(_names)}"


def outbound(i: int, subject: str, **changes) -> OutboundMessage:
    fields = dict(
        message_id=f"m{i}", subject=subject, body=b"\x00body\xff%d" % i, headers={"trace": f"t{i}", "k": "v"},
        schedule_time=1_700_000_000_000 + i, dispatch_time=1_700_000_000_500 + i, attempt=2,
    )
    fields.update(changes)
    return OutboundMessage(**fields)


def transport(nats_server, **options) -> NatsJetStreamTransport:
    return make_transport("nats", nats_server.url, options, data_dir=None)


def jetstream(nats_server, fn):
    """Run `fn(js)` (a coroutine function) on a fresh nats-py connection: the consumer's side."""
    async def main():
        nc = await nats.connect(nats_server.url)
        try:
            return await fn(nc.jetstream())
        finally:
            await nc.close()
    return asyncio.run(main())


def add_stream(nats_server, name: str, subjects: list[str], **config) -> None:
    async def add(js):
        await js.add_stream(StreamConfig(name=name, subjects=subjects, **config))
    jetstream(nats_server, add)


def stored(nats_server, stream: str) -> list:
    """Every message in `stream`, oldest first (RawStreamMsg: subject, data, headers)."""
    async def read(js):
        state = (await js.stream_info(stream)).state
        if not state.messages:
            return []
        return [await js.get_msg(stream, seq) for seq in range(state.first_seq, state.last_seq + 1)]
    return jetstream(nats_server, read)


async def test_batch_lands_with_body_and_headers(nats):
    subject = fresh("orders")
    add_stream(nats, subject, [subject])
    async with transport(nats) as t:
        results = await t.send_batch([outbound(1, subject), outbound(2, subject, headers={})])
    assert [r.outcome for r in results] == [Outcome.ACKED] * 2

    first, second = stored(nats, subject)
    assert first.data == b"\x00body\xff1" and second.data == b"\x00body\xff2"
    assert first.headers == {
        "trace": "t1", "k": "v", "Nats-Msg-Id": "m1", "delayserver-id": "m1", "delayserver-subject": subject,
        "delayserver-schedule-time": "1700000000001", "delayserver-dispatch-time": "1700000000501",
        "delayserver-attempt": "2",
    }
    assert second.headers["Nats-Msg-Id"] == "m2" and "trace" not in second.headers


async def test_subject_template_names_the_nats_subject(nats):
    stream = fresh("delays")
    add_stream(nats, stream, [f"{stream}.>"])
    async with transport(nats, subject_template=stream + ".{subject}") as t:
        results = await t.send_batch([outbound(1, "pay.events"), outbound(2, "orders")])
    assert [r.outcome for r in results] == [Outcome.ACKED] * 2
    assert [m.subject for m in stored(nats, stream)] == [f"{stream}.pay.events", f"{stream}.orders"]


async def test_no_stream_for_the_subject_is_rejected_with_its_reason(nats):
    subject = fresh("kept")
    add_stream(nats, subject, [subject])
    nowhere = fresh("nowhere")
    async with transport(nats) as t:
        results = await t.send_batch([outbound(1, subject), outbound(2, nowhere), outbound(3, subject)])
    assert [r.outcome for r in results] == [Outcome.ACKED, Outcome.REJECTED, Outcome.ACKED]
    assert results[1].detail == f"no JetStream stream for subject {nowhere!r}"
    assert [m.headers["Nats-Msg-Id"] for m in stored(nats, subject)] == ["m1", "m3"]


async def test_same_id_twice_is_stored_once(nats):
    subject = fresh("dedupe")
    add_stream(nats, subject, [subject])
    async with transport(nats) as t:
        first = await t.send_batch([outbound(1, subject), outbound(2, subject)])
        again = await t.send_batch([outbound(1, subject, attempt=3)])
    assert [r.outcome for r in first + again] == [Outcome.ACKED] * 3
    assert [m.headers["Nats-Msg-Id"] for m in stored(nats, subject)] == ["m1", "m2"]


async def test_header_nats_cannot_carry_is_rejected(nats):
    subject = fresh("headers")
    add_stream(nats, subject, [subject])
    async with transport(nats) as t:
        results = await t.send_batch([
            outbound(1, subject, headers={"a key": "v"}), outbound(2, subject, headers={"k": "two\r\nlines"}),
            outbound(3, subject),
        ])
    assert [r.outcome for r in results] == [Outcome.REJECTED, Outcome.REJECTED, Outcome.ACKED]
    assert "'a key'" in results[0].detail and "CR or LF" in results[1].detail


async def test_stream_at_its_limit_is_retry(nats):
    subject = fresh("limited")
    add_stream(nats, subject, [subject], max_msgs=1, discard=DiscardPolicy.NEW)
    async with transport(nats) as t:
        results = await t.send_batch([outbound(1, subject)])
        results += await t.send_batch([outbound(2, subject)])
    assert [r.outcome for r in results] == [Outcome.ACKED, Outcome.RETRY]
    assert "maximum messages" in results[1].detail


async def test_wrong_password_is_retry_with_the_server_reason(nats):
    async with make_transport("nats", nats.address, {"username": "delay", "password": "wrong", "timeout_ms": 5_000},
                              data_dir=None) as t:
        with trio.fail_after(30):
            [result] = await t.send_batch([outbound(1, "orders")])
    assert result.outcome is Outcome.RETRY
    assert "cannot connect" in result.detail and "Authorization" in result.detail


async def test_connection_refused_is_retry(unused_port):
    async with make_transport("nats", f"127.0.0.1:{unused_port}", {"timeout_ms": 500}, data_dir=None) as t:
        with trio.fail_after(30):
            [result] = await t.send_batch([outbound(1, "orders")])
    assert result.outcome is Outcome.RETRY and "cannot connect" in result.detail


async def test_tls_with_a_private_ca(tmp_path):
    executable = nats_executable()
    if executable is None:
        pytest.skip("nats-server is not installed (ops/test installs it)")
    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1")
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    server_cert.cert_chain_pems[0].write_to_path(tmp_path / "server.pem")
    server_cert.private_key_pem.write_to_path(tmp_path / "server.key")
    server = NatsProcess(executable, tmp_path / "nats", extra_args=[
        "--tls", "--tlscert", str(tmp_path / "server.pem"), "--tlskey", str(tmp_path / "server.key")])
    server.start()
    try:
        async def create_stream():
            context = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
            nc = await nats.connect(f"tls://{server.address}", tls=context)
            try:
                await nc.jetstream().add_stream(StreamConfig(name="secure", subjects=["secure"]))
            finally:
                await nc.close()
        asyncio.run(create_stream())
        address = f"tls://{server.address}"
        async with make_transport("nats", address, {"tls_ca_file": str(tmp_path / "ca.pem")}, data_dir=None) as t:
            [result] = await t.send_batch([outbound(1, "secure")])
        assert result.outcome is Outcome.ACKED
        async with make_transport("nats", address, {"timeout_ms": 1000}, data_dir=None) as t:
            [result] = await t.send_batch([outbound(2, "secure")])
        assert result.outcome is Outcome.RETRY and "CERTIFICATE_VERIFY_FAILED" in result.detail
    finally:
        server.stop()


@pytest.mark.slow
async def test_server_down_then_back_loses_nothing(nats):
    subject = fresh("flap")
    add_stream(nats, subject, [subject])
    async with transport(nats, timeout_ms=1000) as t:
        assert [r.outcome for r in await t.send_batch([outbound(1, subject)])] == [Outcome.ACKED]
        with restarted(nats):
            await trio.to_thread.run_sync(nats.stop)
            with trio.fail_after(30):
                results = await t.send_batch([outbound(2, subject), outbound(3, subject)])
            assert [r.outcome for r in results] == [Outcome.RETRY] * 2
        with trio.fail_after(60):
            while [r.outcome for r in results] != [Outcome.ACKED] * 2:  # until the client has reconnected
                results = await t.send_batch([outbound(2, subject), outbound(3, subject)])
    assert [m.headers["Nats-Msg-Id"] for m in stored(nats, subject)] == ["m1", "m2", "m3"]


@pytest.mark.slow
async def test_server_killed_mid_batch_loses_nothing_and_stores_each_id_once(nats):
    """kill -9 of nats-server while batches are in flight: every message JetStream acknowledged is
    in the stream after the restart; sending the unacknowledged ones again stores everything, and
    JetStream's dedupe on Nats-Msg-Id keeps every id once."""
    subject = fresh("crash")
    add_stream(nats, subject, [subject])
    batches = [[outbound(b * 1000 + i, subject, body=b"x" * 512) for i in range(1000)] for b in range(20)]
    results: dict[str, Outcome] = {}

    async def send(t, batch):
        for m, r in zip(batch, await t.send_batch(batch)):
            results[m.message_id] = r.outcome

    async with transport(nats, timeout_ms=3000) as t:
        await send(t, batches[0])
        with restarted(nats):
            async with trio.open_nursery() as nursery:
                for batch in batches[1:]:
                    nursery.start_soon(send, t, batch)
                await trio.sleep(0.1)
                await trio.to_thread.run_sync(nats.kill)
        acked = {i for i, o in results.items() if o is Outcome.ACKED}
        unacked = [m for batch in batches for m in batch if results[m.message_id] is Outcome.RETRY]
        assert len(acked) + len(unacked) == 20_000
        assert acked and unacked, "the kill should land mid-stream; make the batches bigger"
        assert acked <= {m.headers["Nats-Msg-Id"] for m in stored(nats, subject)}, "an acknowledged message was lost"
        with trio.fail_after(120):
            while unacked:  # as the sender does: the unacknowledged again, in batches, until acked
                retry = []
                for k in range(0, len(unacked), 1000):
                    retry += await t.send_batch(unacked[k:k + 1000])
                unacked = [m for m, r in zip(unacked, retry) if r.outcome is not Outcome.ACKED]
    ids = [m.headers["Nats-Msg-Id"] for m in stored(nats, subject)]
    assert set(ids) == {m.message_id for batch in batches for m in batch}
    assert not [i for i, n in collections.Counter(ids).items() if n > 1]


@pytest.mark.parametrize(
    "address, options, field",
    [
        ("", {}, "address"),
        ("localhost", {}, "address"),
        ("http://localhost:4222", {}, "address"),
        ("nats://localhost:x", {}, "address"),
        ("localhost:4222,localhost", {}, "address"),
        ("localhost:4222", {"subject_template": "{topic}"}, "subject_template"),
        ("localhost:4222", {"subject_template": ""}, "subject_template"),
        ("localhost:4222", {"timeout_ms": 0}, "timeout_ms"),
        ("localhost:4222", {"password": 5}, "password"),
        ("localhost:4222", {"creds_file": "/nonexistent.creds"}, "creds_file"),
        ("localhost:4222", {"tls_ca_file": "/nonexistent.pem"}, "tls_ca_file"),
        ("localhost:4222", {"tls_cert_file": "/x.pem"}, "tls_key_file"),
        ("localhost:4222", {"stream": "x"}, "'stream'"),
    ],
)
def test_bad_nats_config_names_the_field(address, options, field):
    with pytest.raises(ValueError, match=field):
        make_transport("nats", address, options, data_dir=None)


def test_name_hides_the_password():
    t = make_transport("nats", "nats://delay:secret@127.0.0.1:4222,127.0.0.1:4223", {}, data_dir=None)
    assert "secret" not in t.name and "127.0.0.1:4223" in t.name
