"""One delay-server node: a trio nursery holding every service, and the connection pump.

Services, each started with `nursery.start` so that it reports readiness: receiver (group commit),
replayer, tick manager, sender, cleaner, metrics, meta agent, listener. `drain()` is the SIGTERM
path: stop accepting, finish the batch, flush, replay, checkpoint.
"""
from __future__ import annotations

import functools
import hmac
import logging
import ssl

import trio

from delayserver import protocol as p
from delayserver.clock import WallClock
from delayserver.config import Config
from delayserver.errors import DelayServerError, ResultCode
from delayserver.lookup import lookup
from delayserver.membership import local_groups, start_meta_agent
from delayserver.meta.store import Role
from delayserver.metrics import serve_metrics
from delayserver.receiver import Receiver
from delayserver.replayer import Replayer
from delayserver.replication import Master, Slave
from delayserver.sender.parked import ParkedLog, parked_offsets
from delayserver.sender.sender import Sender
from delayserver.storage.buckets import bucket_start
from delayserver.storage.cleaner import clean
from delayserver.storage.segment import StorageError
from delayserver.storage.store import Store
from delayserver.wakeup import Wakeup
from delayserver.wheel.service import serve_ticks
from delayserver.wheel.tick_manager import TickManager

log = logging.getLogger("delayserver.server")

MAX_REQUESTS_PER_CONNECTION = 256


