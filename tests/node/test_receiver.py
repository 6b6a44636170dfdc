"""The receiver over a real store: group commit, sequences, acknowledgement after the fsync, the
time rules, disk-full mode, and the batches it hands the replayer."""
from __future__ import annotations

import mmap
import os
import threading
import time

import pytest
import trio
import trio.testing

from delayserver.clock import TrioClock
from delayserver.config import Config
from delayserver.message import MAX_TIME_MS, ResultCode, TimeSpec
from delayserver.node.receiver import DiskSpace, Receiver, RecentBatches
from delayserver.protocol import SendItem
from delayserver.storage.record import (
    Message, RecordType, TxnCheck, decode_cancel, decode_message, decode_txn_check, encode_txn_check, iter_records,
    schedule_change_sequence,
)
from delayserver.storage.store import Store
from delayserver.wakeup import Wakeup

NOW = 1_800_000_000_000


@pytest.fixture
def store(tmp_path):
    store = Store.open(tmp_path / "data")
    yield store
    store.close()


def receiver(store, floor=1, **config):
    config = Config.from_dict({"max_delay": "1d", "max_message_bytes": 1024, **config})
    return Receiver(store, TrioClock(NOW), config, recent=RecentBatches(), disk=DiskSpace(store, 0),
                    on_durable=Wakeup(), sequence_floor=lambda: floor)


def item(i: int, time: TimeSpec = TimeSpec.delay(1000), body: bytes = b"x") -> SendItem:
    return SendItem(f"m-{i}", "orders.q", time, body)


def stored(store) -> list:
    data, _ = store.message_log.read(0, 1 << 20)
    return [decode_message(data, s, e) for _, rtype, s, e in iter_records(data) if rtype == RecordType.MESSAGE]


async def test_concurrent_senders_share_group_commits_and_are_acknowledged_once_durable(store, autojump_clock):
    r = receiver(store, floor=100)
    results = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(r.serve)

        async def send(i):
            (results[i],) = await r.send([item(i)])
            assert r.durable_offset == store.message_log.end_offset  # fsynced before the answer

        async with trio.open_nursery() as senders:
            for i in range(20):
                senders.start_soon(send, i)
        nursery.cancel_scope.cancel()
    assert all(res.code == ResultCode.OK and res.schedule_time == NOW + 1000 for res in results.values())
    assert r.batches < 20 and r.appended == 20
    sequences = [m.sequence for m in stored(store)]
    assert sequences == list(range(100, 120))  # from the floor, strictly increasing


async def test_a_batch_is_handed_to_the_replayer_from_memory(store, autojump_clock):
    r = receiver(store)
    async with trio.open_nursery() as nursery:
        await nursery.start(r.serve)
        await r.send([item(1), item(2)])
        nursery.cancel_scope.cancel()
    data, offset = r.recent.take(0)
    assert offset == 0 and data == store.message_log.read(0)[0]
    assert r.recent.take(0) is None  # taken once


@pytest.mark.parametrize("time", [TimeSpec.delay(-1), TimeSpec.delay(2 * 86_400_000), TimeSpec.level(19),
                                  TimeSpec.level(0), TimeSpec.at(2**62)])
async def test_a_time_out_of_range_is_refused_and_nothing_is_stored(store, autojump_clock, time):
    r = receiver(store)
    async with trio.open_nursery() as nursery:
        await nursery.start(r.serve)
        (result,) = await r.send([item(1, time)])
        nursery.cancel_scope.cancel()
    assert result.code == ResultCode.BAD_SCHEDULE_TIME and store.message_log.end_offset == 0


async def test_a_body_over_max_message_bytes_is_refused_alone(store, autojump_clock):
    r = receiver(store)
    async with trio.open_nursery() as nursery:
        await nursery.start(r.serve)
        big, fine = await r.send([item(1, body=b"x" * 1025), item(2)])
        nursery.cancel_scope.cancel()
    assert big.code == ResultCode.MESSAGE_TOO_LARGE and fine.code == ResultCode.OK
    assert [m.message_id for m in stored(store)] == ["m-2"]


