"""`ops/bench meta`: heartbeats per second one meta server answers, and their latency, over its
embedded SQLite store and over PostgreSQL.

N nodes (default 300, in 10 delay groups) register, then, once all have, heartbeat as fast as
answers come, each over its own connection to a meta server on 127.0.0.1, for --seconds (default
10). The nodes and the meta servers run in this one process (trio), so they share its CPU. With two or
more --servers over PostgreSQL, the nodes spread over them, so groups are written by several meta
servers at once (compare-and-set conflicts are counted: each costs a re-read). The figure to
compare with is what a cluster needs: one heartbeat per node every heartbeat interval (5 s by
default), so 1,000 nodes need 200 heartbeats/s.

    ops/bench meta                                  # SQLite in a temp directory
    ops/bench meta --store postgresql://postgres@127.0.0.1:5432/bench [--servers 2]
    ops/bench meta --store temp-postgres [--servers 2]   # a PostgreSQL started for the run (initdb)
"""
from __future__ import annotations

import argparse
import functools
import logging
import statistics
import tempfile
import time
from pathlib import Path

import trio

from delayserver.clock import WallClock
from delayserver.meta.client import MetaClient
from delayserver.meta.server import serve_meta
from delayserver.meta.store import SqliteMetaStore


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="ops/bench meta")
    parser.add_argument("--store", default="sqlite", help="sqlite, temp-postgres, or a postgresql:// URL")
    parser.add_argument("--servers", type=int, default=1, help="meta servers over the store (PostgreSQL only)")
    parser.add_argument("--nodes", type=int, default=300)
    parser.add_argument("--groups", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args(argv)
    if args.servers > 1 and args.store == "sqlite":
        parser.error("several meta servers need a PostgreSQL store")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger().handlers[0].setLevel(logging.ERROR)
    conflicts = _ConflictCounter()
    logging.getLogger("delayserver.meta").setLevel(logging.INFO)
    logging.getLogger("delayserver.meta").addHandler(conflicts)
    temp_pg = None
    with tempfile.TemporaryDirectory(prefix="bench-meta-") as tmp:
        if args.store == "sqlite":
            open_store = functools.partial(SqliteMetaStore.open, Path(tmp) / "meta.sqlite3")
        else:
            from delayserver.meta.pgstore import PostgresMetaStore

            url = args.store
            if url == "temp-postgres":
                from tests.meta.postgres import PostgresServer

                temp_pg = PostgresServer.create()
                temp_pg.start()
                url = temp_pg.create_database("bench")
            open_store = functools.partial(PostgresMetaStore.open, url)
        try:
            stores = [open_store() for _ in range(args.servers)]
            try:
                beats, latencies = trio.run(_run, stores, args)
            finally:
                for store in stores:
                    store.close()
        finally:
            if temp_pg is not None:
                temp_pg.remove()
    latencies.sort()
    print(f"store: {'sqlite' if args.store == 'sqlite' else 'postgresql'}, meta servers: {args.servers}, "
          f"nodes: {args.nodes} in {args.groups} groups, {args.seconds:.0f} s")
    print(f"heartbeats/s: {beats / args.seconds:,.0f}")
    print(f"latency ms: p50 {1000 * statistics.median(latencies):.2f}  "
          f"p99 {1000 * latencies[int(len(latencies) * 0.99)]:.2f}  max {1000 * latencies[-1]:.2f}")
    print(f"compare-and-set conflicts (re-reads): {conflicts.count}")


async def _run(stores, args) -> tuple[int, list[float]]:
    async with trio.open_nursery() as nursery:
        addresses = []
        for store in stores:
            port = await nursery.start(functools.partial(
                serve_meta, store, "127.0.0.1", 0, clock=WallClock(), heartbeat_interval_ms=60_000))
            addresses.append(f"127.0.0.1:{port}")
        latencies: list[float] = []
        registered, go = trio.CapacityLimiter(args.nodes), trio.Event()
        window = {}
        async with trio.open_nursery() as nodes:
            for i in range(args.nodes):
                # Node i is in group i % groups, and each group has nodes on every meta server.
                address = addresses[(i // args.groups) % len(addresses)]
                nodes.start_soon(_node, address, f"g{i % args.groups}", f"n{i}", registered, go, window, latencies)
            # Every node registers first; the measured window starts after the last one.
            while registered.borrowed_tokens < args.nodes:
                await trio.sleep(0.01)
            window["end"] = trio.current_time() + args.seconds
            go.set()
        nursery.cancel_scope.cancel()
    return len(latencies), latencies


async def _node(address: str, group: str, node_id: str, registered: trio.CapacityLimiter, go: trio.Event,
                window: dict, latencies: list[float]) -> None:
    async with MetaClient(address, timeout_s=60) as client:
        reply = await client.request("register", group=group, node_id=node_id, address="10.0.0.1:20000")
        session = reply["session"]
        registered.acquire_on_behalf_of_nowait(node_id)
        await go.wait()
        while trio.current_time() < window["end"]:
            start = time.perf_counter()
            await client.request("heartbeat", group=group, node_id=node_id, session=session)
            if trio.current_time() < window["end"]:
                latencies.append(time.perf_counter() - start)


class _ConflictCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "changed under us" in record.getMessage():
            self.count += 1
