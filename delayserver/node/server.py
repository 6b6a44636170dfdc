"""One delay-server node: the wiring of its services in one trio nursery.

Services, each started with `nursery.start` so that it reports readiness: receiver (group commit),
replayer, id index (status and cancel lookups), tick manager, sender, cleaner, metrics and the HTTP
API, meta agent, listener. Each takes the narrow collaborators it uses in its constructor; nothing
reaches back into this object. `drain()` is the
SIGTERM path: stop accepting, finish the batch, flush, replay, checkpoint.
"""
from __future__ import annotations

import concurrent.futures
import functools
import gc
import hmac
import logging
import ssl
import sys

import trio

from delayserver import protocol as p
from delayserver.budget import ByteBudget
from delayserver.clock import WallClock
from delayserver.config import Config
from delayserver.dedupe import SAVE_LOOP_SHARE, Dedupe
from delayserver.lookup import Lookup
from delayserver.loopwatch import LoopWatch
from delayserver.message import ResultCode
from delayserver.metrics import NodeMetrics
from delayserver.node.browse import Browser
from delayserver.node.divergence import Realigner
from delayserver.schedules.emitter import serve as serve_schedules
from delayserver.schedules.registry import Registry as ScheduleRegistry
from delayserver.schedules.service import ScheduleService
from delayserver.node.membership import follow_meta, local_groups
from delayserver.node.operations import MessageOperations, Requests
from delayserver.node.pump import PumpLimits, error_frame, peer_name, pump
from delayserver.node.receiver import DiskSpace, Receiver, RecentBatches
from delayserver.node.replication import InSync, Master, Registry, Slave, SlaveStates
from delayserver.node.replication.snapshot import install_pending
from delayserver.node.role import NodeRole
from delayserver.node.view import NodeView
from delayserver.replayer import Replayer
from delayserver.sender.parked import ParkedLog, parked_offsets
from delayserver.sender.sender import Sender
from delayserver.storage.cleaner import clean
from delayserver.storage.errors import StorageError
from delayserver.storage.store import Store
from delayserver.storage.time_index import TimeIndex
from delayserver.transactions.checker import Checker
from delayserver.transactions.operations import TransactionOperations
from delayserver.transactions.sessions import ProducerSessions
from delayserver.transactions.state import HalfMessages
from delayserver.wakeup import Wakeup
from delayserver.wheel.prefetch import prefetch_due
from delayserver.wheel.service import serve_ticks
from delayserver.wheel.tick_manager import TickManager

log = logging.getLogger("delayserver.server")

MAX_REQUESTS_PER_CONNECTION = 256
#: What a connection may buffer before it has authenticated (an AUTH frame is a few bytes).
MAX_BYTES_BEFORE_AUTH = 64 << 10
#: The collector's thresholds while the node serves (Python's are 700, 10, 10): a young collection
#: every 10,000 new container objects, not every 700. The hot paths hold a batch's objects for a
#: moment: at 700 a collection could run within a batch and promote objects about to be dropped.
#: Much larger thresholds let more garbage build up between collections, and each pause grows with
#: it. Figures in README ("Benchmarks": the ingest and deliver rows on the collector).
GC_THRESHOLDS = (10_000, 20, 20)
#: How long the event loop may hold the interpreter's lock while a worker thread waits for it, and
#: a thread that holds it (a bucket's load, a save's encoding) the event loop (Python's 5 ms): a
#: thread back from an fsync, a broker's reply or a read-ahead waited up to that to hand its result
#: over. Figures in README ("Benchmarks": the deliver rows on the switch interval, 1 ms and 0.5 ms).
SWITCH_INTERVAL_S = 0.0005