async def test_in_disk_full_mode_messages_are_refused_until_space_is_back(store, autojump_clock):
    r = receiver(store)
    r.disk.reserve_bytes = 1 << 62  # no disk has room for this much again: the mode holds
    r.disk.enter_full()
    async with trio.open_nursery() as nursery:
        await nursery.start(r.serve)
        (result,) = await r.send([item(1)])
        assert result.code == ResultCode.DISK_FULL and store.message_log.end_offset == 0
        r.disk.reserve_bytes = 0  # room again: the next send leaves the mode by itself
        (result,) = await r.send([item(2)])
        nursery.cancel_scope.cancel()
    assert result.code == ResultCode.OK and not r.disk.full


async def test_a_send_cancelled_while_it_waits_for_its_ack_is_still_remembered_for_dedupe(store, autojump_clock):
    # The producer's connection drops before the answer: the message is stored all the same, and
    # its retry must find it (the replayer does not feed the dedupe table this node's own batches).
    from delayserver.dedupe import DedupeTable

    table = DedupeTable(3_600_000)
    r = Receiver(store, TrioClock(NOW), Config.from_dict({"max_delay": "1d"}), recent=RecentBatches(),
                 disk=DiskSpace(store, 0), on_durable=Wakeup(), sequence_floor=lambda: 1, dedupe=table)
    async with trio.open_nursery() as nursery:
        await nursery.start(r.serve)
        with trio.CancelScope() as waiting:
            nursery.start_soon(_cancel_soon, waiting)
            await r.send([item(1)])
        assert waiting.cancelled_caught
        # The write and its fsync run in a worker thread: bounded in real time, since the mock
        # clock jumps ahead whenever every task waits, however long the thread takes.
        deadline = time.monotonic() + 30
        while r.durable_offset < store.message_log.end_offset or not store.message_log.end_offset:
            assert time.monotonic() < deadline, "the cancelled send's batch never became durable"
            await trio.sleep(0.001)
        (again,) = await r.send([item(1)])
        nursery.cancel_scope.cancel()
    assert again.code == ResultCode.DUPLICATE and again.schedule_time == NOW + 1000
    assert len(stored(store)) == 1


async def _cancel_soon(scope: trio.CancelScope) -> None:
    await trio.lowlevel.checkpoint()
    scope.cancel()


