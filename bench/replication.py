"""`ops/bench replication`: what replication costs at ingest, and how long a failover takes.

Ingest: the load generator of `ops/bench ingest` (its own process, N producers, batches of 1 KiB
messages due in an hour) against a single node, a master with one slave and `replication =
"async"`, and a master with one slave and `replication = "sync"` (each acknowledgement waits for
the slave's fsync). Every node is its own process on 127.0.0.1 with `flush = "sync"`.

Failover: a meta server (heartbeats every 200 ms, 3 missed mark a node down), a master and a
slave registered with it, and a stream of messages each due 20 ms after the one before. The
master is killed (SIGKILL); the figure is the time from the kill to the first message the
promoted slave delivers to its spool, minus nothing: the whole outage a consumer sees, lease
expiry and promotion included. `--rounds N` repeats it (default 3).
"""
from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from bench.harness import LOCALHOST, DelayServerProcess, now_ms
from delayserver.metrics import percentile
from delayserver.sender.spool import iter_spool

HEARTBEAT_MS = 200
MISSED = 3
STREAM_STEP_MS = 20
_LISTENING = re.compile(rb"meta server listening on 127\.0\.0\.1:(\d+)")


def _node(data_dir: Path, config: str) -> DelayServerProcess:
    path = data_dir.with_name(data_dir.name + ".toml")
    path.write_text(config)
    return DelayServerProcess(data_dir, config_path=path).start()


def _load(address: str, producers: int, seconds: float, batch: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.ingest", "load", address, str(producers), str(seconds),
                          str(batch)], capture_output=True, check=True)
    return json.loads(out.stdout)


def ingest(mode: str, producers: int, seconds: float, batch: int) -> dict:
    """mode: "single", "async" or "sync"."""
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        tmp = Path(tmp)
        master = _node(tmp / "m", "" if mode == "single" else f'replication = "{mode}"\nsync_timeout_ms = "30s"\n')
        stack.callback(master.stop)
        if mode != "single":
            slave = _node(tmp / "s", f'replicate_from = "{master.address}"\n')
            stack.callback(slave.stop)
            _wait_for_writes(master.address)
        return _load(master.address, producers, seconds, batch)


def _wait_for_writes(address: str, timeout_s: float = 60) -> None:
    """Until the master takes writes (sync mode: once its slave is in sync)."""
    from delayserver.client import Producer

    deadline = time.monotonic() + timeout_s
    with Producer(address) as producer:
        while True:
            try:
                producer.send("bench.warmup", b"x", delay=3_600_000)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


class _Meta:
    def __init__(self, data_dir: Path):
        self.log_path = data_dir.with_name("meta.log")
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "delayserver", "meta", "--data-dir", str(data_dir), "--listen",
                 f"{LOCALHOST}:0", "--heartbeat-interval-ms", str(HEARTBEAT_MS), "--missed-heartbeats", str(MISSED)],
                stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = _LISTENING.search(self.log_path.read_bytes())
            if m:
                self.address = f"{LOCALHOST}:{int(m.group(1))}"
                return
            time.sleep(0.05)
        raise RuntimeError(f"meta server did not start: {self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def failover_once(mode: str) -> float:
    """Seconds from SIGKILL of the master to the promoted slave's first delivery."""
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        tmp = Path(tmp)
        meta = _Meta(tmp / "meta")
        stack.callback(meta.stop)
        common = f'meta = "{meta.address}"\ngroup = "bench"\nreplication = "{mode}"\n'
        master = _node(tmp / "n1", common + 'node_id = "n1"\n')
        stack.callback(master.stop)
        time.sleep(HEARTBEAT_MS * 2 / 1000)  # n1 registers first: the master
        slave = _node(tmp / "n2", common + 'node_id = "n2"\n')
        stack.callback(slave.stop)
        _wait_for_writes(master.address)
        start = now_ms() + 1000
        trio.run(_stream, master.address, start, 60_000 // STREAM_STEP_MS)
        while now_ms() < start + 1000:  # deliveries are under way, and replicated
            time.sleep(0.05)
        killed = now_ms()
        master.kill()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            first = min((t for _, t, _, _ in iter_spool(slave.data_dir, "bench.failover")), default=None)
            if first is not None:
                return (first - killed) / 1000
            time.sleep(0.01)
        raise RuntimeError("the slave delivered nothing within 60 s of the kill")


async def _stream(address: str, start: int, count: int) -> None:
    from delayserver.client import AsyncProducer, Message

    async with AsyncProducer(address, timeout=60) as prod:
        messages = [Message("bench.failover", b"x", deliver_at=start + i * STREAM_STEP_MS) for i in range(count)]
        for i in range(0, count, 500):
            await prod.send_many(messages[i : i + 500])


def main(argv: list[str]) -> None:
    producers, seconds, batch, rounds = 32, 10.0, 64, 3
    if "--quick" in argv:
        seconds, rounds = 3.0, 1
    if "--rounds" in argv:
        rounds = int(argv[argv.index("--rounds") + 1])
    for mode in ("single", "async", "sync"):
        r = ingest(mode, producers, seconds, batch)
        print(f"replication ingest {mode:6s} producers={producers} batch={batch} body=1KiB: "
              f"{r['msgs_per_s']:,.0f} acknowledged msg/s; ack latency per batch "
              f"P50 {r['batch_ack_ms_p50']:.1f} ms, P99 {r['batch_ack_ms_p99']:.1f} ms", flush=True)
    for mode in ("async", "sync"):
        times = sorted(failover_once(mode) for _ in range(rounds))
        print(f"replication failover {mode:5s} (heartbeat {HEARTBEAT_MS} ms, {MISSED} missed): master killed to "
              f"first delivery by the new master: median {percentile(times, 0.5):.2f} s, "
              f"max {times[-1]:.2f} s over {rounds} rounds", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
