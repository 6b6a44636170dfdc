"""Crash consistency: every on-disk state a power cut could leave keeps every acknowledged message.

A real node (in this process, real sockets, `flush = "sync"`, small segments so that message_log
rolls, a checkpoint every 30 ms, deliveries to the spool so that dispatch_log is written) takes
messages from concurrent producers while `tests/storage/crashfs.py` records every write, truncate,
fsync, directory fsync, creation and rename of its storage files. Each acknowledgement is stamped
with the number of events recorded when it arrived.

Then, for many crash points and seeds, a state the disk could hold after a power cut there is
built (unsynced writes dropped, kept, or torn at 512-byte sectors; creations and renames undone
unless their directory was fsynced), and the node's recovery runs on it: Store.open (message_log's
torn and power-loss tails), Replayer.open (schedule segments back to the checkpoint, replay of the
rest), and a load of every bucket with dispatch_log. For every state:

- recovery succeeds (no CorruptSegment, no checkpoint naming data the disk lost), no bucket is
  quarantined;
- every message acknowledged before the crash point is deliverable (pending in the loaded wheel)
  or recorded as delivered in dispatch_log;
- every message recovered is one that was sent, byte for byte, with the schedule time it was
  acknowledged with (so nothing can fire early).

DELAYSERVER_CRASH_STATES (default 300) sets how many states; DELAYSERVER_CRASH_SEED (default
fixed) the seed they are drawn with, printed so that a failure can be replayed.
"""
from __future__ import annotations

import random
import shutil
import time

import trio

from delayserver.client import AsyncProducer, Message
from delayserver.config import Config
from delayserver.message import Handle
from delayserver.replayer import Replayer
from delayserver.node.server import DelayServer
from delayserver.storage.record import RecordType, decode_scheduled
from delayserver.storage.store import Store
from delayserver.wheel.tick_manager import TickManager
from tests.faults.harness import body_for, env_int
from tests.storage.crashfs import Recorder

SEGMENT_BYTES = 16 * 1024
MAX_UNSYNCED = 24 * 1024  # small, so that the bound on unsynced data is exercised too
SCALE_MS = 60_000
WORKLOAD_S = 2.0
FAR_FUTURE_MS = 4_000_000_000_000  # everything is due: the load hands out every pending message


async def run_workload(root, recorder: Recorder) -> tuple[dict, dict]:
    """Producers send until WORKLOAD_S passes; returns (sent id -> subject, acked id -> (schedule
    time, event index at the ack))."""
    config = Config.from_dict(dict(
        data_dir=str(root), listen="127.0.0.1:0", flush="sync", message_log_segment_bytes=SEGMENT_BYTES,
        segment_scale="1m", checkpoint_interval_ms=30, max_delay="1d", reserve_bytes=0,
        send_batch_size=32, send_wait_ms=1,
    ))
    server = DelayServer(config)
    sent: dict[str, str] = {}
    acked: dict[str, tuple[int, int]] = {}
    rng = random.Random(7)

    async def producer(n: int) -> None:
        async with AsyncProducer(f"127.0.0.1:{server.port}", timeout=30) as p:
            i = 0
            deadline = trio.current_time() + WORKLOAD_S
            while trio.current_time() < deadline:
                batch = []
                for _ in range(rng.randint(1, 24)):
                    mid = f"c{n}-{i:06d}"
                    i += 1
                    subject = f"crash.s{rng.randrange(3)}"
                    sent[mid] = subject
                    # Some due during the run (delivered, dispatch_log written), some later.
                    delay = rng.choice((0, rng.randrange(800), rng.randrange(120_000)))
                    batch.append(Message(subject, body_for(mid), delay=delay, message_id=mid))
                results = await p.send_many(batch)
                seen = recorder.now
                for m, r in zip(batch, results):
                    if isinstance(r, Handle):
                        acked[m.message_id] = (r.schedule_time, seen)
                await trio.sleep(rng.randrange(3) / 1000)

    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        async with trio.open_nursery() as producers:
            for n in range(4):
                producers.start_soon(producer, n)
        await trio.sleep(0.2)
        nursery.cancel_scope.cancel()
    return sent, acked


