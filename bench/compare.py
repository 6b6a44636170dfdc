"""`ops/bench compare [--quick] [--runs N]`: our server against Redis sorted-set delay queues and the
real rq-scheduler, in one run on one machine, with the same workload, all delivering into a Redis
stream.

The systems:

- ours: `delayserver serve` with flush=sync (every acknowledged message is fsynced), delivering
  through its redis transport into a stream on a redis-server of its own (the broker);
- the sorted-set delay queue (see `zset_poller.py`): producers ZADD into a redis-server that runs
  without persistence, as such setups often do, and a poller process moves due members into a
  stream in that same redis-server with an atomic Lua script, sleeping `poll_ms` when nothing more
  is due: 1 s, RQ's scheduler interval (and a 100 ms variant in the full run); it runs again with
  `appendonly yes` and `appendfsync everysec`, and with `appendfsync always` (every ZADD fsynced
  before it is answered: the durability of our flush=sync);
- rq-scheduler (see `rq_queue.py`): the package's `enqueue_at` per message, its `rqscheduler`
  process at a 1 s interval and a real RQ worker that XADDs each job's message into the stream.

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

Then the ratios, ours / theirs: the clean runs of every system go in rounds (`--runs`, default 3),
and each ratio is printed as its median over the rounds with the lowest and highest (the spread).
A system still delivering 120 s after the window closed is not waited for: what it had not
delivered by then counts as not delivered.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs

from bench.deliver import send_workload
from bench.rq_queue import QUEUE as RQ_QUEUE
from bench.harness import (
    LOCALHOST, DelayServerProcess, PeakRss, RedisProcess, environment_note, lateness_figures, memory_note, mib, now_ms,
    pids_of, spread,
)
from bench.workload import SUBJECT, StreamConsumer, Workload, message_id, read_stream

FULL = Workload(n=100_000, window_ms=10_000)
QUICK = Workload(n=5_000, window_ms=2_000)
SCHEDULE_KEY = "delayq:schedule"
#: Members the poller moves per script call (RQ moves all that are due; Sidekiq one at a time).
POLL_LIMIT = 1000
#: After the window, the run ends once deliveries have stopped for this long (or all arrived).
QUIET_MS = 3000
#: A system still delivering this long after the window closed is not waited for any longer.
MAX_AFTER_WINDOW_MS = 120_000


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

    def __init__(self, tmp: Path, poll_ms: int, appendonly: bool, appendfsync: str = "everysec"):
        self.poll_ms = poll_ms
        self.name = f"sorted set, poll {poll_ms} ms, " + (f"appendfsync {appendfsync}" if appendonly else "no persistence")
        self.queue = RedisProcess(tmp / "queue", appendonly=appendonly, appendfsync=appendfsync)
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


class RqScheduler:
    """The rq-scheduler package (see `rq_queue.py`): its scheduler process at a 1 s interval and one
    RQ worker, on a redis-server without persistence (as the sorted-set run)."""

    kind = "rq"
    #: enqueue_at takes two round trips per message and cannot batch: give the sends more room.
    lead_factor = 4

    def __init__(self, tmp: Path):
        self.name = "rq-scheduler, interval 1 s, 1 RQ worker"
        self.queue = RedisProcess(tmp / "queue")
        self.stream_redis = self.queue
        self.log = tmp / "rq.log"
        self.processes: list[subprocess.Popen] = []
        self.quiet_ms = QUIET_MS

    def start(self, stack: contextlib.ExitStack) -> None:
        stack.callback(self.queue.stop)
        self.queue.start()
        url = f"redis://{self.queue.address}"
        bin_dir = Path(sys.executable).parent
        with open(self.log, "ab") as log:
            for args in ([str(bin_dir / "rqscheduler"), "--url", url, "--interval", "1", "--quiet"],
                         [str(bin_dir / "rq"), "worker", "--url", url, "--worker-class", "rq.worker.SimpleWorker",
                          "--logging_level", "WARNING", "--disable-job-desc-logging", RQ_QUEUE]):
                self.processes.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT))
        stack.callback(self._stop)

    def _stop(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()

    @property
    def producer_address(self) -> str:
        return self.queue.address

    def pids(self) -> list[int]:
        return pids_of(self.queue) + [p.pid for p in self.processes if p.poll() is None]


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
    peak_file: int = 0  # the file pages at most in `peak_rss` (the segments our read-ahead maps)


def run_system(system, w: Workload, *, kill: bool) -> Run:
    """One run of `system` (already built on a temp directory); with `kill`, the kill -9 run.

    A clean run reads the stream once deliveries are over, so that no consumer competes with the
    systems for the cores while they deliver; the kill run reads it live (see the module docstring).
    """
    with contextlib.ExitStack() as stack:
        system.start(stack)
        t0 = now_ms() + w.lead_ms * getattr(system, "lead_factor", 1)
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
            _wait_quiet(arrived, load["acked"], t0 + w.window_ms, system.quiet_ms,
                        t0 + w.window_ms + MAX_AFTER_WINDOW_MS)
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
               len(seen), len(delivered) - len(seen), lost, rss.peak, broker_rss.peak, rss.peak_file)


def _wait_quiet(arrived, expected: int, window_end_ms: int, quiet_ms: int, give_up_ms: int) -> None:
    """Return once `arrived()` reaches `expected`, or, after the window, it has not changed for
    `quiet_ms`, or at `give_up_ms` (what has not arrived by then counts as not delivered)."""
    last_count, last_change = -1, now_ms()
    while (count := arrived()) < expected and now_ms() < give_up_ms:
        if count != last_count:
            last_count, last_change = count, now_ms()
        elif now_ms() > max(window_end_ms, last_change) + quiet_ms:
            return
        time.sleep(0.1)


def run(make_system, w: Workload, *, kill: bool) -> Run:
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as tmp:
        return run_system(make_system(Path(tmp)), w, kill=kill)


#: The systems each round of clean runs measures, in the order they run (key -> label maker).
def clean_systems(main_poll: int) -> dict:
    return {
        "ours": Ours,
        "zset": lambda tmp: SortedSet(tmp, main_poll, False),
        "zset_everysec": lambda tmp: SortedSet(tmp, main_poll, True, "everysec"),
        "zset_always": lambda tmp: SortedSet(tmp, main_poll, True, "always"),
        "rq": RqScheduler,
    }


def compare(w: Workload, poll_variants: tuple[int, ...] = (1000,), runs: int = 1) -> dict:
    """Every run of the comparison: {"ours", "ours_kill", "zset": {poll_ms: Run}, "zset_kill",
    "zset_aof_kill", "rounds"}. "rounds" holds `runs` rounds of clean runs, each a {key: Run} of
    every system of `clean_systems` run one after the other (so a disturbance of the machine hits a
    round, not one system); "ours" and "zset" are taken from the first round."""
    main_poll = poll_variants[0]
    rounds = [{key: run(make, w, kill=False) for key, make in clean_systems(main_poll).items()}
              for _ in range(runs)]
    results = {
        "ours": rounds[0]["ours"],
        "ours_kill": run(Ours, w, kill=True),
        "zset": {main_poll: rounds[0]["zset"], **{poll: run(lambda tmp: SortedSet(tmp, poll, False), w, kill=False)
                                                  for poll in poll_variants[1:]}},
        "zset_kill": run(lambda tmp: SortedSet(tmp, main_poll, False), w, kill=True),
        "zset_aof_kill": run(lambda tmp: SortedSet(tmp, main_poll, True), w, kill=True),
        "rounds": rounds,
    }
    return results


def _row(r: Run, lost: str) -> str:
    f = r.lateness
    return (f"| {r.system} | {r.acked_per_s:,.0f} | {r.delivered:,} | {f['p50']} | {f['p90']} | {f['p99']} | {f['p999']} "
            f"| {f['max']} | {f['early']} | {mib(r.peak_rss)} | {lost} |")


def _lost(r: Run) -> str:
    return f"{r.lost:,} of {r.acked:,}"


def table(results: dict) -> str:
    """The first round's figures, one row per system, with the kill -9 runs' losses."""
    first = results["rounds"][0]
    zsets = results["zset"]
    aof = results["zset_aof_kill"]
    lines = [
        "| system | acknowledged msg/s | delivered | P50 ms | P90 ms | P99 ms | P999 ms | max ms | early | peak RSS "
        "| lost after kill -9 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        _row(first["ours"], _lost(results["ours_kill"])),
        _row(first["zset"], _lost(results["zset_kill"])),
    ]
    for r in list(zsets.values())[1:]:
        lines.append(_row(r, "(not run)"))
    lines.append(_row(first["zset_everysec"], _lost(aof)))
    lines.append(_row(first["zset_always"], "(not run)"))
    lines.append(_row(first["rq"], "(not run)"))
    return "\n".join(lines)


def _ratio(a: float, b: float) -> float:
    return a / b if b else (1.0 if a == b else float("inf"))


def ratio_table(results: dict) -> str:
    """Ours / each other system, per round, as median (min-max) over the rounds."""
    rounds = results["rounds"]
    lines = [
        f"ratios, ours / theirs, median (min-max) over {len(rounds)} round(s):",
        "| theirs | acknowledged msg/s, ours / theirs | their msg/s | our msg/s | P99 lateness, ours / theirs "
        "| their P99 ms | our P99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    ours = [r["ours"] for r in rounds]
    for key in [k for k in rounds[0] if k != "ours"]:
        theirs = [r[key] for r in rounds]
        lines.append(
            f"| {theirs[0].system} "
            f"| {spread([_ratio(o.acked_per_s, t.acked_per_s) for o, t in zip(ours, theirs)], '.2f')} "
            f"| {spread([t.acked_per_s for t in theirs], ',.0f')} | {spread([o.acked_per_s for o in ours], ',.0f')} "
            f"| {spread([_ratio(o.lateness['p99'], t.lateness['p99']) for o, t in zip(ours, theirs)], '.3f')} "
            f"| {spread([t.lateness['p99'] for t in theirs], '.0f')} | {spread([o.lateness['p99'] for o in ours], '.0f')} |")
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
        f"{ratio(ours.peak_rss + ours.stream_redis_peak_rss, theirs.peak_rss)}; file pages at most, "
        f"shared with the page cache: ours {mib(ours.peak_file)}, theirs {mib(theirs.peak_file)})",
        f"  lost after kill -9: {results['ours_kill'].lost} vs {results['zset_kill'].lost} "
        f"(appendonly everysec: {results['zset_aof_kill'].lost})",
    ])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="ops/bench compare")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK.describe()} instead of {FULL.describe()}")
    parser.add_argument("--runs", type=int, default=None,
                        help="rounds of clean runs of every system (default 3, 1 with --quick)")
    args = parser.parse_args(argv)
    w = QUICK if args.quick else FULL
    runs = args.runs or (1 if args.quick else 3)
    print(f"compare on {environment_note()}; {memory_note()}", flush=True)
    print(f"workload: {w.describe()}; every system delivers into a Redis stream; {runs} round(s)", flush=True)
    results = compare(w, (1000,) if args.quick else (1000, 100), runs=runs)
    print(table(results))
    main_zset = next(iter(results["zset"].values()))
    print(f"our broker redis-server (holding the stream) peaked at {mib(results['ours'].stream_redis_peak_rss)}; "
          f"duplicates: ours {results['ours'].duplicates}, after kill -9 {results['ours_kill'].duplicates}; "
          f"sorted set {main_zset.duplicates}, after kill -9 {results['zset_kill'].duplicates}, "
          f"appendonly {results['zset_aof_kill'].duplicates}")
    print(ratios(results))
    print(ratio_table(results))
    print(f"load average after the runs: {environment_note()}")
