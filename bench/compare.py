"""`ops/bench compare [--quick]`: our server against a Redis sorted-set delay queue, in one run on
one machine, with the same workload, both delivering into a Redis stream.

The two systems:

- ours: `delayserver serve` with flush=sync (every acknowledged message is fsynced), delivering
  through its redis transport into a stream on a redis-server of its own (the broker);
- the sorted-set delay queue (see `zset_poller.py`): producers ZADD into a redis-server that runs
  without persistence, as such setups often do, and a poller process moves due members into a
  stream in that same redis-server with an atomic Lua script, sleeping `poll_ms` when nothing more
  is due: 1 s, RQ's scheduler interval (and a 100 ms variant in the full run).

The workload (see `workload.py`) is the same for both: N messages due uniformly over a window,
sent beforehand by the same number of concurrent producers in the same batches (a SEND frame, or a
ZADD, per batch, one batch in flight per producer). The benchmark reads the stream once deliveries
are over; in the kill -9 runs a consumer in the benchmark process reads it as entries arrive (XREAD
BLOCK), so what it read stays counted even if its redis-server then loses it.

Measured, for each system:

- acknowledged msg/s: messages acknowledged over the time the producers took to send them all;
- lateness: arrival in the stream (the millisecond part of the entry id, Redis's clock when it
  took the entry) minus schedule time, at P50, P90, P99, P999 and max; early deliveries;
- peak RSS, sampled every 50 ms: our server process; for the sorted-set queue, its redis-server
  plus the poller (that redis-server also holds the stream; ours is in the broker, shown apart);
- lost after kill -9: a second run, in which, once every send is acknowledged and half the window
  has passed, the delay server (ours) or the sorted-set's redis-server is killed with SIGKILL and
  restarted at once; once the window has passed and deliveries have stopped, the acknowledged ids
  the consumer never saw are lost. The sorted-set queue is killed twice: without persistence, and
  with `appendonly yes`, `appendfsync everysec`.

Then the ratios, ours / theirs.
"""
from __future__ import annotations

import contextlib
import functools
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs

from bench.deliver import send_workload
from bench.harness import (
    LOCALHOST, DelayServerProcess, PeakRss, RedisProcess, environment_note, lateness_figures, mib, now_ms, pids_of,
)
from bench.workload import SUBJECT, StreamConsumer, Workload, message_id, read_stream

FULL = Workload(n=100_000, window_ms=10_000)
QUICK = Workload(n=5_000, window_ms=2_000)
SCHEDULE_KEY = "delayq:schedule"
#: Members the poller moves per script call (RQ moves all that are due; Sidekiq one at a time).
POLL_LIMIT = 1000
#: After the window, the run ends once deliveries have stopped for this long (or all arrived).
QUIET_MS = 3000


class Ours:
    kind = "ours"

    def __init__(self, tmp: Path):
        self.name = "delay server, flush=sync"
        self.broker = RedisProcess(tmp / "broker")
        config = tmp / "server.toml"
        config.write_text(f'[[broker_group]]\nname = "redis"\ntransport = "redis"\naddress = "{self.broker.address}"\n')
        self.server = DelayServerProcess(tmp / "data", config)
        self.stream_redis = self.broker
        self.quiet_ms = QUIET_MS

    def start(self, stack: contextlib.ExitStack) -> None:
        stack.callback(self.broker.stop)
        self.broker.start()
        stack.callback(self.server.stop)
        self.server.start()

    @property
    def producer_address(self) -> str:
        return self.server.address

    def pids(self) -> list[int]:
        return pids_of(self.server)

    def crash_and_restart(self) -> None:
        self.server.kill()
        self.server.start()


class SortedSet:
    kind = "zset"

    def __init__(self, tmp: Path, poll_ms: int, appendonly: bool):
        self.poll_ms = poll_ms
        self.name = f"sorted set, poll {poll_ms} ms, " + ("appendonly everysec" if appendonly else "no persistence")
        self.queue = RedisProcess(tmp / "queue", appendonly=appendonly)
        self.stream_redis = self.queue
        self.poller: subprocess.Popen | None = None
        self.log = tmp / "poller.log"
        self.quiet_ms = max(QUIET_MS, 3 * poll_ms)

    def start(self, stack: contextlib.ExitStack) -> None:
        stack.callback(self.queue.stop)
        self.queue.start()
        with open(self.log, "ab") as log:
            self.poller = subprocess.Popen(
                [sys.executable, "-m", "bench.zset_poller", self.queue.address, SCHEDULE_KEY, SUBJECT,
                 str(self.poll_ms), str(POLL_LIMIT)], stdout=log, stderr=subprocess.STDOUT)
        stack.callback(self._stop_poller)

    def _stop_poller(self) -> None:
        self.poller.kill()
        self.poller.wait()

    @property
    def producer_address(self) -> str:
        return self.queue.address

    def pids(self) -> list[int]:
        return pids_of(self.queue) + ([self.poller.pid] if self.poller.poll() is None else [])

    def crash_and_restart(self) -> None:
        self.queue.kill()
        self.queue.start()


@attrs.frozen
class Run:
    system: str
    acked: int
    acked_per_s: float
    lateness: dict
    delivered: int
    duplicates: int
    lost: int
    peak_rss: int
    stream_redis_peak_rss: int