class DelayServer:
    def __init__(self, config: Config, clock=None):
        self.config = config
        self.clock = clock or WallClock()
        self.connections = 0
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._listener_scope = trio.CancelScope()
        self.meta_agent = None

    # --- start --------------------------------------------------------------------------------

    def _open(self) -> None:
        c = self.config
        c.data_dir.mkdir(parents=True, exist_ok=True)
        self.store = Store.open(c.data_dir, segment_scale_ms=c.segment_scale_ms,
                                message_log_segment_bytes=c.message_log_segment_bytes)
        disk_full = not self.store.take_reserve_at_start(c.reserve_bytes)
        if disk_full:
            log.error("disk full: no room for the %d-byte reserve in %s; refusing new messages with DISK_FULL "
                      "until there is", c.reserve_bytes, c.data_dir)
        self.parked = ParkedLog(c.data_dir / "parked")
        scale = c.segment_scale_ms
        self.ticks = TickManager(
            self.store, now_ms=self.clock.now_ms(), tick_ms=c.tick_ms, slots=c.wheel_slots,
            load_ahead_ms=c.effective_load_ahead_ms,
            settled_elsewhere=lambda bucket: parked_offsets(c.data_dir / "parked", bucket, scale),
        )
        self.replayer = Replayer.open(self.store, self.ticks)
        self.durable = Wakeup()
        self.receiver = Receiver(self.store, self.clock, c, next_sequence=self.replayer.max_sequence + 1,
                                 on_durable=self.durable, disk_full=disk_full)
        self.receiver.sequence_floor = lambda: self.replayer.max_sequence + 1
        self.replayer.recent_batch = self.receiver.recent_batch
        self.replayer.on_disk_full = self.receiver.enter_disk_full
        self.master = Master(self)
        self.slave = None
        self.sender = Sender(self.ticks, self.store, local_groups(self), self.clock, send_batch_size=c.send_batch_size,
                             send_wait_ms=c.send_wait_ms, max_inflight=c.max_inflight,
                             batches_in_flight=c.send_batches_in_flight, parked=self.parked,
                             may_deliver=self._may_deliver, on_disk_full=self.receiver.enter_disk_full)

    def _may_deliver(self) -> bool:
        if self.config.replicate_from:
            return False
        if not self.config.meta:
            return True
        return self.meta_agent is not None and self.meta_agent.may_deliver()

    def _is_master(self) -> bool:
        """Master by configuration or by the meta server's word (delivery also needs its lease)."""
        if self.config.replicate_from:
            return False
        if not self.config.meta:
            return True
        return self.meta_agent is not None and self.meta_agent.role is Role.MASTER

    def _is_slave(self) -> bool:
        if self.config.replicate_from:
            return True
        return self.meta_agent is not None and self.meta_agent.role is Role.SLAVE

    def _master_address(self) -> str | None:
        if self.config.replicate_from:
            return self.config.replicate_from
        return self.meta_agent.master_address if self.meta_agent is not None else None

    def _write_refusal(self) -> ResultCode | None:
        """NOT_MASTER or READ_ONLY when this node must not take writes (a slave, or the meta
        server says another node is master or the group is read-only)."""
        if self.config.replicate_from:
            return ResultCode.NOT_MASTER
        if not self.config.meta:
            return None
        agent = self.meta_agent
        if agent is None or agent.role is not Role.MASTER:
            return ResultCode.NOT_MASTER
        if agent.read_only:
            return ResultCode.READ_ONLY
        return None

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Recover, start every service, listen; `task_status.started(port)` once serving."""
        self._open()  # Replayer.open has replayed all of message_log before anything loads
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self.receiver.serve)
                await nursery.start(functools.partial(self.replayer.serve, self.clock,
                                                      lambda: self.receiver.durable_offset, self.durable,
                                                      checkpoint_interval_ms=self.config.checkpoint_interval_ms))
                await nursery.start(functools.partial(serve_ticks, self.ticks, self.clock, self.sender.ready,
                                                      active=self._is_master))
                await nursery.start(self.sender.serve)
                if self.config.metrics_listen is not None:
                    listeners = await nursery.start(serve_metrics, self, *self.config.metrics_listen)
                    self.metrics_port = listeners[0].socket.getsockname()[1]
                listeners = await nursery.start(self._listen)
                self.port = listeners[0].socket.getsockname()[1]
                if self.config.meta:
                    await start_meta_agent(self, nursery)
                if self.config.meta or self.config.replicate_from:
                    node_id = self.config.node_id or f"{self.config.listen[0]}:{self.port}"
                    self.slave = Slave(self, node_id, self._master_address, self._is_slave)
                    await nursery.start(self.slave.run)
                nursery.start_soon(self._clean_periodically)
                log.info("serving on %s:%d, data in %s", self.config.listen[0], self.port, self.config.data_dir)
                task_status.started(self.port)
        finally:
            await self.sender.aclose()
            self.parked.close()
            self.store.close()

    async def _listen(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        host, port = self.config.listen
        handler = self._handle
        if self.config.tls_cert:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(self.config.tls_cert, self.config.tls_key)
            handler = functools.partial(self._handle_tls, context)
        with self._listener_scope:
            await trio.serve_tcp(handler, port, host=host, task_status=task_status)

    async def _handle_tls(self, context: ssl.SSLContext, stream: trio.SocketStream) -> None:
        tls = trio.SSLStream(stream, context, server_side=True)
        try:
            with trio.fail_after(self.config.frame_timeout_ms / 1000):
                await tls.do_handshake()
        except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.aclose()
            return
        await self._handle(tls)

    async def drain(self) -> None:
        """Stop accepting, finish and flush the current batch, replay and checkpoint."""
        log.info("draining")
        self._listener_scope.cancel()
        await self.receiver.drain()
        while self.replayer.replay_once(self.clock.now_ms(), self.receiver.durable_offset):
            await trio.lowlevel.checkpoint()
        try:
            await self.replayer.checkpoint_async()
        except StorageError as e:  # a failed fsync, say: the next start replays from the last checkpoint
            log.error("no checkpoint at shutdown: %s", e)
        with trio.move_on_after(2):
            while self.ticks.inflight:
                await trio.sleep(0.01)
        self._nursery.cancel_scope.cancel()

    async def _clean_periodically(self) -> None:
        """The cleaner: delete what replay, replication and retention no longer need."""
        c = self.config
        while True:
            await trio.sleep(c.cleaner_interval_ms / 1000)
            try:
                cleaned = clean(self.store, replay_offset=self.replayer.checkpointed_offset,
                                now_ms=self.clock.now_ms(), retention_ms=c.retention_ms,
                                sync_offsets=list(self.master.message_log_offsets.values()),
                                dispatch_sync_sizes=list(self.master.dispatch_sizes.values()))
                if cleaned.buckets:
                    await self.replayer.checkpoint_async()
            except StorageError as e:
                log.error("cleaner pass failed: %s", e)

    # --- connections --------------------------------------------------------------------------

    async def _handle(self, stream: trio.abc.Stream) -> None:
        if self.connections >= self.config.max_connections:
            await self._send_error(stream, 0, ResultCode.BUSY, "too many connections")
            await stream.aclose()
            return
        self.connections += 1
        try:
            await self._pump(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
            pass
        finally:
            self.connections -= 1
            await stream.aclose()

    async def _pump(self, stream: trio.SocketStream) -> None:
        c = self.config
        decoder = p.FrameDecoder(max_frame_bytes=c.max_frame_bytes)
        send_lock = trio.Lock()
        slots = trio.Semaphore(MAX_REQUESTS_PER_CONNECTION)
        partial_since = None
        authenticated = not c.auth_secret
        async with trio.open_nursery() as nursery:
            while True:
                now = trio.current_time()
                if decoder.buffered_bytes:
                    partial_since = partial_since if partial_since is not None else now
                    timeout = partial_since + c.frame_timeout_ms / 1000 - now
                else:
                    partial_since = None
                    timeout = c.idle_timeout_ms / 1000
                with trio.move_on_after(max(timeout, 0)) as scope:
                    data = await stream.receive_some(65536)
                if scope.cancelled_caught:
                    # Idle or trickling: drop the connection, it holds a slot others may need.
                    await self._send_error(stream, 0, ResultCode.BAD_REQUEST, "timed out", send_lock)
                    break
                if not data:
                    break
                decoder.feed(data)
                while True:
                    try:
                        frame = decoder.next_frame()
                    except p.RemoteProtocolError as e:
                        await self._send_error(stream, 0, e.code, str(e), send_lock)
                        nursery.cancel_scope.cancel()
                        return
                    if frame is p.NEED_DATA:
                        break
                    if not authenticated:
                        # Handled in line, before any later frame of the same connection.
                        authenticated = await self._authenticate(stream, frame, send_lock)
                        if not authenticated:
                            nursery.cancel_scope.cancel()
                            return
                        continue
                    await slots.acquire()
                    nursery.start_soon(self._request, stream, frame, send_lock, slots)
            # EOF: let requests already read finish and answer.

    async def _authenticate(self, stream, frame: p.Frame, lock: trio.Lock) -> bool:
        """With `auth_secret` set, a connection's first frame must be AUTH with that secret."""
        secret = self.config.auth_secret.encode("utf-8")
        if frame.command == p.Command.AUTH and not frame.is_response and hmac.compare_digest(frame.payload, secret):
            async with lock:
                await stream.send_all(p.encode(p.Frame(p.Command.AUTH, frame.request_id, b"", is_response=True)))
            return True
        log.warning("refused a connection: %s", "wrong secret" if frame.command == p.Command.AUTH
                    else f"{frame.command.name} before AUTH")
        await self._send_error(stream, frame.request_id, ResultCode.UNAUTHORIZED,
                               "authenticate first: AUTH with the shared secret", lock)
        return False

    async def _send_error(self, stream, request_id: int, code: ResultCode, message: str, lock=None) -> None:
        frame = p.Frame(p.Command.ERROR, request_id, p.encode_error(p.ErrorResult(code, message)), is_response=True)
        try:
            if lock is None:
                await stream.send_all(p.encode(frame))
            else:
                async with lock:
                    await stream.send_all(p.encode(frame))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def _request(self, stream, frame: p.Frame, lock: trio.Lock, slots: trio.Semaphore) -> None:
        try:
            if frame.is_response:
                raise p.RemoteProtocolError("a response frame sent to the server")
            payload = await self._dispatch(frame)
            out = p.encode(p.Frame(frame.command, frame.request_id, payload, is_response=True))
        except p.RemoteProtocolError as e:
            out = p.encode(p.Frame(p.Command.ERROR, frame.request_id,
                                   p.encode_error(p.ErrorResult(e.code, str(e))), is_response=True))
        except DelayServerError as e:
            out = p.encode(p.Frame(p.Command.ERROR, frame.request_id,
                                   p.encode_error(p.ErrorResult(e.code, str(e))), is_response=True))
        except StorageError as e:
            log.exception("storage error serving a request")
            out = p.encode(p.Frame(p.Command.ERROR, frame.request_id,
                                   p.encode_error(p.ErrorResult(ResultCode.INTERNAL, str(e))), is_response=True))
        finally:
            slots.release()
        try:
            async with lock:
                await stream.send_all(out)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def _dispatch(self, frame: p.Frame) -> bytes:
        cmd = frame.command
        if cmd == p.Command.PING:
            return frame.payload
        if cmd == p.Command.AUTH:
            return b""  # already authenticated on this connection
        if cmd == p.Command.SEND:
            items = p.decode_send_request(frame.payload)
            refusal = self._write_refusal()
            if refusal is not None:
                return p.encode_send_response([
                    p.SendResult(refusal, refusal.description, 0, i.message_id) for i in items])
            return p.encode_send_response(await self.receiver.send(items))
        if cmd == p.Command.CANCEL:
            return p.encode_cancel_response(await self.cancel(p.decode_handle(frame.payload)))
        if cmd == p.Command.STATUS:
            return p.encode_status_response(await self.status(p.decode_handle(frame.payload)))
        if cmd == p.Command.SYNC_MESSAGE_LOG:
            return await self.master.message_log(frame.payload)
        if cmd == p.Command.SYNC_DISPATCH_LOG:
            return await self.master.dispatch_log(frame.payload)
        raise DelayServerError(f"command {cmd.name} is not served by a delay server", code=ResultCode.BAD_REQUEST)

    # --- cancel and status --------------------------------------------------------------------

    async def _replayed_past(self, offset: int, timeout_s: float = 5.0) -> None:
        with trio.move_on_after(timeout_s):
            while self.replayer.offset < offset:
                await self.replayer.caught_up.wait(0.01)

    async def status(self, handle: p.Handle) -> p.StatusResult:
        await self._replayed_past(self.receiver.durable_offset)
        found = lookup(self.store, handle.schedule_time, handle.message_id)
        return p.StatusResult(ResultCode.OK, found.state.name.lower(), found.state, found.dispatch_time,
                              found.broker_group)

    async def cancel(self, handle: p.Handle) -> p.CancelResult:
        refusal = self._write_refusal()
        if refusal is not None:
            return p.CancelResult(refusal, refusal.description, p.CancelOutcome.UNKNOWN)
        await self._replayed_past(self.receiver.durable_offset)
        found = lookup(self.store, handle.schedule_time, handle.message_id)
        outcome = {p.MessageState.DELIVERED: p.CancelOutcome.ALREADY_DELIVERED,
                   p.MessageState.CANCELLED: p.CancelOutcome.ALREADY_CANCELLED,
                   p.MessageState.UNKNOWN: p.CancelOutcome.UNKNOWN}.get(found.state)
        if outcome is not None:
            return p.CancelResult(ResultCode.OK, outcome.name.lower(), outcome)
        code, message, offset = await self.receiver.append_cancel(handle.schedule_time, handle.message_id)
        if code != ResultCode.OK:
            return p.CancelResult(code, message, p.CancelOutcome.UNKNOWN)
        await self._replayed_past(offset + 1)
        # The cancel is applied now: nothing fires it any more. What fired before it still goes.
        bucket = bucket_start(handle.schedule_time, self.store.segment_scale_ms)
        if any(self.ticks.ref(bucket, o) in self.ticks.inflight for o in found.offsets):
            return p.CancelResult(ResultCode.OK, "already delivered (in flight)", p.CancelOutcome.ALREADY_DELIVERED)
        after = lookup(self.store, handle.schedule_time, handle.message_id)
        if after.state == p.MessageState.DELIVERED:
            return p.CancelResult(ResultCode.OK, "already delivered", p.CancelOutcome.ALREADY_DELIVERED)
        self.ticks.remove_cancelled(bucket, found.offsets, handle.schedule_time)
        return p.CancelResult(ResultCode.OK, "cancelled", p.CancelOutcome.CANCELLED)
