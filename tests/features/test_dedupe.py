"""Idempotent send: a message id accepted within dedupe_window answers its first handle, through the
real server, across a restart, and the table's own rules."""
from __future__ import annotations

import sys
import time

import numpy as np
import pytest
import trio

from delayserver import dedupe
from delayserver import protocol as p
from delayserver.client import AsyncProducer, Message, Producer
from delayserver.config import Config
from delayserver.dedupe import _HEAD, FILE_NAME, Dedupe, DedupeTable, _starts, dedupe_key
from delayserver.message import MessageState, ResultCode, TimeSpec
from delayserver.node.server import DelayServer
from delayserver.storage.record import RecordType, decode_message, iter_records
from tests.procs import ServerProcess

HOUR = 3_600_000
T0 = 1_795_000_000_000


def config(root, **kw) -> Config:
    base = dict(data_dir=str(root), listen="127.0.0.1:0", segment_scale="1m", max_delay="1d", reserve_bytes=0,
                checkpoint_interval_ms=20)
    base.update(kw)
    return Config.from_dict(base)


class SetClock:
    """A wall clock a test moves by hand (the node's sleeps stay on trio's clock)."""

    def __init__(self, now_ms: int):
        self.now = now_ms

    def now_ms(self) -> int:
        return self.now


async def run_node(root, body, clock=None, **kw) -> DelayServer:
    server = DelayServer(config(root, **kw), clock=clock)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        await body(server)
        await server.drain()
    return server


def stored_messages(root) -> list:
    """Every MESSAGE record of message_log, decoded."""
    out = []
    for path in sorted((root / "message_log").glob("*.log")):
        data = path.read_bytes()
        for _, rtype, s, e in iter_records(data):
            if rtype == RecordType.MESSAGE:
                out.append(decode_message(data, s, e))
    return out


# --- the table ------------------------------------------------------------------------------


def test_an_id_is_found_within_the_window_and_not_after():
    table = DedupeTable(window_ms=HOUR)
    table.remember("a", T0 + 5000, T0)
    assert table.find("a", T0 + HOUR - 1) == T0 + 5000
    assert table.find("a", T0 + HOUR) is None
    assert table.find("b", T0) is None


def test_a_later_record_of_the_same_id_moves_the_handle_but_not_the_window():
    table = DedupeTable(window_ms=HOUR)
    table.remember("a", T0 + 5000, T0)
    table.remember("a", T0 + 9000, T0 + 1000)  # a reschedule writes the message again
    assert table.find("a", T0 + HOUR - 1) == T0 + 9000
    assert table.find("a", T0 + HOUR) is None


def test_expire_forgets_only_what_is_older_than_the_window():
    table = DedupeTable(window_ms=HOUR)
    for i in range(10):
        table.remember(f"m{i}", T0, T0 + i * 1000)
    assert table.expire(T0 + HOUR + 4500) == 5
    assert len(table) == 5 and table.find("m5", T0 + HOUR + 4500) == T0


def test_a_saved_table_reads_back_and_a_damaged_one_is_ignored(tmp_path):
    table = DedupeTable(window_ms=HOUR)
    table.remember("order-42", T0 + 5, T0)
    table.remember("ünïcode/id", T0 + 6, T0 + 1)
    path = tmp_path / FILE_NAME
    table.save_to(path, 1234)
    again = DedupeTable(window_ms=HOUR)
    assert again.load(path) == 1234
    assert again.find("ünïcode/id", T0 + 2) == T0 + 6 and again.find("order-42", T0 + 2) == T0 + 5
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    damaged = DedupeTable(window_ms=HOUR)
    assert damaged.load(path) is None and len(damaged) == 0


def test_an_id_accepted_again_after_its_window_gets_a_window_of_its_own(tmp_path):
    table = DedupeTable(window_ms=HOUR)
    table.remember("a", T0 + 5000, T0)
    table.remember("b", T0 + 5000, T0 + 10)
    table.remember("a", T0 + HOUR + 9000, T0 + HOUR)  # after the window, not yet expired
    assert table.find("a", T0 + HOUR + 1) == T0 + HOUR + 9000
    # Expiry passes the first acceptance of "a" (and "b") without forgetting the second.
    assert table.expire(T0 + HOUR + 100) == 2
    assert len(table) == 1 and table.find("a", T0 + 2 * HOUR - 1) == T0 + HOUR + 9000
    # Saved with both of its positions before expiry, it reads back at the later one.
    again = DedupeTable(window_ms=HOUR)
    fresh = DedupeTable(window_ms=HOUR)
    fresh.remember("a", T0 + 5000, T0)
    fresh.remember("a", T0 + HOUR + 9000, T0 + HOUR)
    fresh.save_to(tmp_path / FILE_NAME, 7)
    assert again.load(tmp_path / FILE_NAME) == 7
    assert len(again) == 1 and again.find("a", T0 + HOUR + 1) == T0 + HOUR + 9000
    assert again.expire(T0 + HOUR + 100) == 1 and again.find("a", T0 + HOUR + 1) == T0 + HOUR + 9000


