"""The replication requests and answers on the wire, with strict decoders (no I/O here).

Big-endian, carried by SYNC_MESSAGE_LOG and SYNC_DISPATCH_LOG frames::

    SYNC_MESSAGE_LOG   request:  offset u64, max_bytes u32, wait_ms u32, node id str16
                       response: start u64, master durable end u64, then whole records
    SYNC_DISPATCH_LOG  request:  node id str16, count u32, then (bucket i64, size u64) * count
                       response: count u32, then (bucket i64, start u64, length u32, bytes) * count
    SYNC_SNAPSHOT      request:  kind u8, bucket i64, offset u64, limit u64, node id str16
                       response: kind MANIFEST: a JSON object (the master's replay checkpoint:
                                 message_log_offset, max_sequence, schedule_sizes, and
                                 dispatch_sizes); kind SCHEDULE_LOG or DISPATCH_LOG: the whole
                                 records of that bucket's segment from `offset`, up to `limit`
    SYNC_DISPATCH_DIGEST request: node id str16, count u32, then (bucket i64, size u64, crc32c u32)
                                  * count: the crc32c of the first `size` bytes of each bucket's
                                  dispatch_log on the asking node
                       response:  count u32, then bucket i64 * count: the buckets whose first
                                  `size` bytes differ on the master (or it has fewer)

A SYNC_MESSAGE_LOG request at `offset` also acknowledges that the slave holds message_log up to
`offset` fsynced (it asks for more only after its fsync): in sync mode that is the slave's ack.

Every decoder raises RemoteProtocolError (BAD_REQUEST) for a payload that does not parse to the
byte, so that nothing a peer sends reaches the logs as an unchecked number.
"""
from __future__ import annotations

import struct

import attrs

from delayserver import protocol as p

ML_REQ = struct.Struct(">QIIH")
ML_RESP = struct.Struct(">QQ")
U16 = struct.Struct(">H")
U32 = struct.Struct(">I")
SIZE = struct.Struct(">qQ")
DIGEST = struct.Struct(">qQI")
BUCKET = struct.Struct(">q")
CHUNK = struct.Struct(">qQI")
MAX_NODE_ID_BYTES = 255
MAX_BUCKETS = 1 << 20


@attrs.frozen
class MessageLogRequest:
    offset: int
    max_bytes: int
    wait_ms: int
    node_id: str


SNAPSHOT_REQ = struct.Struct(">BqQQH")
MANIFEST, SCHEDULE_LOG, DISPATCH_LOG = 0, 1, 2


@attrs.frozen
class SnapshotRequest:
    kind: int
    bucket: int
    offset: int
    limit: int
    node_id: str


def encode_snapshot_request(r: SnapshotRequest) -> bytes:
    node = r.node_id.encode("utf-8")
    return SNAPSHOT_REQ.pack(r.kind, r.bucket, r.offset, r.limit, len(node)) + node


def decode_snapshot_request(payload: bytes) -> SnapshotRequest:
    try:
        kind, bucket, offset, limit, _ = SNAPSHOT_REQ.unpack_from(payload, 0)
        node, end = _node_id(payload, SNAPSHOT_REQ.size - 2, "SYNC_SNAPSHOT")
    except (struct.error, UnicodeDecodeError):
        raise p.RemoteProtocolError("malformed SYNC_SNAPSHOT request") from None
    if end != len(payload) or kind not in (MANIFEST, SCHEDULE_LOG, DISPATCH_LOG) or offset > limit:
        raise p.RemoteProtocolError("malformed SYNC_SNAPSHOT request")
    return SnapshotRequest(kind, bucket, offset, limit, node)


@attrs.frozen
class DispatchLogRequest:
    node_id: str
    sizes: dict[int, int]


def _node_id(payload: bytes, pos: int, what: str) -> tuple[str, int]:
    (n,) = U16.unpack_from(payload, pos)
    raw = payload[pos + 2 : pos + 2 + n]
    if len(raw) != n or not 1 <= n <= MAX_NODE_ID_BYTES:
        raise p.RemoteProtocolError(f"malformed {what} request: node id of {n} bytes")
    return raw.decode("utf-8"), pos + 2 + n


def encode_message_log_request(r: MessageLogRequest) -> bytes:
    node = r.node_id.encode("utf-8")
    return ML_REQ.pack(r.offset, r.max_bytes, r.wait_ms, len(node)) + node


