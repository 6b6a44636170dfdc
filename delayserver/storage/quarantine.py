"""Quarantine: a bucket whose segment holds a damaged record is set aside, not allowed to stop the node.

When the loader or the sender meets a damaged record in a bucket's schedule_log or dispatch_log
segment (CorruptSegment), it calls `quarantine`: a marker file
`DATA_DIR/quarantine/<bucket>.json` names the bucket, the file, the offset and the reason; the
error is logged with all of them, and the node goes on delivering every other bucket. What the
bucket held before the damage and was already loaded is still delivered; the rest waits for an
operator. The marker is written like a checkpoint (atomically); if even that fails the quarantine
still holds for the life of the process, and is found again at the next load.

`delayctl buckets` and `delayctl verify` show a quarantined bucket as QUARANTINED, the metric
`delayserver_quarantined_buckets` counts them, and `delayctl salvage DATA_DIR BUCKET` (node
stopped) puts every intact record of it back into delivery, reports exactly which message ids
were lost, and lifts the quarantine.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import attrs

from delayserver.storage.buckets import bucket_name, parse_bucket_name
from delayserver.storage.checkpoint import CorruptCheckpoint, read_checkpoint, write_checkpoint
from delayserver.storage.errors import StorageError
from delayserver.storage.segment import fsync_dir

log = logging.getLogger("delayserver.storage")

DIRECTORY = "quarantine"
SUFFIX = ".json"


@attrs.frozen
class Quarantined:
    bucket: int
    path: str  # the damaged file
    offset: int  # where the damage starts in it
    reason: str
    since_ms: int


# data dir -> bucket -> Quarantined, for this process (also what could not be written to disk).
_known: dict[str, dict[int, Quarantined]] = {}


def marker_path(root: Path, bucket: int) -> Path:
    return Path(root) / DIRECTORY / (bucket_name(bucket) + SUFFIX)


def quarantine(root: Path, bucket: int, path, offset: int, reason: str, now_ms: int | None = None) -> Quarantined:
    """Set `bucket` aside: durable marker, log line, metric. Never raises (a failed marker write
    is logged; the quarantine still holds in this process)."""
    root = Path(root)
    known = _known.setdefault(str(root.resolve()), {})
    if bucket in known:
        return known[bucket]
    q = Quarantined(bucket, str(path), offset, reason, now_ms if now_ms is not None else time.time_ns() // 1_000_000)
    known[bucket] = q
    log.error("bucket %s QUARANTINED: %s offset %d: %s; the other buckets go on; run `delayctl salvage %s %s` "
              "with the node stopped", bucket_name(bucket), path, offset, reason, root, bucket_name(bucket))
    marker = marker_path(root, bucket)
    try:
        if not marker.parent.is_dir():
            marker.parent.mkdir(exist_ok=True)
            fsync_dir(root)
        write_checkpoint(marker, attrs.asdict(q))
    except (OSError, StorageError) as e:
        log.error("%s: could not write the quarantine marker (the quarantine holds until restart): %s", marker, e)
    return q


def quarantine_error(root: Path, bucket: int, error) -> Quarantined:
    """`quarantine` for a CorruptSegment."""
    return quarantine(root, bucket, error.path, error.offset, error.reason)


def list_quarantined(root: Path) -> dict[int, Quarantined]:
    """Every quarantined bucket of the data directory: markers on disk and this process's own."""
    root = Path(root)
    out: dict[int, Quarantined] = {}
    directory = root / DIRECTORY
    if directory.is_dir():
        for marker in sorted(directory.glob("*" + SUFFIX)):
            try:
                bucket = parse_bucket_name(marker.name[: -len(SUFFIX)])
                data = read_checkpoint(marker)
            except (ValueError, CorruptCheckpoint) as e:
                log.error("%s: unreadable quarantine marker: %s", marker, e)
                continue
            if data is not None:
                out[bucket] = Quarantined(**data)
    out.update(_known.get(str(root.resolve()), {}))
    return out


def forget(root: Path) -> None:
    """Drop this process's memory of the data directory's quarantines (a restart within one
    process): the markers on disk stand, and a damaged record still there is found again."""
    _known.pop(str(Path(root).resolve()), None)


def release(root: Path, bucket: int) -> None:
    """Lift the quarantine of `bucket` (after salvage)."""
    root = Path(root)
    _known.get(str(root.resolve()), {}).pop(bucket, None)
    marker = marker_path(root, bucket)
    if marker.exists():
        marker.unlink()
        fsync_dir(marker.parent)