@pytest.mark.parametrize("read_back", [False, True])
def test_remember_many_is_remember_of_each_in_turn(tmp_path, read_back):
    """A request's accepted ids go into the table in one call: the same table as one call each,
    new ids, ids held (within their window or past it), one twice, on a table read back or not."""
    def start() -> DedupeTable:
        table = DedupeTable(window_ms=HOUR)
        table.remember("held", T0 + 5, T0)
        table.remember("old", T0 + 6, T0 - HOUR)  # its window is over at T0 + 10
        return saved_and_read(tmp_path, table) if read_back else table

    entries = [("new-1", T0 + 100), ("held", T0 + 200), ("old", T0 + 300), ("ünïcode", T0 + 400),
               ("new-1", T0 + 500)]
    one_by_one, many = start(), start()
    for message_id, when in entries:
        one_by_one.remember(message_id, when, T0 + 10)
    many.remember_many(entries, T0 + 10)
    assert many.changes == one_by_one.changes and len(many) == len(one_by_one) == 4
    for message_id in ("new-1", "held", "old", "ünïcode", "absent"):
        assert many.find(message_id, T0 + 20) == one_by_one.find(message_id, T0 + 20)
    assert many.find("held", T0 + 20) == T0 + 200 and many.find("old", T0 + HOUR) == T0 + 300
    one_by_one.save_to(tmp_path / "one", 1)
    many.save_to(tmp_path / "many", 1)
    # The same file but for its random id (the head's last field).
    head = _HEAD.size
    assert (tmp_path / "one").read_bytes()[head:] == (tmp_path / "many").read_bytes()[head:]
    assert (tmp_path / "one").read_bytes()[: head - 8] == (tmp_path / "many").read_bytes()[: head - 8]


def saved_and_read(tmp_path, table: DedupeTable) -> DedupeTable:
    table.save_to(tmp_path / FILE_NAME, 1)
    again = DedupeTable(window_ms=table.window_ms)
    assert again.load(tmp_path / FILE_NAME) == 1
    return again


def test_ids_read_back_stay_in_the_files_columns_and_answer_as_before(tmp_path):
    """A restart reads the ids back as columns, with no string or dict entry per id (ten million
    took 10 s and more to read back as strings and a dict): lookups, moved handles, a new window
    after the old one, the next save and expiry behave as on the table that saved them."""
    table = DedupeTable(window_ms=HOUR)
    for i in range(1000):
        table.remember(f"order-{i:06d}", T0 + HOUR + i, T0 + i)
    again = saved_and_read(tmp_path, table)
    assert dict(again._positions) == {} and set(again._keys) == {None}
    assert len(again) == 1000
    assert all(again.find(f"order-{i:06d}", T0 + 1000) == T0 + HOUR + i for i in range(1000))
    assert again.find("order-001000", T0 + 1000) is None and again.find("order", T0) is None
    again.remember("order-000005", T0 + 2 * HOUR, T0 + 1001)  # a reschedule moves its handle
    assert again.find("order-000005", T0 + 1001) == T0 + 2 * HOUR and len(again) == 1000
    again.remember("order-000007", T0 + 3 * HOUR, T0 + HOUR + 7)  # after its window: a new one
    assert again.find("order-000007", T0 + HOUR + 8) == T0 + 3 * HOUR and len(again) == 1000
    assert dict(again._positions) == {"order-000007": 1000}

    third = saved_and_read(tmp_path, again)  # the columns' entries written back from the columns
    assert len(third) == 1000 and third.find("order-000005", T0 + 1001) == T0 + 2 * HOUR
    assert third.find("order-000007", T0 + HOUR + 8) == T0 + 3 * HOUR
    assert third.find("order-000999", T0 + 1000) == T0 + HOUR + 999

    # Expiry walks the columns' entries as the others, and lets the columns go once past them.
    assert again.expire(T0 + HOUR + 500) == 501
    assert len(again) == 500 and again.find("order-000400", T0 + HOUR + 500) is None
    assert again.find("order-000600", T0 + HOUR + 500) == T0 + HOUR + 600
    assert again.find("order-000007", T0 + HOUR + 500) == T0 + 3 * HOUR
    again.expire(T0 + 2 * HOUR + 8)
    assert len(again) == 0 and again._saved is None


def test_ids_that_are_not_ascii_read_back_too(tmp_path):
    table = DedupeTable(window_ms=HOUR)
    for i, message_id in enumerate(["commande-é-1", "注文-2", "plain-3", "a\x00reconsume"]):
        table.remember(message_id, T0 + i, T0)
    again = saved_and_read(tmp_path, table)
    assert len(again) == 4 and again.find("注文-2", T0) == T0 + 1 and again.find("plain-3", T0) == T0 + 2
    assert again.find("commande-é-1", T0) == T0 and again.find("a\x00reconsume", T0) == T0 + 3
    assert again.find("commande-e-1", T0) is None


