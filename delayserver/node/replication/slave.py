"""The slave's side of replication: pull message_log and dispatch_log from the master.

The slave asks for message_log from its own end offset (the two logs are the same byte stream, so
offsets agree), checks every record's crc before writing, fsyncs once per answer (group commit),
and replays its copy into its own schedule_log. Its next request, from the new end, tells the
master that everything before it is fsynced here: the acknowledgement sync mode waits for.

It also pulls each dispatch_log bucket from its own size, so that once promoted it skips what the
master already delivered. A dispatch record is applied only when this node's own schedule_log
holds the record it names, replayed from the same message_log offset: the records of a bucket are
applied in order up to the first one whose message this node has not replayed yet (the rest come
again next round), so a record can never mark another message delivered, such as the one a
promoted slave would later write at that schedule offset. A record naming another message than
the one here means the histories forked: it is not applied, the bucket's dispatch_log stops there,
and the error says so.
"""
from __future__ import annotations

import logging
import ssl

import trio

from delayserver import protocol as p
from delayserver.message import DelayServerError, ResultCode
from delayserver.node.replication import snapshot, wire
from delayserver.node.replication.master import MAX_SYNC_BYTES
from delayserver.node.role import NodeRole
from delayserver.storage.errors import CorruptSegment, StorageError
from delayserver.storage.reader import Damage, read_records
from delayserver.storage.record import OFFSET, RecordError, RecordType, decode_dispatch
from delayserver.storage.threads import run_disk

log = logging.getLogger("delayserver.replication")


def _check_from_master(data: bytes, what: str, base: int) -> None:
    """Every record of `data` whole and valid, or DelayServerError naming the first bad one."""
    def report(damage: Damage) -> None:
        raise DelayServerError(f"{what} from the master fails its check at {damage.offset}: {damage.reason}",
                               code=ResultCode.INTERNAL)

    for _ in read_records(data, base=base, sealed=True, report=report):
        pass


async def no_realign(conn, master: str) -> None:
    """What a Slave runs before pulling when the node gives it no Realigner (node/divergence.py)."""


#: How long a slave waits before connecting again after its master refused a request.
REFUSED_RETRY_S = 5


