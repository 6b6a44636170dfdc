"""`ops/bench ingest`: acknowledged messages/s and ack latency of the real server over loopback.

The server runs as its own process on a temp data directory; the load generator runs in another
process (`python -m bench.ingest load ...`) with N concurrent producers, each sending
batches of 1 KiB messages due in an hour (so the figures are ingest alone) and timing each batch
from send to acknowledgement.

Printed per flush mode: acknowledged msg/s, ack latency per batch, and the CPU per acknowledged
message of the server (utime + stime from /proc/<pid>/stat over the load, not wall time: the
figure other work on a shared machine disturbs least) and of the load generator (its rusage).
The server's figure is also given for its event loop's thread alone (/proc/<pid>/task/<pid>/stat),
with the share of a core it took over the sends: where that nears 100%, that one thread, which runs
all of the node's Python, is what limits the rate, however idle the machine's other core is.
`--profile FILE` also samples the server with py-spy during the flush=sync run and writes the
collapsed stacks to FILE (`--quick`: 3 s runs instead of 10 s). `--producers N` and `--batch M`
change the load's shape (32 producers, 64 messages a request by default): the server's CPU per
message at two batch sizes separates what it spends per request from what it spends per message.
`--dedupe-window D` runs the server with that `dedupe_window` ("0": no dedupe table), to see what
the table of accepted ids costs each message. `--seconds S` sets the runs' length, `--window W`
prints each W seconds' rate and server CPU per message (how a long run's cost moves as the logs
grow), `--sync-only` leaves out the flush=async run.
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import trio

from bench.harness import (
    DelayServerProcess, environment_note, loop_stalls_ms, memory_note, proc_cpu_seconds, py_spy, thread_cpu_seconds,
)
from delayserver.metrics import percentile


async def _producer(address: str, seconds: float, batch: int, body: bytes, out: list, lat: list,
                    acks: list | None) -> None:
    from delayserver.client import AsyncProducer, Message

    async with AsyncProducer(address, timeout=30) as prod:
        deadline = trio.current_time() + seconds
        msgs = [Message("bench.ingest", body, delay=3_600_000) for _ in range(batch)]
        while trio.current_time() < deadline:
            t0 = time.perf_counter()
            results = await prod.send_many(msgs, batch=batch)
            lat.append((time.perf_counter() - t0) * 1000)
            out.append(sum(1 for r in results if not isinstance(r, Exception)))
            if acks is not None:
                acks.append((time.time(), out[-1]))


async def _load(address: str, producers: int, seconds: float, batch: int, timeline: bool = False) -> dict:
    """With `timeline`, the result also lists each batch's acknowledgement as (wall time, messages)."""
    body = b"x" * 1024
    counts: list[int] = []
    latencies: list[float] = []
    acks: list | None = [] if timeline else None
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(producers):
            nursery.start_soon(_producer, address, seconds, batch, body, counts, latencies, acks)
    elapsed = time.perf_counter() - t0
    latencies.sort()
    result = {"acked": sum(counts), "seconds": elapsed, "msgs_per_s": sum(counts) / elapsed,
              "batch_ack_ms_p50": percentile(latencies, 0.5), "batch_ack_ms_p99": percentile(latencies, 0.99)}
    if acks is not None:
        result["acks"] = acks
    return result


def start_server(tmp: Path, flush: str, dedupe_window: str | None = None) -> DelayServerProcess:
    """The server, started, its data (and its config file, for a `dedupe_window`) in `tmp`."""
    config = None
    if dedupe_window is not None:
        config = tmp / "node.toml"
        config.write_text(f"dedupe_window = {json.dumps(dedupe_window)}\n")
    return DelayServerProcess(tmp / "data", config_path=config, flush=flush).start()


def _sample_cpu(pid: int, every: float, samples: list, stop: threading.Event) -> None:
    """(wall time, the server's CPU seconds) every `every` seconds until `stop` is set."""
    while True:
        samples.append((time.time(), proc_cpu_seconds(pid)))
        if stop.wait(every):
            samples.append((time.time(), proc_cpu_seconds(pid)))
            return


def _windows(samples: list, acks: list) -> list[tuple[float, float, float]]:
    """(seconds since the first sample, acknowledged msg/s, server CPU us per message) of each
    window between two CPU samples."""
    out = []
    for (ta, ca), (tb, cb) in zip(samples, samples[1:]):
        n = sum(count for t, count in acks if ta <= t < tb)
        out.append((ta - samples[0][0], n / (tb - ta), (cb - ca) * 1e6 / max(n, 1)))
    return out