async def test_ids_that_share_a_hash_are_told_apart(tmp_path, monkeypatch):
    """Every id on one hash: the file's order of the hashes, the journal's chunks merged into it,
    and a key saved twice (its handle moved) all resolve by comparing the ids themselves."""
    from delayserver import dedupe as module
    from delayserver.dedupe import Dedupe

    monkeypatch.setattr(module, "key_hash", lambda raw: 42)
    # (the compiled bookkeeping hashes in C, not through the module's key_hash: the Python one here)
    monkeypatch.setattr(module, "_native_remember_many", None)
    dedupe = Dedupe(HOUR, tmp_path)
    for i in range(50):
        dedupe.table.remember(f"m{i}", T0 + i, T0)
    await dedupe.save(T0, 100)
    dedupe.table.remember("m3", T0 + 999, T0 + 1)  # moved: written again in the journal
    dedupe.table.remember("m50", T0 + 50, T0 + 1)
    await dedupe.save(T0 + 1, 200)
    assert journal_entries(dedupe) == [2]
    again = Dedupe(HOUR, tmp_path)
    assert again.load() == 200 and dict(again.table._positions) == {}
    assert len(again.table) == 51 and again.table.find("m3", T0 + 2) == T0 + 999
    assert all(again.table.find(f"m{i}", T0 + 2) == T0 + i for i in range(51) if i != 3)
    assert again.table.find("m51", T0 + 2) is None


def format_3_file(path, entries: list[tuple[str, int, int]], offset: int) -> None:
    """A table file as the version before hashes wrote it: (id, store time, schedule time)."""
    import struct

    import crc32c

    body = b"".join(struct.pack(">q", store) for _, store, _ in entries) \
        + b"".join(struct.pack(">q", sched) for _, _, sched in entries) \
        + bytes(len(key) for key, _, _ in entries) + "".join(key for key, _, _ in entries).encode()
    path.write_bytes(struct.pack(">8sQQIQ", b"DSDEDUP3", offset, len(entries), crc32c.crc32c(body), 12345) + body)


async def test_journal_chunks_merge_into_the_files_order_of_hashes(tmp_path):
    """The chunks read back at start are sorted and merged into the file's order of the hashes,
    not the whole table sorted again: every key is found, at its latest handle, through chunks
    with new ids, handles moved in the file and in earlier chunks, and a chunk of no entries
    (a save that only moved the offset)."""
    import random

    from delayserver.dedupe import Dedupe

    rng = random.Random(7)
    dedupe = Dedupe(HOUR, tmp_path)
    expected = {}

    def remember(key, sched, store):
        dedupe.table.remember(key, sched, store)
        expected[key] = sched

    for i in range(5000):
        remember(f"order-{rng.getrandbits(40):x}-{i}", T0 + HOUR + i, T0)
    await dedupe.save(T0, 100)
    keys = list(expected)
    for round_ in range(1, 4):
        for i in range(300):
            remember(f"new-{round_}-{i}", T0 + 2 * HOUR + i, T0 + round_)
        for key in rng.sample(sorted(expected), 200):  # the file's keys and earlier chunks' too
            remember(key, T0 + 3 * HOUR + round_, T0 + round_)
        await dedupe.save(T0 + round_, 100 + round_)
    await dedupe.save(T0 + 4, 200)  # nothing changed: a chunk that only moves the offset
    assert journal_entries(dedupe)[-1] == 0 and len(journal_entries(dedupe)) == 4

    again = Dedupe(HOUR, tmp_path)
    assert again.load() == 200 and dict(again.table._positions) == {}
    saved = again.table._saved
    assert (saved.sorted[1:] >= saved.sorted[:-1]).all() and sorted(saved.order.tolist()) == list(range(len(saved)))
    assert len(again.table) == len(expected) == 5900
    assert all(again.table.find(key, T0 + 5) == sched for key, sched in expected.items())
    assert again.table.find("order-absent", T0 + 5) is None and keys[0] in expected


async def test_the_journal_of_a_table_file_of_the_format_before_is_read_too(tmp_path):
    """After an upgrade, the ids in the old journal's chunks are still known: the cleaner may
    already have dropped the message_log they came from."""
    import struct

    import crc32c

    from delayserver.dedupe import Dedupe

    format_3_file(tmp_path / FILE_NAME, [("a", T0, T0 + 5)], 300)
    body = struct.pack(">q", T0 + 1) + struct.pack(">q", T0 + 6) + bytes([1]) + b"b"
    head = struct.pack(">8sQQII", b"DSDEDJ01", 12345, 400, 1, len(body))
    chunk = head + struct.pack(">I", crc32c.crc32c(body, crc32c.crc32c(head))) + body
    (tmp_path / "dedupe.journal").write_bytes(chunk)
    dedupe = Dedupe(HOUR, tmp_path)
    assert dedupe.load() == 400
    assert dedupe.table.find("a", T0 + 3) == T0 + 5 and dedupe.table.find("b", T0 + 3) == T0 + 6


