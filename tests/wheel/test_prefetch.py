"""Read-ahead of what falls due: the records read into memory or the ranges asked for, and when,
under trio's MockClock; and delivery's reading of what was read ahead."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from unittest import mock

import trio

from delayserver.clock import TrioClock
from delayserver.wheel import prefetch
from delayserver.wheel.prefetch import GAP_BYTES, fetch, prefetch_due, ranges
from delayserver.wheel.tick_manager import READ_GUESS_BYTES
from tests.pipeline_node import START_MS, Node

HOUR_MS = 3600_000


def test_nearby_records_are_read_ahead_as_one_range():
    assert ranges([]) == []
    assert ranges([100]) == [(100, READ_GUESS_BYTES)]
    near = [0, 500, 500 + READ_GUESS_BYTES + GAP_BYTES]  # the last starts just within the gap
    assert ranges(near) == [(0, 500 + 2 * READ_GUESS_BYTES + GAP_BYTES)]
    far = [10 * GAP_BYTES, 0]
    assert ranges(far) == [(0, READ_GUESS_BYTES), (10 * GAP_BYTES, READ_GUESS_BYTES)]


def loaded_node(tmp_path, count=200):
    """A node whose wheel holds `count` messages due 37 ms apart from START_MS + 50 (over 7.4 s
    for 200), their message ids -> (due time, schedule_log offset), and their bucket."""
    node = Node(tmp_path, START_MS, scale_ms=HOUR_MS, tick_ms=10, slots=4096)
    due = {f"m{i}": START_MS + 50 + 37 * i for i in range(count)}
    node.send(list(due.items()))
    node.replay_all()
    node.load_all()
    offsets = {}  # message id -> schedule_log offset
    for ref in node.ticks.wheel.refs_due_between(START_MS, START_MS + HOUR_MS):
        bucket, offset, _, message = node.ticks.read_message(ref)
        offsets[message.message_id] = offset
    return node, {mid: (at, offsets[mid]) for mid, at in due.items()}, bucket


async def on_the_loop(fn, *args):  # the mock clock would jump while a thread works
    return fn(*args)


def test_due_offsets_are_grouped_per_bucket_in_the_order_of_the_refs(tmp_path):
    node, _, _ = loaded_node(tmp_path, 3)
    ticks = node.ticks
    pairs = [(7_200_000, 40), (3_600_000, 10), (7_200_000, 5), (3_600_000, 900), (7_200_000, 41)]
    refs = [ticks.ref(bucket, offset) for bucket, offset in pairs]
    assert ticks.offsets_by_bucket(refs) == {7_200_000: [40, 5, 41], 3_600_000: [10, 900]}
    assert ticks.offsets_by_bucket(refs[1::2]) == {3_600_000: [10, 900]}
    assert ticks.offsets_by_bucket([]) == {}
    node.crash()


async def test_every_record_is_in_memory_before_it_falls_due(tmp_path, autojump_clock):
    clock = TrioClock(START_MS - int(trio.current_time() * 1000))
    node, due, bucket = loaded_node(tmp_path)
    held_at = []  # (time, offsets held then)

    def never(_wanted):
        raise AssertionError("advised while the budget had room")

    async with trio.open_nursery() as nursery:
        await nursery.start(lambda **kw: prefetch_due(node.ticks, clock, horizon_ms=500, step_ms=100,
                                                      advise=never, run_blocking=on_the_loop, **kw))
        for _ in range(800):
            held_at.append((clock.now_ms(), set(node.ticks.ahead.records.get(bucket, ()))))
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    for mid, (at, offset) in due.items():
        # In memory within the horizon before it falls due.
        assert any(max(START_MS, at - 500) <= t < at and offset in held for t, held in held_at), mid
    # Each is held once, as the file holds it: nothing else is.
    data = node.store.schedule_log.path(bucket).read_bytes()
    held = node.ticks.ahead.records[bucket]
    assert set(held) == {offset for _, offset in due.values()}
    assert all(data[offset:offset + len(raw)] == raw for offset, raw in held.items())
    assert node.ticks.ahead.held_bytes == sum(map(len, held.values()))
    node.crash()


async def test_what_a_round_read_is_kept_a_chunk_per_task_step(tmp_path, autojump_clock):
    # Keeping a round's records (a dict merge per chunk) in one step held the event loop for 1.4 to
    # 4.7 ms every 100 ms at 50,000 msg/s falling due: deliveries now go between the chunks.
    clock = TrioClock(START_MS - int(trio.current_time() * 1000))
    node, due, bucket = loaded_node(tmp_path)
    seen = []  # how many records were held at each step of another task

    async def in_chunks_of_5(fn, *args):
        return functools.partial(fn, chunk=5)(*args)

    async def watch():
        for _ in range(200):
            seen.append(len(node.ticks.ahead.records.get(bucket, ())))
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        await trio.lowlevel.checkpoint()
        await nursery.start(lambda **kw: prefetch_due(node.ticks, clock, horizon_ms=1000, step_ms=100,
                                                      run_blocking=in_chunks_of_5, **kw))
        await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    in_horizon = sum(1 for at, _ in due.values() if at < START_MS + 1000)
    assert in_horizon == 26 and seen[0] == 0 and seen[-1] == in_horizon
    between = set(seen) - {0, in_horizon}  # seen part way through the round: a chunk at a time
    assert between and all(n % 5 == 0 for n in between)
    # Between two steps of the watch the reader took at most two steps of its own (trio runs the
    # tasks of one batch in either order): never more than two chunks at once.
    assert max(b - a for a, b in zip(seen, seen[1:])) <= 2 * 5
    node.crash()


async def test_delivery_decodes_what_was_read_ahead(tmp_path, autojump_clock):
    clock = TrioClock(START_MS - int(trio.current_time() * 1000))
    node, due, bucket = loaded_node(tmp_path, 60)
    refs = node.ticks.wheel.refs_due_between(START_MS, START_MS + HOUR_MS)
    from_file = node.ticks.read_messages(refs, cached_only=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda **kw: prefetch_due(node.ticks, clock, horizon_ms=5000, step_ms=100,
                                                      run_blocking=on_the_loop, **kw))
        await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    ahead = node.ticks.ahead
    assert len(ahead.records[bucket]) == 60
    # One held record damaged in memory: it is read from its segment instead.
    damaged = due["m7"][1]
    raw = bytearray(ahead.records[bucket][damaged])
    raw[-1] ^= 0xFF
    ahead.records[bucket][damaged] = bytes(raw)
    assert node.ticks.read_messages(refs, cached_only=True) == from_file
    assert ahead.hits == 60 and ahead.held_bytes == 0 and bucket not in ahead.records
    node.crash()


async def test_what_was_read_ahead_is_forgotten_when_the_segment_changes(tmp_path, autojump_clock):
    clock = TrioClock(START_MS - int(trio.current_time() * 1000))
    node, due, bucket = loaded_node(tmp_path, 20)
    ahead = node.ticks.ahead

    async def fill():
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda **kw: prefetch_due(node.ticks, clock, horizon_ms=5000, step_ms=100,
                                                          run_blocking=on_the_loop, **kw))
            await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    await fill()
    assert len(ahead.records[bucket]) == 20
    node.ticks.reset(clock.now_ms())  # a change of role
    assert ahead.records == {} and ahead.held_bytes == 0
    epoch = ahead.epoch
    node.store.schedule_log.truncate(bucket, max(offset for _, offset in due.values()))
    assert ahead.epoch > epoch
    # A worker's read that began before the truncation is not kept.
    assert ahead.put(bucket, {0: b"x" * 40}, epoch) == 0 and ahead.records == {}
    # Nor is more than the budget; a record held already is counted once.
    ahead.max_bytes = 100
    assert ahead.put(bucket, {0: b"x" * 50, 50: b"y" * 40, 90: b"z" * 20}, ahead.epoch) == 2
    assert ahead.held_bytes == 90 and ahead.room == 10
    assert ahead.put(bucket, {50: b"y" * 40, 200: b"w" * 10}, ahead.epoch) == 1
    assert ahead.held_bytes == 100 and set(ahead.records[bucket]) == {0, 50, 200}
    assert ahead.take(bucket, [50, 7, 0]) == [b"y" * 40, None, b"x" * 50] and ahead.held_bytes == 10
    node.crash()


async def test_over_the_budget_every_record_is_advised_before_it_falls_due(tmp_path, autojump_clock):
    clock = TrioClock(START_MS - int(trio.current_time() * 1000))
    node, due, bucket = loaded_node(tmp_path)
    node.ticks.ahead.max_bytes = 0  # no room in memory: the kernel is asked to read ahead
    offsets = {mid: offset for mid, (_, offset) in due.items()}
    due = {mid: at for mid, (at, _) in due.items()}
    path = str(node.store.schedule_log.path(bucket))
    asked = []  # (time, start, length)

    def spy(wanted):
        for p, spans in wanted:
            assert p == path
            asked.extend((clock.now_ms(), start, length) for start, length in spans)
        return len(asked)

    async with trio.open_nursery() as nursery:
        await nursery.start(lambda **kw: prefetch_due(node.ticks, clock, horizon_ms=500, step_ms=100,
                                                      advise=spy, run_blocking=on_the_loop, **kw))
        await trio.sleep(8)
        nursery.cancel_scope.cancel()
    for mid, at in due.items():
        covering = [t for t, start, length in asked if start <= offsets[mid] < start + length]
        assert covering, mid
        # Asked for within the horizon before it falls due (the first ones: at the start).
        assert any(max(START_MS, at - 500) <= t < at for t in covering), (mid, at, covering)
    assert node.ticks.ahead.records == {}
    node.crash()


def test_a_burst_is_read_into_memory_a_chunk_at_a_time_up_to_the_budget(tmp_path):
    node, due, bucket = loaded_node(tmp_path, 40)
    path = str(node.store.schedule_log.path(bucket))
    size = node.store.schedule_log.size(bucket)
    offsets = [offset for _, offset in sorted(due.values())]  # in the order they fall due
    data = node.store.schedule_log.path(bucket).read_bytes()
    one = len(data) // 40  # about one record (ids of 2 and 3 characters)
    advised = []
    got = fetch([(bucket, path, size, offsets), (bucket + HOUR_MS, path, size, offsets[:3])], 12 * one,
                advise=advised.extend, chunk=5)
    # Chunks of 5 while the budget (12 records) has room: 15 read, the rest only advised.
    assert [(b, list(records)) for b, records in got] == [(bucket, offsets[0:5]), (bucket, offsets[5:10]),
                                                          (bucket, offsets[10:15])]
    assert all(raw == data[o:o + len(raw)] and len(raw) in (one - 1, one, one + 1)
               for _, records in got for o, raw in records.items())
    assert advised == [(path, ranges(offsets[15:])), (path, ranges(offsets[:3]))]
    node.crash()


def test_a_rounds_records_are_read_in_the_order_they_lie_in_their_segment(tmp_path):
    # Messages that arrive in random order of their due time lie all over their segment in the
    # order they fall due: read in that order, each chunk's records would lie far apart, a read
    # each. In segment order a chunk's records are neighbours, and neighbours share a read.
    node, due, bucket = loaded_node(tmp_path, 40)
    path = str(node.store.schedule_log.path(bucket))
    size = node.store.schedule_log.size(bucket)
    in_file = sorted(offset for _, offset in due.values())
    shuffled = in_file[1::2] + in_file[0::2][::-1]  # as a round could meet them
    got = fetch([(bucket, path, size, shuffled)], 1 << 20, advise=None, chunk=8)
    assert [list(records) for _, records in got] == [in_file[k:k + 8] for k in range(0, 40, 8)]
    node.crash()


def test_records_are_copied_from_a_mapping_kept_while_their_segment_has_messages_falling_due(tmp_path):
    # A read per record cost 1.4 us from the page cache, a copy from a mapping kept from one round
    # to the next 0.4: the worker maps the segments it reads ahead from, and reads what it did.
    node, due, bucket = loaded_node(tmp_path, 40)
    schedule_log = node.store.schedule_log
    path, size = str(schedule_log.path(bucket)), schedule_log.size(bucket)
    offsets = sorted(offset for _, offset in due.values())
    maps = {}
    mapped_fetch = functools.partial(fetch, advise=None, maps=maps, truncation=schedule_log.truncation)
    with mock.patch.object(prefetch, "read_records", wraps=prefetch.read_records) as reads:
        got = mapped_fetch([(bucket, path, size, offsets[:20])], 1 << 20)
    mapped = maps[bucket]
    assert [call.kwargs.get("mapped") for call in reads.call_args_list] == [mapped]
    assert got == fetch([(bucket, path, size, offsets[:20])], 1 << 20, advise=None)  # what a read gives
    assert list(got[0][1]) == offsets[:20]
    # The next round's records come from the same mapping; a round without the bucket lets it go.
    assert mapped_fetch([(bucket, path, size, offsets[20:])], 1 << 20)[0][1].keys() == set(offsets[20:])
    assert maps[bucket] is mapped
    assert mapped_fetch([(bucket + HOUR_MS, path, size, offsets[:1])], 1 << 20) and bucket not in maps
    node.crash()


def test_a_segment_made_again_or_grown_past_its_mapping_is_mapped_again(tmp_path):
    node, due, bucket = loaded_node(tmp_path, 40)
    schedule_log = node.store.schedule_log
    path, size = schedule_log.path(bucket), schedule_log.size(bucket)
    offsets = sorted(offset for _, offset in due.values())
    data = path.read_bytes()
    maps = {}
    mapped_fetch = functools.partial(fetch, advise=None, maps=maps, truncation=schedule_log.truncation)
    mapped_fetch([(bucket, str(path), size, offsets)], 1 << 20)
    first = maps[bucket]
    # Removed and written again (another file at the same path): its records are the new file's.
    node.crash()
    path.unlink()
    path.write_bytes(data[offsets[20]:] + data[:offsets[20]])  # the last 20 records first
    moved = [offset - offsets[20] for offset in offsets[20:]]
    got = mapped_fetch([(bucket, str(path), size, moved)], 1 << 20)
    assert maps[bucket] is not first and maps[bucket].key != first.key
    assert got[0][1] == {o: data[o + offsets[20]:o + offsets[20] + len(raw)] for o, raw in got[0][1].items()}
    assert sorted(got[0][1]) == moved
    # Grown past what is mapped: mapped again, longer.
    second = maps[bucket]
    mapped_fetch([(bucket, str(path), second.length + 1, moved[:2])], 1 << 20)
    assert maps[bucket] is not second and maps[bucket].length > second.length


async def test_the_segments_are_let_go_once_nothing_of_theirs_falls_due_soon(tmp_path, autojump_clock):
    # A mapping keeps its file's space: a bucket cleaned after its messages went out must not stay
    # mapped while nothing else falls due.
    clock = TrioClock(START_MS - int(trio.current_time() * 1000))
    node, due, bucket = loaded_node(tmp_path, 10)  # due from START_MS + 50 to + 383
    maps = {}
    seen = []
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda **kw: prefetch_due(node.ticks, clock, horizon_ms=500, step_ms=100,
                                                      run_blocking=on_the_loop, maps=maps, **kw))
        for _ in range(20):
            seen.append(bucket in maps)
            await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    assert seen[0] and not seen[-1]
    node.crash()


def test_a_segment_shortened_under_its_mapping_is_copied_only_as_far_as_it_goes(tmp_path):
    # Touching a mapped page past the end of its file kills the process (SIGBUS), so this runs in a
    # process of its own: a file cut before the copy took the lock is read up to where it ends now,
    # and a mapping handed a descriptor of another file is not copied from.
    script = textwrap.dedent("""
        import os, sys
        from delayserver.native.records import SegmentMap, read_ahead
        from delayserver.storage.record import HEADER
        from delayserver.wheel.read_ahead import _read_ahead_py
        path = sys.argv[1]
        record = HEADER.pack(0, 291, 3) + bytes(291)  # 300 bytes, header included
        with open(path, "wb") as f:
            f.write(record * 1000)
        fd = os.open(path, os.O_RDONLY)
        size = os.fstat(fd).st_size
        mapped = SegmentMap(fd, 2 * size)
        os.truncate(path, 8192 + 100)  # two pages and a bit: records 0 to 26 whole
        offsets = list(range(0, size, 300))
        got = read_ahead(fd, size, offsets, 512, 65536, mapped=mapped)
        assert got == _read_ahead_py(fd, size, offsets, 512, 65536), sorted(got)
        # A descriptor of another file is read, not copied from the mapping of this one.
        other = path + ".other"
        with open(other, "wb") as f:
            f.write((HEADER.pack(0, 91, 3) + bytes([7]) * 91) * 10)  # 100 bytes each
        other_fd = os.open(other, os.O_RDONLY)
        wanted = list(range(0, 1000, 100))
        assert read_ahead(other_fd, 1000, wanted, 512, 65536, mapped=mapped) == _read_ahead_py(other_fd, 1000, wanted, 512, 65536)
        print(len(got))
    """)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "segment")], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == ["27"]
