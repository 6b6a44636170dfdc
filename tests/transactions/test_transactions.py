"""Half messages in-process over real sockets: prepare, commit, rollback, the check-back, parking,
a restart, bad input. Time moves by stepping the server's clock (TrioClock.step), never by sleeping
out a delay; the waits below are for the server to act on what it was told."""
from __future__ import annotations

import json
import sys
import threading
import time

import pytest
import trio

from delayserver import protocol as p
from delayserver.client import AsyncProducer
from delayserver.clock import TrioClock
from delayserver.config import Config
from delayserver.message import BadSubject, DelayServerError, MessageState, ResultCode, TransactionState
from delayserver.node.server import DelayServer
from delayserver.sender.parked import iter_parked
from tests.procs import spooled

HOUR = 3_600_000


def config(tmp_path, **kw) -> Config:
    base = dict(data_dir=str(tmp_path / "data"), listen="127.0.0.1:0", max_delay="1d", transaction_timeout_ms=6000,
                check_interval_ms=60_000, check_max=3, check_spacing_ms=0, checkpoint_interval_ms=50)
    base.update(kw)
    return Config.from_dict(base)


class Listener:
    """A listener whose answers are set by the test; it records the checks it was asked."""

    def __init__(self, execute=TransactionState.UNKNOWN, check=TransactionState.UNKNOWN):
        self.execute, self.check = execute, check
        self.checked = []

    def execute_local_transaction(self, message, arg):
        return self.execute

    def check_local_transaction(self, message):
        self.checked.append((message.message_id, message.checks, message.body))
        return self.check


