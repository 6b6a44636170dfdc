"""The fault suite's harness against real processes: namespaces that really partition, processes
that really run in them, a teardown that leaves nothing behind, and a quiet run that checks clean."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.jepsen.cluster import META_PORT, NODE_PORT
from tests.jepsen.netns import Network, unsupported_reason
from tests.jepsen.suite import run_rounds

pytestmark = pytest.mark.slow

CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5).close()"


def can_connect(network, from_name: str | None, to_address: str, port: int) -> bool:
    prefix = network.exec_prefix(from_name) if from_name else []
    return subprocess.run(prefix + [sys.executable, "-c", CONNECT, to_address, str(port)],
                          capture_output=True, timeout=30).returncode == 0


def test_partitions_cut_nodes_apart_but_not_from_the_root_namespace(network, start_cluster):
    cluster = start_cluster("async")
    n1, n2, meta = (network.addresses[n] for n in ("n1", "n2", "meta"))
    assert can_connect(network, "n2", n1, NODE_PORT) and can_connect(network, "n1", meta, META_PORT)

    network.isolate("n1")
    assert not can_connect(network, "n2", n1, NODE_PORT), "the slave still reaches the isolated master"
    assert not can_connect(network, "n1", meta, META_PORT), "the isolated master still reaches the meta server"
    assert can_connect(network, "n2", meta, META_PORT), "the slave lost the meta server too"
    assert can_connect(network, None, n1, NODE_PORT), "producers in the root namespace lost the master"

    network.heal()
    assert can_connect(network, "n2", n1, NODE_PORT) and can_connect(network, "n1", meta, META_PORT)


def test_teardown_removes_every_namespace_and_link():
    if reason := unsupported_reason():
        pytest.skip(f"the fault suite needs network namespaces: {reason}")
    network = Network().open()
    try:
        for name in ("a", "b"):
            network.add(name)
        network.partition("a", "b")
        assert len(network.leftovers()) >= 3  # the bridge, two namespaces, their veth ends
    finally:
        network.close()
    assert network.leftovers() == []
    network.close()  # twice is harmless


def test_a_quiet_async_cluster_delivers_every_acknowledged_message_once(start_cluster):
    cluster = start_cluster("async")

    async def no_fault(cluster, observer, history):
        pass

    run = run_rounds(cluster, no_fault, rounds=2)
    print(run.report("no fault"))
    assert run.verdict.acked > 100, run.report("no fault")
    assert not run.verdict.problems("sync"), "\n".join([run.report("no fault"), *run.verdict.problems("sync")])
    assert run.verdict.deliveries == run.verdict.delivered_ids, "a duplicate without any fault"
    assert len(run.history.cancels) > 0, "the canceller never cancelled"

