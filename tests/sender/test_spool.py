import errno
import os
import threading

import pytest
import trio
import trio.testing

from delayserver.sender.spool import SpoolCorrupt, SpoolTransport, iter_spool, list_spool_subjects, spool_path
from delayserver.sender.transport import OutboundMessage, Outcome, make_transport


#: Whether `outbound` gives its messages headers: every test runs both ways, since a batch with
#: none is encoded whole by the compiled kernel (the spool's fast path) and one with headers not.
WITH_HEADERS = [True]


@pytest.fixture(autouse=True, params=[True, False], ids=["headers", "no-headers"])
def with_headers(request):
    WITH_HEADERS[0] = request.param
    yield request.param
    WITH_HEADERS[0] = True


def outbound(i: int, subject: str = "orders", **changes) -> OutboundMessage:
    fields = dict(
        message_id=f"m{i}", subject=subject, body=b"body-%d" % i, headers={"trace": f"t{i}"} if WITH_HEADERS[0] else {},
        schedule_time=1_700_000_000_000 + i, dispatch_time=1_700_000_000_500 + i, attempt=1,
    )
    fields.update(changes)
    return OutboundMessage(**fields)


def read_back(data_dir, subject, start_offset=0):
    return [(when, attempt, m.message_id, m.subject, m.body, dict(m.headers), m.schedule_time)
            for _offset, when, attempt, m in iter_spool(data_dir, subject, start_offset)]


def expected(messages):
    return [(m.dispatch_time, m.attempt, m.message_id, m.subject, m.body, dict(m.headers), m.schedule_time)
            for m in messages]


async def send(data_dir, messages):
    async with SpoolTransport(data_dir) as spool:
        return await spool.send_batch(messages)


async def test_batch_round_trips_through_iter_spool_per_subject(tmp_path):
    batch = [outbound(1, "orders"), outbound(2, "pay.events", attempt=3), outbound(3, "orders")]

    results = await send(tmp_path, batch)

    assert [r.outcome for r in results] == [Outcome.ACKED] * 3
    assert list_spool_subjects(tmp_path) == ["orders", "pay.events"]
    assert read_back(tmp_path, "orders") == expected([batch[0], batch[2]])
    assert read_back(tmp_path, "pay.events") == expected([batch[1]])


async def test_data_is_durable_across_transports(tmp_path):
    first, second = [outbound(1), outbound(2)], [outbound(3), outbound(4)]
    await send(tmp_path, first)
    await send(tmp_path, second)
    assert read_back(tmp_path, "orders") == expected(first + second)


async def test_each_subject_gets_one_write_and_one_fsync_per_batch(tmp_path, monkeypatch):
    subjects = ["a", "b", "c"]
    await send(tmp_path, [outbound(0, s) for s in subjects])  # creates the files
    calls = {"pwrite": 0, "fsync": 0}
    real_pwrite, real_fsync = os.pwrite, os.fsync

    def counting_pwrite(*args):
        calls["pwrite"] += 1
        return real_pwrite(*args)

    def counting_fsync(fd):
        calls["fsync"] += 1
        return real_fsync(fd)

    monkeypatch.setattr(os, "pwrite", counting_pwrite)
    monkeypatch.setattr(os, "fsync", counting_fsync)
    async with SpoolTransport(tmp_path) as spool:
        await spool.send_batch([outbound(0, s) for s in subjects])  # opens (and scans) the files
        calls.update(pwrite=0, fsync=0)
        results = await spool.send_batch([outbound(i, s) for i in range(1, 6) for s in subjects])

    assert all(r.outcome is Outcome.ACKED for r in results)
    assert calls == {"pwrite": 3, "fsync": 3}


class HeldFsync:
    """os.fsync on a slow disk: every call waits until `released` is set (from a worker thread)."""

    def __init__(self):
        self.real = os.fsync
        self.entered = threading.Event()
        self.released = threading.Event()
        self.calls = 0

    def __call__(self, fd):
        self.calls += 1
        self.entered.set()
        self.released.wait(60)
        return self.real(fd)


async def send_while_an_fsync_waits(spool, held, batches):
    """Send `batches` concurrently, in order: the first one's fsync waits (`held`) until every
    other has been sent and waits too. Their results, in order."""
    results = [None] * len(batches)

    async def one(i):
        results[i] = await spool.send_batch(batches[i])

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 0)
            await trio.to_thread.run_sync(held.entered.wait, 30)
            for i in range(1, len(batches)):
                nursery.start_soon(one, i)
                await trio.testing.wait_all_tasks_blocked(cushion=0.01)
            held.released.set()
    finally:
        held.released.set()
    return results