async def test_every_kind_of_request_shares_one_write_and_one_run_of_sequences(store, autojump_clock):
    """A send, a cancel, a move, a schedule change and a transactional record queued together: one
    group commit, one run of sequences, each request's records side by side in it and each answer
    naming where its records start (or end)."""
    r = receiver(store, floor=10)
    answers = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(r.serve)

        async def request(name, call):
            answers[name] = await call

        async with trio.open_nursery() as requests:
            requests.start_soon(request, "send", r.send([item(1), item(2)]))
            requests.start_soon(request, "cancel", r.append_cancel(NOW + 1000, "m-1"))
            requests.start_soon(request, "move", r.append_move(Message("m-2", "orders.q", b"x", NOW + 1000), NOW + 5000))
            requests.start_soon(request, "schedule", r.append_schedule_change({"op": "pause", "name": "daily"}))
            requests.start_soon(request, "check", r.append_record(
                RecordType.TXN_CHECK, encode_txn_check(TxnCheck("t-1", NOW + 1000, 2, NOW))))
        nursery.cancel_scope.cancel()
    assert r.batches == 1 and r.appended == 7
    data, _ = store.message_log.read(0, 1 << 20)
    decode = {RecordType.MESSAGE: lambda s, e: decode_message(data, s, e),
              RecordType.CANCEL: lambda s, e: decode_cancel(data, s, e),
              RecordType.SCHEDULE: lambda s, e: None,
              RecordType.TXN_CHECK: lambda s, e: decode_txn_check(data, s, e)}
    (epoch, *rest) = iter_records(data)
    assert epoch[1] == RecordType.EPOCH
    # by its start: (type, sequence, decoded, end)
    records = {at: (rtype, schedule_change_sequence(data, s) if rtype == RecordType.SCHEDULE
                    else decode[rtype](s, e).sequence, decode[rtype](s, e), e) for at, rtype, s, e in rest}
    assert [records[at][1] for at in sorted(records)] == list(range(10, 17))
    assert all(res.code == ResultCode.OK for res in answers["send"])
    code, text, at = answers["cancel"]
    assert (code, text) == (ResultCode.OK, "stored") and records[at][0] == RecordType.CANCEL
    assert (records[at][2].message_id, records[at][2].schedule_time) == ("m-1", NOW + 1000)
    code, text, end = answers["move"]  # the copy at its new time, then the cancel of the old one, ending there
    assert (code, text) == (ResultCode.OK, "stored")
    [(cancel_at, cancel)] = [(at, x) for at, x in records.items() if x[3] == end]
    [copy] = [x for x in records.values() if x[3] == cancel_at]
    assert copy[2].message_id == cancel[2].message_id == "m-2"
    assert (copy[0], copy[2].schedule_time, cancel[0], cancel[2].schedule_time) == (
        RecordType.MESSAGE, NOW + 5000, RecordType.CANCEL, NOW + 1000)
    assert cancel[1] == copy[1] + 1
    code, text, end = answers["schedule"]
    assert (code, text) == (ResultCode.OK, "stored")
    assert [x[0] for x in records.values() if x[3] == end] == [RecordType.SCHEDULE]
    code, text, at = answers["check"]
    assert (code, text, records[at][0], records[at][2].message_id) == (ResultCode.OK, "stored", RecordType.TXN_CHECK, "t-1")


async def test_a_record_message_log_does_not_hold_is_refused_before_the_commit_task(store, autojump_clock):
    r = receiver(store)
    async with trio.open_nursery() as nursery:
        await nursery.start(r.serve)
        with pytest.raises(ValueError, match="no sequenced record"):
            await r.append_record(RecordType.DISPATCH, bytes(40))
        with pytest.raises(ValueError, match="no sequenced record"):
            await r.append_record(RecordType.TXN_CHECK, bytes(20))  # no room for its sequence
        (result,) = await r.send([item(1)])  # the commit task goes on
        nursery.cancel_scope.cancel()
    assert result.code == ResultCode.OK and [m.message_id for m in stored(store)] == ["m-1"]


async def test_each_batch_opens_with_the_epoch_it_is_written_under(store, autojump_clock):
    r = receiver(store)
    epoch = 3
    r.epoch = lambda: epoch
    async with trio.open_nursery() as nursery:
        await nursery.start(r.serve)
        await r.send([item(1), item(2)])
        epoch = 4
        (result,) = await r.send([item(3)])
        nursery.cancel_scope.cancel()
    data, _ = store.message_log.read(0, 1 << 20)
    types = [rtype for _, rtype, _, _ in iter_records(data)]
    assert types == [RecordType.EPOCH, RecordType.MESSAGE, RecordType.MESSAGE, RecordType.EPOCH, RecordType.MESSAGE]
    assert [e for e, _ in store.message_log.epochs.entries] == [3, 4]
    assert result.code == ResultCode.OK


async def test_a_batch_written_after_the_lease_lapsed_is_not_acknowledged(store, autojump_clock):
    r = receiver(store)
    lease = True
    r.may_acknowledge = lambda: lease
    async with trio.open_nursery() as nursery:
        await nursery.start(r.serve)
        (ok,) = await r.send([item(1)])
        lease = False  # the lease runs out between the check at the door and the fsync
        (fenced,) = await r.send([item(2)])
        nursery.cancel_scope.cancel()
    assert (ok.code, fenced.code) == (ResultCode.OK, ResultCode.FENCED)