def run_system(system, w: Workload, *, kill: bool) -> Run:
    """One run of `system` (already built on a temp directory); with `kill`, the kill -9 run.

    A clean run reads the stream once deliveries are over, so that no consumer competes with the
    systems for the cores while they deliver; the kill run reads it live (see the module docstring).
    """
    with contextlib.ExitStack() as stack:
        system.start(stack)
        t0 = now_ms() + w.lead_ms
        broker = system.stream_redis
        client = broker.client(socket_timeout=5)
        stack.callback(client.close)
        consumer = stack.enter_context(StreamConsumer(LOCALHOST, broker.port, SUBJECT)) if kill else None
        with PeakRss(system.pids) as rss, PeakRss(lambda: pids_of(broker)) as broker_rss:
            load = send_workload(system.producer_address, w, t0, system.kind, SCHEDULE_KEY)
            if kill:
                time.sleep(max(0, t0 + w.window_ms // 2 - now_ms()) / 1000)
                system.crash_and_restart()
            arrived = consumer.arrived if kill else functools.partial(client.xlen, SUBJECT)
            _wait_quiet(arrived, load["acked"], t0 + w.window_ms, system.quiet_ms)
        if kill:
            stack.close()
            delivered = consumer.delivered
        else:
            delivered = read_stream(client, SUBJECT)[0]
    seen = {d.message_id for d in delivered}
    acked_ids = set(range(w.n)) - set(load["unacked"])
    lost = sum(1 for i in acked_ids if message_id(i) not in seen)
    return Run(system.name, load["acked"], load["acked"] / load["seconds"],
               lateness_figures([d.arrival_time - d.schedule_time for d in delivered]),
               len(seen), len(delivered) - len(seen), lost, rss.peak, broker_rss.peak)


def _wait_quiet(arrived, expected: int, window_end_ms: int, quiet_ms: int) -> None:
    """Return once `arrived()` reaches `expected`, or, after the window, it has not changed for `quiet_ms`."""
    last_count, last_change = -1, now_ms()
    while (count := arrived()) < expected:
        if count != last_count:
            last_count, last_change = count, now_ms()
        elif now_ms() > max(window_end_ms, last_change) + quiet_ms:
            return
        time.sleep(0.1)


def run(make_system, w: Workload, *, kill: bool) -> Run:
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as tmp:
        return run_system(make_system(Path(tmp)), w, kill=kill)


def compare(w: Workload, poll_variants: tuple[int, ...] = (1000,)) -> dict:
    """Every run of the comparison: {"ours", "ours_kill", "zset": {poll_ms: Run}, "zset_kill", "zset_aof_kill"}."""
    main_poll = poll_variants[0]
    results = {
        "ours": run(Ours, w, kill=False),
        "ours_kill": run(Ours, w, kill=True),
        "zset": {poll: run(lambda tmp: SortedSet(tmp, poll, False), w, kill=False) for poll in poll_variants},
        "zset_kill": run(lambda tmp: SortedSet(tmp, main_poll, False), w, kill=True),
        "zset_aof_kill": run(lambda tmp: SortedSet(tmp, main_poll, True), w, kill=True),
    }
    return results


def _row(r: Run, lost: str) -> str:
    f = r.lateness
    return (f"| {r.system} | {r.acked_per_s:,.0f} | {f['p50']} | {f['p90']} | {f['p99']} | {f['p999']} | {f['max']} "
            f"| {f['early']} | {mib(r.peak_rss)} | {lost} |")


def _lost(r: Run) -> str:
    return f"{r.lost:,} of {r.acked:,}"


def table(results: dict) -> str:
    ours, zsets = results["ours"], results["zset"]
    main = next(iter(zsets.values()))
    aof = results["zset_aof_kill"]
    lines = [
        "| system | acknowledged msg/s | P50 ms | P90 ms | P99 ms | P999 ms | max ms | early | peak RSS | lost after kill -9 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        _row(ours, _lost(results["ours_kill"])),
        _row(main, _lost(results["zset_kill"])),
    ]
    for r in list(zsets.values())[1:]:
        lines.append(_row(r, "(not run)"))
    lines.append(f"| {aof.system} | {aof.acked_per_s:,.0f} | | | | | | | | {_lost(aof)} |")
    return "\n".join(lines)


def ratios(results: dict) -> str:
    ours, theirs = results["ours"], next(iter(results["zset"].values()))
    lo, lt = ours.lateness, theirs.lateness

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}" if b else ("1.00" if a == b else "inf")

    return "\n".join([
        f"ratios, ours / {theirs.system}:",
        f"  acknowledged msg/s {ratio(ours.acked_per_s, theirs.acked_per_s)}",
        f"  lateness P50 {ratio(lo['p50'], lt['p50'])}, P99 {ratio(lo['p99'], lt['p99'])}, "
        f"P999 {ratio(lo['p999'], lt['p999'])}, max {ratio(lo['max'], lt['max'])}",
        f"  peak RSS {ratio(ours.peak_rss, theirs.peak_rss)} (ours plus its broker redis-server: "
        f"{ratio(ours.peak_rss + ours.stream_redis_peak_rss, theirs.peak_rss)})",
        f"  lost after kill -9: {results['ours_kill'].lost} vs {results['zset_kill'].lost} "
        f"(appendonly everysec: {results['zset_aof_kill'].lost})",
    ])


def main(argv: list[str]) -> None:
    quick = argv[:1] == ["--quick"]
    w = QUICK if quick else FULL
    print(f"compare on {environment_note()}", flush=True)
    print(f"workload: {w.describe()}; both deliver into a Redis stream", flush=True)
    results = compare(w, (1000,) if quick else (1000, 100))
    print(table(results))
    print(f"our broker redis-server (holding the stream) peaked at {mib(results['ours'].stream_redis_peak_rss)}; "
          f"duplicates: ours {results['ours'].duplicates}, after kill -9 {results['ours_kill'].duplicates}; "
          f"sorted set {results['zset'][1000].duplicates}, after kill -9 {results['zset_kill'].duplicates}, "
          f"appendonly {results['zset_aof_kill'].duplicates}")
    print(ratios(results))
    print(f"load average after the runs: {environment_note()}")