async def test_a_table_file_of_the_format_before_is_read_and_then_written_whole(tmp_path):
    from delayserver.dedupe import Dedupe

    format_3_file(tmp_path / FILE_NAME, [("a", T0, T0 + 5), ("b", T0 + 1, T0 + 6), ("a", T0 + 2, T0 + 7)], 300)
    dedupe = Dedupe(HOUR, tmp_path)
    assert dedupe.load() == 300
    assert dedupe.table.find("a", T0 + 3) == T0 + 7 and dedupe.table.find("b", T0 + 3) == T0 + 6
    assert len(dedupe.table) == 2
    dedupe.table.remember("c", T0 + 8, T0 + 3)
    await dedupe.save(T0 + 3, 400)
    assert (tmp_path / FILE_NAME).read_bytes()[:8] == b"DSDEDUP4" and not dedupe.journal_path.exists()
    again = Dedupe(HOUR, tmp_path)
    assert again.load() == 400 and dict(again.table._positions) == {}
    assert [again.table.find(k, T0 + 3) for k in "abc"] == [T0 + 7, T0 + 6, T0 + 8]


def test_expiry_looks_at_no_more_than_its_limit_and_then_goes_on_where_it_stopped():
    table = DedupeTable(window_ms=HOUR)
    for i in range(100_000):
        table.remember(f"m{i}", T0, T0 + i)
    now = T0 + HOUR + 60_000  # the first 60,001 are out of the window
    looked = [table.expire(now, 25_000) for _ in range(4)]
    assert looked == [25_000, 25_000, 10_001, 0]
    assert len(table) == 39_999 and table.find("m60000", now) is None and table.find("m60001", now) == T0
    # The expired front is given back once it is half of what is kept (here after the second
    # call), and the positions still point at the right entries.
    assert len(table._keys) == 50_000
    table.remember("late", T0 + 1, now)
    assert table.find("late", now) == T0 + 1 and table.find("m99999", now) == T0


async def test_a_save_goes_in_slices_with_the_event_loop_free_between_them(tmp_path):
    from delayserver.dedupe import Dedupe

    dedupe = Dedupe(HOUR, tmp_path)
    for i in range(10_000):
        dedupe.table.remember(f"m{i}", T0 + i, T0 + i)
    others_ran = 0
    saving = True

    async def other_task():
        nonlocal others_ran
        while saving:
            others_ran += 1
            await trio.lowlevel.checkpoint()

    class Steps(trio.abc.Instrument):
        """Counts the save's task steps."""

        def __init__(self):
            self.steps = 0

        def before_task_step(self, task):
            if task.name.endswith("save"):
                self.steps += 1

    steps = Steps()
    trio.lowlevel.add_instrument(steps)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other_task)

            async def save():
                nonlocal saving
                # Entries come in while the save encodes: each is in the file or fed again at start.
                await dedupe.save(T0 + 5000 + HOUR, 1234, slice_entries=1000)
                saving = False
            nursery.start_soon(save, name="save")
            for i in range(10_000, 10_100):
                dedupe.table.remember(f"m{i}", T0 + i, T0 + i)
                await trio.lowlevel.checkpoint()
    finally:
        trio.lowlevel.remove_instrument(steps)
    # 5,001 expired in 1,000-entry slices, 4,999 (and some of those remembered meanwhile) encoded in
    # 1,000-entry slices: at least 11 steps, with the other task running between them.
    assert steps.steps >= 11 and others_ran >= 10
    again = DedupeTable(HOUR)
    assert again.load(tmp_path / FILE_NAME) == 1234
    assert again.find("m5000", T0 + 5000 + HOUR) is None and again.find("m5001", T0 + 5001) == T0 + 5001
    assert again.find("m9999", T0 + 9999) == T0 + 9999


async def test_a_save_keeps_to_its_share_of_the_event_loop(tmp_path, autojump_clock):
    """After each slice a save lets the rest of the loop run three times as long as the slice took:
    with each slice taking 10 ms (a work clock that says so), 30 ms pass after each before the
    next, however many slices the save has."""
    dedupe = Dedupe(HOUR, tmp_path)
    for i in range(10_000):
        dedupe.table.remember(f"m{i}", T0 + i, T0 + i)
    worked = 0.0

    def work_clock():  # read at a slice's start and at its end: each read 10 ms on
        nonlocal worked
        worked += 0.010
        return worked

    dedupe.work_clock = work_clock
    gaps = []  # trio time between the save's steps, the other tasks' part of the loop
    last = None

    class Between(trio.abc.Instrument):
        def before_task_step(self, task):
            nonlocal last
            if task.name == "save":
                now = trio.current_time()
                if last is not None:
                    gaps.append(now - last)
                last = now

    between = Between()
    trio.lowlevel.add_instrument(between)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(dedupe.save, T0 + 5000 + HOUR, 1234, 1000, name="save")
    finally:
        trio.lowlevel.remove_instrument(between)
    # 5 slices of expiry, 5 of encoding (the thread's writing is one more step after them).
    paced = [gap for gap in gaps if gap > 0]
    assert len(paced) >= 10 and all(gap >= 0.030 - 1e-9 for gap in paced[:10])
    assert DedupeTable(HOUR).load(tmp_path / FILE_NAME) == 1234
    # A node that is stopping saves without pauses: no time passes between the slices.
    dedupe.table.remember("after", T0 + 6000, T0 + 6000)
    began = trio.current_time()
    await dedupe.save(T0 + 6000, 1240, 1000, loop_share=1.0)
    assert trio.current_time() == began and Dedupe.read(HOUR, tmp_path)[1] == 1240