class Slave:
    """The slave's side: a task that pulls from the role's master address while the role is slave."""

    def __init__(self, store, receiver, role: NodeRole, node_id: str, *, secret: str = "", tls_ca: str = "",
                 poll_ms: int = 500, on_snapshot=None):
        """`secret`: the cluster secret (or the master's producer secret when the cluster has
        none); `tls_ca`: a CA file to check the master's certificate against (TLS when given).
        `on_snapshot()`: called once a snapshot of the master is ready to install (the node
        restarts to install it); without it, a slave behind the master's retention stops."""
        self.on_snapshot = on_snapshot
        self.store = store
        self.receiver = receiver
        self.role = role
        self.node_id = node_id
        self.secret = secret
        self.tls_ca = tls_ca
        self.poll_ms = poll_ms
        self.pulled = 0
        self.stopped_reason = ""
        self.lag_bytes = 0  # the master's durable end minus ours, at the last pull
        self.in_sync = False  # the last pull left nothing of the master's durable log to fetch
        self.dispatch_held_back = 0  # dispatch records waiting for this node's replay, at the last pull
        self._behind_since: float | None = None  # trio time of the first pull that found us behind
        self._forked: set[int] = set()  # buckets whose dispatch_log names other messages than ours
        self._logged_unexpected = False
        self.last_refusal = ""  # the last BAD_REQUEST the master answered, for operators
        self.realign = no_realign  # run on each connection before pulling (node/divergence.py)

    def lag_seconds(self) -> float:
        """How long this slave has been behind its master (0 when caught up at the last pull)."""
        return 0.0 if self._behind_since is None else trio.current_time() - self._behind_since

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from delayserver.client import AsyncProducer

        task_status.started()
        while not self.stopped_reason:
            address = self.role.master_address() if self.role.is_slave() else None
            if not address:
                await trio.sleep(self.poll_ms / 1000)
                continue
            try:
                async with AsyncProducer(address, timeout=15, secret=self.secret, tls=self._tls()) as conn:
                    log.info("replicating from %s", address)
                    await self.realign(conn, address)
                    while self.role.is_slave() and self.role.master_address() == address:
                        await self._pull_message_log(conn)
                        await self._pull_dispatch_log(conn)
            except (ConnectionError, TimeoutError, p.RemoteProtocolError) as e:
                log.warning("replication from %s interrupted: %s", address, e)
                await trio.sleep(1)
            except DelayServerError as e:
                if not (self.role.is_slave() and self.role.master_address() == address):
                    # An answer to a request sent before this node's role changed: it no longer
                    # says anything about how to replicate (the next round realigns first).
                    log.info("replication from %s: %s (answered after this node's role changed)", address, e)
                elif e.code == ResultCode.BAD_REQUEST:
                    # Each connection realigns the logs first: a refusal that survives it is a
                    # fault to report loudly, but the node keeps trying (never stops for good).
                    self.last_refusal = str(e)
                    log.critical("replication from %s refused: %s; retrying in %d s", address, e,
                                 REFUSED_RETRY_S)
                    await trio.sleep(REFUSED_RETRY_S)
                elif e.code == ResultCode.NOT_FOUND and self.on_snapshot is not None:
                    await self._resync(address, e)
                elif e.code == ResultCode.NOT_FOUND:
                    self.stopped_reason = (f"{e}: this node fell behind the master's retention; seed it with a "
                                           "copy of the master's data directory")
                    log.critical("replication stopped: %s", self.stopped_reason)
                else:
                    log.error("replication from %s: %s", address, e)
                    await trio.sleep(1)
            except Exception:  # noqa: BLE001 - whatever the master sends, this node goes on
                if not self._logged_unexpected:
                    self._logged_unexpected = True
                    log.exception("replication from %s failed unexpectedly; retrying", address)
                await trio.sleep(1)

    async def _resync(self, address: str, cause: DelayServerError) -> None:
        """Behind the master's retention: take a snapshot of it, then have the node restart to
        install it (snapshot.py). A segment cleaned during the download means a new snapshot."""
        from delayserver.client import AsyncProducer

        log.warning("replication from %s: %s; this node fell behind the master's retention: resyncing from a "
                    "snapshot of the master", address, cause)
        try:
            async with AsyncProducer(address, timeout=60, secret=self.secret, tls=self._tls()) as conn:
                await snapshot.download(conn, self.node_id, self.store.root, self.store.segment_scale_ms)
        except DelayServerError as e:
            if e.code == ResultCode.BAD_REQUEST:
                self.stopped_reason = f"cannot resync from the master: {e}"
                log.critical("replication stopped: %s", self.stopped_reason)
            else:  # a segment cleaned during the download, say: the next round takes a new snapshot
                log.error("snapshot of the master not taken: %s", e)
                await trio.sleep(1)
            return
        except (ConnectionError, TimeoutError, OSError, p.RemoteProtocolError, ValueError, KeyError) as e:
            log.error("snapshot of the master not taken: %s", e)
            await trio.sleep(1)
            return
        self.stopped_reason = "restarting to install a snapshot of the master"
        self.on_snapshot()

    def _tls(self):
        """TLS to the master when `tls_ca` names the CA to check its certificate against."""
        return ssl.create_default_context(cafile=self.tls_ca) if self.tls_ca else False

    async def _pull_message_log(self, conn) -> None:
        store, receiver = self.store, self.receiver
        offset = store.message_log.end_offset
        request = wire.encode_message_log_request(
            wire.MessageLogRequest(offset, MAX_SYNC_BYTES, self.poll_ms, self.node_id))
        reply = await conn.request(p.Command.SYNC_MESSAGE_LOG, request)
        if not self.role.is_slave():
            return  # promoted while the pull was in flight: never append the old master's records
        start, master_end, data = wire.decode_message_log_response(reply)
        # Behind by all the master has past what is stored here: in sync only once pulled bytes are
        # appended and synced here, not while they are being written (nor when storing them fails).
        self._note_lag(master_end - offset)
        if not data:
            return
        if start != offset:
            raise DelayServerError(f"master answered from {start}, asked for {offset}", code=ResultCode.INTERNAL)
        _check_from_master(data, "message_log", start)
        try:
            store.message_log.append(data)
            await run_disk(store.message_log.sync)
        except StorageError as e:
            log.error("cannot store replicated records: %s", e)
            store.message_log.truncate(offset)
            await trio.sleep(1)
            return
        # What this pull appended and synced: not the log's end, which a node promoted meanwhile
        # may have written past (its own batch is durable once its own fsync says so).
        receiver.set_durable(offset + len(data))
        self.pulled += len(data)
        self._note_lag(master_end - offset - len(data))

    def _note_lag(self, lag_bytes: int) -> None:
        self.lag_bytes = max(0, lag_bytes)
        self.in_sync = not self.lag_bytes
        if not self.lag_bytes:
            self._behind_since = None
        elif self._behind_since is None:
            self._behind_since = trio.current_time()

    async def _pull_dispatch_log(self, conn) -> None:
        dispatch_log = self.store.dispatch_log
        sizes = {b: dispatch_log.size(b) for b in dispatch_log.buckets()}
        request = wire.encode_dispatch_log_request(wire.DispatchLogRequest(self.node_id, sizes))
        reply = await conn.request(p.Command.SYNC_DISPATCH_LOG, request)
        if not self.role.is_slave():
            return  # promoted while the pull was in flight
        chunks = wire.decode_dispatch_log_response(reply)
        held_back, appended = 0, False
        for bucket, start, data in chunks:
            if start != dispatch_log.size(bucket) or bucket in self._forked:
                continue  # raced with an earlier answer: ask again next round
            try:
                _check_from_master(data, f"dispatch_log bucket {bucket}", start)
                applicable = self._applicable(bucket, data, start)
                held_back += len(data) - applicable
                if applicable:
                    dispatch_log.append(bucket, data[:applicable])
                    appended = True
            except (DelayServerError, StorageError, RecordError) as e:
                log.error("dispatch_log bucket %d from the master not stored: %s", bucket, e)
        self.dispatch_held_back = held_back
        if appended:
            paths, new_files = dispatch_log.take_dirty()
            try:
                await run_disk(dispatch_log.sync_paths, paths, new_files)
            except StorageError as e:  # a failed fsync is final (the node turns read-only), not fatal
                log.error("replicated dispatch_log records not durable: %s", e)
                await trio.sleep(1)

    def _applicable(self, bucket: int, data: bytes, start: int) -> int:
        """How many leading bytes of `data` (dispatch records of `bucket` from `start`) name messages
        this node holds, each replayed from the message_log offset the record names."""
        schedule_log = self.store.schedule_log
        held = schedule_log.size(bucket) if bucket in schedule_log.buckets() else 0
        end = 0
        for at, rtype, s, e in read_records(data, base=start):
            if rtype == RecordType.DISPATCH:
                d = decode_dispatch(data, s, e)
                if d.schedule_offset >= held:
                    break  # not replayed here yet: it comes again next round
                ours = self._replayed_from(bucket, d.schedule_offset)
                if ours is None or (d.message_log_offset >= 0 and ours != d.message_log_offset):
                    self._forked.add(bucket)
                    log.error("dispatch_log bucket %d: the master's record at %d marks schedule offset %d "
                              "(message_log offset %d) delivered, which here holds %s: not applied; "
                              "the histories differ", bucket, at, d.schedule_offset, d.message_log_offset,
                              "no message" if ours is None else f"message_log offset {ours}")
                    break
            end = e
        return end

    def _replayed_from(self, bucket: int, schedule_offset: int) -> int | None:
        """The message_log offset this node's schedule_log record at `schedule_offset` was replayed
        from; None when no SCHEDULED record starts there."""
        try:
            rtype, data, s, _ = self.store.schedule_log.read_record(bucket, schedule_offset)
        except (CorruptSegment, RecordError):
            return None
        return OFFSET.unpack_from(data, s)[0] if rtype == RecordType.SCHEDULED else None
