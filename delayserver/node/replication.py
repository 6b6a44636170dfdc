"""Master/slave replication: the slave pulls message_log and dispatch_log from its master.

The slave asks for message_log from its own end offset (the two logs are the same byte stream, so
offsets agree), checks every record's crc before writing, fsyncs, and replays its copy into its
own schedule_log. It also pulls each dispatch_log bucket from its own size, so that once promoted
it skips what the master already delivered. Only the master delivers; a slave takes no writes
(NOT_MASTER). Replication is asynchronous: the master acknowledges producers after its own fsync,
so a message acknowledged in the last moments before the master is lost for good may be missing
on the slave.

Wire payloads (big-endian), carried by SYNC_MESSAGE_LOG and SYNC_DISPATCH_LOG frames::

    SYNC_MESSAGE_LOG   request:  offset u64, max_bytes u32, wait_ms u32, node id str16
                       response: start u64, master durable end u64, then whole records
    SYNC_DISPATCH_LOG  request:  node id str16, count u32, then (bucket i64, size u64) * count
                       response: count u32, then (bucket i64, start u64, length u32, bytes) * count

A master answers a message_log request at its durable end by waiting up to `wait_ms` for more (a
long poll). An offset past the master's end means the slave holds records the master never had
(the slave was a master once): the master answers DIVERGED, and the slave connects again. On each
connection, before pulling, the slave finds where its history parts from the master's and cuts
it there after quarantining the rest (node/divergence.py).
"""
from __future__ import annotations

import logging
import ssl
import struct

import trio

from delayserver import protocol as p
from delayserver.message import DelayServerError, ResultCode
from delayserver.node.divergence import no_realign
from delayserver.node.receiver import Receiver
from delayserver.node.role import NodeRole
from delayserver.storage.errors import StorageError
from delayserver.storage.reader import Damage, raise_unless_incomplete, read_records
from delayserver.storage.store import Store

log = logging.getLogger("delayserver.replication")

_ML_REQ = struct.Struct(">QIIH")
_ML_RESP = struct.Struct(">QQ")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_SIZE = struct.Struct(">qQ")
_CHUNK = struct.Struct(">qQI")
MAX_SYNC_BYTES = 4 << 20


def _node(payload: bytes, pos: int) -> tuple[str, int]:
    (n,) = _U16.unpack_from(payload, pos)
    return payload[pos + 2 : pos + 2 + n].decode("utf-8"), pos + 2 + n


class Master:
    """The master's side: answer pulls, remember how far each slave got (for the cleaner)."""

    def __init__(self, receiver: Receiver, store: Store):
        self.receiver = receiver
        self.store = store
        self.message_log_offsets: dict[str, int] = {}
        self.dispatch_sizes: dict[str, dict[int, int]] = {}

    async def message_log(self, payload: bytes) -> bytes:
        try:
            offset, max_bytes, wait_ms, _ = _ML_REQ.unpack_from(payload, 0)
            node, _ = _node(payload, _ML_REQ.size - 2)
        except (struct.error, UnicodeDecodeError):
            raise p.RemoteProtocolError("malformed SYNC_MESSAGE_LOG request") from None
        receiver, message_log = self.receiver, self.store.message_log
        if offset > receiver.durable_offset:
            raise DelayServerError(
                f"slave offset {offset} is past this master's end {receiver.durable_offset}: the slave holds "
                "records this master never had", code=ResultCode.DIVERGED)
        if offset < message_log.start_offset:
            raise DelayServerError(f"offset {offset} was cleaned from message_log", code=ResultCode.NOT_FOUND)
        self.message_log_offsets[node] = offset
        if offset == receiver.durable_offset and wait_ms:
            with trio.move_on_after(min(wait_ms, 10_000) / 1000):
                while offset == receiver.durable_offset:
                    await receiver.durable_changed.wait()
        data, start = b"", offset
        if offset < receiver.durable_offset:
            data, start = message_log.read(offset, min(max_bytes, MAX_SYNC_BYTES))
            # Only what is durable here goes out: a slave never holds what a master crash loses.
            data = _whole_records_before(data, start, receiver.durable_offset)
        return _ML_RESP.pack(start, receiver.durable_offset) + data

    async def dispatch_log(self, payload: bytes) -> bytes:
        try:
            node, pos = _node(payload, 0)
            (count,) = _U32.unpack_from(payload, pos)
            pos += 4
            theirs = {}
            for _ in range(count):
                bucket, size = _SIZE.unpack_from(payload, pos)
                theirs[bucket] = size
                pos += _SIZE.size
        except (struct.error, UnicodeDecodeError):
            raise p.RemoteProtocolError("malformed SYNC_DISPATCH_LOG request") from None
        self.dispatch_sizes[node] = theirs
        dispatch_log = self.store.dispatch_log
        chunks, budget = [], MAX_SYNC_BYTES
        for bucket in dispatch_log.buckets():
            have = theirs.get(bucket, 0)
            mine = dispatch_log.size(bucket)
            if mine > have and budget > 0:
                data = dispatch_log.read(bucket, have, min(mine, have + budget))
                data = _whole_records_before(data, have, have + len(data))
                if data:
                    chunks.append(_CHUNK.pack(bucket, have, len(data)) + data)
                    budget -= len(data)
        return _U32.pack(len(chunks)) + b"".join(chunks)