async def test_a_batch_of_an_epoch_older_than_the_logs_is_refused_fenced(store, autojump_clock):
    r = receiver(store)
    epoch = 5
    r.epoch = lambda: epoch
    async with trio.open_nursery() as nursery:
        await nursery.start(r.serve)
        await r.send([item(1)])
        end = store.message_log.end_offset
        epoch = 4  # a node told of an older epoch than its log already holds
        (result,) = await r.send([item(2)])
        nursery.cancel_scope.cancel()
    assert result.code == ResultCode.FENCED and store.message_log.end_offset == end


async def test_a_decoded_request_stores_what_the_messages_one_by_one_would(tmp_path, autojump_clock, monkeypatch):
    """A request as the protocol decodes it (a SendBatch) is stored by putting a head in front of
    each message's span of the request: the same records, results and refusals as the same
    messages handed over one by one and encoded, headers, non-ASCII ids and dedupe included; only
    the messages the quick checks do not pass are encoded (and refused) one by one."""
    from delayserver.dedupe import DedupeTable
    from delayserver.node import receiver as receiver_module
    from delayserver.protocol import SendBatch, decode_send_request, encode_send_request
    from delayserver.storage import record

    # No subject checked yet (the process's table may hold these, or be full): each is checked on
    # its first use.
    checked = {}
    monkeypatch.setattr(record, "CHECKED_SUBJECTS", checked)
    monkeypatch.setattr(receiver_module, "CHECKED_SUBJECTS", checked)
    fresh = "fresh.subject"
    items = [
        SendItem("plain", "orders.q", TimeSpec.delay(1000), b"x" * 10),
        SendItem("with-headers", "orders.q", TimeSpec.at(NOW + 5000), b"body", {"trace": "t-1", "k": ""}),
        SendItem("идентификатор", fresh, TimeSpec.level(3), b""),
        SendItem("again-fresh", fresh, TimeSpec.delay(0), b"y"),
        SendItem("plain", "orders.q", TimeSpec.delay(2000), b"twin"),  # the same id: a duplicate
        SendItem("empty-key", "orders.q", TimeSpec.delay(1000), b"", {"": "v"}),
        SendItem("too-big", "orders.q", TimeSpec.delay(1000), b"z" * 1025),
        SendItem("i" * 129, "orders.q", TimeSpec.delay(1000), b""),
        SendItem("bad-subject", "orders q", TimeSpec.delay(1000), b""),
        SendItem("late", "orders.q", TimeSpec.delay(2 * 86_400_000), b""),
        SendItem("big-headers", "orders.q", TimeSpec.delay(1000), b"", {"h": "v" * 40_000}),
        SendItem("plain", "orders.q", TimeSpec.delay(1000), b"", {"reconsume-times": "1"}),  # a retry: its own key
    ]
    batch = decode_send_request(encode_send_request(items))
    assert type(batch) is SendBatch and list(batch) == items

    encoded = []
    real = receiver_module.encode_message_fields
    monkeypatch.setattr(receiver_module, "encode_message_fields",
                        lambda message_id, *a, **k: encoded.append(message_id) or real(message_id, *a, **k))

    class Still:  # one clock reading for both nodes, whenever each sends
        def now_ms(self) -> int:
            return NOW

    def node(path):
        store = Store.open(path)
        config = Config.from_dict({"max_delay": "1d", "max_message_bytes": 1024})
        return store, Receiver(store, Still(), config, recent=RecentBatches(), disk=DiskSpace(store, 0),
                               on_durable=Wakeup(), sequence_floor=lambda: 1, dedupe=DedupeTable(3_600_000))

    (one_store, one), (batch_store, whole) = node(tmp_path / "one"), node(tmp_path / "batch")
    results = {}
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(one.serve)
            await nursery.start(whole.serve)

            results["batch"] = await whole.send(batch)
            results["one"] = await one.send(items)
            nursery.cancel_scope.cancel()
        assert results["batch"] == results["one"]
        codes = [r.code for r in results["batch"]]
        assert codes == [ResultCode.OK, ResultCode.OK, ResultCode.OK, ResultCode.OK, ResultCode.DUPLICATE,
                         ResultCode.BAD_HEADERS, ResultCode.MESSAGE_TOO_LARGE, ResultCode.BAD_MESSAGE_ID,
                         ResultCode.BAD_SUBJECT, ResultCode.BAD_SCHEDULE_TIME, ResultCode.BAD_HEADERS,
                         ResultCode.OK]
        assert one_store.message_log.read(0, 1 << 20)[0] == batch_store.message_log.read(0, 1 << 20)[0]
        assert [m.message_id for m in stored(batch_store)] == ["plain", "with-headers", "идентификатор",
                                                               "again-fresh", "plain"]
        # The batch went through encode_message_fields only for each subject's first message and
        # the ones refused there; the list, every message that reached encoding (the twin and the
        # late one are answered before it).
        assert encoded == ["plain", "идентификатор", "empty-key", "too-big", "i" * 129, "bad-subject",
                           "big-headers",
                           "plain", "with-headers", "идентификатор", "again-fresh", "empty-key", "too-big",
                           "i" * 129, "bad-subject", "big-headers", "plain"]
        assert set(checked) == {"orders.q", fresh}
    finally:
        one_store.close()
        batch_store.close()


