"""README's Quick start and Python examples, run as written against `ops/run` (a real meta server
and delay server, as processes), with only the addresses and the data directory moved."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import attrs
import pytest

from tests.conftest import free_port
from tests.sender.test_readme_consumers import consumer_example

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
SHELL_PROMPT = "$ "


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end > 0 else None]


def code_blocks(text: str, lang: str = "") -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, re.M | re.S)


def shape(line: str) -> re.Pattern:
    """`line` with its ids (28 hex digits) and numbers (times, offsets) free to differ."""
    parts = re.split(r"([0-9a-f]{28}|\d+)", line)
    pattern = "".join("[0-9a-f]{28}" if re.fullmatch(r"[0-9a-f]{28}", p) else r"\d+" if p.isdigit()
                      else re.escape(p) for p in parts)
    return re.compile(pattern)


@attrs.define
class Run:
    meta: str
    delay: str
    metrics: str
    http: str
    var: Path
    env: dict
    stdout: list[str]

    def moved(self, text: str) -> str:
        """README's addresses and data directory replaced by this run's."""
        for readme, here in (("127.0.0.1:20800", self.meta), ("127.0.0.1:20801", self.delay),
                             ("127.0.0.1:20802", self.metrics), ("127.0.0.1:20803", self.http),
                             ("var/node", f"{self.var}/node")):
            text = text.replace(readme, here)
        return text

    def shell(self, command: str) -> subprocess.CompletedProcess:
        return subprocess.run(command, shell=True, cwd=REPO, env=self.env, capture_output=True, text=True,
                              timeout=120)


@pytest.fixture(scope="module")
def ops_run(tmp_path_factory):
    var = tmp_path_factory.mktemp("ops-run") / "var"
    meta, delay, metrics, http = (f"127.0.0.1:{free_port()}" for _ in range(4))
    env = dict(os.environ, VAR_DIR=str(var), META_LISTEN=meta, DELAY_LISTEN=delay, METRICS_LISTEN=metrics,
               HTTP_LISTEN=http,
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    log = open(var.parent / "ops-run.log", "w")
    proc = subprocess.Popen(["bash", str(REPO / "ops" / "run")], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=log, text=True, start_new_session=True)
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if any(l.startswith("delayserver: serving on") for l in lines) and any("nodes" in l for l in lines):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(180), f"ops/run did not come up: {lines}\n{(var.parent / 'ops-run.log').read_text()}"
        time.sleep(0.5)  # the blank line after the hint
        yield Run(meta, delay, metrics, http, var, env, lines)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_ops_run_prints_what_the_quick_start_shows(ops_run):
    shown = code_blocks(section("Quick start"))[0].splitlines()
    assert shown[0] == SHELL_PROMPT + "ops/run"
    want = sorted(ops_run.moved(line) for line in shown[1:] if line.strip())
    assert sorted(line for line in ops_run.stdout if line.strip()) == want


def test_the_quick_start_commands_answer_as_shown(ops_run):
    block = code_blocks(section("Quick start"))[1]
    steps: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith(SHELL_PROMPT):
            steps.append((line[len(SHELL_PROMPT):], []))
        else:
            steps[-1][1].append(line)
    readme_handle = None
    handle = None
    for command, shown in steps:
        if command.startswith("source "):
            continue  # the test runs with the environment's bin directory first on PATH already
        command = ops_run.moved(command)
        if readme_handle:
            command = command.replace(readme_handle, handle)
        if "--follow" in command:
            # The message is due 10 s after it was sent: read the spool until it is there.
            command = command.replace(" --follow", "")
            deadline = time.monotonic() + 90
            while not (done := ops_run.shell(command)).stdout and time.monotonic() < deadline:
                time.sleep(0.5)
        else:
            done = ops_run.shell(command)
        assert done.returncode == 0, (command, done.stderr)
        got = done.stdout.splitlines()
        assert len(got) == len(shown), (command, got, shown)
        for line, want in zip(got, shown):
            assert shape(want).fullmatch(line), (command, line, want)
        if command.startswith("delayctl send"):
            readme_handle, handle = shown[0], got[0]


def python_examples() -> list[str]:
    blocks = []
    for title in ("Sending messages", "Meta server, delay groups and failover"):
        blocks += code_blocks(section(title), "python")
    return blocks


@pytest.mark.parametrize("example", python_examples(), ids=lambda code: code.splitlines()[-1].strip()[:40])
def test_the_python_examples_run_and_print_what_their_comments_say(ops_run, example):
    done = subprocess.run([sys.executable, "-c", ops_run.moved(example)], cwd=REPO, env=ops_run.env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # A print whose comment is a bare name (`# PENDING`) says what it prints.
    said = [m[1] for m in re.finditer(r"^\s*print\(.*\)\s+# ([A-Z_]+)$", example, re.M)]
    if said:
        assert done.stdout.splitlines() == said


def test_the_other_python_examples_are_covered_elsewhere():
    """TLS needs certificates (tests/node/test_server.py runs TLS end to end), the Spark data
    source a Spark session (tests/spark) and the RabbitMQ and NATS consumers their brokers
    (tests/sender/test_readme_consumers.py): README's examples of those are not run here."""
    covered = set(python_examples()) | {consumer_example("RabbitMQ"), consumer_example("NATS JetStream")}
    rest = [b for b in code_blocks(README, "python") if b not in covered]
    assert rest and all("ssl" in b or "spark" in b for b in rest)
