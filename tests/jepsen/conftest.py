"""Fixtures of the fault suite: a network of namespaces, and clusters started in it. Both are torn
down at the end of the test, whether it passed or not."""
from __future__ import annotations

import pytest

from tests.jepsen.cluster import Cluster, Timing
from tests.jepsen.netns import Network, unsupported_reason


@pytest.fixture
def network():
    reason = unsupported_reason()
    if reason is not None:
        pytest.skip(f"the fault suite needs network namespaces: {reason}")
    net = Network()
    try:
        yield net.open()
    finally:
        net.close()
    assert not net.leftovers(), f"namespaces or links left behind: {net.leftovers()}"


@pytest.fixture
def start_cluster(network, tmp_path):
    """`start_cluster(mode)`: a meta server and nodes n1 (master) and n2 (slave), started."""
    started: list[Cluster] = []

    def start(mode: str, timing: Timing = Timing()) -> Cluster:
        cluster = Cluster(network, tmp_path, mode, timing)
        started.append(cluster)
        return cluster.start()

    yield start
    for cluster in started:
        cluster.stop()
