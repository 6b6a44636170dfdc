"""`ops/bench browse`: the latency of a browse page on a node holding many pending messages.

A data directory holding N pending messages (100 B bodies) in one one-hour bucket three hours ahead
is written with the storage code (`bench.status.prepare`, as a node would have left it, with the id
index saved). The real server starts on it in its own process; a client then asks, over loopback:

- the first page of 100, oldest first, on the first start (it waits for the bucket's time index,
  built from the segment), then again after a restart (the node saved the index meanwhile, and
  reads it back);
- pages of 100 oldest first, newest first, by a subject glob, in a time window in the middle of the
  bucket, and deep pages (a cursor half way through), each repeated for S seconds.

Target (issue: at 10,000,000 pending): a page of 100 in milliseconds, not a scan.
Options: --pending N (default 1,000,000), --seconds S (3), --dir PATH.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

HOUR_MS = 3_600_000


async def _first_page(address: str) -> float:
    from delayserver.client import AsyncProducer

    async with AsyncProducer(address, timeout=3600) as prod:
        t0 = time.perf_counter()
        first = await prod.browse(limit=100)
        assert len(first.messages) == 100
        return (time.perf_counter() - t0) * 1000


async def _pages(address: str, bucket: int, seconds: float) -> list[tuple[str, list[float]]]:
    import trio

    from delayserver.client import AsyncProducer

    out = []
    async with AsyncProducer(address, timeout=3600) as prod:
        middle = f"{bucket + HOUR_MS // 2}.0"
        queries = [
            ("oldest first", dict()),
            ("newest first", dict(newest_first=True)),
            ("subject glob bench.*", dict(subject="bench.*")),
            ("10-minute window mid-bucket", dict(since=bucket + 25 * 60_000, until=bucket + 35 * 60_000)),
            ("deep page (cursor half way)", dict(cursor=middle)),
            ("with bodies", dict(bodies=True)),
        ]
        for name, query in queries:
            lat = []
            deadline = trio.current_time() + seconds
            while trio.current_time() < deadline:
                t0 = time.perf_counter()
                page = await prod.browse(limit=100, **query)
                lat.append((time.perf_counter() - t0) * 1000)
                assert len(page.messages) == 100, (name, len(page.messages))
            out.append((name, lat))
    return out


def main(argv: list[str]) -> None:
    import trio

    from bench.harness import DelayServerProcess, environment_note
    from bench.status import _quantiles, bucket_now, prepare

    parser = argparse.ArgumentParser(prog="ops/bench browse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pending", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args(argv)

    print(f"browse benchmark on {environment_note()}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-browse-", dir=args.dir))
    server = None
    try:
        bucket = bucket_now()
        began = time.perf_counter()
        prepare(root / "data", args.pending, bucket)
        print(f"{args.pending:,} pending messages in one one-hour bucket, written and replayed in "
              f"{time.perf_counter() - began:.1f} s", flush=True)
        server = DelayServerProcess(root / "data")
        server.start(timeout=3600)
        built = trio.run(_first_page, server.address)
        print(f"  first page, time index built from the segment: {built:,.0f} ms", flush=True)
        while not list((root / "data" / "index" / "time").glob("*.idx")):
            time.sleep(0.1)  # the node saves the bucket's index once it is built
        server.stop()
        server.start(timeout=3600)
        print(f"  first page after a restart, saved index: {trio.run(_first_page, server.address):,.0f} ms",
              flush=True)
        for name, lat in trio.run(_pages, server.address, bucket, args.seconds):
            print(f"  page of 100, {name:<30} {_quantiles(lat)}", flush=True)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