class DelayServer:
    def __init__(self, config: Config, clock=None, dedupe_read: concurrent.futures.Future | None = None):
        """`dedupe_read`: `Dedupe.read` of this node's table started by the caller (the command
        line starts it before it imports this module); else `serve` starts it."""
        self.config = config
        self._dedupe_read = dedupe_read
        self.clock = clock or WallClock()
        self.connections = 0
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self.metrics = NodeMetrics()
        self._listener_scope = trio.CancelScope()
        self.role = NodeRole.configured(config)
        self.slave: Slave | None = None
        self.restart_requested = False
        self.buffered = ByteBudget(config.max_buffered_bytes)  # request bytes held by every connection

    # --- start --------------------------------------------------------------------------------

    def _open(self) -> None:
        c = self.config
        c.data_dir.mkdir(parents=True, exist_ok=True)
        install_pending(c.data_dir)  # a snapshot of the master, taken by the slave before a restart
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dedupe-load") as pool:
            # The saved dedupe table is read while the store and its indexes are opened: its copies
            # and checksums run mostly outside the interpreter's lock (0.3 to 0.4 s at ten million ids).
            # (A snapshot's install leaves the table's files alone: read before it, they are the same.)
            reading = self._dedupe_read or pool.submit(Dedupe.read, c.dedupe_window_ms, c.data_dir / "checkpoint")
            self._dedupe_read = None  # read once: a later start reads afresh
            self._open_rest(reading)

    def _open_rest(self, reading: concurrent.futures.Future) -> None:
        c = self.config
        self.store = Store.open(c.data_dir, segment_scale_ms=c.segment_scale_ms,
                                message_log_segment_bytes=c.message_log_segment_bytes)
        disk_full = not self.store.take_reserve_at_start(c.reserve_bytes)
        if disk_full:
            log.error("disk full: no room for the %d-byte reserve in %s; refusing new messages with DISK_FULL "
                      "until there is", c.reserve_bytes, c.data_dir)
        self.parked = ParkedLog(c.data_dir / "parked")
        self.lookup = Lookup(self.store, c.data_dir / "index")
        self.times = TimeIndex(self.store.schedule_log, c.segment_scale_ms, c.data_dir / "index" / "time")  # browse
        scale = c.segment_scale_ms
        self.ticks = TickManager(
            self.store, now_ms=self.clock.now_ms(), tick_ms=c.tick_ms, slots=c.wheel_slots,
            load_ahead_ms=c.effective_load_ahead_ms, read_ahead_bytes=c.read_ahead_bytes,
            settled_elsewhere=lambda bucket: parked_offsets(c.data_dir / "parked", bucket, scale),
        )
        recent = RecentBatches()
        self.disk = DiskSpace(self.store, c.reserve_bytes, full=disk_full)
        self.halves = HalfMessages(scale)
        self.dedupe, saved = reading.result()
        if self.dedupe.table.enabled:
            self.dedupe.recover(self.store.message_log, self.clock.now_ms(), saved)
        self.schedules = ScheduleRegistry(self.store.checkpoint_dir)
        self.schedules.recover(self.store.message_log)
        self.replayer = replayer = Replayer.open(
            self.store, self.ticks, recent_batch=recent.take, on_disk_full=self.disk.enter_full,
            on_records=self._follow_records, follow_prefix=self._follow_prefix, transactions=self.halves)
        self.durable = Wakeup()
        # After a promotion, sequences go on above the replayed log's top.
        self.receiver = Receiver(self.store, self.clock, c, recent=recent, disk=self.disk, on_durable=self.durable,
                                 sequence_floor=lambda: replayer.max_sequence + 1, dedupe=self.dedupe.table)
        # Replication: registered slaves' durable offsets; in sync mode, the acknowledgement gate.
        self.registry = Registry(set() if c.meta else None)
        slaves = SlaveStates(self.store.checkpoint_dir, registry=self.registry, max_lag_bytes=c.max_slave_lag)
        insync = None
        if c.replication == "sync":
            insync = InSync(min_insync_replicas=c.min_insync_replicas, timeout_s=c.sync_timeout_ms / 1000,
                            durable_end=lambda: self.receiver.durable_offset)
            self.receiver.replicas = insync
        self.receiver.page_floor = functools.partial(self._page_floor, slaves)
        self.receiver.epoch = functools.partial(self.role.epoch, self.store.message_log)
        self.receiver.may_acknowledge = self.role.may_acknowledge
        self.master = Master(self.receiver, self.store, slaves, insync, replayer)
        self.sender = Sender(self.ticks, self.store, local_groups(c), self.clock, send_batch_size=c.send_batch_size,
                             send_wait_ms=c.send_wait_ms, max_inflight=c.max_inflight,
                             batches_in_flight=c.send_batches_in_flight, parked=self.parked,
                             may_deliver=self.role.may_deliver, on_disk_full=self.disk.enter_full)
        self.sender.on_delivered = self.metrics.delivered
        self.operations = MessageOperations(self.store, self.receiver, self.replayer, self.ticks, self.role,
                                            self.lookup, on_acknowledged=self.metrics.acknowledged,
                                            browser=Browser(self.store, self.lookup, self.times))
        # transactions: half messages, the producer connections that answer checks, the checker
        self.producer_sessions = ProducerSessions()
        self.transactions = TransactionOperations(self.store, self.receiver, self.replayer, self.lookup, self.role,
                                                  c, self.clock, self.parked)
        self.checker = Checker(self.transactions, self.producer_sessions, c, self.clock,
                               may_check=self.role.may_deliver)
        self.requests = Requests(self.operations, self.master,
                                 ScheduleService(self.schedules, self.operations, self.clock, c.max_message_bytes),
                                 self.transactions, cluster_secret=c.cluster_secret, role=self.role)
        self.loop_watch = LoopWatch()
        self.limits = PumpLimits(c.max_frame_bytes, c.idle_timeout_ms / 1000, c.frame_timeout_ms / 1000,
                                 max_in_flight=MAX_REQUESTS_PER_CONNECTION,
                                 max_bytes_before_gate=MAX_BYTES_BEFORE_AUTH,
                                 max_connection_bytes=c.max_connection_bytes)

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Recover, start every service, listen; `task_status.started(port)` once serving."""
        # No automatic collection until what recovery builds is frozen below: a full collection
        # in the middle of a start walked the dedupe table's millions of entries (113 ms at ten
        # million), and everything built here lives as long as the node.
        collecting, thresholds, switch_s = gc.isenabled(), gc.get_threshold(), sys.getswitchinterval()
        gc.disable()
        try:
            self._open()  # Replayer.open has replayed all of message_log before anything loads
        except BaseException:
            if collecting:
                gc.enable()
            raise
        c = self.config
        trio.lowlevel.add_instrument(self.loop_watch)
        gc.callbacks.append(self.loop_watch.on_gc)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self.receiver.serve)
                await nursery.start(self.lookup.serve)
                await nursery.start(self.times.serve)
                await nursery.start(functools.partial(self.replayer.serve, self.clock,
                                                      lambda: self.receiver.durable_offset, self.durable,
                                                      checkpoint_interval_ms=c.checkpoint_interval_ms))
                await nursery.start(functools.partial(serve_ticks, self.ticks, self.clock, self.sender.dispatch_now,
                                                      active=self.role.is_master))
                await nursery.start(functools.partial(prefetch_due, horizon_ms=c.read_ahead_ms), self.ticks, self.clock)
                await nursery.start(self.sender.serve)
                nursery.start_soon(self._save_followers_periodically)
                await nursery.start(functools.partial(serve_schedules, self.schedules, self.operations, self.clock,
                                                      self.role.is_master))
                await nursery.start(self.transactions.serve_parking)
                await nursery.start(self.checker.serve)
                # Bound now (the meta server is told the port), accepting only once the role is
                # known: a producer quick off the mark waits in the backlog for its answer instead
                # of meeting NOT_MASTER from a node that has not heard from the meta server yet.
                listeners = await trio.open_tcp_listeners(c.listen[1], host=c.listen[0])
                self.port = listeners[0].socket.getsockname()[1]
                if c.meta or c.replicate_from:
                    node_id = c.node_id or c.advertised_address or f"{c.listen[0]}:{self.port}"
                    self.slave = Slave(self.store, self.receiver, self.role, node_id,
                                       secret=c.cluster_secret or c.auth_secret, tls_ca=c.tls_ca,
                                       on_snapshot=self._restart_for_snapshot)
                    self.slave.realign = Realigner(c.data_dir, self.store, self.receiver, self.replayer, self.ticks,
                                                   self.clock, self.role, node_id)
                if c.meta:
                    nursery.start_soon(self._follow_registered, node_id)
                await self._serve_http(nursery)
                if c.meta:
                    await follow_meta(c, self.clock, self.port, self.role, self.sender, nursery)
                await nursery.start(self._listen, listeners)
                if self.slave is not None:
                    await nursery.start(self.slave.run)
                nursery.start_soon(self._clean_periodically)
                # What recovery built lives as long as the node (the dedupe table's list of ids,
                # the schedules, the replayer's state): kept out of the collector's generations,
                # a full collection no longer walks millions of entries on the event loop.
                gc.freeze()
                gc.set_threshold(*GC_THRESHOLDS)
                sys.setswitchinterval(SWITCH_INTERVAL_S)
                if collecting:
                    gc.enable()
                log.info("serving on %s:%d, data in %s", c.listen[0], self.port, c.data_dir)
                task_status.started(self.port)
        finally:
            trio.lowlevel.remove_instrument(self.loop_watch)
            gc.callbacks.remove(self.loop_watch.on_gc)
            gc.unfreeze()  # what was frozen is collectable again once the node stops
            gc.set_threshold(*thresholds)
            sys.setswitchinterval(switch_s)
            if collecting:
                gc.enable()
            await self.sender.aclose()
            self.parked.close()
            self.store.close()

    async def _serve_http(self, nursery) -> None:
        """Metrics (prometheus-client) and, with http_listen, the HTTP API and console."""
        from delayserver.node.http.backlog import Backlog

        c = self.config
        view = NodeView(c, self.clock, self.port, self.store, self.receiver, self.disk, self.replayer, self.ticks,
                        self.sender, self.master, self.slave, self.role, self.operations,
                        connections=lambda: self.connections, loop_watch=self.loop_watch)
        self.backlog = Backlog(c.data_dir, self.clock, c.segment_scale_ms)
        self.metrics.register_node(view, self.backlog)
        if c.metrics_listen is None and c.http_listen is None:
            return
        # Only now: the ASGI framework and server take a tenth of a second to import.
        from delayserver.node.http.app import create_app, metrics_app
        from delayserver.node.http.ops import ServerOps
        from delayserver.node.http.serve import serve_asgi

        await nursery.start(self.backlog.serve)
        if c.metrics_listen is not None:
            self.metrics_port = await nursery.start(serve_asgi, metrics_app(self.metrics), *c.metrics_listen)
        if c.http_listen is not None:
            app = create_app(ServerOps(view), secret=c.auth_secret, metrics=self.metrics, backlog=self.backlog,
                             max_body_bytes=c.max_frame_bytes, clock=self.clock)
            self.http_port = await nursery.start(functools.partial(
                serve_asgi, app, *c.http_listen, certfile=c.tls_cert, keyfile=c.tls_key,
                read_timeout_s=c.frame_timeout_ms / 1000))

    async def _listen(self, listeners, task_status=trio.TASK_STATUS_IGNORED) -> None:
        handler = self._handle
        if self.config.tls_cert:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(self.config.tls_cert, self.config.tls_key)
            handler = functools.partial(self._handle_tls, context)
        with self._listener_scope:
            await trio.serve_listeners(handler, listeners, task_status=task_status)

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
        await self._save_followers(loop_share=1.0)  # stopping: the save need not leave room
        with trio.move_on_after(2):
            while self.ticks.inflight:
                await trio.sleep(0.01)
        self._nursery.cancel_scope.cancel()

    def _restart_for_snapshot(self) -> None:
        """A slave's snapshot of its master is ready: stop; the next start installs it (the
        `delayserver serve` process starts itself again when `restart_requested`)."""
        log.warning("stopping to install the master's snapshot")
        self.restart_requested = True
        self._listener_scope.cancel()
        self._nursery.cancel_scope.cancel()

    async def _follow_registered(self, node_id: str) -> None:
        """Keep the registry of slaves to the group's nodes at the meta server."""
        from delayserver.meta.client import MetaClient

        c = self.config
        tls = ssl.create_default_context(cafile=c.meta_tls_ca) if c.meta_tls_ca else None
        async with MetaClient(c.meta, secret=c.cluster_secret, tls=tls) as client:
            await self.registry.follow(client, c.group, node_id)

    async def _clean_periodically(self) -> None:
        """The cleaner: delete what replay, replication and retention no longer need."""
        while True:
            await trio.sleep(self.config.cleaner_interval_ms / 1000)
            try:
                await self.clean_once()
            except StorageError as e:
                log.error("cleaner pass failed: %s", e)

    async def clean_once(self):
        """One cleaner pass (raises StorageError subtypes); what it deleted."""
        c = self.config
        # Saved first, so that message_log is not kept past retention for their sake.
        await self._save_followers()
        # Written first: after a restart the cleaner still keeps what each slave lacks.
        slaves = self.master.slaves
        slaves.save()
        pinning = slaves.pinning(self.receiver.durable_offset)
        cleaned = clean(self.store, replay_offset=self.replayer.checkpointed_offset, now_ms=self.clock.now_ms(),
                        retention_ms=c.retention_ms,
                        sync_offsets=[*(s.message_log_offset for s in pinning), *self._pinned_offsets()],
                        dispatch_sync_sizes=[s.dispatch_sizes for s in pinning])
        if cleaned.buckets:
            await self.replayer.checkpoint_async()
        return cleaned

    def _follower_offsets(self) -> list[int]:
        """Where message_log is needed from to rebuild the dedupe table and the schedules at start."""
        return [self.schedules.saved_offset, *([self.dedupe.saved_offset] if self.dedupe.table.enabled else [])]

    def _follow_records(self, data, records: list[tuple[int, int, int]], own: bool) -> None:
        """The message_log records of a replay pass: the dedupe table and the schedules follow
        them. A batch this node wrote itself is in the dedupe table already (a send is remembered
        when it is acknowledged, a move when it is stored): it is not decoded a second time."""
        table = self.dedupe.table
        if table.enabled and not own:
            for rtype, s, e in records:
                table.feed_record(rtype, data, s, e)
        self.schedules.feed_records(data, records)

    def _follow_prefix(self, own: bool) -> bytes | None:
        """Which records `_follow_records` needs of a pass (Replayer's `follow_prefix`): all of them
        while the dedupe table learns from the log, else only what the schedules look at."""
        return None if self.dedupe.table.enabled and not own else self.schedules.id_prefix

    async def _save_followers(self, loop_share: float = SAVE_LOOP_SHARE) -> None:
        """Save the dedupe table and the schedules, covering message_log up to replay's offset.
        `loop_share`: the most of the event loop the table's save takes."""
        offset = self.replayer.offset
        if self.dedupe.table.enabled:
            await self.dedupe.save(self.clock.now_ms(), offset, loop_share=loop_share)
        try:
            await self.schedules.save(offset)
        except StorageError as e:
            log.error("schedules not saved (will try again): %s", e)

    async def _save_followers_periodically(self, interval_s: float = 60.0) -> None:
        while True:
            await trio.sleep(interval_s)
            await self._save_followers()

    def _page_floor(self, slaves: SlaveStates) -> int:
        """The message_log offset below which this node reads its log back from the disk only (the
        receiver's `page_floor`): replayed (the replayer reads a batch it missed in memory on the
        event loop), and pulled by every slave that holds back the cleaner (a slave in step is
        answered on the event loop)."""
        return min([self.replayer.offset, *(s.message_log_offset for s in slaves.pinning(self.receiver.durable_offset))])

    def _pinned_offsets(self) -> list[int]:
        """message_log offsets the cleaner keeps from besides the slaves': what the dedupe table and
        the schedules are rebuilt from at start, open half messages."""
        offsets = self._follower_offsets()
        if self.halves.pinned_offset is not None:
            offsets.append(self.halves.pinned_offset)
        return offsets

    # --- connections --------------------------------------------------------------------------

    async def _handle(self, stream: trio.abc.Stream) -> None:
        try:
            if self.connections >= self.config.max_connections:
                with trio.move_on_after(self.limits.send_timeout_s):
                    await stream.send_all(error_frame(0, ResultCode.BUSY, "too many connections"))
                return
            self.connections += 1
            session = self.producer_sessions.open(peer_name(stream))
            try:
                peer = self.requests.connection()
                gate = functools.partial(self._authenticate, peer) if self.config.auth_secret else None
                await pump(stream, self.limits, functools.partial(peer.respond, session=session), gate=gate,
                           what="a producer connection", budget=self.buffered,
                           on_send=functools.partial(setattr, session, "send"), respond_now=peer.answer_now)
            finally:
                session.close()
                self.connections -= 1
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
            pass
        except Exception:  # noqa: BLE001 - one connection's failure never stops the node
            log.exception("closing a connection after an unexpected error")
        finally:
            await stream.aclose()

    async def _authenticate(self, peer, frame: p.Frame, send) -> bool:
        """With `auth_secret` set, a connection's first frame must be AUTH with that secret (or
        with the cluster secret: a node of the cluster, allowed to replicate)."""
        secret = self.config.auth_secret.encode("utf-8")
        if frame.command == p.Command.AUTH and not frame.is_response:
            if peer.authenticate(frame.payload) or hmac.compare_digest(frame.payload, secret):
                await send(p.encode(p.Frame(p.Command.AUTH, frame.request_id, b"", is_response=True)))
                return True
        log.warning("refused a connection: %s", "wrong secret" if frame.command == p.Command.AUTH
                    else f"{frame.command.name} before AUTH")
        await send(error_frame(frame.request_id, ResultCode.UNAUTHORIZED,
                               "authenticate first: AUTH with the shared secret"))
        return False
