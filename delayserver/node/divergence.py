"""Where a replica's history parts from its master's, and how it is cut back to the common part.

Every message_log batch carries the epoch of the master that wrote it (storage/record.py), and
each log indexes where its epochs begin (storage/epochs.py). Before pulling from a master, a
slave (or a former master that returns as a slave) finds the divergence point as Kafka followers
do with leader epochs:

1. Take the epoch `e` of its last record and ask the master for the end offset of `e`
   (SYNC_EPOCH_END): the master answers the largest epoch it holds not above `e`, `e2`, and the
   offset where its records of `e2` end.
2. The histories agree up to the smaller of that offset and where the replica's own records of
   `e2` end. If that is the replica's end, they agree; otherwise the replica's history is cut
   there for the next round, which asks again with the epoch of the new last record.

What lies past the divergence point was written by a master that the group has since replaced
(a master acknowledges only under its lease, but an asynchronous slave may not have pulled what
it acknowledged), so it is kept: first copied, byte for byte, to
``DATA_DIR/quarantine/diverged/<offset>-<time>.log`` (a message_log fragment `delayctl inspect`
reads) with a listing ``.json`` naming every message id and cancel in it; only then is
message_log truncated. `delayctl diverged DATA_DIR` lists them and `--redrive ADDRESS` sends the
messages to the current master again. A cut below what the node has replayed rolls its
schedule_log back too (records replayed from the cut part), drops those buckets' dispatch_log (the
master's copy is pulled again) and moves the replay cursor back to the cut.

dispatch_log is compared too, bucket by bucket (SYNC_DISPATCH_DIGEST, a crc32c of the replica's
bytes): a bucket the replica wrote to as a master differs from the current master's, and is
copied to ``quarantine/diverged/dispatch/`` and pulled again whole.

Wire payloads (big-endian)::

    SYNC_EPOCH_END   request:  epoch u64
                     response: epoch u64 (the largest the master holds not above it), end u64
"""
from __future__ import annotations

import json
import logging
import struct
import time
from pathlib import Path

import trio

from delayserver import protocol as p
from delayserver.message import DelayServerError, ResultCode
from delayserver.storage.checkpoint import read_checkpoint
from delayserver.node.replication import wire
from delayserver.node.replication.master import prefix_crc
from delayserver.storage.buckets import bucket_name, parse_bucket_name
from delayserver.storage.record import (
    OFFSET, RecordType, decode_payload, iter_checked_records,
)
from delayserver.storage.segment import fsync_dir, fsync_path

log = logging.getLogger("delayserver.divergence")

_REQUEST = struct.Struct(">Q")
_RESPONSE = struct.Struct(">QQ")
DIRECTORY = Path("quarantine") / "diverged"


def answer_epoch_end(store, receiver, payload: bytes) -> bytes:
    """The master's answer to SYNC_EPOCH_END: only what is durable here counts."""
    if len(payload) != _REQUEST.size:
        raise p.RemoteProtocolError("malformed SYNC_EPOCH_END request: an epoch is 8 bytes")
    (epoch,) = _REQUEST.unpack(payload)
    durable = receiver.durable_offset
    found, end = store.message_log.epochs.end_offset_for(epoch, durable)
    return _RESPONSE.pack(found, min(end, durable))


async def find_divergence(conn, message_log) -> int:
    """The offset up to which this node's message_log agrees with the master's behind `conn`
    (its end when they agree throughout). Reads the local log's epoch history; changes nothing."""
    epochs = message_log.epochs
    limit = message_log.end_offset
    while limit > message_log.start_offset:
        epoch = epochs.epoch_at(limit - 1)
        reply = await conn.request(p.Command.SYNC_EPOCH_END, _REQUEST.pack(epoch))
        theirs, their_end = _RESPONSE.unpack_from(reply, 0)
        _, our_end = epochs.end_offset_for(theirs, limit)
        point = min(their_end, our_end, limit)
        if point >= limit:
            break
        limit = point
    return limit


