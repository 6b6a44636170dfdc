"""The fault suite: each nemesis for several rounds against a master, a slave and a meta server in
their own network namespaces, producers sending throughout, then the checker (see `checker`).

Sync mode must keep every acknowledged message and honour every acknowledged cancel through every
fault; both modes must never deliver early, never deliver what nobody sent, and redeliver (by the
same master or by two of different epochs) only what was in flight at a fault. Async mode says
how many acknowledged messages it lost, and the nodes' quarantine files must name each of them.

Rounds, producers and delays: DELAYSERVER_JEPSEN_ROUNDS (2), DELAYSERVER_JEPSEN_PRODUCERS (2),
DELAYSERVER_JEPSEN_MAX_DELAY_MS (3000); DELAYSERVER_JEPSEN_SEED replays a run's random choices.
"""
from __future__ import annotations

import pytest

from tests.jepsen.checker import check_quarantine
from tests.jepsen.nemesis import NEMESES
from tests.jepsen.quarantine import quarantined_ids
from tests.jepsen.suite import ROUNDS, run_rounds

pytestmark = pytest.mark.slow


def assert_ran(run, name: str, cluster) -> None:
    report = run.report(name)
    print(report)
    assert run.stuck is None, f"{report}\n{cluster.logs()}"
    assert len(run.history.faults) == ROUNDS, report
    assert run.verdict.acked > 50, f"too little was acknowledged to check anything: {report}"


@pytest.mark.parametrize("nemesis", sorted(NEMESES))
def test_sync_mode_keeps_every_acknowledged_message_through(nemesis, start_cluster):
    cluster = start_cluster("sync")
    run = run_rounds(cluster, NEMESES[nemesis])
    assert_ran(run, f"sync {nemesis}", cluster)
    problems = run.verdict.problems("sync")
    assert not problems, "\n".join([run.report(f"sync {nemesis}"), *problems, cluster.logs()])


@pytest.mark.parametrize("nemesis", ["kill_master", "partition_master", "pause_master"])
def test_async_mode_loses_only_what_it_reports_and_never_delivers_wrongly(nemesis, start_cluster):
    cluster = start_cluster("async")
    run = run_rounds(cluster, NEMESES[nemesis])
    assert_ran(run, f"async {nemesis}", cluster)
    problems = run.verdict.problems("async")
    assert not problems, "\n".join([run.report(f"async {nemesis}"), *problems, cluster.logs()])


def test_async_mode_quarantines_exactly_the_acknowledged_messages_it_lost(start_cluster):
    cluster = start_cluster("async")
    run = run_rounds(cluster, NEMESES["kill_master_cut_from_slave"])
    assert_ran(run, "async kill_master_cut_from_slave", cluster)
    assert run.verdict.lost, "the master acknowledged nothing the slave missed: nothing was tested"
    quarantined = {i for d in cluster.data_dirs.values() for i in quarantined_ids(d)}
    offenders = check_quarantine(run.verdict.lost, quarantined, run.history)
    assert not offenders, f"{run.report('async quarantine')}\n{offenders}"
