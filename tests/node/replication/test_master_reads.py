"""The master reads what a slave pulls in worker threads: a slave catching up asks for up to
MAX_SYNC_BYTES at a time (message_log, dispatch_log, snapshot segments), and reading and checking
that much on the event loop would hold the master's deliveries for milliseconds per pull."""
from __future__ import annotations

import threading

import pytest

from delayserver import protocol as p
from delayserver.client import AsyncProducer, Message
from delayserver.node.replication import master as master_module, wire

from tests.node.replication.helpers import cfg, start, wait_until

HOUR = 3_600_000


class ThreadLog:
    """Wraps the readers a log hands out for worker threads, and its reads on the caller's
    thread: where each ran."""

    def __init__(self, log, *names: str):
        self.loop_thread = threading.current_thread()
        self.in_threads: list[bool] = []
        self.on_loop: list[str] = []
        for name in names:
            setattr(log, name, self._reader(getattr(log, name)))
        real_read = log.read

        def read(*args, **kw):
            if threading.current_thread() is self.loop_thread:
                self.on_loop.append(repr(args))
            return real_read(*args, **kw)
        log.read = read

    def _reader(self, make):
        def made(*args):
            read = make(*args)

            def run(*a):
                self.in_threads.append(threading.current_thread() is not self.loop_thread)
                return read(*a)
            return run
        return made


@pytest.mark.parametrize("catching_up", [True, False])
async def test_pulls_and_snapshot_reads_run_in_worker_threads_and_answer_the_same_bytes(
        tmp_path, nursery, monkeypatch, catching_up):
    """A pull of more than ON_LOOP_BYTES is read in a worker thread (a slave catching up), a
    smaller one on the loop (a slave in step: what was just written); snapshot segments always in
    a thread. Every answer holds the same bytes."""
    monkeypatch.setattr(master_module, "ON_LOOP_BYTES", 0 if catching_up else 1 << 30)
    master = await start(nursery, cfg(tmp_path, "m", checkpoint_interval_ms=10))
    async with AsyncProducer(f"127.0.0.1:{master.port}") as prod:
        for _ in range(4):
            await prod.send_many([Message("pull.q", b"x" * 1000, delay=HOUR) for _ in range(200)])
        due = await prod.send_many([Message("pull.q", b"now", delay=0) for _ in range(20)])
        await wait_until(lambda: master.replayer.offset == master.receiver.durable_offset)
        await wait_until(lambda: sum(master.store.dispatch_log.size(b) for b in master.store.dispatch_log.buckets()) > 0
                         and master.sender.delivered == len(due))
        store = master.store
        end = store.message_log.end_offset
        whole_log, _ = store.message_log.read(0, 1 << 30)
        # Nothing else reads these logs now: replay is done, the delivered messages are settled.
        message_log = ThreadLog(store.message_log, "reader")
        schedule_log = ThreadLog(store.schedule_log, "range_reader")
        dispatch_log = ThreadLog(store.dispatch_log, "range_reader")

        at, durable, data = wire.decode_message_log_response(await prod.request(
            p.Command.SYNC_MESSAGE_LOG, wire.encode_message_log_request(wire.MessageLogRequest(0, 1 << 30, 0, "s1"))))
        assert (at, durable) == (0, end)
        assert data == whole_log and len(data) > 800_000

        sizes = {b: store.dispatch_log.size(b) for b in store.dispatch_log.buckets()}
        chunks = wire.decode_dispatch_log_response(await prod.request(
            p.Command.SYNC_DISPATCH_LOG, wire.encode_dispatch_log_request(
                wire.DispatchLogRequest("s1", {b: 0 for b in sizes}))))
        assert {b: len(d) for b, _, d in chunks} == sizes

        bucket = max(store.schedule_log.buckets(), key=store.schedule_log.size)
        size = store.schedule_log.size(bucket)
        segment = await prod.request(p.Command.SYNC_SNAPSHOT, wire.encode_snapshot_request(
            wire.SnapshotRequest(wire.SCHEDULE_LOG, bucket, 0, size, "s1")))
        assert segment == store.schedule_log.path(bucket).read_bytes()[: len(segment)] and len(segment) > 0

    assert schedule_log.in_threads and all(schedule_log.in_threads) and schedule_log.on_loop == []
    for log in (message_log, dispatch_log):
        if catching_up:
            assert log.in_threads and all(log.in_threads)
            assert log.on_loop == [], "a log read on the event loop while answering a slave catching up"
        else:
            assert log.in_threads == [] and log.on_loop