async def test_batches_arriving_while_an_fsync_runs_go_in_one_write_and_one_fsync(tmp_path, monkeypatch):
    batches = [[outbound(1)]] + [[outbound(i), outbound(i + 100)] for i in range(2, 7)]
    async with SpoolTransport(tmp_path) as spool:
        await spool.send_batch([outbound(0)])  # creates and scans the file
        held = HeldFsync()
        monkeypatch.setattr(os, "fsync", held)
        results = await send_while_an_fsync_waits(spool, held, batches)
    assert all(r.outcome is Outcome.ACKED for batch in results for r in batch)
    assert held.calls == 2  # the first batch's, and one for the five that waited for it
    assert (spool.appends, spool.writes) == (7, 3)
    assert read_back(tmp_path, "orders") == expected([outbound(0)] + [m for b in batches for m in b])


async def test_a_stalled_spool_disk_holds_only_the_transports_own_threads(tmp_path, monkeypatch):
    """Each subject being written holds a worker thread; with more subjects in flight than
    TRANSPORT_THREADS while the disk stalls, the spool holds its own threads only, none of trio's
    default limiter (the rest of the process shares those), and every batch lands once it moves."""
    from delayserver.sender.transport import TRANSPORT_THREADS

    default = trio.to_thread.current_default_thread_limiter()
    subjects = [f"s{i}" for i in range(TRANSPORT_THREADS + 12)]
    async with SpoolTransport(tmp_path) as spool:
        held = HeldFsync()
        monkeypatch.setattr(os, "fsync", held)
        results = []

        async def send(subject):
            results.append(await spool.send_batch([outbound(0, subject)]))

        async with trio.open_nursery() as nursery:
            try:
                for subject in subjects:
                    nursery.start_soon(send, subject)
                await trio.to_thread.run_sync(held.entered.wait, 30, limiter=trio.CapacityLimiter(1))
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                assert default.borrowed_tokens == 0
                assert spool._threads.busy == spool._threads.threads == TRANSPORT_THREADS
                assert spool._threads.queued == 12
            finally:  # the writes move on, also when an assertion failed
                held.released.set()
    assert [r[0].outcome for r in results] == [Outcome.ACKED] * len(subjects)
    for subject in subjects:
        assert read_back(tmp_path, subject) == expected([outbound(0, subject)])


async def test_a_failed_fsync_gives_retry_to_every_batch_it_covered_and_truncates_back(tmp_path, monkeypatch):
    path = spool_path(tmp_path, "orders")
    held = HeldFsync()

    def failing_fsync(fd):
        held(fd)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    async with SpoolTransport(tmp_path) as spool:
        await spool.send_batch([outbound(0)])
        before = path.read_bytes()
        monkeypatch.setattr(os, "fsync", failing_fsync)
        results = await send_while_an_fsync_waits(spool, held, [[outbound(1)], [outbound(2)], [outbound(3), outbound(4)]])
    assert [r.outcome for batch in results for r in batch] == [Outcome.RETRY] * 4
    assert all("Input/output error" in r.detail for batch in results for r in batch)
    assert path.read_bytes() == before