def decode_message_log_request(payload: bytes) -> MessageLogRequest:
    try:
        offset, max_bytes, wait_ms, _ = ML_REQ.unpack_from(payload, 0)
        node, end = _node_id(payload, ML_REQ.size - 2, "SYNC_MESSAGE_LOG")
    except (struct.error, UnicodeDecodeError):
        raise p.RemoteProtocolError("malformed SYNC_MESSAGE_LOG request") from None
    if end != len(payload):
        raise p.RemoteProtocolError("malformed SYNC_MESSAGE_LOG request: bytes after the node id")
    return MessageLogRequest(offset, max_bytes, wait_ms, node)


def _encode_per_bucket(node_id: str, layout: struct.Struct, rows: list[tuple]) -> bytes:
    """node id str16, count u32, then one `layout` row (starting with the bucket) per bucket."""
    node = node_id.encode("utf-8")
    return U16.pack(len(node)) + node + U32.pack(len(rows)) + b"".join(layout.pack(*row) for row in rows)


def _decode_per_bucket(payload: bytes, layout: struct.Struct, what: str) -> tuple[str, dict[int, tuple]]:
    """The node id and {bucket: rest of its row} of a request `_encode_per_bucket` wrote."""
    try:
        node, pos = _node_id(payload, 0, what)
        (count,) = U32.unpack_from(payload, pos)
        pos += 4
        if count > MAX_BUCKETS or pos + count * layout.size != len(payload):
            raise p.RemoteProtocolError(f"malformed {what} request: {count} buckets declared, "
                                        f"{len(payload) - pos} bytes follow")
        rows = {}
        for _ in range(count):
            bucket, *rest = layout.unpack_from(payload, pos)
            rows[bucket] = tuple(rest)
            pos += layout.size
    except (struct.error, UnicodeDecodeError):
        raise p.RemoteProtocolError(f"malformed {what} request") from None
    return node, rows


def encode_dispatch_log_request(r: DispatchLogRequest) -> bytes:
    return _encode_per_bucket(r.node_id, SIZE, list(r.sizes.items()))


def decode_dispatch_log_request(payload: bytes) -> DispatchLogRequest:
    node, rows = _decode_per_bucket(payload, SIZE, "SYNC_DISPATCH_LOG")
    return DispatchLogRequest(node, {bucket: size for bucket, (size,) in rows.items()})


def decode_message_log_response(reply: bytes) -> tuple[int, int, bytes]:
    """(start, master durable end, records); RemoteProtocolError for a reply too short to hold them."""
    if len(reply) < ML_RESP.size:
        raise p.RemoteProtocolError(f"SYNC_MESSAGE_LOG answer of {len(reply)} bytes")
    start, end = ML_RESP.unpack_from(reply, 0)
    return start, end, reply[ML_RESP.size :]


def decode_dispatch_log_response(reply: bytes) -> list[tuple[int, int, bytes]]:
    """(bucket, start, bytes) per chunk; raises RemoteProtocolError for a reply that does not add up."""
    try:
        (count,) = U32.unpack_from(reply, 0)
        pos, out = 4, []
        for _ in range(count):
            bucket, start, length = CHUNK.unpack_from(reply, pos)
            pos += CHUNK.size
            if pos + length > len(reply):
                raise p.RemoteProtocolError("SYNC_DISPATCH_LOG answer cut short")
            out.append((bucket, start, reply[pos : pos + length]))
            pos += length
    except struct.error:
        raise p.RemoteProtocolError("malformed SYNC_DISPATCH_LOG answer") from None
    return out


@attrs.frozen
class DispatchDigestRequest:
    node_id: str
    digests: dict[int, tuple[int, int]]  # bucket -> (size, crc32c of its first `size` bytes)


def encode_dispatch_digest_request(r: DispatchDigestRequest) -> bytes:
    return _encode_per_bucket(r.node_id, DIGEST, [(b, size, crc) for b, (size, crc) in r.digests.items()])


def decode_dispatch_digest_request(payload: bytes) -> DispatchDigestRequest:
    return DispatchDigestRequest(*_decode_per_bucket(payload, DIGEST, "SYNC_DISPATCH_DIGEST"))


def encode_buckets(buckets: list[int]) -> bytes:
    return U32.pack(len(buckets)) + b"".join(BUCKET.pack(b) for b in buckets)


def decode_buckets(reply: bytes) -> list[int]:
    """The buckets of a SYNC_DISPATCH_DIGEST answer; RemoteProtocolError when it does not add up."""
    if len(reply) < 4 or 4 + U32.unpack_from(reply, 0)[0] * BUCKET.size != len(reply):
        raise p.RemoteProtocolError(f"SYNC_DISPATCH_DIGEST answer of {len(reply)} bytes does not add up")
    return [BUCKET.unpack_from(reply, 4 + i * BUCKET.size)[0] for i in range(U32.unpack_from(reply, 0)[0])]
