"""`ops/bench http`: acknowledged sends per second over the HTTP API beside the binary protocol.

One real server process (`flush = "sync"`, temp data directory, HTTP API on) and, for each case, a
load generator in its own process (`python -m bench.http load ...`): N concurrent clients, each
on its own keep-alive connection, sending 256-byte messages due in an hour for a fixed time.
Cases: one message per request and batches of 64, over HTTP (httpx, JSON) and over the binary
protocol (AsyncProducer). Prints messages/s, request latency P50/P99 and server CPU per message,
then what the console's refresh costs on the node holding all those messages.
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

BODY = "x" * 256


async def _http_client(base: str, seconds: float, batch: int, counts: list, latencies: list) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        one = {"subject": "bench.http", "body": BODY, "delay_ms": 3_600_000}
        path, payload = ("/v1/messages", one) if batch == 1 else ("/v1/messages/batch", {"messages": [one] * batch})
        deadline = trio.current_time() + seconds
        while trio.current_time() < deadline:
            t0 = time.perf_counter()
            r = await client.post(path, json=payload)
            latencies.append((time.perf_counter() - t0) * 1000)
            if r.status_code == 200:
                counts.append(1 if batch == 1 else r.json()["accepted"])


async def _binary_client(address: str, seconds: float, batch: int, counts: list, latencies: list) -> None:
    from delayserver.client import AsyncProducer, Message

    async with AsyncProducer(address, timeout=30) as producer:
        messages = [Message("bench.binary", BODY.encode(), delay=3_600_000) for _ in range(batch)]
        deadline = trio.current_time() + seconds
        while trio.current_time() < deadline:
            t0 = time.perf_counter()
            if batch == 1:
                await producer.send("bench.binary", BODY.encode(), delay=3_600_000)
                done = 1
            else:
                done = sum(1 for r in await producer.send_many(messages, batch=batch) if not isinstance(r, Exception))
            latencies.append((time.perf_counter() - t0) * 1000)
            counts.append(done)


async def _load(protocol: str, target: str, clients: int, seconds: float, batch: int) -> dict:
    counts: list[int] = []
    latencies: list[float] = []
    client = _http_client if protocol == "http" else _binary_client
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(client, target, seconds, batch, counts, latencies)
    elapsed = time.perf_counter() - t0
    latencies.sort()
    return {"acked": sum(counts), "msgs_per_s": sum(counts) / elapsed, "requests": len(latencies),
            "p50_ms": percentile(latencies, 0.5), "p99_ms": percentile(latencies, 0.99)}


def _start_server(tmp: str) -> tuple[subprocess.Popen, int, int]:
    server = subprocess.Popen(
        [sys.executable, "-m", "delayserver", "serve", "--data-dir", str(Path(tmp) / "data"),
         "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    port = int(server.stdout.readline().split(",")[0].rsplit(":", 1)[1])
    http_port = int(server.stdout.readline().strip().rstrip("/").rsplit(":", 1)[1])
    return server, port, http_port


def main(argv: list[str]) -> None:
    clients, seconds = 32, 10.0
    if argv and argv[0] == "--quick":
        seconds = 3.0
    with tempfile.TemporaryDirectory() as tmp:
        server, port, http_port = _start_server(tmp)
        try:
            cpu = psutil.Process(server.pid).cpu_times
            for batch in (1, 64):
                for protocol, target in (("binary", f"127.0.0.1:{port}"), ("http", f"http://127.0.0.1:{http_port}")):
                    before = sum(cpu()[:2])
                    load = subprocess.run(
                        [sys.executable, "-m", "bench.http", "load", protocol, target, str(clients), str(seconds),
                         str(batch)], capture_output=True, check=True, text=True)
                    r = json.loads(load.stdout)
                    cpu_us = (sum(cpu()[:2]) - before) / max(r["acked"], 1) * 1e6
                    print(f"{protocol:6s} batch={batch:<3d} clients={clients} body=256B flush=sync: "
                          f"{r['msgs_per_s']:,.0f} acknowledged msg/s ({r['requests']:,} requests); "
                          f"per request P50 {r['p50_ms']:.1f} ms, P99 {r['p99_ms']:.1f} ms; "
                          f"server CPU {cpu_us:.0f} us per message", flush=True)
            _console_cost(http_port, cpu)
        finally:
            server.terminate()
            server.wait(30)


def _console_cost(http_port: int, cpu) -> None:
    """What the console's refresh costs on the node now holding every message sent above: one
    pass over changed buckets, then the cached answer the other pages get within the same second."""
    import httpx

    with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=120) as client:
        before = sum(cpu()[:2])
        t0 = time.perf_counter()
        pending = client.get("/v1/buckets").json()
        first_ms = (time.perf_counter() - t0) * 1000
        first_cpu_ms = (sum(cpu()[:2]) - before) * 1000
        held = sum(b["pending"] for b in pending["buckets"])
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            client.get("/v1/overview")
            times.append((time.perf_counter() - t0) * 1000)
        times.sort()
    print(f"console on a node holding {held:,} pending messages: a backlog pass over changed buckets "
          f"{first_ms:.0f} ms ({first_cpu_ms:.0f} ms server CPU); /v1/overview P50 {percentile(times, 0.5):.1f} ms, "
          f"max {times[-1]:.1f} ms over 20 requests", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["load"]:
        protocol, target, clients, seconds, batch = sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6])
        print(json.dumps(trio.run(_load, protocol, target, clients, seconds, batch)))
    else:
        main(sys.argv[1:])
