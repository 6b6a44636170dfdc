"""Real processes: a master cut off from the meta server (a proxy between them is cut) while its
slave still reaches it. Once its lease lapses the master answers FENCED to every write and,
with `deliver_through_meta_outage = false`, delivers nothing; the slave is promoted and delivers.
"""
from __future__ import annotations

import time

import pytest

from delayserver.client import Producer
from delayserver.message import DelayServerError, ResultCode
from tests.ctl.test_meta_commands import request, meta  # noqa: F401 (a fixture)
from tests.meta.procs import ProxyProcess
from tests.procs import ServerProcess, send_while_roles_settle, spooled, wait_for, nodes  # noqa: F401 (a fixture)


@pytest.fixture
def proxy(meta):
    proc = ProxyProcess(meta.address).start()
    yield proc
    proc.stop()


def start_node(nodes, tmp_path, meta_address: str, name: str, config: str = "") -> ServerProcess:
    args = ["--meta", meta_address, "--group", "g", "--node-id", name]
    if config:
        path = tmp_path / f"{name}.toml"
        path.write_text(config)
        args += ["--config", str(path)]
    node = ServerProcess(tmp_path / name, args=args).start()
    nodes.append(node)
    return node


def send_until_taken(address: str):
    """One message, asked again while a loaded machine delays the master's lease renewal."""
    with Producer(address) as producer:
        return send_while_roles_settle(producer, "fence.q", b"due during the partition", delay=3000)


def masters(meta) -> set[str]:
    return {n["node_id"] for n in request(meta.address, "list_nodes", group="g")["nodes"]
            if n["role"] == "master" and n["state"] == "up"}


def log_size(node: ServerProcess) -> int:
    return sum(p.stat().st_size for p in (node.data_dir / "message_log").glob("*.log"))


def test_a_master_cut_off_from_meta_stops_acknowledging_and_delivering_and_its_slave_takes_over(
        tmp_path, meta, proxy, nodes):
    old = start_node(nodes, tmp_path, f"127.0.0.1:{proxy.port}", "n1", "deliver_through_meta_outage = false\n")
    assert wait_for(lambda: masters(meta) == {"n1"}, 15)
    new = start_node(nodes, tmp_path, meta.address, "n2")
    due = send_until_taken(old.address)
    assert wait_for(lambda: log_size(new) == log_size(old), 15), "the slave did not catch up"
    proxy.cut()
    assert wait_for(lambda: masters(meta) == {"n2"}, 15), "the slave was not promoted"
    with Producer(old.address) as producer:
        with pytest.raises(DelayServerError) as refused:
            producer.send("fence.q", b"must not be acknowledged", delay=0)
    assert refused.value.code == ResultCode.FENCED
    time.sleep(max(0.0, due.schedule_time / 1000 - time.time()) + 1.5)
    assert spooled(old.data_dir) == [], "a master without a lease delivered"
    assert wait_for(lambda: [m.message_id for _, _, m in spooled(new.data_dir)] == [due.message_id], 15)
    # The partition heals: the old master hears it is a slave now, and says so.
    proxy.heal()

    def refusal():
        with Producer(old.address) as producer:
            try:
                producer.send("fence.q", b"still not", delay=0)
            except DelayServerError as e:
                return e.code
        raise AssertionError("the old master acknowledged a write")

    assert wait_for(lambda: refusal() == ResultCode.NOT_MASTER, 15)