@pytest.mark.parametrize("now", [NOW, MAX_TIME_MS - 1000])
async def test_a_decoded_requests_epoch_times_are_taken_as_schedule_time_takes_them(tmp_path, autojump_clock, now):
    """A decoded request keeps each epoch time as the int itself and the receiver takes one from
    now to max_delay ahead as it is: at each edge of that window (a time before now, now, the
    last time max_delay allows and the first past it, the last epoch time there is) the request
    is answered as the same messages with their TimeSpecs, one by one, are."""
    from delayserver.protocol import SendBatch, decode_send_request, encode_send_request

    day = 86_400_000
    times = [-5, now - 5000, now, now + 1, now + day, now + day + 1, MAX_TIME_MS, MAX_TIME_MS + 1]
    items = [SendItem(f"m{k}", "orders.q", TimeSpec.at(t), b"x") for k, t in enumerate(times)]
    batch = decode_send_request(encode_send_request(items))
    assert type(batch) is SendBatch and [row[2] for row in batch.rows] == times and list(batch) == items

    class Still:
        def now_ms(self) -> int:
            return now

    def node(path):
        store = Store.open(path)
        return store, Receiver(store, Still(), Config.from_dict({"max_delay": "1d"}), recent=RecentBatches(),
                               disk=DiskSpace(store, 0), on_durable=Wakeup(), sequence_floor=lambda: 1)

    (one_store, one), (batch_store, whole) = node(tmp_path / "one"), node(tmp_path / "batch")
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(one.serve)
            await nursery.start(whole.serve)
            got, expected = await whole.send(batch), await one.send(items)
            nursery.cancel_scope.cancel()
    finally:
        one_store.close()
        batch_store.close()
    assert got == expected
    ok, bad = ResultCode.OK, ResultCode.BAD_SCHEDULE_TIME
    # (before now: now; past max_delay or the last epoch time: refused)
    assert [(r.code, r.schedule_time) for r in got] == [
        (ok, max(t, now)) if t <= now + day and max(t, now) <= MAX_TIME_MS else (bad, 0) for t in times]
    assert sum(r.code == ok for r in got) == 5