async def start(nursery, tmp_path, **kw) -> DelayServer:
    server = DelayServer(config(tmp_path, **kw), clock=TrioClock(time.time_ns() // 1_000_000))
    await nursery.start(server.serve)
    return server


async def client(server, nursery, **kw) -> AsyncProducer:
    prod = AsyncProducer(f"127.0.0.1:{server.port}", timeout=10, **kw)
    await nursery.start(_hold, prod)
    return prod


async def _hold(prod, task_status=trio.TASK_STATUS_IGNORED):
    async with prod:
        task_status.started()
        await trio.sleep_forever()


async def eventually(predicate, timeout: float = 20.0):
    with trio.fail_after(timeout):
        while not (value := predicate()):
            await trio.sleep(0.02)
    return value


def delivered_ids(server) -> list[str]:
    return [m.message_id for _, _, m in spooled(server.config.data_dir)]


async def test_a_half_message_is_prepared_then_committed_once_and_a_repeat_commit_is_harmless(nursery, tmp_path):
    server = await start(nursery, tmp_path)
    prod = await client(server, nursery)
    now = server.clock.now_ms()
    handle = await prod.prepare("orders.expire", b"order 42", group="orders", deliver_at=now + HOUR)
    status = await prod.status(handle)
    assert status.state == MessageState.PREPARED and status.checks == 0
    assert status.next_check_time == server.halves.open[(handle.schedule_time, handle.message_id)].store_time + 6000
    assert await prod.commit(handle) == TransactionState.COMMIT
    assert (await prod.status(handle)).state == MessageState.PENDING
    assert await prod.commit(handle) == TransactionState.COMMIT  # idempotent: not scheduled twice
    with pytest.raises(DelayServerError) as err:
        await prod.rollback(handle)
    assert err.value.code == ResultCode.TXN_RESOLVED
    assert server.halves.totals()[:3] == [1, 1, 0]
    assert len(server.store.schedule_log.buckets()) == 1


async def test_a_committed_half_message_whose_time_has_passed_is_delivered_at_once(nursery, tmp_path):
    server = await start(nursery, tmp_path)
    prod = await client(server, nursery)
    handle = await prod.prepare("orders.expire", b"late", group="orders", delay=1000)
    server.clock.step(5000)  # its delivery time passes while it is prepared: nothing is delivered
    await trio.sleep(0.2)
    assert delivered_ids(server) == []
    await prod.commit(handle)
    assert await eventually(lambda: delivered_ids(server)) == [handle.message_id]


async def test_a_rolled_back_half_message_is_never_delivered_and_answers_clearly(nursery, tmp_path):
    server = await start(nursery, tmp_path)
    prod = await client(server, nursery)
    handle = await prod.prepare("orders.expire", b"x", group="orders", delay=0)
    assert await prod.rollback(handle) == TransactionState.ROLLBACK
    assert await prod.rollback(handle) == TransactionState.ROLLBACK
    with pytest.raises(DelayServerError) as err:
        await prod.commit(handle)
    assert err.value.code == ResultCode.TXN_RESOLVED and "rolled back" in str(err.value)
    unknown = p.Handle(handle.schedule_time, "never-prepared")
    with pytest.raises(DelayServerError) as err:
        await prod.commit(unknown)
    assert err.value.code == ResultCode.TXN_NOT_FOUND
    status = await prod.status(handle)
    assert status.state == MessageState.UNKNOWN
    await trio.sleep(0.3)
    assert delivered_ids(server) == []


async def test_send_in_transaction_commits_or_rolls_back_as_the_local_transaction_says(nursery, tmp_path):
    server = await start(nursery, tmp_path)
    committing = await client(server, nursery, group="orders", transaction_listener=Listener(TransactionState.COMMIT))
    rolling = await client(server, nursery, group="orders",
                           transaction_listener=Listener(TransactionState.ROLLBACK))
    ok = await committing.send_in_transaction("orders.expire", b"kept", delay=0)
    dropped = await rolling.send_in_transaction("orders.expire", b"dropped", delay=0)
    assert (ok.state, dropped.state) == (TransactionState.COMMIT, TransactionState.ROLLBACK)
    assert await eventually(lambda: delivered_ids(server)) == [ok.handle.message_id]
    await trio.sleep(0.3)
    assert delivered_ids(server) == [ok.handle.message_id]


async def test_the_check_back_asks_a_live_producer_of_the_group_and_its_commit_schedules_the_message(
        nursery, tmp_path):
    server = await start(nursery, tmp_path)
    gone = await client(server, nursery)
    handle = await gone.prepare("orders.expire", b"body", group="orders", delay=0)
    listener = Listener(check=TransactionState.COMMIT)
    answering = await client(server, nursery, group="orders", transaction_listener=listener)
    await answering.ping()  # connected and registered
    await trio.sleep(0.2)
    assert listener.checked == []  # not before transaction_timeout
    server.clock.step(6000)
    await eventually(lambda: listener.checked)
    assert listener.checked[0] == (handle.message_id, 1, b"body")
    assert await eventually(lambda: delivered_ids(server)) == [handle.message_id]
    assert server.checker.answers[TransactionState.COMMIT] == 1
    assert server.halves.totals() == [1, 1, 0, 1, 0]


async def test_a_check_answered_rollback_drops_the_message(nursery, tmp_path):
    server = await start(nursery, tmp_path)
    listener = Listener(check=TransactionState.ROLLBACK)
    prod = await client(server, nursery, group="orders", transaction_listener=listener)
    handle = await prod.prepare("orders.expire", b"body", delay=0)
    server.clock.step(6000)
    await eventually(lambda: server.halves.outcome((handle.schedule_time, handle.message_id)))
    assert server.halves.outcome((handle.schedule_time, handle.message_id)) == TransactionState.ROLLBACK
    await trio.sleep(0.3)
    assert delivered_ids(server) == []


async def test_check_immunity_delays_the_first_check(nursery, tmp_path):
    server = await start(nursery, tmp_path)
    listener = Listener(check=TransactionState.COMMIT)
    prod = await client(server, nursery, group="orders", transaction_listener=listener)
    handle = await prod.prepare("orders.expire", b"body", delay=0, check_immunity_ms=30_000)
    assert (await prod.status(handle)).next_check_time == \
        server.halves.open[(handle.schedule_time, handle.message_id)].store_time + 30_000
    server.clock.step(6000)
    await trio.sleep(0.3)
    assert listener.checked == []
    server.clock.step(24_000)
    await eventually(lambda: listener.checked)


async def test_unknown_answers_check_max_times_park_the_message_on_the_check_max_subject(nursery, tmp_path):
    server = await start(nursery, tmp_path)
    listener = Listener(check=TransactionState.UNKNOWN)
    prod = await client(server, nursery, group="orders", transaction_listener=listener)
    handle = await prod.prepare("orders.expire", b"body", delay=0, headers={"k": "v"})
    server.clock.step(6000)
    for n in (1, 2, 3):
        await eventually(lambda: len(listener.checked) == n)
        status = await eventually(lambda: server.halves.open[(handle.schedule_time, handle.message_id)].checks == n)
        assert status
        assert (await prod.status(handle)).checks == n
        server.clock.step(60_000)
    parked = await eventually(lambda: list(iter_parked(server.config.data_dir / "parked")))
    (_, record), = parked
    assert record.message.subject == "%TRANS_CHECK_MAX%orders"
    assert record.message.headers == {"k": "v", "origin-subject": "orders.expire", "producer-group": "orders",
                                      "transaction-checks": "3"}
    assert record.attempt == 3 and "3 times" in record.reason
    assert len(listener.checked) == 3
    with pytest.raises(DelayServerError) as err:
        await prod.commit(handle)
    assert err.value.code == ResultCode.TXN_RESOLVED and "parked" in str(err.value)
    assert server.halves.totals() == [1, 0, 0, 3, 1]
    await eventually(lambda: not server.halves.open)
    assert delivered_ids(server) == []


async def test_a_group_with_no_live_producer_is_not_asked_and_its_check_is_not_counted(nursery, tmp_path):
    server = await start(nursery, tmp_path)
    prod = await client(server, nursery)
    handle = await prod.prepare("orders.expire", b"body", group="orders", delay=0)
    server.clock.step(6000)
    await trio.sleep(0.3)
    assert (await prod.status(handle)).checks == 0
    listener = Listener(check=TransactionState.COMMIT)
    await (await client(server, nursery, group="orders", transaction_listener=listener)).ping()
    server.clock.step(60_000)
    assert await eventually(lambda: delivered_ids(server)) == [handle.message_id]


async def test_half_messages_and_their_checks_survive_a_restart(tmp_path):
    listener = Listener(check=TransactionState.UNKNOWN)
    async with trio.open_nursery() as nursery:
        server = await start(nursery, tmp_path)
        prod = await client(server, nursery, group="orders", transaction_listener=listener)
        handle = await prod.prepare("orders.expire", b"body", delay=0)
        kept = await prod.prepare("orders.expire", b"rolled", delay=0)
        await prod.rollback(kept)
        server.clock.step(6000)
        await eventually(lambda: listener.checked)
        await eventually(lambda: server.halves.open[(handle.schedule_time, handle.message_id)].checks == 1)
        await server.drain()
        nursery.cancel_scope.cancel()
    # The operator tools read every transactional record of message_log.
    data_dir = server.config.data_dir
    await delayctl("verify", str(data_dir))
    segment = sorted((data_dir / "message_log").glob("*.log"))[0]
    records = [json.loads(line) for line in (await delayctl("inspect", str(segment), "--json")).splitlines()]
    # (each batch opens with the EPOCH record of the master epoch that wrote it)
    records = [r for r in records if r["type"] != "EPOCH"]
    assert [r["type"] for r in records] == ["PREPARE", "PREPARE", "ROLLBACK", "TXN_CHECK"]
    assert records[0]["group"] == "orders" and records[3]["checks"] == 1
    async with trio.open_nursery() as nursery:
        server = await start(nursery, tmp_path)
        half = server.halves.open[(handle.schedule_time, handle.message_id)]
        assert half.checks == 1 and list(server.halves.open) == [half.key]
        assert server.halves.outcome((kept.schedule_time, kept.message_id)) == TransactionState.ROLLBACK
        prod = await client(server, nursery)
        assert await prod.commit(handle) == TransactionState.COMMIT
        assert await eventually(lambda: delivered_ids(server)) == [handle.message_id]
        nursery.cancel_scope.cancel()


async def test_bad_transactional_requests_get_clear_codes_and_the_server_goes_on(nursery, tmp_path):
    server = await start(nursery, tmp_path)
    prod = await client(server, nursery)
    with pytest.raises(BadSubject):
        await prod.prepare("orders.expire", b"x", group="bad group")
    with pytest.raises(DelayServerError) as err:
        await prod.prepare("orders.expire", b"x", group="g", check_immunity_ms=-1)
    assert err.value.code == ResultCode.BAD_REQUEST
    with pytest.raises(DelayServerError) as err:
        await prod.request(p.Command.TXN_CHECK, b"")
    assert err.value.code == ResultCode.BAD_REQUEST
    for command in (p.Command.PREPARE, p.Command.COMMIT, p.Command.ROLLBACK, p.Command.PRODUCER_REGISTER):
        with pytest.raises(DelayServerError) as err:
            await prod.request(command, b"\x00\x05abc")
        assert err.value.code == ResultCode.BAD_REQUEST
    assert await prod.ping(b"still here") == b"still here"


async def test_metrics_and_delayctl_buckets_count_half_messages(nursery, tmp_path):
    from prometheus_client import generate_latest

    server = await start(nursery, tmp_path, check_max=1)
    listener = Listener(check=TransactionState.UNKNOWN)
    prod = await client(server, nursery, group="orders", transaction_listener=listener)
    await prod.commit(await prod.prepare("a", b"1", delay=0))
    await prod.rollback(await prod.prepare("a", b"2", delay=0))
    parked = await prod.prepare("a", b"3", delay=HOUR)
    open_one = await prod.prepare("a", b"4", delay=HOUR, check_immunity_ms=HOUR)
    server.clock.step(6000)
    await eventually(lambda: listener.checked)
    server.clock.step(60_000)
    await eventually(lambda: not server.halves.open.get((parked.schedule_time, parked.message_id)))
    text = generate_latest(server.metrics.registry).decode()
    for line in ('delayserver_half_messages_prepared 1.0', 'delayserver_half_messages_total{event="prepared"} 4.0',
                 'delayserver_half_messages_total{event="committed"} 1.0',
                 'delayserver_half_messages_total{event="rolled_back"} 1.0',
                 'delayserver_half_messages_total{event="checked"} 1.0',
                 'delayserver_half_messages_total{event="parked"} 1.0'):
        assert line in text
    await server.replayer.checkpoint_async()
    out = await delayctl("buckets", str(server.config.data_dir), "--json")
    rows = [json.loads(line) for line in out.splitlines() if '"half_messages"' in line]
    assert rows[-1] == {"half_messages": True, "bucket": "total", "prepared": 1, "committed": 1, "rolled_back": 1,
                        "checked": 1, "parked": 1}
    status = await delayctl("status", str(open_one), "--server", f"127.0.0.1:{server.port}", "--json")
    fields = json.loads(status)
    assert fields["state"] == "prepared" and fields["checks"] == 0
    assert fields["next_check_time"] == server.halves.open[(open_one.schedule_time, open_one.message_id)].store_time \
        + HOUR


async def delayctl(*args: str) -> str:
    """Run delayctl as a process; its stdout (it must exit 0)."""
    result = await trio.run_process([sys.executable, "-m", "delayserver.ctl", *args], capture_stdout=True,
                                    capture_stderr=True, check=False)
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout.decode()


async def test_checks_are_spaced_and_bounded_in_flight(nursery, tmp_path, monkeypatch):
    from delayserver.transactions.checker import CHECKS_IN_FLIGHT
    from delayserver.transactions.sessions import ProducerSession

    server = await start(nursery, tmp_path, check_spacing_ms=20, check_answer_timeout_ms=60_000)
    release = trio.Event()
    sent, in_flight = [], [0, 0]
    ask = ProducerSession.check

    async def timed_check(session, request, timeout_s):
        sent.append(trio.current_time())  # when the server sends the request
        return await ask(session, request, timeout_s)

    monkeypatch.setattr(ProducerSession, "check", timed_check)

    class Holding:  # an async listener: awaited on the client's loop
        async def execute_local_transaction(self, message, arg):
            return TransactionState.UNKNOWN

        async def check_local_transaction(self, message):
            in_flight[0] += 1
            in_flight[1] = max(in_flight[1], in_flight[0])
            await release.wait()
            in_flight[0] -= 1
            return TransactionState.COMMIT

    prod = await client(server, nursery, group="orders", transaction_listener=Holding())
    handles = [await prod.prepare("orders.expire", b"x", delay=0) for _ in range(CHECKS_IN_FLIGHT + 8)]
    server.clock.step(6000)  # all due at once
    await eventually(lambda: in_flight[0] == CHECKS_IN_FLIGHT)
    await trio.sleep(0.3)
    assert len(sent) == CHECKS_IN_FLIGHT and in_flight[1] == CHECKS_IN_FLIGHT
    # check_spacing (20 ms) apart, never a burst. `sent` is read a few statements after the pacer
    # stamps its request, and that gap differs from one request to the next (a collection, the
    # VM's steal), so allow 5 ms of it: a burst would put requests microseconds apart.
    assert all(b - a >= 0.015 for a, b in zip(sent, sent[1:])), [round(b - a, 4) for a, b in zip(sent, sent[1:])]
    release.set()
    assert await eventually(lambda: len(delivered_ids(server)) == len(handles))
    assert len(sent) == len(handles)


async def test_a_half_message_unresolved_past_retention_is_parked_even_with_no_producer_to_ask(nursery, tmp_path):
    server = await start(nursery, tmp_path, retention_ms=600_000, check_max=15)
    prod = await client(server, nursery)
    handle = await prod.prepare("orders.expire", b"body", group="nobody", delay=0)
    server.clock.step(6000)
    await trio.sleep(0.3)
    assert (await prod.status(handle)).state == MessageState.PREPARED  # no producer: not asked, kept
    server.clock.step(600_000)
    (_, record), = await eventually(lambda: list(iter_parked(server.config.data_dir / "parked")))
    assert (record.message.subject, record.attempt) == ("%TRANS_CHECK_MAX%nobody", 0)
    assert record.reason == "transaction unresolved past retention"
    assert server.halves.outcome((handle.schedule_time, handle.message_id)) == TransactionState.PARKED


async def test_a_prepare_record_is_read_back_in_a_worker_thread_never_on_the_event_loop(nursery, tmp_path):
    """A commit, a check and a park read the half message's PREPARE record back from message_log;
    one that came hours ago may be on disk only, so they read it in a worker thread, never with a
    read on the event loop that may wait for the disk."""
    server = await start(nursery, tmp_path, check_max=2)
    log = server.store.message_log
    loop_thread = threading.current_thread()
    on_loop, off_loop = [], []
    read, reader = log.read, log.reader

    def read_spy(offset, max_bytes=1 << 20):
        if max_bytes == 1:  # one record (replay and the slaves' pulls read more)
            on_loop.append(offset)
        return read(offset, max_bytes)

    def reader_spy(offset, max_bytes=1 << 20):
        run = reader(offset, max_bytes)

        def in_thread():
            off_loop.append((offset, threading.current_thread() is not loop_thread))
            return run()
        return in_thread

    log.read, log.reader = read_spy, reader_spy
    listener = Listener(check=TransactionState.UNKNOWN)
    prod = await client(server, nursery, group="orders", transaction_listener=listener)
    committed = await prod.prepare("orders.expire", b"paid", delay=0)
    await prod.commit(committed)
    assert await eventually(lambda: delivered_ids(server)) == [committed.message_id]
    parked = await prod.prepare("orders.expire", b"unanswered", delay=0)
    server.clock.step(6000)
    await eventually(lambda: len(listener.checked) == 1)
    await eventually(lambda: server.halves.open[(parked.schedule_time, parked.message_id)].checks == 1)
    server.clock.step(60_000)
    await eventually(lambda: len(listener.checked) == 2)
    await eventually(lambda: server.halves.open[(parked.schedule_time, parked.message_id)].checks == 2)
    server.clock.step(60_000)
    await eventually(lambda: list(iter_parked(server.config.data_dir / "parked")))
    assert on_loop == []
    assert [in_thread for _, in_thread in off_loop] == [True] * 4  # the commit, two checks, the park
    assert len({offset for offset, _ in off_loop}) == 2
