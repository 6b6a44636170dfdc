"""`ops/bench ingest`: acknowledged messages/s and ack latency of the real server over loopback.

The server runs as its own process on a temp data directory; the load generator runs in another
process (`python -m bench.ingest load ...`) with N concurrent producers, each sending
batches of 1 KiB messages due in an hour (so the figures are ingest alone) and timing each batch
from send to acknowledgement.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import trio

from delayserver.metrics import percentile


async def _producer(address: str, seconds: float, batch: int, body: bytes, out: list, lat: list) -> None:
    from delayserver.client import AsyncProducer, Message

    async with AsyncProducer(address, timeout=30) as prod:
        deadline = trio.current_time() + seconds
        msgs = [Message("bench.ingest", body, delay=3_600_000) for _ in range(batch)]
        while trio.current_time() < deadline:
            t0 = time.perf_counter()
            results = await prod.send_many(msgs, batch=batch)
            lat.append((time.perf_counter() - t0) * 1000)
            out.append(sum(1 for r in results if not isinstance(r, Exception)))


async def _load(address: str, producers: int, seconds: float, batch: int) -> dict:
    body = b"x" * 1024
    counts: list[int] = []
    latencies: list[float] = []
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(producers):
            nursery.start_soon(_producer, address, seconds, batch, body, counts, latencies)
    elapsed = time.perf_counter() - t0
    latencies.sort()
    return {"acked": sum(counts), "seconds": elapsed, "msgs_per_s": sum(counts) / elapsed,
            "batch_ack_ms_p50": percentile(latencies, 0.5), "batch_ack_ms_p99": percentile(latencies, 0.99)}


def bench(flush: str, producers: int, seconds: float, batch: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        server = subprocess.Popen(
            [sys.executable, "-m", "delayserver", "serve", "--data-dir", str(Path(tmp) / "data"),
             "--listen", "127.0.0.1:0", "--flush", flush, "--log-level", "WARNING"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            line = server.stdout.readline().decode()
            port = int(line.rsplit(":", 1)[1].split(",")[0])
            cpu = psutil.Process(server.pid).cpu_times
            before = sum(cpu()[:2])
            load = subprocess.run(
                [sys.executable, "-m", "bench.ingest", "load", f"127.0.0.1:{port}",
                 str(producers), str(seconds), str(batch)], capture_output=True, check=True)
            result = json.loads(load.stdout)
            result["server_cpu_us_per_msg"] = (sum(cpu()[:2]) - before) / max(result["acked"], 1) * 1e6
            return result
        finally:
            server.terminate()
            server.wait(30)


def main(argv: list[str]) -> None:
    producers, seconds, batch = 32, 10.0, 64
    if argv and argv[0] == "--quick":
        seconds = 3.0
    for flush in ("sync", "async"):
        r = bench(flush, producers, seconds, batch)
        print(f"ingest flush={flush:5s} producers={producers} batch={batch} body=1KiB: "
              f"{r['msgs_per_s']:,.0f} acknowledged msg/s; ack latency per batch "
              f"P50 {r['batch_ack_ms_p50']:.1f} ms, P99 {r['batch_ack_ms_p99']:.1f} ms; "
              f"server CPU {r['server_cpu_us_per_msg']:.0f} us per message")


if __name__ == "__main__":
    if sys.argv[1:2] == ["load"]:
        address, producers, seconds, batch = sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
        print(json.dumps(trio.run(_load, address, producers, seconds, batch)))
    else:
        main(sys.argv[1:])
