"""Parked messages: those a broker rejected for good, kept until an operator redrives them.

`DATA_DIR/parked/parked.log` holds PARKED records (the whole scheduled record, the reason, and the
schedule_log offset, so that a reload after a restart skips what was parked). Redriving re-sends
each parked message through a delay server, to be delivered at once with its own id, and then
records in `parked/redriven.json` the parked.log offset up to which everything was redriven.
"""
from __future__ import annotations

import logging
from pathlib import Path

import trio

from delayserver.storage.buckets import bucket_start
from delayserver.storage.checkpoint import read_checkpoint, write_checkpoint
from delayserver.storage.reader import read_records
from delayserver.storage.record import (
    RecordType, decode_parked, encode_message, encode_parked, encode_record, encode_scheduled,
)
from delayserver.storage.errors import StorageError
from delayserver.storage.segment import Segment, read_file
from delayserver.storage.threads import run_disk

log = logging.getLogger("delayserver.sender")

REDRIVEN = "redriven.json"
#: Back-off of a failed park: 100 ms doubling to this.
MAX_PARK_BACKOFF_S = 30.0


class ParkedLog:
    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.segment = Segment.open(self.directory / "parked.log")
        self._lock = trio.Lock()

    async def park(self, delivery, reason: str, now: int) -> None:
        m = delivery.message
        payload = encode_parked(now, delivery.attempt, delivery.schedule_offset, reason,
                                encode_scheduled(0, encode_message(m, max_body_bytes=len(m.body))))
        record = encode_record(RecordType.PARKED, payload)
        delay, appended = 0.1, False
        async with self._lock:
            while True:
                # A failed park is retried with back-off, never raised: the message stays in flight
                # (not delivered, not lost) until its PARKED record is durable. A failed write is
                # rolled back and written again; a failed fsync is not retried by rewriting (no
                # later fsync of the file is trusted), so it keeps failing until a restart.
                try:
                    if not appended:
                        self.segment.append(record)
                        appended = True
                    await run_disk(self.segment.sync)
                    return
                except StorageError as e:
                    log.error("parking message %s failed, retrying in %.1f s: %s", m.message_id, delay, e)
                await trio.sleep(delay)
                delay = min(delay * 2, MAX_PARK_BACKOFF_S)

    def close(self) -> None:
        self.segment.close()


def redriven_offset(directory: Path) -> int:
    return (read_checkpoint(Path(directory) / REDRIVEN) or {}).get("offset", 0)


def set_redriven_offset(directory: Path, offset: int) -> None:
    write_checkpoint(Path(directory) / REDRIVEN, {"offset": offset})


def iter_parked(directory: Path, start: int = 0):
    """Yield ``(offset, Parked)`` from `start`; a torn tail ends the walk, corruption raises."""
    path = Path(directory) / "parked.log"
    if not path.exists():
        return
    data = read_file(path)
    for pos, rtype, s, e in read_records(data, path):
        if pos >= start and rtype == RecordType.PARKED:
            yield pos, decode_parked(data, s, e)


def parked_offsets(directory: Path, bucket: int, scale_ms: int) -> set[int]:
    """schedule_log offsets in `bucket` that were parked (a reload must not send them again)."""
    return {p.schedule_offset for _, p in iter_parked(directory)
            if bucket_start(p.message.schedule_time, scale_ms) == bucket}
