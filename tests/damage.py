"""Test helpers: damage files the way crashes and disks do, and build records to damage.

Every recovery test is built from these three: flip a bit, truncate, zero-fill (LevelDB's log
tests do the same).
"""
from __future__ import annotations

import os
from pathlib import Path

from delayserver.storage.record import (
    Message, RecordType, encode_message, encode_record, encode_scheduled, iter_records,
)


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    """Flip one bit of the byte at `offset`."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def truncate(path: Path, size: int) -> None:
    os.truncate(path, size)


def zero_fill(path: Path, offset: int, length: int) -> None:
    """Overwrite (or extend the file with) `length` zero bytes at `offset`."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes(length))


def record_offsets(path: Path) -> list[int]:
    """The offset of every whole record of an undamaged file, and its size last."""
    data = Path(path).read_bytes()
    return [pos for pos, *_ in iter_records(data)] + [len(data)]


def message(i: int, *, schedule_time: int = 1_800_000_000_000, body_bytes: int = 32, **kw) -> Message:
    return Message(f"m-{i}", "orders.created", bytes([i % 251]) * body_bytes, schedule_time,
                   kw.pop("headers", {"n": str(i)}), sequence=i, **kw)


def message_record(i: int, **kw) -> bytes:
    return encode_record(RecordType.MESSAGE, encode_message(message(i, **kw)))


def scheduled_record(i: int, message_log_offset: int = 0, **kw) -> bytes:
    payload = encode_scheduled(message_log_offset, encode_message(message(i, **kw)))
    return encode_record(RecordType.SCHEDULED, payload)