def recover(root) -> tuple[dict[str, tuple[int, bytes, str]], set[str], dict]:
    """Open a crash state as the node does; returns (pending id -> (schedule time, body, subject),
    delivered ids, quarantined buckets)."""
    store = Store.open(root, segment_scale_ms=SCALE_MS, message_log_segment_bytes=SEGMENT_BYTES,
                       max_unsynced_bytes=MAX_UNSYNCED)
    try:
        ticks = TickManager(store, now_ms=FAR_FUTURE_MS, tick_ms=10, slots=64)
        Replayer.open(store, ticks)
        while ticks.load_step(FAR_FUTURE_MS):
            pass
        pending = {}
        for ref in list(ticks.ready):
            _, _, _, m = ticks.read_message(ref)
            assert m.message_id not in pending, f"{m.message_id} scheduled twice"
            pending[m.message_id] = (m.schedule_time, m.body, m.subject)
        delivered = set()
        for bucket in store.schedule_log.buckets():
            done = store.dispatched(bucket)
            if not done:
                continue
            for offset, rtype, payload in store.schedule_log.records(bucket):
                if rtype == RecordType.SCHEDULED and offset in done:
                    delivered.add(decode_scheduled(payload, 0, len(payload))[1].message_id)
        return pending, delivered, store.quarantined()
    finally:
        store.close()


async def test_every_power_cut_state_keeps_every_acknowledged_message(tmp_path, monkeypatch):
    recorder = Recorder(tmp_path / "node")
    recorder.install(monkeypatch)
    real_open = Store.open.__func__
    monkeypatch.setattr(Store, "open", classmethod(
        lambda cls, root, **kw: real_open(cls, root, **{"max_unsynced_bytes": MAX_UNSYNCED, **kw})))
    sent, acked = await run_workload(tmp_path / "node", recorder)
    events = recorder.events
    assert len(acked) > 500 and len(events) > 1000, (len(acked), len(events))
    assert sum(e.kind == "rename" for e in events) > 5, "the run wrote too few checkpoints"

    states = env_int("DELAYSERVER_CRASH_STATES", 300)
    seed = env_int("DELAYSERVER_CRASH_SEED", 20261123)
    print(f"DELAYSERVER_CRASH_SEED={seed}: {states} states over {len(events)} events, {len(acked)} acks")
    rng = random.Random(seed)
    started = time.monotonic()
    totals = {"lost": 0, "torn": 0, "kept": 0, "acked_checked": 0, "delivered": 0}
    for n in range(states):
        k = rng.randrange(1, len(events) + 1)
        state_seed = rng.randrange(1 << 32)
        state = tmp_path / "state"
        counts = recorder.crash_state(k, random.Random(state_seed), state)
        context = f"state {n} (crash at event {k} of {len(events)}, state seed {state_seed})"
        try:
            pending, delivered, quarantined = recover(state)
        except Exception as e:
            raise AssertionError(f"{context}: recovery failed: {e!r}") from e
        assert not quarantined, f"{context}: quarantined {quarantined}"
        must = [mid for mid, (_, at) in acked.items() if at <= k]
        lost = [mid for mid in must if mid not in pending and mid not in delivered]
        assert not lost, f"{context}: {len(lost)} acknowledged messages lost: {lost[:10]}"
        for mid, (schedule_time, body, subject) in pending.items():
            assert mid in sent and body == body_for(mid) and subject == sent[mid], f"{context}: {mid} corrupt"
            if mid in acked:
                assert schedule_time == acked[mid][0], f"{context}: {mid} schedule time changed"
        for key in ("lost", "torn", "kept"):
            totals[key] += counts[key]
        totals["acked_checked"] += len(must)
        totals["delivered"] += len(delivered)
        shutil.rmtree(state)
    print(f"{states} states in {time.monotonic() - started:.1f} s: {totals}")
    assert totals["torn"] and totals["lost"], "no state tore or lost an unsynced write"
