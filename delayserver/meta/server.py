"""The meta server process: a trio TCP service speaking META frames, and `delayserver meta`.

Each connection is served by the shared connection pump (`delayserver.node.pump`): one request at
a time, answered in order. A META request carries a JSON object and gets a META response (see
`service`). Any other well-formed request gets an ERROR response and the connection goes on. A
frame that breaks the protocol (bad magic, crc, a declared length over `max_frame_bytes`) gets an
ERROR response and the connection is closed; so is a connection idle for `idle_timeout_s`.

With a cluster secret, a connection gives it in an AUTH frame (answered by an empty AUTH response;
a wrong one by ERROR UNAUTHORIZED, and the connection closes); until then it may ask only what
producers need (`service.OPEN_OPS`), and anything else is answered UNAUTHORIZED. This is the
pump's gate: it sees every frame, in line, until AUTH lets the connection in. With a certificate,
every connection is TLS. Several meta servers may share one PostgreSQL store
(`--store postgresql://...`); the default is SQLite in `--data-dir`.

Default port: 20800 (`wire.DEFAULT_META_PORT`); the delay server's is 20801.
"""
from __future__ import annotations

import argparse
import functools
import hmac
import logging
import os
import signal
import ssl
import sys
from pathlib import Path

import trio

from delayserver.clock import TrioClock, WallClock
from delayserver.message import ResultCode, format_address, parse_address
from delayserver.meta.service import MetaService
from delayserver.meta.store import MetaStore, SqliteMetaStore, StoreError, StoreUnavailable
from delayserver.meta.wire import DEFAULT_META_PORT, MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES
from delayserver.node.pump import PumpLimits, error_frame, pump
from delayserver.protocol import (
    Command, ErrorResult, Frame, LocalProtocolError, RemoteProtocolError, decode_json, encode, encode_error,
    encode_json,
)

log = logging.getLogger("delayserver.meta")

DEFAULT_IDLE_TIMEOUT_S = 120.0
DEFAULT_MAX_CONNECTIONS = 1024
#: The environment variable holding the cluster secret (nodes, delayctl and the meta server).
CLUSTER_SECRET_ENV = "DELAYSERVER_CLUSTER_SECRET"


async def serve_meta(
    store: MetaStore, listen_host: str, listen_port: int, *, clock,
    heartbeat_interval_ms: int = 5000, missed_heartbeats: int = 3,
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S, max_connections: int = DEFAULT_MAX_CONNECTIONS,
    cluster_secret: str = "", ssl_context: ssl.SSLContext | None = None,
    run_blocking=trio.to_thread.run_sync, task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the meta protocol on (listen_host, listen_port) until cancelled.

    Reports the port actually bound (useful with port 0) through `task_status.started`. Nodes
    not heard from for `heartbeat_interval_ms * missed_heartbeats` are marked down. With
    `cluster_secret`, only connections that give it may register, heartbeat, change or list
    anything (see the module docstring); with `ssl_context`, connections are TLS. Raises
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
            if ssl_context is not None:
                stream = trio.SSLStream(stream, ssl_context, server_side=True)
                try:
                    with trio.fail_after(idle_timeout_s):
                        await stream.do_handshake()
                except (trio.BrokenResourceError, trio.TooSlowError) as exc:
                    log.info("meta connection failed its TLS handshake: %r", exc.__cause__ or exc)
                    await trio.aclose_forcefully(stream)
                    return
            await _serve_connection(stream, service, idle_timeout_s, cluster_secret.encode("utf-8"))
        finally:
            limiter.release()

    await service.start()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_reap_forever, service)
        await nursery.start(trio.serve_listeners, handle, listeners)
        log.info("meta server listening on %s", format_address(listen_host, port))
        task_status.started(port)


async def _reap_forever(service: MetaService) -> None:
    # Half an interval: a node is marked down at most half an interval after its lease ended.
    while True:
        await trio.sleep(service.heartbeat_interval_ms / 2000)
        try:
            await service.reap()
        except StoreUnavailable:
            pass  # logged once by the service; reaping resumes a lease after the store is back
        except StoreError as exc:
            log.error("cannot mark down silent nodes now: %s", exc)
        except Exception:  # a bug in one round must not stop the meta server
            log.exception("reaping silent nodes failed")


async def _serve_connection(stream: trio.abc.Stream, service: MetaService, idle_timeout_s: float,
                             secret: bytes) -> None:
    # Requests are answered in order, one at a time; an idle connection is closed without a word.
    limits = PumpLimits(MAX_REQUEST_BYTES, idle_timeout_s, send_timeout_s=idle_timeout_s, max_in_flight=1,
                        say_timeout=False)
    gate = functools.partial(_authenticate, service=service, secret=secret) if secret else None
    async with stream:
        await pump(stream, limits, functools.partial(_respond, service=service, authenticated=True, secret=secret),
                   gate=gate, what="a meta connection")


