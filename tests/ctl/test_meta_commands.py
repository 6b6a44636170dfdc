"""A real meta server process: delayctl meta as subprocesses against it, kill -9 durability,
SIGTERM and SIGINT, and heartbeat expiry with tiny intervals."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import trio

from delayserver.meta.client import MetaClient
from tests.procs import wait_for

LISTENING = re.compile(r"meta server listening on 127\.0\.0\.1:(\d+)")


@attrs.define(eq=False)
class MetaProcess:
    data_dir: Path
    args: list[str] = attrs.field(factory=list)
    command: tuple[str, ...] = ("-m", "delayserver.meta")
    process: subprocess.Popen | None = None
    port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir.parent / f"{self.data_dir.name}.meta.log"

    def start(self, port: int = 0) -> MetaProcess:
        """Start the meta server and wait for its "listening on" line."""
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, *self.command, "--data-dir", str(self.data_dir),
                 "--listen", f"127.0.0.1:{port}", *self.args],
                stdout=subprocess.DEVNULL, stderr=log,
            )

        def listening():
            if self.process.poll() is not None:
                raise AssertionError(f"meta server exited {self.process.returncode}: {self.log()}")
            return LISTENING.search(self.log()[offset:])

        self.port = int(wait_for(listening, timeout=30).group(1))
        return self

    def stop(self, sig=signal.SIGTERM) -> int:
        self.process.send_signal(sig)
        return self.process.wait(30)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def meta(tmp_path):
    """A meta server that marks a node down after 1 s of silence. Its masters hold 900 ms leases,
    renewed every 200 ms: a heartbeat delayed by a loaded machine (or by a slow fsync of the
    store) for less than 700 ms costs no master its lease."""
    proc = MetaProcess(tmp_path / "meta", ["--heartbeat-interval-ms", "200", "--missed-heartbeats", "5"]).start()
    yield proc
    proc.kill()


def delayctl(meta: MetaProcess, *args, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "delayserver.ctl", "meta", "--meta", meta.address, *args],
                          capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"delayctl meta {args} exited {proc.returncode}: {proc.stderr}")
    return proc


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def request(meta_address: str, op: str, /, **args) -> dict:
    async def main():
        async with MetaClient(meta_address) as client:
            return await client.request(op, **args)

    return trio.run(main)


def test_broker_groups_and_routes_through_delayctl(meta):
    assert delayctl(meta, "broker-group", "add", "local", "--transport", "spool", "--address", "var/spool").stdout \
        == "broker group 'local' added\n"
    delayctl(meta, "broker-group", "add", "r1", "--transport", "redis", "--address", "redis://127.0.0.1:6379/0",
             "--weight", "3", "--option", "stream=delay:{subject}", "--option", "maxlen=1000")
    delayctl(meta, "broker-group", "update", "r1", "--weight", "5", "--remove-option", "maxlen", "--read-only")
    groups = json_lines(delayctl(meta, "broker-groups", "--json").stdout)
    assert groups == [
        {"name": "local", "transport": "spool", "address": "var/spool", "weight": 1, "read_only": False, "options": {}},
        {"name": "r1", "transport": "redis", "address": "redis://127.0.0.1:6379/0", "weight": 5, "read_only": True,
         "options": {"stream": "delay:{subject}"}},
    ]
    table = delayctl(meta, "broker-groups").stdout.splitlines()
    assert table[0].split() == ["NAME", "TRANSPORT", "ADDRESS", "WEIGHT", "READ_ONLY", "OPTIONS"]
    assert table[2].split()[:5] == ["r1", "redis", "redis://127.0.0.1:6379/0", "5", "yes"]

    assert delayctl(meta, "route", "add", "orders.*", "r1", "local").stdout == "route added\n"
    assert json_lines(delayctl(meta, "routes", "--json").stdout) == [
        {"pattern": "orders.*", "broker_groups": ["r1", "local"]}]
    assert delayctl(meta, "routes").stdout.splitlines()[1].split() == ["orders.*", "r1,local"]
    resolved = json.loads(delayctl(meta, "resolve", "orders.paid", "--json").stdout)
    assert resolved["route"] == "orders.*"
    assert [g["name"] for g in resolved["broker_groups"]] == ["local"]  # r1 is read-only

    delayctl(meta, "route", "remove", "orders.*")
    delayctl(meta, "broker-group", "remove", "r1")
    assert [g["name"] for g in json_lines(delayctl(meta, "broker-groups", "--json").stdout)] == ["local"]


@pytest.mark.parametrize("args, message", [
    (["broker-group", "remove", "nope"], "error: no broker group 'nope'"),
    (["route", "add", "x", "nope"], "error: no broker group 'nope'; add it first"),
    (["route", "remove", "nope"], "error: no route 'nope'"),
    (["group", "read-only", "nope", "on"], "error: no delay group 'nope'"),
    (["broker-group", "add", "x", "--transport", "spool", "--address", "a", "--weight", "0"],
     "error: weight must be 1 to"),
    (["resolve", "bad subject"], "error: resolve: bad subject"),
])
def test_a_refused_request_exits_1_with_the_server_message(meta, args, message):
    proc = delayctl(meta, *args, check=False)
    assert proc.returncode == 1
    assert proc.stderr.startswith(message)
    assert proc.stdout == ""


def test_usage_errors_exit_2(meta):
    assert delayctl(meta, "broker-group", "add", "x", "--transport", "pigeon", "--address", "a",
                    check=False).returncode == 2
    assert delayctl(meta, "broker-group", "add", "x", "--transport", "spool", "--address", "a", "--option", "novalue",
                    check=False).returncode == 2
    proc = subprocess.run([sys.executable, "-m", "delayserver.ctl", "meta", "--meta", "nohost", "groups"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "HOST:PORT" in proc.stderr


def test_an_unreachable_meta_server_exits_1(meta):
    meta.stop()
    proc = delayctl(meta, "groups", check=False)
    assert proc.returncode == 1 and proc.stderr.startswith(f"error: meta server {meta.address}")


def test_groups_nodes_and_read_only_through_delayctl(meta):
    request(meta.address, "register", group="g1", node_id="a", address="10.0.0.1:20801")
    request(meta.address, "register", group="g1", node_id="b", address="10.0.0.2:20801", want_role="slave")
    groups = json_lines(delayctl(meta, "groups", "--json").stdout)
    assert groups[0].pop("lease_expires_ms") > 0
    assert groups == [{"name": "g1", "read_only": False, "master_epoch": 1,
                       "master": {"node_id": "a", "address": "10.0.0.1:20801", "state": groups[0]["master"]["state"]}}]
    nodes = json_lines(delayctl(meta, "nodes", "--json").stdout)
    assert [(n["node_id"], n["role"], n["want_role"]) for n in nodes] == [("a", "master", "master"),
                                                                           ("b", "slave", "slave")]
    table = delayctl(meta, "nodes").stdout.splitlines()
    assert table[0].split() == ["GROUP", "NODE_ID", "ROLE", "STATE", "ADDRESS", "EPOCH", "WANT_ROLE", "LAST_HEARTBEAT"]
    assert delayctl(meta, "group", "read-only", "g1", "on").stdout == "delay group 'g1' is read-only\n"
    assert json_lines(delayctl(meta, "groups", "--json").stdout)[0]["read_only"] is True
    assert request(meta.address, "live_delay_groups")["delay_groups"] == []
    delayctl(meta, "group", "read-only", "g1", "off")
    assert json_lines(delayctl(meta, "groups", "--json").stdout)[0]["read_only"] is False


def test_a_real_meta_server_marks_a_silent_master_down_and_promotes_its_slave(meta):
    a = request(meta.address, "register", group="g1", node_id="a", address="h:1")
    b = request(meta.address, "register", group="g1", node_id="b", address="h:2")
    assert (a["role"], b["role"]) == ("master", "slave")

    def promoted():
        beat = request(meta.address, "heartbeat", group="g1", node_id="b", session=b["session"])
        return beat if beat["role"] == "master" else None

    beat = wait_for(promoted, timeout=30, interval=0.05)
    assert beat["epoch"] == 2
    old = request(meta.address, "heartbeat", group="g1", node_id="a", session=a["session"])
    assert (old["role"], old["epoch"]) == ("slave", 2)
    assert "node a of group g1 is down" in meta.log()


def test_the_store_survives_kill_9(meta):
    delayctl(meta, "broker-group", "add", "local", "--transport", "spool", "--address", "var/spool")
    delayctl(meta, "route", "add", "orders.*", "local")
    a = request(meta.address, "register", group="g1", node_id="a", address="h:1")
    assert a["epoch"] == 1
    meta.kill()  # SIGKILL: no chance to close anything
    port = meta.port
    meta.start(port)
    routes = json_lines(delayctl(meta, "routes", "--json").stdout)
    assert routes == [{"pattern": "orders.*", "broker_groups": ["local"]}]
    assert [g["name"] for g in json_lines(delayctl(meta, "broker-groups", "--json").stdout)] == ["local"]
    # The node's registration and the group's epoch are there too: its session still heartbeats,
    # and the next grant is epoch 2, never 1 again.
    beat = request(meta.address, "heartbeat", group="g1", node_id="a", session=a["session"])
    assert (beat["role"], beat["epoch"]) == ("master", 1)
    again = request(meta.address, "register", group="g1", node_id="a", address="h:1", previous_session=a["session"])
    assert again["epoch"] == 2


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_stop_it_cleanly(tmp_path, sig):
    proc = MetaProcess(tmp_path / "meta", command=("-m", "delayserver", "meta")).start()
    try:
        assert proc.stop(sig) == 0
        assert "stopping the meta server" in proc.log()
    finally:
        proc.kill()


def test_a_second_meta_server_on_the_same_store_is_refused(meta):
    second = subprocess.run([sys.executable, "-m", "delayserver.meta", "--data-dir", str(meta.data_dir),
                             "--listen", "127.0.0.1:0"], capture_output=True, text=True, timeout=60)
    assert second.returncode == 1
    assert "in use by another process" in second.stderr


def test_a_port_in_use_is_reported(meta, tmp_path):
    other = subprocess.run([sys.executable, "-m", "delayserver.meta", "--data-dir", str(tmp_path / "other"),
                            "--listen", meta.address], capture_output=True, text=True, timeout=60)
    assert other.returncode == 1
    assert f"cannot serve on {meta.address}" in other.stderr