def test_consumer_retries_and_redrives_are_new_attempts_of_their_id():
    assert dedupe_key("m", {}) == "m"
    assert dedupe_key("m", {"tenant": "x"}) == "m"
    assert dedupe_key("m", {"reconsume-times": "1"}) != dedupe_key("m", {"reconsume-times": "2"})
    assert dedupe_key("m", {"redriven-from": "1:m"}) != "m"


# --- through the server ---------------------------------------------------------------------


async def test_a_resent_id_answers_the_first_handle_and_is_stored_once(tmp_path):
    root = tmp_path / "node"

    async def body(server):
        async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
            first = await prod.send("orders.expire", b"order 42", delay=HOUR, message_id="order-42")
            again = await prod.send("orders.expire", b"order 42", delay=2 * HOUR, message_id="order-42")
            assert again == first
            assert (await prod.status(first)).state == MessageState.PENDING
            # The raw answer says DUPLICATE, a success the client returns as the handle.
            item = p.SendItem("order-42", "orders.expire", TimeSpec.delay(HOUR), b"order 42")
            raw = p.decode_send_response(await prod.request(p.Command.SEND, p.encode_send_request([item])))
            assert raw[0].code == ResultCode.DUPLICATE and raw[0].handle == first

    await run_node(root, body)
    assert [m.message_id for m in stored_messages(root)] == ["order-42"]


async def test_duplicates_within_one_batch_and_racing_requests_are_stored_once(tmp_path):
    root = tmp_path / "node"

    async def body(server):
        async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
            batch = [Message("q.batch", b"x", delay=HOUR, message_id="same") for _ in range(3)]
            handles = await prod.send_many(batch)
            assert len(set(handles)) == 1
            results = []

            async def one():
                results.append(await prod.send("q.race", b"y", delay=HOUR, message_id="racing"))

            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(one)
            assert len(set(results)) == 1

    await run_node(root, body)
    assert sorted(m.message_id for m in stored_messages(root)) == ["racing", "same"]


async def test_the_dedupe_state_survives_a_restart(tmp_path):
    root = tmp_path / "node"
    handles = {}

    async def before(server):
        async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
            handles["a"] = await prod.send("q.restart", b"a", delay=HOUR, message_id="a")

    async def saved_then_more(server):
        async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
            assert await prod.send("q.restart", b"a", delay=HOUR, message_id="a") == handles["a"]
            # Sent after the last save: found again from message_log at the next start.
            handles["b"] = await prod.send("q.restart", b"b", delay=HOUR, message_id="b")

    async def after(server):
        async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
            assert await prod.send("q.restart", b"a", delay=5, message_id="a") == handles["a"]
            assert await prod.send("q.restart", b"b", delay=5, message_id="b") == handles["b"]

    await run_node(root, before)  # drained: the table is saved
    assert (root / "checkpoint" / FILE_NAME).exists()
    server = DelayServer(config(root))
    async with trio.open_nursery() as nursery:  # stopped without a drain: no save
        await nursery.start(server.serve)
        await saved_then_more(server)
        nursery.cancel_scope.cancel()
    await run_node(root, after)
    assert sorted(m.message_id for m in stored_messages(root)) == ["a", "b"]


async def test_a_node_that_is_stopping_saves_its_table_without_pauses(tmp_path):
    """Saves pause after each slice to leave the loop to delivery, but not at a drain: with a work
    clock saying each slice took 10 s, a paced save would wait 30 s after the first."""
    root = tmp_path / "node"

    async def body(server):
        worked = iter(range(0, 10**6, 10))
        server.dedupe.work_clock = lambda: float(next(worked))
        async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
            await prod.send("q.stop", b"s", delay=HOUR, message_id="s")

    with trio.fail_after(20):
        await run_node(root, body)
    again, offset = Dedupe.read(HOUR * 24, root / "checkpoint")
    assert offset and again.table.find("s", int(time.time() * 1000)) is not None


async def test_the_table_is_rebuilt_from_message_log_when_its_file_is_lost(tmp_path):
    root = tmp_path / "node"
    handle = {}

    async def before(server):
        async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
            handle["x"] = await prod.send("q.lost", b"x", delay=HOUR, message_id="x")

    async def after(server):
        async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
            assert await prod.send("q.lost", b"x", delay=5, message_id="x") == handle["x"]

    await run_node(root, before)
    (root / "checkpoint" / FILE_NAME).unlink()
    await run_node(root, after)
    assert len(stored_messages(root)) == 1