async def test_new_file_is_created_with_its_directories(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    await send(data_dir, [outbound(1)])
    assert spool_path(data_dir, "orders").is_file()


async def test_missing_data_directory_gives_retry(tmp_path):
    [result] = await send(tmp_path / "missing", [outbound(1)])
    assert result.outcome is Outcome.RETRY
    assert "No such file" in result.detail


async def test_next_offset_lets_a_reader_follow_the_file(tmp_path):
    await send(tmp_path, [outbound(1), outbound(2)])
    cursor = iter_spool(tmp_path, "orders")
    assert [m.message_id for _, _, _, m in cursor] == ["m1", "m2"]
    assert cursor.next_offset == spool_path(tmp_path, "orders").stat().st_size

    await send(tmp_path, [outbound(3)])
    assert [m.message_id for _, _, _, m in iter_spool(tmp_path, "orders", cursor.next_offset)] == ["m3"]


async def test_offsets_are_record_boundaries(tmp_path):
    await send(tmp_path, [outbound(1), outbound(2), outbound(3)])
    offsets = [offset for offset, *_ in iter_spool(tmp_path, "orders")]
    assert offsets[0] == 0
    assert [m.message_id for _, _, _, m in iter_spool(tmp_path, "orders", offsets[1])] == ["m2", "m3"]


def test_subject_without_a_spool_reads_empty(tmp_path):
    assert list(iter_spool(tmp_path, "never")) == []
    assert list_spool_subjects(tmp_path) == []


async def test_truncated_trailing_record_is_ignored_by_the_reader(tmp_path):
    await send(tmp_path, [outbound(1), outbound(2)])
    path = spool_path(tmp_path, "orders")
    whole = path.stat().st_size
    (_, _, _, _), (second, _, _, _) = iter_spool(tmp_path, "orders")
    record = path.read_bytes()[second:]
    with open(path, "ab") as f:
        f.write(record[: len(record) // 2])  # an append cut short, or still under way

    cursor = iter_spool(tmp_path, "orders")
    assert [m.message_id for _, _, _, m in cursor] == ["m1", "m2"]
    assert cursor.next_offset == whole


async def test_zero_filled_tail_is_ignored_by_the_reader(tmp_path):
    await send(tmp_path, [outbound(1)])
    with open(spool_path(tmp_path, "orders"), "ab") as f:
        f.write(bytes(100))
    assert [m.message_id for _, _, _, m in iter_spool(tmp_path, "orders")] == ["m1"]


async def test_writer_truncates_a_torn_tail_before_appending(tmp_path):
    await send(tmp_path, [outbound(1)])
    path = spool_path(tmp_path, "orders")
    whole = path.read_bytes()
    with open(path, "ab") as f:
        f.write(whole[:20])

    [result] = await send(tmp_path, [outbound(2)])

    assert result.outcome is Outcome.ACKED
    assert [m.message_id for _, _, _, m in iter_spool(tmp_path, "orders")] == ["m1", "m2"]
    assert path.stat().st_size == 2 * len(whole)


async def test_corrupt_record_in_the_middle_raises_naming_file_and_offset(tmp_path):
    await send(tmp_path, [outbound(1), outbound(2), outbound(3)])
    path = spool_path(tmp_path, "orders")
    offsets = [offset for offset, *_ in iter_spool(tmp_path, "orders")]
    data = bytearray(path.read_bytes())
    data[offsets[1] + 20] ^= 0xFF
    path.write_bytes(bytes(data))

    cursor = iter_spool(tmp_path, "orders")
    assert next(cursor)[3].message_id == "m1"
    with pytest.raises(SpoolCorrupt) as caught:
        next(cursor)
    assert caught.value.path == path and caught.value.offset == offsets[1]
    assert str(path) in str(caught.value) and f"offset {offsets[1]}" in str(caught.value)


async def test_writer_refuses_to_append_after_corruption(tmp_path):
    await send(tmp_path, [outbound(1), outbound(2)])
    path = spool_path(tmp_path, "orders")
    data = bytearray(path.read_bytes())
    data[20] ^= 0xFF
    path.write_bytes(bytes(data))

    [result] = await send(tmp_path, [outbound(3)])

    assert result.outcome is Outcome.RETRY
    assert "offset 0" in result.detail
    assert path.read_bytes() == bytes(data)


async def test_disk_full_mid_write_gives_retry_and_leaves_the_file_intact(tmp_path, monkeypatch):
    await send(tmp_path, [outbound(1)])
    path = spool_path(tmp_path, "orders")
    before = path.read_bytes()
    real_pwrite = os.pwrite

    writes = []

    def half_then_enospc(fd, data, offset):
        writes.append(len(data))
        if len(writes) == 1:
            return real_pwrite(fd, bytes(data[: len(data) // 2]), offset)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    async with SpoolTransport(tmp_path) as spool:
        monkeypatch.setattr(os, "pwrite", half_then_enospc)
        results = await spool.send_batch([outbound(2), outbound(3)])
        monkeypatch.setattr(os, "pwrite", real_pwrite)
        assert [r.outcome for r in results] == [Outcome.RETRY] * 2
        assert len(writes) == 2
        assert "No space left" in results[0].detail
        assert path.read_bytes() == before

        [result] = await spool.send_batch([outbound(4)])
    assert result.outcome is Outcome.ACKED
    assert [m.message_id for _, _, _, m in iter_spool(tmp_path, "orders")] == ["m1", "m4"]


async def test_failed_fsync_gives_retry_and_truncates_back(tmp_path, monkeypatch):
    path = spool_path(tmp_path, "orders")

    def eio(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    async with SpoolTransport(tmp_path) as spool:
        await spool.send_batch([outbound(2)])
        before = path.read_bytes()
        monkeypatch.setattr(os, "fsync", eio)
        [result] = await spool.send_batch([outbound(3)])
    assert result.outcome is Outcome.RETRY
    assert "Input/output error" in result.detail
    assert path.read_bytes() == before


@pytest.mark.parametrize("subject", [".", "..", "a/b", "../etc", "", "x" * 252])
async def test_subject_that_is_no_safe_file_name_is_rejected(tmp_path, subject):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    results = await send(data_dir, [outbound(1, subject), outbound(2, "orders")])

    assert [r.outcome for r in results] == [Outcome.REJECTED, Outcome.ACKED]
    assert sorted(p.name for p in (data_dir / "spool").iterdir()) == ["orders.log"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    with pytest.raises(ValueError):
        iter_spool(data_dir, subject)


async def test_longest_subject_that_fits_a_file_name_is_spooled(tmp_path):
    subject = "x" * 251
    [result] = await send(tmp_path, [outbound(1, subject)])
    assert result.outcome is Outcome.ACKED
    assert list_spool_subjects(tmp_path) == [subject]


async def test_invalid_message_is_rejected_alone(tmp_path):
    results = await send(tmp_path, [outbound(1), outbound(2, schedule_time=-5), outbound(3, message_id="")])
    assert [r.outcome for r in results] == [Outcome.ACKED, Outcome.REJECTED, Outcome.REJECTED]
    assert "schedule time" in results[1].detail
    assert [m.message_id for _, _, _, m in iter_spool(tmp_path, "orders")] == ["m1"]


async def test_two_transports_on_one_data_directory_never_interleave(tmp_path):
    async with SpoolTransport(tmp_path) as first, SpoolTransport(tmp_path) as second:
        async with trio.open_nursery() as nursery:
            for spool, base in ((first, 0), (second, 1000)):
                for k in range(10):
                    batch = [outbound(base + 10 * k + i, body=b"x" * 5000) for i in range(10)]
                    nursery.start_soon(spool.send_batch, batch)
    ids = sorted(m.message_id for _, _, _, m in iter_spool(tmp_path, "orders"))
    assert ids == sorted([f"m{i}" for i in range(100)] + [f"m{1000 + i}" for i in range(100)])


async def test_empty_batch_gives_no_results(tmp_path):
    assert await send(tmp_path, []) == []


def test_make_transport_builds_the_spool(tmp_path):
    spool = make_transport("spool", "", {}, tmp_path)
    assert isinstance(spool, SpoolTransport)
    assert str(tmp_path / "spool") in spool.name


@pytest.mark.parametrize(
    "address, options, field",
    [("somewhere", {}, "address"), ("", {"fsync": False}, "'fsync'")],
)
def test_bad_spool_config_names_the_field(tmp_path, address, options, field):
    with pytest.raises(ValueError, match=field):
        make_transport("spool", address, options, tmp_path)


async def test_bad_crc_in_the_last_record_is_a_torn_tail(tmp_path):
    await send(tmp_path, [outbound(1), outbound(2)])
    path = spool_path(tmp_path, "orders")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert [m.message_id for _, _, _, m in iter_spool(tmp_path, "orders")] == ["m1"]


async def test_an_unexpected_error_in_a_group_commit_gives_retry_to_the_batches_waiting_for_it(tmp_path, monkeypatch):
    held = HeldFsync()

    def crashing_fsync(fd):
        held(fd)
        raise MemoryError("out of memory in the middle of an fsync")

    async with SpoolTransport(tmp_path) as spool:
        await spool.send_batch([outbound(0)])
        monkeypatch.setattr(os, "fsync", crashing_fsync)
        results = [None, None]

        errors = []

        async def first():
            try:
                await spool.send_batch([outbound(1)])
            except BaseException as e:  # noqa: B036 (what the writer's own caller sees)
                errors.append(e)

        async def second():
            results[1] = await spool.send_batch([outbound(2)])

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(first)
                await trio.to_thread.run_sync(held.entered.wait, 30)
                nursery.start_soon(second)
                await trio.testing.wait_all_tasks_blocked(cushion=0.01)
                held.released.set()
        finally:
            held.released.set()
    assert errors and "out of memory" in repr(errors[0])
    assert [r.outcome for r in results[1]] == [Outcome.RETRY]
    assert "append failed" in results[1][0].detail
