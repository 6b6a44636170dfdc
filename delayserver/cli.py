"""`delayserver serve` (a delay-server node) and `delayserver meta` (the meta server)."""
from __future__ import annotations

import argparse
import concurrent.futures
import gc
import os
import signal
import sys

import trio

from delayserver.config import Config, ConfigError
from delayserver.logs import configure as configure_logging
from delayserver.storage.store import LayoutMismatch, check_layout


def _serve_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="delayserver serve", description="Run a delay-server node.")
    ap.add_argument("--config", help="TOML configuration file (see README: Configuration)")
    ap.add_argument("--data-dir", help="data directory (default ./var)")
    ap.add_argument("--listen", help="HOST:PORT to serve producers on (default 127.0.0.1:20801)")
    ap.add_argument("--metrics-listen", help="HOST:PORT for Prometheus metrics (default: off)")
    ap.add_argument("--http-listen", help="HOST:PORT for the HTTP API and web console (default: off)")
    ap.add_argument("--flush", choices=["sync", "async"], help="fsync before ack (sync) or on a timer (async)")
    ap.add_argument("--meta", help="meta servers HOST:PORT[,HOST:PORT...] (default: none, embedded routing)")
    ap.add_argument("--group", help="delay group this node belongs to (with --meta)")
    ap.add_argument("--node-id", help="this node's id in its group (with --meta; default: its address)")
    ap.add_argument("--replicate-from", help="run as a slave of the master at HOST:PORT (without --meta)")
    ap.add_argument("--advertised-address", help="HOST:PORT others reach this node at (default: --listen)")
    ap.add_argument("--log-level", default="INFO")
    ap.add_argument("--log-format", choices=["text", "json"], help="log lines as text (default) or JSON objects")
    return ap


def _read_dedupe_early(config: Config) -> concurrent.futures.Future:
    """`Dedupe.read` of the node's table, started now in a thread: it runs while the node's modules
    are imported (a tenth of a second; the read takes 0.3 to 0.4 s at ten million ids)."""
    def read():
        from delayserver.dedupe import Dedupe

        return Dedupe.read(config.dedupe_window_ms, config.data_dir / "checkpoint")

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dedupe-load")
    try:
        return pool.submit(read)
    finally:
        pool.shutdown(wait=False)


async def run_node(config: Config, dedupe_read: concurrent.futures.Future | None = None) -> bool:
    """Serve until SIGTERM or SIGINT (drain) or until the node asks to be started again (a slave
    that took a snapshot of its master); True in the last case."""
    from delayserver.node.server import DelayServer

    server = DelayServer(config, dedupe_read=dedupe_read)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            async def serve(task_status=trio.TASK_STATUS_IGNORED):
                await server.serve(task_status=task_status)
                nursery.cancel_scope.cancel()  # stopped by itself: stop waiting for signals

            port = await nursery.start(serve)
            gc.enable()  # off since the start (serve_main); what the start built is frozen now
            print(f"delayserver: serving on {config.listen[0]}:{port}, data in {config.data_dir}", flush=True)
            if server.http_port is not None:
                scheme = "https" if config.tls_cert else "http"
                print(f"delayserver: HTTP API and console on {scheme}://{config.http_listen[0]}:{server.http_port}/",
                      flush=True)
            async for _ in signals:
                await server.drain()
                break
    return server.restart_requested


def serve_main(argv: list[str]) -> int:
    args = _serve_parser().parse_args(argv)
    overrides = {"data_dir": args.data_dir, "listen": args.listen, "metrics_listen": args.metrics_listen,
                 "http_listen": args.http_listen, "log_format": args.log_format,
                 "flush": args.flush, "meta": args.meta, "group": args.group, "node_id": args.node_id,
                 "advertised_address": args.advertised_address, "replicate_from": args.replicate_from,
                 "auth_secret": os.environ.get("DELAYSERVER_SECRET"),
                 "cluster_secret": os.environ.get("DELAYSERVER_CLUSTER_SECRET")}
    try:
        config = Config.load(args.config, **overrides)
    except ConfigError as e:
        print(f"delayserver: invalid configuration: {e}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, config.log_format)
    try:
        check_layout(config.data_dir, config.segment_scale_ms)
    except LayoutMismatch as e:
        print(f"delayserver: {e}", file=sys.stderr)
        return 2
    # No automatic collection while the start builds the node (DelayServer.serve says why); it is
    # off already while the dedupe table is read beside the imports.
    gc.disable()
    if trio.run(run_node, config, _read_dedupe_early(config)):
        # Everything is closed: start again as the same command, which installs the snapshot.
        os.execv(sys.executable, [sys.executable, "-m", "delayserver", "serve", *argv])
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: delayserver {serve,meta} [options]\n\n"
              "  serve   run a delay-server node (delayserver serve --help)\n"
              "  meta    run the meta server (delayserver meta --help)")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return serve_main(rest)
    if command == "meta":
        from delayserver.meta.server import main_meta
        return main_meta(rest)
    print(f"delayserver: unknown command {command!r} (serve, meta)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
