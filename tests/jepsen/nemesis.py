"""Nemeses: one round of one fault each, recorded in the history as a `Fault` from the moment it
was injected to the moment it was healed.

- kill_master: kill -9 the master; once the meta server names another master, start the old one
  again (it comes back as a slave and must catch up with, or fence itself from, the new history).
- restart_master: kill -9 the master and start it again at once, within its lease.
- partition_master: cut the master off from the meta server and the slave (producers still reach
  it) for two leases and a second, then heal.
- partition_slave: the same for the slave.
- kill_master_cut_from_slave: cut the master off from the slave alone (both still reach the meta
  server) for a second while producers send, then kill -9 the master; once the slave is promoted,
  heal and start the old master again. What the master acknowledged in that second never reached
  the slave: sync mode must not have acknowledged it; async mode loses it, and the old master
  must quarantine it when it finds its history diverged.
- pause_master: SIGSTOP the master for two leases and a second (its lease runs out, the slave is
  promoted), then SIGCONT: the old master wakes up believing it is master.
"""
from __future__ import annotations

from typing import Awaitable, Callable

import trio

from tests.jepsen.checker import Fault, History
from tests.jepsen.cluster import Cluster, Observer, now_ms

Nemesis = Callable[[Cluster, Observer, History], Awaitable[None]]


def _hold_s(cluster: Cluster) -> float:
    return 2 * cluster.timing.lease_ms / 1000 + 1.0


async def _restart(cluster: Cluster, name: str) -> None:
    await trio.to_thread.run_sync(cluster.nodes[name].start)


async def kill_master(cluster: Cluster, observer: Observer, history: History) -> None:
    victim = await observer.wait_master(60)
    start = now_ms()
    cluster.nodes[victim].kill()
    await observer.wait_master(60, other_than=victim)
    await _restart(cluster, victim)
    history.faults.append(Fault("kill_master", victim, start, now_ms()))


async def kill_master_cut_from_slave(cluster: Cluster, observer: Observer, history: History) -> None:
    victim = await observer.wait_master(60)
    slave = observer.slave()
    start = now_ms()
    await trio.to_thread.run_sync(cluster.network.partition, victim, slave)
    try:
        await trio.sleep(1.0)
        cluster.nodes[victim].kill()
        await observer.wait_master(60, other_than=victim)
    finally:
        await trio.to_thread.run_sync(cluster.network.heal)
    await _restart(cluster, victim)
    history.faults.append(Fault("kill_master_cut_from_slave", victim, start, now_ms()))


async def restart_master(cluster: Cluster, observer: Observer, history: History) -> None:
    victim = await observer.wait_master(60)
    start = now_ms()
    cluster.nodes[victim].kill()
    await _restart(cluster, victim)
    history.faults.append(Fault("restart_master", victim, start, now_ms()))


async def _partition(cluster: Cluster, history: History, kind: str, victim: str) -> None:
    start = now_ms()
    await trio.to_thread.run_sync(cluster.network.isolate, victim)
    try:
        await trio.sleep(_hold_s(cluster))
    finally:
        await trio.to_thread.run_sync(cluster.network.heal)
    history.faults.append(Fault(kind, victim, start, now_ms()))


async def partition_master(cluster: Cluster, observer: Observer, history: History) -> None:
    await _partition(cluster, history, "partition_master", await observer.wait_master(60))


async def partition_slave(cluster: Cluster, observer: Observer, history: History) -> None:
    await observer.wait_master(60)
    await _partition(cluster, history, "partition_slave", observer.slave())


async def pause_master(cluster: Cluster, observer: Observer, history: History) -> None:
    victim = await observer.wait_master(60)
    start = now_ms()
    cluster.nodes[victim].pause()
    try:
        await trio.sleep(_hold_s(cluster))
    finally:
        cluster.nodes[victim].resume()
    history.faults.append(Fault("pause_master", victim, start, now_ms()))


NEMESES: dict[str, Nemesis] = {f.__name__: f for f in (
    kill_master, kill_master_cut_from_slave, restart_master, partition_master, partition_slave, pause_master)}