async def _authenticate(frame: Frame, send, service: MetaService, secret: bytes) -> bool | None:
    """The pump's gate with a cluster secret: AUTH with the secret lets the connection in (True), a
    wrong one closes it (False); any other request before it is answered as anonymous (None)."""
    if frame.command is Command.AUTH and not frame.is_response:
        if hmac.compare_digest(frame.payload, secret):
            await send(encode(Frame(Command.AUTH, frame.request_id, b"", True)))
            return True
        log.warning("refused a meta connection: wrong cluster secret")
        await send(error_frame(frame.request_id, ResultCode.UNAUTHORIZED, "wrong cluster secret"))
        return False
    await send(await _respond(frame, service, authenticated=False, secret=secret))
    return None


async def _respond(frame: Frame, service: MetaService, authenticated: bool, secret: bytes) -> bytes:
    """The bytes answering one well-formed frame."""
    if frame.command is Command.AUTH and not frame.is_response:
        # Past the gate (or with no secret at all): AUTH again, or AUTH a server without a secret.
        if secret and hmac.compare_digest(frame.payload, secret):
            return encode(Frame(Command.AUTH, frame.request_id, b"", True))
        message = "wrong cluster secret" if secret else "this meta server has no cluster secret: do not send one"
        return error_frame(frame.request_id, ResultCode.UNAUTHORIZED, message)
    if frame.is_response or frame.command is not Command.META:
        what = "a response" if frame.is_response else f"a {frame.command.name} request"
        error = ErrorResult(ResultCode.BAD_REQUEST, f"the meta server answers META requests only, not {what}")
        return encode(Frame(Command.ERROR, frame.request_id, encode_error(error), True))
    try:
        request = decode_json(frame.payload)
    except RemoteProtocolError as exc:
        response = {"code": int(ResultCode.BAD_REQUEST), "message": str(exc)}
    else:
        response = await service.handle(request, authenticated=authenticated)
    try:
        return encode(Frame(Command.META, frame.request_id, encode_json(response), True), MAX_RESPONSE_BYTES)
    except LocalProtocolError as exc:
        log.error("cannot send a meta response: %s", exc)
        response = {"code": int(ResultCode.INTERNAL), "message": f"the response cannot be sent: {exc}"}
        return encode(Frame(Command.META, frame.request_id, encode_json(response), True))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="delayserver meta", description="Run the meta server.",
        epilog=f"The cluster secret is read from ${CLUSTER_SECRET_ENV} or --cluster-secret-file; without one, "
               "anyone who reaches the port can change the cluster.")
    parser.add_argument("--data-dir", type=Path,
                        help="directory of the embedded SQLite store (meta.sqlite3); created if missing")
    parser.add_argument("--store", metavar="URL",
                        help="a PostgreSQL store shared by several meta servers: postgresql://USER@HOST:PORT/DB "
                             "(instead of --data-dir)")
    parser.add_argument("--cluster-secret-file", type=Path, metavar="PATH",
                        help="file holding the cluster secret that nodes and operators must give")
    parser.add_argument("--tls-cert", type=Path, metavar="PEM", help="serve TLS with this certificate chain")
    parser.add_argument("--tls-key", type=Path, metavar="PEM", help="the private key of --tls-cert")
    parser.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_META_PORT}", metavar="HOST:PORT",
                        help=f"address to listen on (default 127.0.0.1:{DEFAULT_META_PORT}; port 0: any free port)")
    parser.add_argument("--heartbeat-interval-ms", type=_positive_int, default=5000,
                        help="how often nodes heartbeat (default 5000)")
    parser.add_argument("--missed-heartbeats", type=_positive_int, default=3,
                        help="heartbeats a node may miss before it is marked down (default 3)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def _cluster_secret(path: Path | None) -> str:
    """The secret from `path` (its first line) or the environment; "" for none."""
    if path is not None:
        secret = path.read_text(encoding="utf-8").splitlines()[0].strip() if path.stat().st_size else ""
        if not secret:
            raise ValueError(f"--cluster-secret-file: {path} is empty")
        return secret
    return os.environ.get(CLUSTER_SECRET_ENV, "")


def _open_store(args: argparse.Namespace) -> MetaStore:
    if args.store is not None:
        from delayserver.meta.pgstore import PostgresMetaStore

        return PostgresMetaStore.open(args.store)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    return SqliteMetaStore.open(args.data_dir / "meta.sqlite3")


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
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        host, port = parse_address(args.listen, allow_port_zero=True)
    except ValueError as exc:
        parser.error(f"--listen: {exc}")
    if (args.data_dir is None) == (args.store is None):
        parser.error("give --data-dir (the embedded SQLite store) or --store postgresql://... (shared)")
    if args.store is not None and not args.store.startswith(("postgresql://", "postgres://")):
        parser.error(f"--store: want a postgresql:// URL, not {args.store!r}")
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        args.cluster_secret = _cluster_secret(args.cluster_secret_file)
        args.ssl_context = None
        if args.tls_cert is not None:
            args.ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            args.ssl_context.load_cert_chain(args.tls_cert, args.tls_key)
    except (OSError, ssl.SSLError, ValueError) as exc:
        log.error("cannot start: %s", exc)
        return 1
    if not args.cluster_secret:
        log.warning("no cluster secret: anyone who reaches this port can register nodes and change routes")
    try:
        store = _open_store(args)
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
                        missed_heartbeats=args.missed_heartbeats, cluster_secret=args.cluster_secret,
                        ssl_context=args.ssl_context, task_status=task_status,
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
