"""The real server process: many producers, delivery once and never early, kill -9 and restart."""
from __future__ import annotations

import collections
import random
import threading

import pytest

from delayserver.client import Message, Producer
from tests.procs import ServerProcess, spooled, wait_for


@pytest.fixture
def server(tmp_path):
    proc = ServerProcess(tmp_path / "data")
    yield proc
    proc.kill()


def produce(address: str, n: int, max_delay_ms: int, acked: list, errors: list, stop=None) -> None:
    rng = random.Random()
    try:
        with Producer(address, timeout=20) as producer:
            for start in range(0, n, 50):
                if stop is not None and stop.is_set():
                    return
                batch = [Message("e2e.orders", f"body-{start + i}".encode(), delay=rng.randrange(max_delay_ms + 1))
                         for i in range(min(50, n - start))]
                for h in producer.send_many(batch):
                    if isinstance(h, Exception):
                        errors.append(h)
                    else:
                        acked.append(h)
    except (ConnectionError, TimeoutError) as e:
        errors.append(e)


def test_concurrent_producers_each_message_delivered_once_never_early(server):
    server.start()
    acked, errors = [], []
    threads = [threading.Thread(target=produce, args=(server.address, 500, 3000, acked, errors)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(acked) == 2000
    delivered = wait_for(lambda: d if len(d := spooled(server.data_dir)) >= 2000 else None, timeout=30)
    assert delivered, server.log_text()[-2000:]
    counts = collections.Counter(m.message_id for _, _, m in delivered)
    assert set(counts) == {h.message_id for h in acked}
    assert max(counts.values()) == 1
    by_id = {h.message_id: h.schedule_time for h in acked}
    for dispatch_time, attempt, m in delivered:
        assert m.schedule_time == by_id[m.message_id]
        assert dispatch_time >= m.schedule_time, "delivered before its time"
    assert server.terminate() == 0


def test_kill_9_while_sending_loses_no_acknowledged_message(server):
    server.start()
    acked, errors = [], []
    stop = threading.Event()
    threads = [threading.Thread(target=produce, args=(server.address, 100_000, 2000, acked, errors, stop))
               for _ in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: len(acked) >= 3000, timeout=30)
    server.kill()
    stop.set()
    for t in threads:
        t.join()
    acked_ids = {h.message_id for h in acked}
    assert len(acked_ids) >= 3000
    server.start()
    delivered = wait_for(
        lambda: (ids if acked_ids <= (ids := {m.message_id for _, _, m in spooled(server.data_dir)}) else None),
        timeout=30,
    )
    assert delivered, f"{len(acked_ids - {m.message_id for _, _, m in spooled(server.data_dir)})} acknowledged messages lost"
    for dispatch_time, _, m in spooled(server.data_dir):
        assert dispatch_time >= m.schedule_time
    assert server.terminate() == 0


def test_kill_between_broker_ack_and_dispatch_log_write_delivers_again_after_restart(tmp_path):
    proc = ServerProcess(tmp_path / "data", env={"DELAYSERVER_FAILPOINT": "after-broker-ack"})
    proc.start()
    try:
        with Producer(proc.address) as producer:
            handle = producer.send("fp.orders", b"exactly-this", delay=300)
        assert proc.process.wait(15) == -9
        first = [m.message_id for _, _, m in spooled(proc.data_dir)]
        assert first == [handle.message_id]  # the broker has it; dispatch_log does not
        proc.env = {}
        proc.start()
        again = wait_for(lambda: len(d) == 2 and d if (d := spooled(proc.data_dir)) else None, timeout=15)
        assert again and {m.message_id for _, _, m in again} == {handle.message_id}
        with Producer(proc.address) as producer:
            assert wait_for(lambda: producer.status(handle).state.name == "DELIVERED", timeout=10)
    finally:
        proc.kill()
