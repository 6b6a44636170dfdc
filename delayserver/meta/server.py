"""The meta server process: a trio TCP service speaking META frames, and `delayserver meta`.

Each connection is a short pump around `protocol.FrameDecoder`: one request at a time, answered
in order. A META request carries a JSON object and gets a META response (see `service`). Any other
well-formed request gets an ERROR response and the connection goes on. A frame that breaks the
protocol (bad magic, crc, a declared length over `max_frame_bytes`) gets an ERROR response with
request id 0 and the connection is closed; so is a connection idle for `idle_timeout_s`.

Default port: 20800 (`wire.DEFAULT_META_PORT`); the delay server's is 20801.
"""
from __future__ import annotations

import argparse
import functools
import logging
import signal
import sys
from pathlib import Path

import trio

from delayserver.clock import TrioClock, WallClock
from delayserver.message import ResultCode, format_address, parse_address
from delayserver.meta.service import MetaService
from delayserver.meta.store import MetaStore, SqliteMetaStore, StoreError
from delayserver.meta.wire import DEFAULT_META_PORT, MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES
from delayserver.node.pump import PumpLimits, pump
from delayserver.protocol import (
    Command, ErrorResult, Frame, LocalProtocolError, RemoteProtocolError, decode_json, encode, encode_error,
    encode_json,
)

log = logging.getLogger("delayserver.meta")

DEFAULT_IDLE_TIMEOUT_S = 120.0
DEFAULT_MAX_CONNECTIONS = 1024


async def serve_meta(
    store: MetaStore, listen_host: str, listen_port: int, *, clock,
    heartbeat_interval_ms: int = 5000, missed_heartbeats: int = 3,
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S, max_connections: int = DEFAULT_MAX_CONNECTIONS,
    run_blocking=trio.to_thread.run_sync, task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the meta protocol on (listen_host, listen_port) until cancelled.

    Reports the port actually bound (useful with port 0) through `task_status.started`. Nodes
    not heard from for `heartbeat_interval_ms * missed_heartbeats` are marked down. Raises
    OSError if it cannot listen. Store calls run through `run_blocking` (a worker thread; see
    `MetaService.run_blocking`).
    """
    service = MetaService(store, clock, heartbeat_interval_ms, missed_heartbeats, run_blocking)
    listeners = await trio.open_tcp_listeners(listen_port, host=listen_host)
    port = listeners[0].socket.getsockname()[1]
    limiter = trio.CapacityLimiter(max_connections)

    async def handle(stream: trio.SocketStream) -> None:
        try:
            limiter.acquire_nowait()
        except trio.WouldBlock:
            log.warning("connection refused: %d connections open", max_connections)
            await trio.aclose_forcefully(stream)
            return
        try:
            await _serve_connection(stream, service, idle_timeout_s)
        finally:
            limiter.release()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(_reap_forever, service)
        await nursery.start(trio.serve_listeners, handle, listeners)
        log.info("meta server listening on %s", format_address(listen_host, port))
        task_status.started(port)


async def _reap_forever(service: MetaService) -> None:
    # Half an interval: a node is marked down at most half an interval after its lease ended.
    while True:
        await trio.sleep(service.heartbeat_interval_ms / 2000)
        await service.reap()


async def _serve_connection(stream: trio.SocketStream, service: MetaService, idle_timeout_s: float) -> None:
    # Requests are answered in order, one at a time; an idle connection is closed without a word.
    limits = PumpLimits(MAX_REQUEST_BYTES, idle_timeout_s, send_timeout_s=idle_timeout_s, max_in_flight=1,
                        say_timeout=False)
    async with stream:
        await pump(stream, limits, functools.partial(_respond, service=service), what="a meta connection")


async def _respond(frame: Frame, service: MetaService) -> bytes:
    """The bytes answering one well-formed frame."""
    if frame.is_response or frame.command is not Command.META:
        what = "a response" if frame.is_response else f"a {frame.command.name} request"
        error = ErrorResult(ResultCode.BAD_REQUEST, f"the meta server answers META requests only, not {what}")
        return encode(Frame(Command.ERROR, frame.request_id, encode_error(error), True))
    try:
        request = decode_json(frame.payload)
    except RemoteProtocolError as exc:
        response = {"code": int(ResultCode.BAD_REQUEST), "message": str(exc)}
    else:
        response = await service.handle(request)
    try:
        return encode(Frame(Command.META, frame.request_id, encode_json(response), True), MAX_RESPONSE_BYTES)
    except LocalProtocolError as exc:
        log.error("cannot send a meta response: %s", exc)
        response = {"code": int(ResultCode.INTERNAL), "message": f"the response cannot be sent: {exc}"}
        return encode(Frame(Command.META, frame.request_id, encode_json(response), True))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="delayserver meta", description="Run the meta server.")
    parser.add_argument("--data-dir", required=True, type=Path,
                        help="directory of the store (meta.sqlite3); created if missing")
    parser.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_META_PORT}", metavar="HOST:PORT",
                        help=f"address to listen on (default 127.0.0.1:{DEFAULT_META_PORT}; port 0: any free port)")
    parser.add_argument("--heartbeat-interval-ms", type=_positive_int, default=5000,
                        help="how often nodes heartbeat (default 5000)")
    parser.add_argument("--missed-heartbeats", type=_positive_int, default=3,
                        help="heartbeats a node may miss before it is marked down (default 3)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def main_meta(argv: list[str]) -> int:
    """`delayserver meta ARGS`: serve until SIGTERM or SIGINT, then return 0.

    Returns 1 (after saying why on stderr) when the store cannot be opened or the address cannot
    be listened on; argparse exits 2 on bad arguments.
    """
    args = _parser().parse_args(argv)
    try:
        host, port = parse_address(args.listen, allow_port_zero=True)
    except ValueError as exc:
        _parser().error(f"--listen: {exc}")
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        args.data_dir.mkdir(parents=True, exist_ok=True)
        store = SqliteMetaStore.open(args.data_dir / "meta.sqlite3")
    except (OSError, StoreError) as exc:
        log.error("cannot open the meta store: %s", exc)
        return 1
    try:
        return trio.run(_run, store, host, port, args)
    except KeyboardInterrupt:
        log.info("interrupted before the signal handler was installed: stopped")
        return 0
    finally:
        store.close()


async def _run(store: MetaStore, host: str, port: int, args: argparse.Namespace) -> int:
    # Epoch milliseconds that follow trio's monotonic clock: a step of the wall clock must not
    # mark every node down at once (or extend a lease).
    clock = TrioClock(WallClock().now_ms() - int(trio.current_time() * 1000))
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            try:
                await nursery.start(
                    lambda task_status: serve_meta(
                        store, host, port, clock=clock, heartbeat_interval_ms=args.heartbeat_interval_ms,
                        missed_heartbeats=args.missed_heartbeats, task_status=task_status,
                    )
                )
            except OSError as exc:
                log.error("cannot serve on %s: %s", args.listen, exc)
                return 1
            async for signum in signals:
                log.info("%s: stopping the meta server", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break
    return 0