async def test_after_the_window_an_id_is_a_new_message_and_a_zero_window_turns_dedupe_off(tmp_path):
    clock = SetClock(T0)

    async def body(server):
        async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
            first = await prod.send("q.window", b"x", delay=HOUR, message_id="w")
            clock.now += 10 * 60_000 - 1
            assert await prod.send("q.window", b"x", delay=HOUR, message_id="w") == first
            clock.now += 1  # ten minutes after the first acceptance
            later = await prod.send("q.window", b"x", delay=HOUR, message_id="w")
            assert later != first and later.schedule_time == clock.now + HOUR

    await run_node(tmp_path / "windowed", body, clock=clock, dedupe_window="10m")
    assert len(stored_messages(tmp_path / "windowed")) == 2

    async def off(server):
        async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
            await prod.send("q.off", b"x", delay=HOUR, message_id="w")
            await prod.send("q.off", b"x", delay=HOUR, message_id="w")

    await run_node(tmp_path / "off", off, dedupe_window=0)
    assert len(stored_messages(tmp_path / "off")) == 2
    assert not (tmp_path / "off" / "checkpoint" / FILE_NAME).exists()


async def test_a_consumer_retry_keeps_its_id_and_is_stored_each_time(tmp_path):
    root = tmp_path / "node"

    async def body(server):
        async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
            await prod.send("orders", b"x", delay=HOUR, message_id="m1")
            one = await prod.send_back("billing", "m1", b"x", reconsume_times=0)
            two = await prod.send_back("billing", "m1", b"x", reconsume_times=1)
            assert one != two
            assert await prod.send_back("billing", "m1", b"x", reconsume_times=1) == two

    await run_node(root, body)
    assert len(stored_messages(root)) == 3


async def test_what_recovery_built_is_kept_out_of_the_collectors_generations(tmp_path):
    """A full collection walks every tracked container: the dedupe table's list of ids, millions
    long, cost 50 ms and more of the event loop per collection until the node froze it."""
    import gc

    async def sends(server):
        async with AsyncProducer(f"127.0.0.1:{server.port}") as producer:
            await producer.send_many([Message("orders", b"x", delay=HOUR, message_id=f"m{i}") for i in range(10)])

    await run_node(tmp_path, sends)

    async def look(server):
        keys = server.dedupe.table._keys
        assert len(keys) == 10
        assert not any(o is keys for o in gc.get_objects())  # frozen: in no generation

    await run_node(tmp_path, look)


async def test_no_automatic_collection_runs_while_recovery_builds_the_node(tmp_path, monkeypatch):
    """Recovery builds millions of entries that live as long as the node; a full collection in the
    middle of a start walked them all (113 ms with ten million dedupe ids) before they were
    frozen. The collector is off from recovery until then, and on again once serving."""
    import gc

    async def sends(server):
        async with AsyncProducer(f"127.0.0.1:{server.port}") as producer:
            await producer.send_many([Message("orders", b"x", delay=HOUR, message_id=f"m{i}") for i in range(200)])

    await run_node(tmp_path, sends)
    phase, during_start = ["before"], []
    recover, freeze = DelayServer._open, gc.freeze

    def watched_open(server):
        phase[0] = "recovering"
        recover(server)

    def watched_freeze():
        phase[0] = "frozen"
        freeze()

    def watch(event, info):
        if event == "start" and phase[0] == "recovering":
            during_start.append(info["generation"])

    async def look(server):
        assert phase[0] == "frozen" and gc.isenabled()

    monkeypatch.setattr(DelayServer, "_open", watched_open)
    monkeypatch.setattr(gc, "freeze", watched_freeze)
    threshold = gc.get_threshold()
    gc.set_threshold(5, 1, 1)  # a collection every few allocations, were the collector on
    gc.callbacks.append(watch)
    try:
        await run_node(tmp_path, look)
    finally:
        gc.callbacks.remove(watch)
        gc.set_threshold(*threshold)
    assert during_start == [] and gc.isenabled()


async def a_saved_table(root, count: int, offset: int):
    """A node's Dedupe holding ids m0 .. m{count - 1} (accepted at T0 + i), saved covering `offset`."""
    from delayserver.dedupe import Dedupe

    dedupe = Dedupe(HOUR, root)
    for i in range(count):
        dedupe.table.remember(f"m{i}", T0 + i, T0 + i)
    await dedupe.save(T0 + count, offset)
    return dedupe


async def test_a_save_of_an_unchanged_table_rewrites_only_the_offset_it_covers(tmp_path):
    from delayserver.dedupe import Dedupe

    dedupe = await a_saved_table(tmp_path, 1000, 100)
    path = tmp_path / FILE_NAME
    whole = path.read_bytes()
    inode = path.stat().st_ino
    await dedupe.save(T0 + 1000, 250)  # replay went on, the table did not change
    assert path.stat().st_ino == inode, "rewritten in place, not replaced"
    assert path.read_bytes()[16:] == whole[16:] and dedupe.saved_offset == 250
    again = DedupeTable(HOUR)
    assert again.load(path) == 250 and len(again) == 1000
    dedupe.table.remember("new", T0 + 5, T0 + 1001)
    await dedupe.save(T0 + 1001, 300)  # changed: the new id goes to the journal
    assert path.stat().st_ino == inode and path.read_bytes()[16:] == whole[16:]
    fresh = Dedupe(HOUR, tmp_path)
    assert fresh.load() == 300 and fresh.table.find("new", T0 + 1001) == T0 + 5


