"""The master's side of replication: answer the slaves' pulls, and note how far each got.

A master answers a message_log request at its durable end by waiting up to `wait_ms` for more (a
long poll). An offset past the master's end means the slave holds records the master never had
(the slave was a master once): the master answers DIVERGED, and the slave connects again. On each
connection, before pulling, the slave finds where its history parts from the master's and cuts it
there after quarantining the rest (node/divergence.py). An offset that is not where a record starts, a
size inside a dispatch_log record or past its end, a malformed request: each is answered
BAD_REQUEST on that connection, and the master goes on.

A slave that finds its next offset cleaned, or is told it is more than `max_slave_lag` behind (both
NOT_FOUND), resyncs from a snapshot (SYNC_SNAPSHOT):
the master's replay checkpoint as of now (message_log offset, max sequence, the size of every
schedule_log and dispatch_log segment, taken together, between two replay steps) and then the
segments up to those sizes. From then on the slave pulls message_log from that offset, which the
manifest pins for it.
"""
from __future__ import annotations

import functools
import json

import crc32c
import trio

from delayserver.message import DelayServerError, ResultCode
from delayserver.node.replication import wire
from delayserver.node.replication.slaves import MAX_LONG_POLL_S, InSync, SlaveStates
from delayserver.storage.buckets import bucket_name
from delayserver.storage.errors import CorruptSegment
from delayserver.storage.reader import raise_unless_incomplete, read_records
from delayserver.storage.segment import own_descriptor
from delayserver.storage.record import RecordError

MAX_SYNC_BYTES = 4 << 20
#: A pull of at most this much (a slave in step with its master: what was just written, in memory)
#: is read on the event loop; more (a slave catching up) in a worker thread.
ON_LOOP_BYTES = 64 << 10


class Master:
    """Answer pulls; remember how far each registered slave got (for the cleaner and, in sync
    mode, for the producers' acknowledgements)."""

    def __init__(self, receiver, store, slaves: SlaveStates, insync: InSync | None = None, replayer=None):
        """`replayer`: for snapshots, whose offset and schedule sizes go together."""
        self.receiver = receiver
        self.replayer = replayer
        self.store = store
        self.slaves = slaves
        self.insync = insync

    @property
    def message_log_offsets(self) -> dict[str, int]:
        """Each registered slave's last message_log offset (what it holds fsynced)."""
        return {s.node_id: s.message_log_offset for s in self.slaves.states.values()}

    async def message_log(self, payload: bytes) -> bytes:
        request = wire.decode_message_log_request(payload)
        offset, receiver, message_log = request.offset, self.receiver, self.store.message_log
        if offset > receiver.durable_offset:
            raise DelayServerError(
                f"slave offset {offset} is past this master's end {receiver.durable_offset}: the slave holds "
                "records this master never had", code=ResultCode.DIVERGED)
        if offset < message_log.start_offset:
            raise DelayServerError(f"offset {offset} was cleaned from message_log", code=ResultCode.NOT_FOUND)
        if self.slaves.pulled_message_log(request.node_id, offset, receiver.durable_offset):
            if not self.slaves.states[request.node_id].pinning:
                raise DelayServerError(
                    f"offset {offset} is more than max_slave_lag ({self.slaves.max_lag_bytes} bytes) behind this "
                    f"master's end {receiver.durable_offset}: resync from a snapshot", code=ResultCode.NOT_FOUND)
            if self.insync is not None:
                self.insync.acknowledged(request.node_id, offset)
        if offset == receiver.durable_offset and request.wait_ms:
            with trio.move_on_after(min(request.wait_ms / 1000, MAX_LONG_POLL_S)):
                while offset == receiver.durable_offset:
                    await receiver.durable_changed.wait()
        data, start = b"", offset
        durable = receiver.durable_offset
        if offset < durable:
            max_bytes = min(request.max_bytes, MAX_SYNC_BYTES)

            def read_durable(read) -> tuple[bytes, int]:
                data, start = read()
                # Only what is durable here goes out: a slave never holds what a master crash loses.
                return _whole_records_before(data, start, durable, "message_log offset"), start

            try:
                if durable - offset > ON_LOOP_BYTES:
                    # A slave catching up: up to MAX_SYNC_BYTES read and checked in a worker thread,
                    # not on the event loop the deliveries run on (milliseconds per pull).
                    data, start = await trio.to_thread.run_sync(read_durable, message_log.reader(offset, max_bytes))
                else:  # a slave in step: what was just written, in memory, a few records
                    data, start = read_durable(functools.partial(message_log.read, offset, max_bytes))
            except CorruptSegment as e:
                # The read raises only for damage where it starts: at the offset asked for.
                raise DelayServerError(f"no whole record starts at message_log offset {offset} ({e.reason}): "
                                       "a slave asks from the end of its copy, a record boundary",
                                       code=ResultCode.BAD_REQUEST) from None
        return wire.ML_RESP.pack(start, receiver.durable_offset) + data

    async def dispatch_log(self, payload: bytes) -> bytes:
        request = wire.decode_dispatch_log_request(payload)
        dispatch_log = self.store.dispatch_log
        mine = {bucket: dispatch_log.size(bucket) for bucket in dispatch_log.buckets()}
        for bucket, have in request.sizes.items():
            if have > mine.get(bucket, 0):
                # The asker wrote dispatch records this master never had (it was a master once):
                # it compares digests on its next connection (SYNC_DISPATCH_DIGEST) and cuts there.
                raise DelayServerError(f"dispatch_log bucket {bucket}: size {have} is past this master's "
                                       f"{mine.get(bucket, 0)}", code=ResultCode.DIVERGED)
        self.slaves.pulled_dispatch_log(request.node_id, request.sizes)
        spans, budget = [], MAX_SYNC_BYTES  # (bucket, from, to): what each bucket may send
        for bucket, size in mine.items():
            have = request.sizes.get(bucket, 0)
            if size > have and budget > 0:
                spans.append((bucket, have, min(size, have + budget)))
                budget -= spans[-1][2] - have
        # As for message_log: a slave catching up is answered from a worker thread.
        in_thread = MAX_SYNC_BYTES - budget > ON_LOOP_BYTES
        readers = [(bucket, have, _range(dispatch_log, bucket, have, end, in_thread)) for bucket, have, end in spans]

        def read_chunks() -> list[bytes]:
            chunks = []
            for bucket, have, read in readers:
                data = read()
                data = _whole_records_before(data, have, have + len(data), f"dispatch_log bucket {bucket} size")
                if data:
                    chunks.append(wire.CHUNK.pack(bucket, have, len(data)) + data)
            return chunks

        chunks = await trio.to_thread.run_sync(read_chunks) if in_thread else read_chunks()
        return wire.U32.pack(len(chunks)) + b"".join(chunks)


    async def dispatch_digest(self, payload: bytes) -> bytes:
        """The buckets whose dispatch_log differs here from the asker's first bytes (a digest of
        each), computed on a worker thread: whole buckets are read."""
        request = wire.decode_dispatch_digest_request(payload)
        dispatch_log = self.store.dispatch_log

        def differing() -> list[int]:
            out = []
            for bucket, (size, crc) in request.digests.items():
                if size > dispatch_log.size(bucket) or prefix_crc(dispatch_log, bucket, size) != crc:
                    out.append(bucket)
            return out

        return wire.encode_buckets(await trio.to_thread.run_sync(differing))

    async def snapshot(self, payload: bytes) -> bytes:
        request = wire.decode_snapshot_request(payload)
        store = self.store
        if request.kind == wire.MANIFEST:
            if self.replayer is None:
                raise DelayServerError("this node serves no snapshots", code=ResultCode.BAD_REQUEST)
            # No await from here to the answer: the offset and the sizes are of one moment.
            offset = self.replayer.offset
            manifest = {
                "message_log_offset": offset,
                "max_sequence": self.replayer.max_sequence,
                "segment_scale_ms": store.segment_scale_ms,
                "schedule_sizes": {bucket_name(b): s for b, s in store.schedule_log.sizes.items()},
                "dispatch_sizes": {bucket_name(b): store.dispatch_log.size(b) for b in store.dispatch_log.buckets()},
            }
            # The slave goes on from `offset`: keep it from the cleaner from now on.
            self.slaves.pulled_message_log(request.node_id, offset, self.receiver.durable_offset)
            return json.dumps(manifest).encode("utf-8")
        log = store.schedule_log if request.kind == wire.SCHEDULE_LOG else store.dispatch_log
        size = log.size(request.bucket) if request.bucket in log.buckets() else 0
        if request.limit > size:
            raise DelayServerError(f"bucket {request.bucket} holds {size} bytes, not {request.limit} (cleaned since "
                                   "the manifest?): take a new snapshot", code=ResultCode.NOT_FOUND)
        if request.offset == request.limit:
            return b""
        read = log.range_reader(request.bucket, request.offset, min(request.limit, request.offset + MAX_SYNC_BYTES))
        # Read and checked in a worker thread, as a message_log pull is.
        try:
            return await trio.to_thread.run_sync(
                lambda: _whole_records_before(read(), request.offset, request.limit, f"bucket {request.bucket} offset"))
        except FileNotFoundError:
            raise DelayServerError(f"bucket {request.bucket} was cleaned while it was read: take a new snapshot",
                                   code=ResultCode.NOT_FOUND) from None