def _whole_records_before(data: bytes, start: int, limit: int) -> bytes:
    """The whole records of `data` (a read at `start`) that end at or before `limit`."""
    end = 0
    for _, _, _, stop in read_records(data, report=raise_unless_incomplete):
        if start + stop > limit:
            break
        end = stop
    return data[:end]


def _check_from_master(data: bytes, what: str, base: int) -> None:
    """Every record of `data` whole and valid, or DelayServerError naming the first bad one."""
    def report(damage: Damage) -> None:
        raise DelayServerError(f"{what} from the master fails its check at {damage.offset}: {damage.reason}",
                               code=ResultCode.INTERNAL)

    for _ in read_records(data, base=base, sealed=True, report=report):
        pass


class Slave:
    """The slave's side: a task that pulls from the role's master address while the role is slave."""

    def __init__(self, store: Store, receiver: Receiver, role: NodeRole, node_id: str, *, secret: str = "",
                 tls_ca: str = "", poll_ms: int = 500):
        """`secret`: the master's shared secret; `tls_ca`: a CA file to check the master's
        certificate against (TLS to the master when given)."""
        self.store = store
        self.receiver = receiver
        self.role = role
        self.node_id = node_id.encode("utf-8")
        self.secret = secret
        self.tls_ca = tls_ca
        self.poll_ms = poll_ms
        self.pulled = 0
        self.stopped_reason = ""
        self.lag_bytes = 0  # the master's durable end minus ours, at the last pull
        self.in_sync = False  # the last pull left nothing of the master's durable log to fetch
        self._behind_since: float | None = None  # trio time of the first pull that found us behind
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
            except (ConnectionError, TimeoutError) as e:
                log.warning("replication from %s interrupted: %s", address, e)
                await trio.sleep(1)
            except DelayServerError as e:
                if e.code == ResultCode.BAD_REQUEST:
                    self.stopped_reason = str(e)
                    log.critical("replication stopped: %s", e)
                else:
                    log.error("replication from %s: %s", address, e)
                    await trio.sleep(1)

    def _tls(self):
        """TLS to the master when `tls_ca` names the CA to check its certificate against."""
        return ssl.create_default_context(cafile=self.tls_ca) if self.tls_ca else False

    async def _pull_message_log(self, conn) -> None:
        store, receiver = self.store, self.receiver
        offset = store.message_log.end_offset
        request = _ML_REQ.pack(offset, MAX_SYNC_BYTES, self.poll_ms, len(self.node_id)) + self.node_id
        reply = await conn.request(p.Command.SYNC_MESSAGE_LOG, request)
        if not self.role.is_slave():
            return  # promoted while the pull was in flight: never append the old master's records
        start, master_end = _ML_RESP.unpack_from(reply, 0)
        data = reply[_ML_RESP.size :]
        self.lag_bytes = max(0, master_end - offset - len(data))
        self.in_sync = not self.lag_bytes
        if not self.lag_bytes:
            self._behind_since = None
        elif self._behind_since is None:
            self._behind_since = trio.current_time()
        if not data:
            return
        if start != offset:
            raise DelayServerError(f"master answered from {start}, asked for {offset}", code=ResultCode.INTERNAL)
        _check_from_master(data, "message_log", start)
        try:
            store.message_log.append(data)
            await trio.to_thread.run_sync(store.message_log.sync)
        except StorageError as e:
            log.error("cannot store replicated records: %s", e)
            store.message_log.truncate(offset)
            await trio.sleep(1)
            return
        receiver.set_durable(store.message_log.end_offset)
        self.pulled += len(data)

    async def _pull_dispatch_log(self, conn) -> None:
        dispatch_log = self.store.dispatch_log
        buckets = dispatch_log.buckets()
        request = (_U16.pack(len(self.node_id)) + self.node_id + _U32.pack(len(buckets))
                   + b"".join(_SIZE.pack(b, dispatch_log.size(b)) for b in buckets))
        reply = await conn.request(p.Command.SYNC_DISPATCH_LOG, request)
        if not self.role.is_slave():
            return
        (count,) = _U32.unpack_from(reply, 0)
        pos = 4
        for _ in range(count):
            bucket, start, length = _CHUNK.unpack_from(reply, pos)
            pos += _CHUNK.size
            data = reply[pos : pos + length]
            pos += length
            if start != dispatch_log.size(bucket):
                continue  # raced with an earlier answer: ask again next round
            try:
                _check_from_master(data, f"dispatch_log bucket {bucket}", start)
                dispatch_log.append(bucket, data)
            except (DelayServerError, StorageError) as e:
                log.error("dispatch_log bucket %d from the master not stored: %s", bucket, e)
        if count:
            paths, new_files = dispatch_log.take_dirty()
            try:
                await trio.to_thread.run_sync(dispatch_log.sync_paths, paths, new_files)
            except StorageError as e:  # a failed fsync is final (the node turns read-only), not fatal
                log.error("replicated dispatch_log records not durable: %s", e)
                await trio.sleep(1)
