"""Real processes: a meta server, delay groups registering with it, a producer that uses it."""
from __future__ import annotations

import signal
import time

import pytest

from delayserver.client import Producer
from tests.ctl.test_meta_commands import request, meta  # noqa: F401 (a fixture)
from tests.procs import ServerProcess, send_while_roles_settle, spooled, wait_for, nodes  # noqa: F401 (a fixture)


def start_node(nodes, tmp_path, meta, name: str, group: str) -> ServerProcess:
    node = ServerProcess(tmp_path / name, args=["--meta", meta.address, "--group", group, "--node-id", name]).start()
    nodes.append(node)
    return node


def live_groups(meta) -> set[str]:
    return {g["group"] for g in request(meta.address, "live_delay_groups")["delay_groups"]}


def test_sends_spread_over_groups_skip_a_dead_one_and_survive_a_meta_outage(tmp_path, meta, nodes):
    a = start_node(nodes, tmp_path, meta, "a", "ga")
    b = start_node(nodes, tmp_path, meta, "b", "gb")
    assert wait_for(lambda: live_groups(meta) == {"ga", "gb"}, 15)
    with Producer(meta=meta.address) as producer:
        first = [producer.send("cluster.q", b"x", delay=0) for _ in range(20)]
        assert wait_for(lambda: len(spooled(a.data_dir)) + len(spooled(b.data_dir)) == 20, 15)
        assert spooled(a.data_dir) and spooled(b.data_dir), "sends were not spread over both groups"

        a.kill()
        after_kill = [producer.send("cluster.q", b"y", delay=0) for _ in range(20)]
        assert len(after_kill) == 20
        assert wait_for(lambda: {m.message_id for _, _, m in spooled(b.data_dir)}
                        >= {h.message_id for h in after_kill}, 15)

    port = meta.port
    meta.kill()
    with Producer(b.address) as direct:
        during = direct.send("cluster.q", b"z", delay=3000)  # comes due well past the lease
    assert wait_for(lambda: during.message_id in {m.message_id for _, _, m in spooled(b.data_dir)}, 15), \
        "delivery stopped while the meta server was down"

    meta.start(port=port)
    assert wait_for(lambda: live_groups(meta) == {"gb"}, 15), "the node did not register again"
    assert {h.message_id for h in first} <= {m.message_id for d in (a.data_dir, b.data_dir)
                                             for _, _, m in spooled(d)}


def test_an_old_master_that_returns_after_a_newer_epoch_never_delivers(tmp_path, meta, nodes):
    old = start_node(nodes, tmp_path, meta, "n1", "g")
    assert wait_for(lambda: live_groups(meta) == {"g"}, 15)
    new = start_node(nodes, tmp_path, meta, "n2", "g")
    with Producer(old.address) as producer:
        handle = producer.send("fence.q", b"held", delay=2000)
    old.process.send_signal(signal.SIGSTOP)  # the master goes silent: its lease runs out
    masters = lambda: {n["node_id"] for n in request(meta.address, "list_nodes", group="g")["nodes"]
                       if n["role"] == "master"}
    assert wait_for(lambda: masters() == {"n2"}, 15)
    epoch = request(meta.address, "list_groups")["groups"][0]["master_epoch"]
    assert epoch >= 2
    old.process.send_signal(signal.SIGCONT)
    time.sleep(handle.schedule_time / 1000 - time.time() + 2.0)  # well past the message's time
    assert spooled(old.data_dir) == [], "a fenced master delivered"
    roles = {n["node_id"]: n["role"] for n in request(meta.address, "list_nodes", group="g")["nodes"]}
    assert roles == {"n1": "slave", "n2": "master"}
    with Producer(old.address) as producer:
        with pytest.raises(Exception) as err:
            producer.send("fence.q", b"refused", delay=0)
        assert "NOT_MASTER" in repr(err.value.code) or "master" in str(err.value)


def log_bytes(node: ServerProcess) -> int:
    return sum(p.stat().st_size for p in (node.data_dir / "message_log").glob("*.log"))


def test_when_the_master_dies_its_slave_is_promoted_and_delivers_its_messages(tmp_path, meta, nodes):
    master = start_node(nodes, tmp_path, meta, "n1", "g")
    assert wait_for(lambda: live_groups(meta) == {"g"}, 15)
    slave = start_node(nodes, tmp_path, meta, "n2", "g")
    with Producer(master.address) as producer:
        delivered_before = [send_while_roles_settle(producer, "failover.q", b"early", delay=0) for _ in range(10)]
        due_later = [send_while_roles_settle(producer, "failover.q", b"later", delay=3000) for _ in range(30)]
    assert wait_for(lambda: len(spooled(master.data_dir)) == 10, 10)
    assert wait_for(lambda: log_bytes(slave) == log_bytes(master), 10), "the slave did not catch up"
    time.sleep(0.5)  # one more dispatch_log pull
    master.kill()
    assert wait_for(lambda: {m.message_id for _, _, m in spooled(slave.data_dir)}
                    >= {h.message_id for h in due_later}, 20), "the promoted slave lost messages"
    again = {m.message_id for _, _, m in spooled(slave.data_dir)} & {h.message_id for h in delivered_before}
    assert not again, f"{len(again)} messages the old master had delivered were delivered again"
    for dispatch_time, _, m in spooled(slave.data_dir):
        assert dispatch_time >= m.schedule_time