async def test_a_table_read_back_and_saved_unchanged_at_the_same_offset_writes_nothing(tmp_path):
    """A node stopped right after it started (no send, no replay) leaves its files as they were:
    no empty journal chunk, no rewrite."""
    from delayserver.dedupe import Dedupe

    first = await a_saved_table(tmp_path, 1000, 100)
    first.table.remember("new", T0 + 5, T0 + 1001)
    await first.save(T0 + 1001, 200)  # a journal with one chunk
    files = {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in (first.path, first.journal_path)}
    again = Dedupe(HOUR, tmp_path)
    assert again.load() == 200
    await again.save(T0 + 1001, 200)
    assert {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in files} == files
    await again.save(T0 + 1002, 250)  # replay went on: the offset it covers is saved
    assert Dedupe(HOUR, tmp_path).load() == 250


def journal_entries(dedupe) -> list[int]:
    """The entry count of each chunk of the node's journal."""
    from delayserver.dedupe import read_journal

    chunks, _ = read_journal(dedupe.journal_path.read_bytes(), dedupe._base_id)
    return [len(keys) for keys, *_ in chunks]


async def test_a_save_writes_only_what_changed_since_the_last_one(tmp_path):
    from delayserver.dedupe import Dedupe

    dedupe = await a_saved_table(tmp_path, 10_000, 100)
    path = tmp_path / FILE_NAME
    whole, inode = path.read_bytes(), path.stat().st_ino
    for i in range(10_000, 10_010):
        dedupe.table.remember(f"m{i}", T0 + i, T0 + i)
    dedupe.table.remember("m5", T0 + 99_999, T0 + 10_011)  # a reschedule moves its handle
    await dedupe.save(T0 + 10_011, 200)
    assert (path.read_bytes(), path.stat().st_ino) == (whole, inode), "the table file was rewritten"
    assert journal_entries(dedupe) == [11]
    assert dedupe.journal_path.stat().st_size < 1000  # the 11 entries, not the 10,010
    dedupe.table.remember("m10010", T0 + 10_010, T0 + 10_012)
    await dedupe.save(T0 + 10_012, 300)
    assert journal_entries(dedupe) == [11, 1]

    again = Dedupe(HOUR, tmp_path)
    assert again.load() == 300
    now = T0 + 10_012
    assert again.table.find("m5", now) == T0 + 99_999 and again.table.find("m4", now) == T0 + 4
    assert all(again.table.find(f"m{i}", now) == T0 + i for i in range(6, 10_011))
    assert len(again.table) == 10_011


async def test_a_torn_journal_chunk_is_ignored_and_cut_by_the_next_save(tmp_path, caplog):
    from delayserver.dedupe import Dedupe

    dedupe = Dedupe(HOUR, tmp_path)
    dedupe.table.remember("a", T0, T0)
    await dedupe.save(T0, 100)
    dedupe.table.remember("b", T0 + 1, T0 + 1)
    await dedupe.save(T0 + 1, 200)
    good = dedupe.journal_path.stat().st_size
    with open(dedupe.journal_path, "ab") as f:
        f.write(b"DSDEDJ01" + b"\x00" * 20)  # a chunk the crash cut short

    again = Dedupe(HOUR, tmp_path)
    assert again.load() == 200
    assert again.table.find("b", T0 + 2) == T0 + 1 and "cut short" in caplog.text
    again.table.remember("c", T0 + 2, T0 + 2)
    await again.save(T0 + 2, 300)
    third = Dedupe(HOUR, tmp_path)
    assert third.load() == 300 and third.table.find("c", T0 + 3) == T0 + 2
    assert journal_entries(third) == [1, 1] and third.journal_bytes > good