def quarantine_suffix(data_dir: Path, message_log, start: int, master: str) -> Path:
    """Copy message_log from `start` to its end into the quarantine, with its listing; returns
    the listing's path. Both files are durable when this returns (StorageError otherwise)."""
    end = message_log.end_offset
    chunks, offset = [], start
    while offset < end:
        data, base = message_log.read(offset, 4 << 20)
        if not data:
            break
        chunks.append(data)
        offset = base + len(data)
    raw = b"".join(chunks)
    messages, cancels, epoch = [], [], message_log.epochs.epoch_at(start)
    for pos, rtype, s, e in iter_checked_records(raw):
        if rtype == RecordType.EPOCH:
            epoch = OFFSET.unpack_from(raw, s)[0]
        elif rtype == RecordType.MESSAGE:
            m = decode_payload(rtype, raw, s, e)
            messages.append({"offset": start + pos, "epoch": epoch, "message_id": m.message_id,
                             "subject": m.subject, "schedule_time": m.schedule_time, "store_time": m.store_time})
        elif rtype == RecordType.CANCEL:
            c = decode_payload(rtype, raw, s, e)
            cancels.append({"offset": start + pos, "epoch": epoch, "message_id": c.message_id,
                            "schedule_time": c.schedule_time})
    directory = Path(data_dir) / DIRECTORY
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{start:020d}-{time.time_ns() // 1_000_000}"
    segment = directory / f"{stem}.log"
    listing = directory / f"{stem}.json"
    segment.write_bytes(raw)
    fsync_path(segment)
    doc = {"from_offset": start, "to_offset": start + len(raw), "master": master,
           "truncated_ms": time.time_ns() // 1_000_000, "segment": segment.name,
           "messages": messages, "cancels": cancels}
    listing.write_text(json.dumps(doc, indent=1))
    fsync_path(listing)
    fsync_dir(directory)
    fsync_dir(directory.parent)
    return listing


def quarantine_dispatch(data_dir: Path, dispatch_log, bucket: int) -> Path:
    """Copy `bucket`'s dispatch_log, byte for byte, to ``quarantine/diverged/dispatch/`` (a
    segment `delayctl inspect` reads); durable when this returns."""
    directory = Path(data_dir) / DIRECTORY / "dispatch"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{bucket_name(bucket)}-{time.time_ns() // 1_000_000}.log"
    path.write_bytes(dispatch_log.read(bucket))
    fsync_path(path)
    fsync_dir(directory)
    fsync_dir(directory.parent)
    return path


def list_diverged(data_dir: Path) -> list[dict]:
    """Every quarantined divergent suffix of the data directory, oldest first, with its path."""
    directory = Path(data_dir) / DIRECTORY
    out = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            log.error("%s: unreadable listing of a divergent suffix: %s", path, e)
            continue
        out.append({**doc, "listing": str(path)})
    return out


class Realigner:
    """What a slave runs on each connection to its master before pulling: find the divergence
    point, quarantine and cut what lies past it."""

    def __init__(self, data_dir: Path, store, receiver, replayer, ticks, clock, role, node_id: str = "realign"):
        self.data_dir = Path(data_dir)
        self.role = role
        self.store = store
        self.receiver = receiver
        self.replayer = replayer
        self.ticks = ticks
        self.clock = clock
        self.node_id = node_id
        self.truncations = 0
        self.dispatch_truncations = 0

    async def __call__(self, conn, master: str) -> None:
        await self._realign_message_log(conn, master)
        await self._realign_dispatch_log(conn, master)

    async def _realign_message_log(self, conn, master: str) -> None:
        message_log = self.store.message_log
        point = await find_divergence(conn, message_log)
        if point >= message_log.end_offset or not self.role.is_slave():
            return  # agreeing, or promoted meanwhile: a master's log is the group's history
        if point < message_log.start_offset:
            raise DelayServerError(
                f"the history diverges from master {master} at offset {point}, before the first segment "
                f"this node holds ({message_log.start_offset}): resync this node from an empty data directory",
                code=ResultCode.DIVERGED)
        # Synchronous from here on: no replay pass or delivery interleaves with the cut.
        listing = quarantine_suffix(self.data_dir, message_log, point, master)
        dropped = message_log.end_offset - point
        if point < self.replayer.offset:
            self._roll_back_schedule(point)
        message_log.truncate(point)
        self.receiver.durable_offset = point
        self.receiver.recent.forget()
        self.truncations += 1
        log.critical("message_log diverged from master %s at offset %d: %d bytes past it were written by a "
                     "replaced master; copied to %s (every message id listed), then truncated",
                     master, point, dropped, listing)
        await trio.lowlevel.checkpoint()

    async def _realign_dispatch_log(self, conn, master: str) -> None:
        """dispatch_log is pulled by size, bucket by bucket: a bucket this node wrote to while it
        was master (deliveries the new master never heard of) differs from the master's from some
        record on. Each bucket's digest is compared with the master's; a bucket that differs is
        copied to the quarantine and cut to nothing here, to be pulled again whole. (What the
        copy lists was delivered by this node; the new master may deliver it again: a duplicate,
        never a loss.)"""
        dispatch_log = self.store.dispatch_log
        buckets = [b for b in dispatch_log.buckets() if dispatch_log.size(b)]
        if not buckets:
            return

        def digests() -> dict[int, tuple[int, int]]:
            out = {}
            for bucket in buckets:
                size = dispatch_log.size(bucket)
                crc = prefix_crc(dispatch_log, bucket, size)
                if crc is not None:  # (None: the cleaner removed the bucket meanwhile)
                    out[bucket] = (size, crc)
            return out

        mine = await trio.to_thread.run_sync(digests)
        request = wire.encode_dispatch_digest_request(wire.DispatchDigestRequest(self.node_id, mine))
        differing = wire.decode_buckets(await conn.request(p.Command.SYNC_DISPATCH_DIGEST, request))
        if not self.role.is_slave():
            return  # promoted meanwhile
        for bucket in differing:
            if bucket not in mine:
                continue
            # Synchronous from the copy to the cut: no delivery interleaves.
            size = dispatch_log.size(bucket)
            copy = quarantine_dispatch(self.data_dir, dispatch_log, bucket)
            dispatch_log.truncate(bucket, 0)
            self.dispatch_truncations += 1
            log.critical("dispatch_log bucket %d differs from master %s's: its %d bytes (deliveries by a replaced "
                         "master) copied to %s, then cut; the master's are pulled again", bucket, master, size, copy)
        if differing:
            dispatch_log.sync()
            self.ticks.reset(self.clock.now_ms())

    def _roll_back_schedule(self, point: int) -> None:
        """Drop from schedule_log what was replayed from message_log at or after `point`; move
        the replay cursor back there and checkpoint it."""
        schedule_log, dispatch_log = self.store.schedule_log, self.store.dispatch_log
        cp = read_checkpoint(self.replayer.checkpoint_path) or {}
        # Records replayed before a checkpoint at or below the cut are common history: skip them.
        floor = ({parse_bucket_name(k): v for k, v in cp.get("schedule_sizes", {}).items()}
                 if cp.get("message_log_offset", 1 << 63) <= point else {})
        for bucket in schedule_log.buckets():
            cut = None
            for offset, rtype, payload in schedule_log.records(bucket, floor.get(bucket, 0)):
                if rtype in (RecordType.SCHEDULED, RecordType.SCHEDULED_CANCEL) \
                        and OFFSET.unpack_from(payload, 0)[0] >= point:
                    cut = offset
                    break
            if cut is None:
                continue
            log.warning("%s: rolling back %d bytes replayed from the divergent part of message_log",
                        schedule_log.path(bucket), schedule_log.size(bucket) - cut)
            schedule_log.truncate(bucket, cut)
            dispatch_log.truncate(bucket, 0)  # pulled again from the master
        self.ticks.reset(self.clock.now_ms())
        self.replayer.offset = point
        self.replayer.checkpoint()
        dispatch_log.sync()