async def test_an_async_flush_whose_segment_rolls_during_its_fsync_stays_writable(store, autojump_clock, monkeypatch):
    """flush=async fsyncs message_log from a worker thread while the event loop goes on writing;
    a roll then may close the segment's descriptor (it fsyncs the segment it seals first). The
    log's sync goes through a descriptor of its own, so a roll never makes it fail. (Through the
    segment's closed descriptor it raised ValueError out of the flush task, which stopped the
    receiver; an fsync error there would have left the node read-only for good.)"""
    from delayserver.storage import message_log as message_log_module
    from delayserver.storage.segment import Segment

    staged = []
    loop_thread = threading.current_thread()
    token = trio.lowlevel.current_trio_token()  # (the node's worker threads are not trio's own)

    def roll_first(fn):
        def run(*args, **kw):
            if threading.current_thread() is not loop_thread and not staged:
                staged.append(True)  # the loop rolls the log in the moment this fsync begins
                trio.from_thread.run_sync(store.message_log.roll, trio_token=token)
            return fn(*args, **kw)
        return run

    monkeypatch.setattr(Segment, "sync", roll_first(Segment.sync))
    monkeypatch.setattr(message_log_module, "fsync_path", roll_first(message_log_module.fsync_path))
    r = receiver(store, flush="async", flush_interval_ms=10)
    async with trio.open_nursery() as nursery:
        await nursery.start(r.serve)
        (first,) = await r.send([item(0)])
        # The mock clock jumps whenever every task waits, a wait for a worker thread too: a bound
        # in virtual time, of many polls, not seconds of them.
        with trio.fail_after(3600):
            while r.durable_offset < store.message_log.end_offset:
                await trio.sleep(0.01)
        assert staged and not r.read_only_reason
        (second,) = await r.send([item(1)])
        nursery.cancel_scope.cancel()
    assert first.code == second.code == ResultCode.OK
    assert len(store.message_log.segments) == 2


def _resident_pages_of_message_log(store) -> list[bool]:
    from tests.damage import resident_map
    fd = os.open(store.message_log.path(store.message_log.active_base), os.O_RDONLY)
    try:
        return resident_map(fd)
    finally:
        os.close(fd)


async def _send_rounds(r, rounds: int, per_round: int = 4) -> list[int]:
    """`rounds` sends one after the other (each its own batch and fsync); the durable offset after each."""
    ends = []
    for n in range(rounds):
        results = await r.send([item(n * per_round + k, body=bytes([k]) * 4000) for k in range(per_round)])
        assert {res.code for res in results} == {ResultCode.OK}
        ends.append(r.durable_offset)
    return ends


