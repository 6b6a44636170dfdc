"""A delay group under test: a meta server and two delay-server nodes, each a real process in its
own network namespace (see `netns`), and an observer that records who the meta server says is
master, with which epoch, when.

Timings are short so that a fault suite round takes seconds: heartbeats every `heartbeat_ms`, a
lease of `heartbeat_ms * missed_heartbeats`. Every process writes its log beside its data
directory; `Cluster.logs()` gathers their tails for a failure message.
"""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import trio

from delayserver.meta.client import MetaClient, MetaError, MetaUnavailable
from tests.faults.harness import write_config
from tests.jepsen.checker import Term
from tests.jepsen.netns import Network

ROOT = Path(__file__).resolve().parents[2]
META_PORT = 20800
NODE_PORT = 20801
GROUP = "jepsen"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@attrs.define(eq=False)
class Proc:
    """One process of the cluster, run in its node's namespace; `start` waits for `ready` in its log."""

    name: str
    network: Network
    argv: list[str]
    log_path: Path
    ready: re.Pattern
    process: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> Proc:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.network.exec_prefix(self.name) + [sys.executable, *self.argv],
                                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + timeout
        while not self.ready.search(self.log()[offset:]):
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.process.returncode}: {self.log()[-3000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name} did not start in {timeout} s: {self.log()[-3000:]}")
            time.sleep(0.05)
        return self

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """kill -9 (a paused process too), and reap it."""
        if self.running():
            self.process.kill()
            self.process.wait(30)

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.running():
            self.process.send_signal(signal.SIGCONT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@attrs.frozen
class Timing:
    heartbeat_ms: int = 200
    missed_heartbeats: int = 5

    @property
    def lease_ms(self) -> int:
        return self.heartbeat_ms * self.missed_heartbeats


def node_options(mode: str) -> dict:
    """The configuration of a node in replication `mode` ("sync" or "async")."""
    options = {"flush": "sync", "deliver_through_meta_outage": False, "max_inflight": 512}
    if mode == "sync":
        options.update({"replication": "sync", "sync_timeout_ms": 2000})
    return options


@attrs.define(eq=False)
class Cluster:
    network: Network
    base: Path
    mode: str = "sync"
    timing: Timing = Timing()
    meta: Proc | None = None
    nodes: dict[str, Proc] = attrs.Factory(dict)
    data_dirs: dict[str, Path] = attrs.Factory(dict)

    @property
    def meta_address(self) -> str:
        return f"{self.network.addresses['meta']}:{META_PORT}"

    def address(self, name: str) -> str:
        return f"{self.network.addresses[name]}:{NODE_PORT}"

    def start(self, names: tuple[str, ...] = ("n1", "n2")) -> Cluster:
        """The meta server, then each node in turn (the first registered becomes master)."""
        self.network.add("meta")
        self.meta = Proc("meta", self.network, [
            "-m", "delayserver.meta", "--data-dir", str(self.base / "meta"), "--listen", self.meta_address,
            "--heartbeat-interval-ms", str(self.timing.heartbeat_ms),
            "--missed-heartbeats", str(self.timing.missed_heartbeats)],
            self.base / "meta.log", re.compile(r"meta server listening on")).start()
        for name in names:
            self.network.add(name)
            self.data_dirs[name] = self.base / name
            config = write_config(self.base / f"{name}.toml", node_options(self.mode))
            self.nodes[name] = Proc(name, self.network, [
                "-m", "delayserver", "serve", "--config", str(config), "--data-dir", str(self.data_dirs[name]),
                "--listen", self.address(name), "--advertised-address", self.address(name),
                "--meta", self.meta_address, "--group", GROUP, "--node-id", name],
                self.base / f"{name}.log", re.compile(r"serving on")).start()
        return self

    def stop(self) -> None:
        for proc in [*self.nodes.values(), self.meta]:
            if proc is not None:
                proc.resume()
                proc.kill()

    def logs(self, chars: int = 2500) -> str:
        return "\n".join(f"--- {p.name} ({p.log_path}) ---\n{p.log()[-chars:]}"
                         for p in [self.meta, *self.nodes.values()] if p is not None)


@attrs.define(eq=False)
class Observer:
    """Polls the meta server every `interval_s` and keeps the master terms it saw, the address of
    the master (None while the master is down or unknown) and each node's state."""

    cluster: Cluster
    interval_s: float = 0.1
    terms: list[Term] = attrs.Factory(list)
    master: str | None = None  # node id of a master that is up
    states: dict[str, tuple[str, str]] = attrs.Factory(dict)  # node id -> (role, state)
    changed: trio.Event = attrs.Factory(trio.Event)

    def master_address(self) -> str | None:
        return self.cluster.address(self.master) if self.master else None

    def slave(self) -> str | None:
        return next((n for n in self.cluster.nodes if n != self.master), None)

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        started = False
        async with MetaClient(self.cluster.meta_address, timeout_s=1.0) as client:
            while True:
                try:
                    nodes = (await client.request("list_nodes", group=GROUP))["nodes"]
                except (MetaError, MetaUnavailable, OSError):
                    await trio.sleep(self.interval_s)
                    continue
                self._update(nodes)
                if not started and self.master:
                    task_status.started()
                    started = True
                await trio.sleep(self.interval_s)

    def _update(self, nodes: list[dict]) -> None:
        at = now_ms()
        self.states = {n["node_id"]: (n["role"], n["state"]) for n in nodes}
        master = next((n for n in nodes if n["role"] == "master"), None)
        current = (master["node_id"], master["epoch"]) if master else None
        last = (self.terms[-1].node, self.terms[-1].epoch) if self.terms and self.terms[-1].end_ms is None else None
        if current != last:
            if last is not None:
                self.terms[-1] = attrs.evolve(self.terms[-1], end_ms=at)
            if current is not None:
                self.terms.append(Term(current[0], current[1], at))
        up = master["node_id"] if master and master["state"] == "up" else None
        if up != self.master:
            self.master = up
            self.changed.set()
            self.changed = trio.Event()

    async def wait_master(self, timeout_s: float, other_than: str | None = None) -> str:
        """The node id of a master that is up (not `other_than`), once there is one."""
        with trio.fail_after(timeout_s):
            while self.master is None or self.master == other_than:
                await self.changed.wait()
        return self.master

    async def wait_all_up(self, timeout_s: float) -> None:
        with trio.fail_after(timeout_s):
            while not (self.master and len(self.states) == len(self.cluster.nodes)
                       and all(state == "up" for _, state in self.states.values())):
                await trio.sleep(self.interval_s)
