"""The dispatch_log fsync is group-committed off the send path: a slow fsync of our own disk holds
back no delivery, one fsync covers every batch acknowledged meanwhile, and a message is settled
only once an fsync covers its record.

The server runs in-process over real sockets and delivers to the spool; only the dispatch_log's
fsync is made to wait, on an event the test holds."""
from __future__ import annotations

import threading

import trio

from delayserver.client import AsyncProducer, Message
from delayserver.config import Config
from delayserver.node.server import DelayServer
from delayserver.sender import sender as sender_module
from delayserver.sender.spool import iter_spool


def spooled_ids(server, subject: str) -> set[str]:
    return {m.message_id for _, _, _, m in iter_spool(server.config.data_dir, subject)}


async def wait_until(predicate, timeout_s: float = 30) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():
            await trio.sleep(0.01)


class HeldSync:
    """Wraps `dispatch_log.sync_paths`: a slow disk. Every call waits until `released` is set; the
    calls are counted."""

    def __init__(self, sync_paths):
        self.sync_paths = sync_paths
        self.entered = threading.Event()
        self.released = threading.Event()
        self.calls = 0

    def __call__(self, paths, new_files):
        self.calls += 1
        self.entered.set()
        self.released.wait(60)
        self.sync_paths(paths, new_files)


async def test_a_slow_dispatch_fsync_holds_back_no_delivery_and_one_fsync_covers_the_batches_meanwhile(
        tmp_path, nursery):
    cfg = Config.from_dict(dict(data_dir=str(tmp_path / "data"), listen="127.0.0.1:0", send_wait_ms=1,
                                broker_group=[{"name": "spool", "transport": "spool"}]))
    server = DelayServer(cfg)
    await nursery.start(server.serve)
    dispatch_log = server.store.dispatch_log
    held = HeldSync(dispatch_log.sync_paths)
    dispatch_log.sync_paths = held
    try:
        async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
            first = await prod.send("sync.q", b"1", delay=0)
            await wait_until(lambda: first.message_id in spooled_ids(server, "sync.q"))
            await trio.to_thread.run_sync(held.entered.wait, 30)
            # The first batch's fsync waits. Each message below falls due on its own and is sent
            # as its own batch: the sender must go on while fsyncs wait (with the fsync in the
            # group task, two batches in flight per group, the third waited for the disk).
            later = []
            for i in range(5):
                h = await prod.send("sync.q", b"later %d" % i, delay=0)
                await wait_until(lambda: h.message_id in spooled_ids(server, "sync.q"))
                later.append(h)
        group = server.sender.groups["spool"]
        # Handed to the broker, none settled: no fsync has covered a dispatch record yet.
        assert server.sender.delivered == 0
        assert group.inflight == 6
        held.released.set()
        await wait_until(lambda: server.sender.delivered == 6)
        assert group.inflight == 0
        # The held round and one more that covered the five batches appended meanwhile.
        assert held.calls == 2
        assert server.sender.dispatch_fsyncs == 2
        dispatched = [off for b in dispatch_log.sizes.keys() for off in server.store.dispatched(b)]
        assert len(dispatched) == 6
    finally:
        held.released.set()


def spool_node(tmp_path, **kw) -> DelayServer:
    raw = dict(data_dir=str(tmp_path / "data"), listen="127.0.0.1:0", send_wait_ms=1,
               broker_group=[{"name": "spool", "transport": "spool"}])
    raw.update(kw)
    return DelayServer(Config.from_dict(raw))


async def test_a_delivery_settles_after_the_linger_with_those_acknowledged_meanwhile(tmp_path, nursery, monkeypatch):
    """The fsync task gathers acknowledged batches for `DISPATCH_SYNC_LINGER_S` before a round (an
    fsync costs about as much CPU whatever it covers): batches acknowledged within it settle
    together, in one fsync, none before the linger is over."""
    monkeypatch.setattr(sender_module, "DISPATCH_SYNC_LINGER_S", 2.0)
    server = spool_node(tmp_path)
    await nursery.start(server.serve)
    async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
        first = await prod.send("linger.q", b"0", delay=0)
        await wait_until(lambda: first.message_id in spooled_ids(server, "linger.q"))
        handed_over = trio.current_time()
        for i in range(3):  # each falls due on its own and is sent as a batch of its own
            h = await prod.send("linger.q", b"%d" % i, delay=0)
            await wait_until(lambda: h.message_id in spooled_ids(server, "linger.q"))
    assert trio.current_time() - handed_over < 1.5, "the machine is too slow for this test's linger"
    assert server.sender.delivered == 0 and server.sender.dispatch_fsyncs == 0
    await wait_until(lambda: server.sender.delivered == 4)
    assert trio.current_time() - handed_over >= 1.5  # (the linger began a little before `handed_over`: the poll lags)
    assert server.sender.dispatch_fsyncs == 1


async def test_a_quarter_of_the_in_flight_budget_waiting_for_an_fsync_starts_the_round_at_once(
        tmp_path, nursery, monkeypatch):
    """A small in-flight budget must not fill with deliveries that only wait for the fsync task's
    linger: once a quarter of it waits, the round starts. With a linger of a minute, 40 messages
    through a budget of 8 are all settled within seconds."""
    monkeypatch.setattr(sender_module, "DISPATCH_SYNC_LINGER_S", 60)
    server = spool_node(tmp_path, max_inflight=8, send_batch_size=2)
    await nursery.start(server.serve)
    async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
        await prod.send_many([Message("early.q", b"x", message_id=f"e{i}") for i in range(40)])
    await wait_until(lambda: server.sender.delivered == 40, 20)
    assert spooled_ids(server, "early.q") == {f"e{i}" for i in range(40)}
    assert server.sender.dispatch_fsyncs >= 40 // 8
    assert server.sender.groups["spool"].inflight == 0
