"""Real processes: a meta server and a master and slave of one group, forked by pausing them in turn.

The master acknowledges messages its paused slave never pulls; then the master is paused past its
lease, the slave is promoted (epoch 2) and takes messages of its own; then the old master comes
back. It must find where its history parts from the new master's, copy the suffix only it holds
to the quarantine (naming each message id), truncate it and replicate from the new master, byte
for byte, whether its log was longer than the new master's or shorter.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys

from delayserver.client import Producer
from delayserver.message import MessageState
from delayserver.node.divergence import list_diverged
from tests.ctl.test_meta_commands import request, meta  # noqa: F401 (a fixture)
from tests.procs import ServerProcess, send_while_roles_settle, wait_for, nodes  # noqa: F401 (a fixture)


def start_node(nodes, tmp_path, meta, name: str) -> ServerProcess:
    node = ServerProcess(tmp_path / name, args=["--meta", meta.address, "--group", "g", "--node-id", name]).start()
    nodes.append(node)
    return node


def log_bytes(node: ServerProcess) -> bytes:
    return b"".join(p.read_bytes() for p in sorted((node.data_dir / "message_log").glob("*.log")))


def master_of(meta) -> set[str]:
    return {n["node_id"] for n in request(meta.address, "list_nodes", group="g")["nodes"]
            if n["role"] == "master" and n["state"] == "up"}


def send_until_taken(address: str, count: int, body: bytes) -> list:
    """Send `count` messages, asked again while a node not yet sure of its role refuses them."""
    with Producer(address) as producer:
        return [send_while_roles_settle(producer, "div.q", body, delay=3_600_000) for _ in range(count)]


def fork(tmp_path, meta, nodes, new_master_messages: int):
    old = start_node(nodes, tmp_path, meta, "n1")
    assert wait_for(lambda: master_of(meta) == {"n1"}, 15)
    new = start_node(nodes, tmp_path, meta, "n2")
    common = send_until_taken(old.address, 5, b"common")
    assert wait_for(lambda: log_bytes(new) == log_bytes(old), 15), "the slave did not catch up"
    new.process.send_signal(signal.SIGSTOP)
    lost = send_until_taken(old.address, 8, b"acknowledged by the old master only " * 4)
    old.process.send_signal(signal.SIGSTOP)  # past its lease: the slave is promoted
    new.process.send_signal(signal.SIGCONT)
    assert wait_for(lambda: master_of(meta) == {"n2"}, 20), "the slave was not promoted"
    after = send_until_taken(new.address, new_master_messages, b"new master") if new_master_messages else []
    return old, new, common, lost, after


def check_realigned(old, new, lost, shorter: bool) -> list:
    """The old master realigns; returns the messages lost (acknowledged by it only)."""
    new_log = log_bytes(new)
    assert (len(log_bytes(old)) < len(new_log)) is shorter
    old.process.send_signal(signal.SIGCONT)
    assert wait_for(lambda: list_diverged(old.data_dir), 20), f"no divergence found: {old.log_text()[-3000:]}"
    [listing] = list_diverged(old.data_dir)
    # A batch the slave had been sent before its pause reached it: only the rest is lost.
    with Producer(new.address) as producer:
        lost = [h for h in lost if producer.status(h).state is not MessageState.PENDING]
    assert lost, "the slave pulled every message the old master acknowledged: nothing forked"
    assert sorted(m["message_id"] for m in listing["messages"]) == sorted(h.message_id for h in lost)
    assert {m["epoch"] for m in listing["messages"]} == {1}
    assert listing["cancels"] == []
    assert wait_for(lambda: log_bytes(old) == log_bytes(new), 20), "the old master does not replicate"
    assert "replication stopped" not in old.log_text()
    # The tool lists exactly the lost messages.
    out = subprocess.run([sys.executable, "-m", "delayserver.ctl", "diverged", str(old.data_dir), "--json"],
                         capture_output=True, text=True, check=True).stdout
    assert sorted(json.loads(line)["message_id"] for line in out.splitlines()) == sorted(h.message_id for h in lost)
    return lost


def test_a_returning_old_master_with_a_longer_log_quarantines_its_suffix_and_replicates(tmp_path, meta, nodes):
    old, new, common, lost, after = fork(tmp_path, meta, nodes, new_master_messages=1)
    lost = check_realigned(old, new, lost, shorter=False)
    # The common history and the new master's message are kept on both; the lost ones are on neither.
    for node in (new, old):
        with Producer(node.address) as producer:
            assert all(producer.status(h).state is MessageState.PENDING for h in common + after)
            assert not any(producer.status(h).state is MessageState.PENDING for h in lost)


def test_a_returning_old_master_with_a_shorter_forked_log_truncates_it_and_replicates(tmp_path, meta, nodes):
    old, new, common, lost, after = fork(tmp_path, meta, nodes, new_master_messages=30)
    lost = check_realigned(old, new, lost, shorter=True)
    # The redrive brings the lost messages to the new master, once.
    for expected in (f"redrove {len(lost)} messages and 0 cancels", "nothing to redrive"):
        out = subprocess.run([sys.executable, "-m", "delayserver.ctl", "diverged", str(old.data_dir),
                              "--redrive", new.address], capture_output=True, text=True, check=True).stdout
        assert expected in out
    with Producer(new.address) as producer:
        assert all(producer.status(h).state is MessageState.PENDING for h in lost)