def _range(log, bucket: int, start: int, end: int, in_thread: bool):
    """A function reading `bucket` of `log` from `start` to `end`: for a worker thread (through a
    descriptor of its own), or for the event loop (through the log's)."""
    return log.range_reader(bucket, start, end) if in_thread else functools.partial(log.read, bucket, start, end)


def _whole_records_before(data: bytes, start: int, limit: int, what: str) -> bytes:
    """The whole records of `data` (a read at `start`) that end at or before `limit`; BAD_REQUEST
    when `start` is not where a record starts."""
    end = 0
    try:
        for _, _, _, stop in read_records(data, report=raise_unless_incomplete):
            if start + stop > limit:
                break
            end = stop
    except (RecordError, CorruptSegment) as e:
        raise DelayServerError(f"{what} {start} is not where a record starts ({e})",
                               code=ResultCode.BAD_REQUEST) from None
    return data[:end]



def prefix_crc(dispatch_log, bucket: int, size: int, chunk: int = 4 << 20) -> int | None:
    """The crc32c of the first `size` bytes of `bucket`'s dispatch_log, read `chunk` at a time;
    None when its file is gone (the cleaner removed the bucket).

    For worker threads: it reads through a descriptor of its own. The log's descriptor cache is
    the event loop's: taking one from it here could close a descriptor the loop is about to write
    through (another bucket's records would land in whatever file reused its number), and would
    create the file of a bucket the cleaner has just removed."""
    crc, pos = 0, 0
    if size <= 0:
        return crc
    try:
        with own_descriptor(dispatch_log.path(bucket), size) as read:
            while pos < size:
                data = read(pos, min(size, pos + chunk))
                if not data:
                    break
                crc = crc32c.crc32c(data, value=crc)
                pos += len(data)
    except FileNotFoundError:
        return None
    return crc