def bench(flush: str, producers: int, seconds: float, batch: int, profile: str = "",
          dedupe_window: str | None = None, window: float = 0.0) -> dict:
    """`dedupe_window`: the server's `dedupe_window` (its default when None; "0" turns it off).
    `window`: also the rate and the server's CPU per message of each `window` seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(Path(tmp), flush, dedupe_window)
        try:
            pid = server.process.pid
            spy = None
            if profile:
                spy = py_spy(pid, seconds, profile)
            before, loop_before, children_before = proc_cpu_seconds(pid), thread_cpu_seconds(pid, pid), _children_cpu()
            samples: list = []
            stop = threading.Event()
            sampler = threading.Thread(target=_sample_cpu, args=(pid, window, samples, stop)) if window else None
            if sampler is not None:
                sampler.start()
            # (its answer, the timeline of a long run among it, goes to a file: a pipe read only at
            # the end would fill and stop the load generator)
            with open(Path(tmp) / "load.json", "w+") as out_file:
                load = subprocess.Popen(
                    [sys.executable, "-m", "bench.ingest", "load", server.address,
                     str(producers), str(seconds), str(batch), *(["--timeline"] if window else [])], stdout=out_file)
                load.wait()
                out_file.seek(0)
                out = out_file.read()
            if sampler is not None:
                stop.set()
                sampler.join()
            if spy is not None:
                spy.wait(60)
            if load.returncode:
                raise RuntimeError(f"the load generator failed ({load.returncode})")
            result = json.loads(out)
            if window:
                result["windows"] = _windows(samples, result.pop("acks"))
            # The load process has exited, so its CPU is whole; the server's is read as the load ends.
            result["server_cpu_us_per_msg"] = (proc_cpu_seconds(pid) - before) / max(result["acked"], 1) * 1e6
            # Its event loop's thread alone: where its Python runs, one core at most.
            loop = thread_cpu_seconds(pid, pid) - loop_before
            result["server_loop_cpu_us_per_msg"] = loop / max(result["acked"], 1) * 1e6
            result["server_loop_share"] = loop / result["seconds"]
            # The server is still running, so the children's figure grew by the load process alone.
            result["load_cpu_us_per_msg"] = (_children_cpu() - children_before) / max(result["acked"], 1) * 1e6
            result["stalls_ms"] = loop_stalls_ms(server.log_path.read_text(errors="replace"))
            return result
        finally:
            server.stop()


def _children_cpu() -> float:
    """CPU seconds of this process's children that have exited and been waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="ops/bench ingest")
    parser.add_argument("--quick", action="store_true", help="3 s runs instead of 10 s")
    parser.add_argument("--profile", default="", metavar="FILE",
                        help="sample the server with py-spy in the flush=sync run; collapsed stacks to FILE")
    parser.add_argument("--producers", type=int, default=32, help="concurrent producers (default 32)")
    parser.add_argument("--batch", type=int, default=64, help="messages per SEND request (default 64)")
    parser.add_argument("--seconds", type=float, default=None, help="seconds per run (default 10; --quick: 3)")
    parser.add_argument("--window", type=float, default=0.0, metavar="S",
                        help="also print each S-second window's rate and server CPU per message")
    parser.add_argument("--sync-only", action="store_true", help='only the flush = "sync" run')
    parser.add_argument("--dedupe-window", default=None, metavar="DURATION",
                        help='the server\'s dedupe_window ("0" turns dedupe off; default: the server\'s own)')
    args = parser.parse_args(argv)
    if args.producers < 1 or args.batch < 1:
        parser.error("--producers and --batch take a whole number of at least 1")
    if args.dedupe_window is not None:
        from delayserver.config import ConfigError, parse_duration

        try:
            parse_duration(args.dedupe_window, "--dedupe-window")
        except ConfigError as e:
            parser.error(str(e))
    if (args.seconds is not None and args.seconds <= 0) or args.window < 0:
        parser.error("--seconds and --window take a positive number of seconds")
    producers, batch = args.producers, args.batch
    seconds = args.seconds if args.seconds is not None else 3.0 if args.quick else 10.0
    print(f"ingest on {environment_note()}; {memory_note()}", flush=True)
    for flush in ("sync",) if args.sync_only else ("sync", "async"):
        r = bench(flush, producers, seconds, batch, args.profile if flush == "sync" else "", args.dedupe_window,
                  args.window)
        for at, rate, cpu in r.get("windows", ()):
            print(f"  {at:5.1f} s: {rate:9,.0f} acknowledged msg/s, server CPU {cpu:5.1f} us per message", flush=True)
        dedupe = "" if args.dedupe_window is None else f" dedupe_window={args.dedupe_window}"
        print(f"ingest flush={flush:5s} producers={producers} batch={batch} body=1KiB{dedupe}: "
              f"{r['msgs_per_s']:,.0f} acknowledged msg/s; ack latency per batch "
              f"P50 {r['batch_ack_ms_p50']:.1f} ms, P99 {r['batch_ack_ms_p99']:.1f} ms; "
              f"server CPU {r['server_cpu_us_per_msg']:.1f} us per acknowledged message "
              f"(/proc/<pid>/stat utime+stime), {r['server_loop_cpu_us_per_msg']:.1f} us of it on the event "
              f"loop's thread ({r['server_loop_share']:.0%} of a core over the sends); "
              f"load generator {r['load_cpu_us_per_msg']:.1f} us", flush=True)
        stalls = r["stalls_ms"]
        print(f"  event loop: {len(stalls)} task steps over 100 ms" + (f" (the longest {max(stalls)} ms)" if stalls else ""),
              flush=True)
    print(f"load average after the runs: {environment_note()}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["load"]:
        address, producers, seconds, batch = sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
        print(json.dumps(trio.run(_load, address, producers, seconds, batch, "--timeline" in sys.argv[6:])))
    else:
        main(sys.argv[1:])
