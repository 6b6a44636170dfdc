"""Resync from a snapshot: how a slave that fell behind its master's retention starts over.

`download` fetches the master's manifest (its replay checkpoint: a message_log offset and the
schedule_log and dispatch_log sizes of that moment) and the segments up to those sizes into
DATA_DIR/snapshot.tmp, every record's crc checked, fsyncs them, and renames the directory to
DATA_DIR/snapshot: the rename is the commit. The node then restarts, and `install_pending`, run
before the data directory is opened, replaces the node's logs with the snapshot: an empty
message_log that begins at the manifest's offset, the master's schedule_log and dispatch_log
segments, and the manifest as the replay checkpoint. The id index and bucket quarantine markers
are derived from the old segments and go with them. The files are hard-linked in and the snapshot
directory removed last, so a crash anywhere in the install repeats it whole at the next start.
Replication then goes on from the manifest's offset as usual.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from delayserver import protocol as p
from delayserver.message import DelayServerError, ResultCode
from delayserver.node.replication import wire
from delayserver.storage.buckets import parse_bucket_name
from delayserver.storage.checkpoint import write_checkpoint
from delayserver.storage.message_log import segment_name
from delayserver.storage.reader import Damage, read_records
from delayserver.storage.segment import fsync_dir
from delayserver.storage.store import REPLAY_CHECKPOINT

log = logging.getLogger("delayserver.replication")

READY = "snapshot"
PARTIAL = "snapshot.tmp"
MANIFEST = "manifest.json"
LOGS = {wire.SCHEDULE_LOG: "schedule_log", wire.DISPATCH_LOG: "dispatch_log"}
#: What an install replaces: derived from the old segments, or the segments themselves.
REPLACED = ("message_log", "schedule_log", "dispatch_log", "index", "quarantine")


async def download(conn, node_id: str, data_dir: Path, segment_scale_ms: int) -> dict:
    """Fetch the master's snapshot into DATA_DIR/snapshot (see the module docstring); returns the
    manifest. Raises DelayServerError (NOT_FOUND when a segment was cleaned meanwhile: ask again),
    ConnectionError, OSError."""
    partial = Path(data_dir) / PARTIAL
    shutil.rmtree(partial, ignore_errors=True)
    request = wire.SnapshotRequest(wire.MANIFEST, 0, 0, 0, node_id)
    manifest = json.loads(await conn.request(p.Command.SYNC_SNAPSHOT, wire.encode_snapshot_request(request)))
    if manifest["segment_scale_ms"] != segment_scale_ms:
        raise DelayServerError(f"the master cuts buckets by {manifest['segment_scale_ms']} ms, this node by "
                               f"{segment_scale_ms} ms: give them the same segment_scale", code=ResultCode.BAD_REQUEST)
    total = 0
    for kind, name in LOGS.items():
        directory = partial / name
        directory.mkdir(parents=True)
        for bucket_text, size in manifest[name.replace("_log", "_sizes")].items():
            bucket = parse_bucket_name(bucket_text)
            with open(directory / f"{bucket_text}.log", "wb") as f:
                offset = 0
                while offset < size:
                    chunk = await conn.request(p.Command.SYNC_SNAPSHOT, wire.encode_snapshot_request(
                        wire.SnapshotRequest(kind, bucket, offset, size, node_id)))
                    if not chunk:
                        raise DelayServerError(f"{name} bucket {bucket_text}: empty answer at {offset}",
                                               code=ResultCode.INTERNAL)
                    _check(chunk, f"{name} bucket {bucket_text}", offset)
                    f.write(chunk)
                    offset += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            total += size
        fsync_dir(directory)
    (partial / MANIFEST).write_text(json.dumps(manifest))
    with open(partial / MANIFEST, "rb") as f:
        os.fsync(f.fileno())
    fsync_dir(partial)
    ready = Path(data_dir) / READY
    shutil.rmtree(ready, ignore_errors=True)
    os.rename(partial, ready)
    fsync_dir(Path(data_dir))
    log.warning("snapshot of the master taken: %d bytes of segments, message_log from offset %d",
                total, manifest["message_log_offset"])
    return manifest


def _check(data: bytes, what: str, base: int) -> None:
    def report(damage: Damage) -> None:
        raise DelayServerError(f"{what} from the master fails its check at {damage.offset}: {damage.reason}",
                               code=ResultCode.INTERNAL)

    for _ in read_records(data, base=base, sealed=True, report=report):
        pass


def install_pending(data_dir: Path) -> bool:
    """Install DATA_DIR/snapshot if there is one (before the store is opened); True if it did."""
    data_dir = Path(data_dir)
    ready = data_dir / READY
    if not ready.is_dir():
        shutil.rmtree(data_dir / PARTIAL, ignore_errors=True)  # an unfinished download: start over
        return False
    manifest = json.loads((ready / MANIFEST).read_text())
    for name in REPLACED:
        shutil.rmtree(data_dir / name, ignore_errors=True)
    for name in LOGS.values():
        (data_dir / name).mkdir()
        for path in (ready / name).iterdir():
            os.link(path, data_dir / name / path.name)
        fsync_dir(data_dir / name)
    message_log = data_dir / "message_log"
    message_log.mkdir()
    (message_log / segment_name(manifest["message_log_offset"])).touch()
    fsync_dir(message_log)
    (data_dir / "checkpoint").mkdir(exist_ok=True)
    write_checkpoint(data_dir / "checkpoint" / REPLAY_CHECKPOINT, {
        "message_log_offset": manifest["message_log_offset"], "max_sequence": manifest["max_sequence"],
        "schedule_sizes": manifest["schedule_sizes"]})
    shutil.rmtree(ready)
    fsync_dir(data_dir)
    log.warning("installed the master's snapshot: message_log goes on from offset %d, %d schedule segments",
                manifest["message_log_offset"], len(manifest["schedule_sizes"]))
    return True