@pytest.mark.parametrize("floor", [None, "all", "half"])
async def test_durable_pages_below_the_page_floor_are_given_back(store, autojump_clock, floor, monkeypatch):
    """After an fsync, a worker thread hands back to the kernel the pages of message_log made
    durable below the node's page floor: what is still read back (not yet replayed, not yet pulled
    by a slave, not yet durable) stays in the page cache; without a floor every page stays."""
    from delayserver.node import receiver as receiver_module
    from delayserver.storage import segment
    PAGE_BYTES = mmap.PAGESIZE
    from tests.damage import gives_back_pages
    if not gives_back_pages(store.message_log.directory):
        pytest.skip("this file system keeps its pages whatever it is told")
    monkeypatch.setattr(receiver_module, "GIVE_BACK_BYTES", PAGE_BYTES)  # (a MiB at least, in a node)
    monkeypatch.setattr(segment, "GIVE_BACK_LAG_BYTES", 2 * PAGE_BYTES)  # (a MiB)
    r = receiver(store, max_message_bytes=8192)
    limit = {"all": 10**18, "half": 0}.get(floor)
    async with trio.open_nursery() as nursery:
        await nursery.start(r.serve)
        if floor is not None:
            r.page_floor = lambda: limit
        if floor == "half":
            ends = await _send_rounds(r, 4)
            limit = ends[1] + 100  # say, a slave that has pulled this far
            ends += await _send_rounds(r, 4)
        else:
            ends = await _send_rounds(r, 8)
        for ask in (False, True):  # one under way at the last fsync put the rest off to the next
            if ask:
                r._give_back_pages()
            while r._giving_back:  # under way in its worker thread
                await trio.sleep(0.001)
        nursery.cancel_scope.cancel()
    resident = _resident_pages_of_message_log(store)
    if floor is None:
        assert all(resident)
        return
    below = min(limit, ends[-1] - 2 * PAGE_BYTES)
    # Kept: the folio holding `below` (a send's write, 4 pages or 5, may be one folio), and after it.
    assert not any(resident[:below // PAGE_BYTES - 5]), resident
    assert all(resident[below // PAGE_BYTES + 1:]), resident


async def test_the_page_floor_is_worked_out_only_when_a_give_back_could_be_due(store, autojump_clock, monkeypatch):
    """The node's page floor walks the slaves' states: the receiver works it out only when
    GIVE_BACK_BYTES of message_log could be given back (`MessageLog.give_back_due`, the lag behind
    the log's end included), not at every fsync. With a floor that holds nothing back, every time
    it is worked out pages go back."""
    from delayserver.node import receiver as receiver_module
    from delayserver.storage import segment
    monkeypatch.setattr(receiver_module, "GIVE_BACK_BYTES", 8 * 4096)
    monkeypatch.setattr(segment, "GIVE_BACK_LAG_BYTES", 8 * 4096)
    gave = []
    # (What the advice does to the page cache is the test above's; here only when it is asked for.)
    monkeypatch.setattr(receiver_module, "give_back_pages", gave.append)
    asked = []
    r = receiver(store, max_message_bytes=8192)
    async with trio.open_nursery() as nursery:
        await nursery.start(r.serve)
        r.page_floor = lambda: asked.append(r.durable_offset) or 10**18
        await _send_rounds(r, 24, per_round=2)  # an fsync a round, about two pages each
        while r._giving_back:
            await trio.sleep(0.001)
        nursery.cancel_scope.cancel()
    assert len(gave) >= 2, gave
    assert len(asked) == len(gave), (asked, gave)


async def test_a_request_racing_one_that_commits_its_ids_answers_each_with_the_first_ones_time(store, autojump_clock):
    """Two requests of the same 300 ids, the second sent while the first commits: each of the
    second's messages waits for the first and answers DUPLICATE with the schedule time its id was
    stored at (each id its own: the first request's times differ); nothing is stored twice."""
    from delayserver.dedupe import DedupeTable

    config = Config.from_dict({"max_delay": "1d", "max_message_bytes": 1024})
    r = Receiver(store, TrioClock(NOW), config, recent=RecentBatches(), disk=DiskSpace(store, 0),
                 on_durable=Wakeup(), sequence_floor=lambda: 1, dedupe=DedupeTable(config.dedupe_window_ms))
    first_items = [SendItem(f"order-{i}", "orders.q", TimeSpec.delay(1000 + i), b"x") for i in range(300)]
    again = [SendItem(f"order-{i}", "orders.q", TimeSpec.delay(5000), b"y") for i in reversed(range(300))]
    answers = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(r.serve)

        async def send(name, items):
            answers[name] = await r.send(items)

        async with trio.open_nursery() as senders:
            senders.start_soon(send, "first", first_items)
            await trio.testing.wait_all_tasks_blocked()
            assert len(r._committing) == 300  # the first request holds its ids while it commits
            senders.start_soon(send, "again", again)
        nursery.cancel_scope.cancel()
    assert [a.code for a in answers["first"]] == [ResultCode.OK] * 300
    assert [(a.code, a.schedule_time) for a in answers["again"]] == \
        [(ResultCode.DUPLICATE, NOW + 1000 + i) for i in reversed(range(300))]
    assert len(stored(store)) == 300 and r._committing == {}