async def test_a_failed_chunk_is_written_with_the_next_save(tmp_path, monkeypatch):
    from delayserver.dedupe import Dedupe

    dedupe = Dedupe(HOUR, tmp_path)
    dedupe.table.remember("a", T0, T0)
    await dedupe.save(T0, 100)
    dedupe.table.remember("a", T0 + 50, T0 + 1)  # its handle moves
    dedupe.table.remember("b", T0 + 1, T0 + 1)
    real = DedupeTable.append_chunk

    def full_disk(*args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(DedupeTable, "append_chunk", staticmethod(full_disk))
    await dedupe.save(T0 + 1, 200)
    assert dedupe.saved_offset == 100
    monkeypatch.setattr(DedupeTable, "append_chunk", staticmethod(real))
    inode = (tmp_path / FILE_NAME).stat().st_ino
    await dedupe.save(T0 + 2, 300)
    # A journal whose write or fsync failed is not appended to again: the table is written whole.
    assert (tmp_path / FILE_NAME).stat().st_ino != inode and not dedupe.journal_path.exists()
    again = Dedupe(HOUR, tmp_path)
    assert again.load() == 300
    assert again.table.find("a", T0 + 2) == T0 + 50 and again.table.find("b", T0 + 2) == T0 + 1


async def test_the_journal_is_folded_into_the_table_file_once_half_its_size(tmp_path, monkeypatch):
    from delayserver import dedupe as module
    from delayserver.dedupe import Dedupe

    monkeypatch.setattr(module, "JOURNAL_MIN_COMPACT_BYTES", 0)
    dedupe = Dedupe(HOUR, tmp_path)
    for i in range(100):
        dedupe.table.remember(f"m{i}", T0 + i, T0 + i)
    await dedupe.save(T0 + 100, 100)
    inode = (tmp_path / FILE_NAME).stat().st_ino
    saves = 0
    while (tmp_path / FILE_NAME).stat().st_ino == inode:
        for i in range(100 + 10 * saves, 110 + 10 * saves):
            dedupe.table.remember(f"m{i}", T0 + i, T0 + i)
        saves += 1
        await dedupe.save(T0 + 200, 100 + saves)
        assert saves < 20, "the journal was never folded in"
    assert not dedupe.journal_path.exists() and saves > 2  # emptied: the next chunk starts a new file
    again = Dedupe(HOUR, tmp_path)
    assert again.load() == 100 + saves and len(again.table) == 100 + 10 * saves


async def test_chunks_of_a_replaced_table_file_are_not_applied(tmp_path):
    from delayserver.dedupe import Dedupe

    first = Dedupe(HOUR, tmp_path)
    first.table.remember("a", T0, T0)
    await first.save(T0, 100)
    first.table.remember("ghost", T0 + 1, T0 + 1)
    await first.save(T0 + 1, 200)
    old_journal = first.journal_path.read_bytes()
    # A node whose table file was written whole again (its table rebuilt without "ghost"), and a
    # crash before the old journal was emptied.
    second = Dedupe(HOUR, tmp_path)
    second.table.remember("a", T0, T0)
    await second.save(T0 + 2, 150)
    second.journal_path.write_bytes(old_journal)
    third = Dedupe(HOUR, tmp_path)
    assert third.load() == 150
    assert third.table.find("ghost", T0 + 2) is None and third.table.find("a", T0 + 2) == T0


def test_a_restarted_server_process_still_answers_a_retried_send_with_the_first_handle(tmp_path):
    """The real process reads its saved table beside its imports (delayserver/cli.py): after a
    drained stop (table saved) and after a kill -9 (the rest found again in message_log)."""
    server = ServerProcess(tmp_path / "data")
    try:
        server.start()
        with Producer(server.address) as producer:
            first = producer.send("q.process", b"a", delay=HOUR, message_id="a")
        assert server.terminate() == 0
        assert (tmp_path / "data" / "checkpoint" / FILE_NAME).exists()
        server.start()
        with Producer(server.address) as producer:
            assert producer.send("q.process", b"a", delay=5, message_id="a") == first
            second = producer.send("q.process", b"b", delay=HOUR, message_id="b")
        server.kill()
        server.start()
        with Producer(server.address) as producer:
            assert producer.send("q.process", b"a", delay=5, message_id="a") == first
            assert producer.send("q.process", b"b", delay=5, message_id="b") == second
        assert server.terminate() == 0
    finally:
        server.kill()
    assert sorted(m.message_id for m in stored_messages(tmp_path / "data")) == ["a", "b"]


@pytest.mark.parametrize("step", [1, 3, 4, 1 << 18])
def test_the_ids_start_offsets_are_summed_in_slices_without_losing_the_carry(step):
    lengths = np.array([5, 0, 128, 7, 1, 1, 30, 2, 9, 0], dtype=np.uint8)
    expected = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
    assert _starts(lengths, np.int32, step).tolist() == expected.tolist()
    assert _starts(lengths[:0], np.int32, step).tolist() == [0]


def _keeps_hashes(positions) -> bool:
    """The map of id -> position probes by each key's hash without reading the string in each
    slot it passes: the compiled `IdMap` (each slot holds its key's hash) when built, else a dict
    in CPython's general layout (larger than a dict of the same string keys built one by one,
    which keeps no hash)."""
    if dedupe.IdMap is not None:
        return type(positions) is dedupe.IdMap
    return sys.getsizeof(positions) > sys.getsizeof({k: v for k, v in positions.items()})


def test_the_fallback_dict_of_ids_keeps_each_ids_hash():
    positions = dedupe._positions_dict((f"order-{i:06d}", i) for i in range(1000))
    assert len(positions) == 1000 and positions["order-000999"] == 999
    assert sys.getsizeof(positions) > sys.getsizeof({k: v for k, v in positions.items()})


def test_the_ids_dict_keeps_each_ids_hash_remembered_or_read_back(tmp_path):
    table = DedupeTable(window_ms=HOUR)
    table.remember_many([(f"order-{i:06d}", T0 + HOUR + i) for i in range(1000)], T0)
    assert len(table._positions) == 1000 and _keeps_hashes(table._positions)
    # Ids that are not all ASCII are read back as strings, into a dict of their own.
    table.remember("ordre-é", T0 + HOUR, T0)
    again = saved_and_read(tmp_path, table)
    assert len(again._positions) == 1001 and _keeps_hashes(again._positions)
    assert again.find("ordre-é", T0 + 1) == T0 + HOUR and again.find("order-000999", T0 + 1) == T0 + HOUR + 999
