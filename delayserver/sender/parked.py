"""Parked messages: those a broker rejected for good, kept until an operator redrives them.

`DATA_DIR/parked/parked.log` holds PARKED records (the whole scheduled record, the reason, and the
schedule_log offset, so that a reload after a restart skips what was parked). Redriving re-sends
each parked message through a delay server, to be delivered at once with its own id, and then
records in `parked/redriven.json` the parked.log offset up to which everything was redriven.
"""
from __future__ import annotations

from pathlib import Path

import trio

from delayserver.storage.buckets import bucket_start
from delayserver.storage.checkpoint import read_checkpoint, write_checkpoint
from delayserver.storage.reader import read_records
from delayserver.storage.record import (
    RecordType, decode_parked, encode_message, encode_parked, encode_record, encode_scheduled,
)
from delayserver.storage.segment import Segment, read_file

REDRIVEN = "redriven.json"


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
        async with self._lock:
            self.segment.append(encode_record(RecordType.PARKED, payload))
            await trio.to_thread.run_sync(self.segment.sync)

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
