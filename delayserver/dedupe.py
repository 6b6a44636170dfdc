"""Idempotent send: the message ids a node accepted within `dedupe_window`, and their handles.

A send whose id is in the table (accepted less than `dedupe_window` ago) is answered with the first
message's handle and DUPLICATE, and nothing is stored. The table is fed from two sides:

- the receiver, once a message is acknowledged (it is durable then), so that a retry arriving
  before replay has caught up is still recognised;
- the replayer, for every MESSAGE record of message_log, so that a slave's table follows its
  master's log and is whole when it is promoted. A later MESSAGE with the same id (a reschedule
  moves a message by writing it again at its new time) replaces the handle: a retried send gets
  the message's current handle. Feeding the same record twice changes nothing.

Durability: `save` writes the table to `checkpoint/dedupe.bin` (temp file, fsync, rename) with the
message_log offset replay had reached when the table was copied. At start the file is read back and
message_log from that offset on is fed again (`recover`), so the table survives a restart; the
cleaner keeps message_log from that offset (node/server.py). A damaged file is ignored with a
warning and the table is rebuilt from what message_log still holds.

The key is the message id, except for a new attempt of a message that keeps its id: a consumer
retry (`send_back`, header `reconsume-times`) and a redrive of a parked message (header
`redriven-from`) are keyed by the id and those headers, so that each attempt is stored once and a
retry of that attempt's send is still a duplicate (`dedupe_key`).

Memory: one dict entry per id, the key the id itself and the value one int packing the store time
and the schedule time (``store_time << 48 | schedule_time``); `ops/bench dedupe` measures it.
"""
from __future__ import annotations

import itertools
import logging
import os
import struct
from pathlib import Path

import crc32c
import numpy as np
import trio

from delayserver.storage.record import MESSAGE_HEAD, RecordType, decode_headers, iter_checked_records

log = logging.getLogger("delayserver.dedupe")

FILE_NAME = "dedupe.bin"
_TIME_BITS = 48
_TIME_MASK = (1 << _TIME_BITS) - 1
_HEAD = struct.Struct(">8sQQI")  # magic, message_log offset, entry count, crc32c of the entries
_MAGIC = b"DSDEDUP2"
_MESSAGE_HEAD_SIZE = MESSAGE_HEAD.size


#: Headers that make a send a new attempt of a message that keeps its id.
ATTEMPT_HEADERS = ("reconsume-times", "redriven-from")


def dedupe_key(message_id: str, headers) -> str:
    """The table's key for a message: its id, plus its attempt headers when it has any."""
    if headers:
        attempt = [headers[h] for h in ATTEMPT_HEADERS if h in headers]
        if attempt:
            return "\x00".join((message_id, *attempt))
    return message_id


class DedupeTable:
    """id -> (store time, schedule time) of the messages accepted within `window_ms`."""

    def __init__(self, window_ms: int):
        self.window_ms = window_ms
        # Insertion order is acceptance order (near enough): expiry pops from the front.
        self._entries: dict[str, int] = {}
        self.duplicates = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.window_ms > 0

    def find(self, message_id: str, now_ms: int) -> int | None:
        """The schedule time of the message accepted under `message_id` within the window, or None."""
        packed = self._entries.get(message_id)
        if packed is None or now_ms - (packed >> _TIME_BITS) >= self.window_ms:
            return None
        return packed & _TIME_MASK

    def remember(self, message_id: str, schedule_time: int, store_time: int) -> None:
        """Note an accepted message; a later one under the same id keeps the first store time (the
        window runs from the first acceptance) and takes the newer schedule time (its handle)."""
        old = self._entries.get(message_id)
        if old is not None:
            store_time = old >> _TIME_BITS
        self._entries[message_id] = store_time << _TIME_BITS | schedule_time

    def expire(self, now_ms: int) -> int:
        """Forget the ids accepted more than the window ago; returns how many."""
        entries, cutoff, dropped = self._entries, now_ms - self.window_ms, 0
        while entries:
            first = next(iter(entries))
            if entries[first] >> _TIME_BITS > cutoff:
                break
            del entries[first]
            dropped += 1
        return dropped

    def feed(self, data, start: int = 0, end: int | None = None) -> None:
        """Remember every MESSAGE of checked message_log bytes (`data[start:end]`)."""
        for _, rtype, s, e in iter_checked_records(data, start, end):
            self.feed_record(rtype, data, s, e)

    def feed_record(self, rtype: int, data, s: int, e: int) -> None:
        """Remember the MESSAGE record whose payload is `data[s:e]` (the replayer's hook)."""
        if rtype == RecordType.MESSAGE:
            store, sched, _seq, _flags, idlen, slen, hlen, _blen = MESSAGE_HEAD.unpack_from(data, s)
            at = s + _MESSAGE_HEAD_SIZE
            key = bytes(data[at : at + idlen]).decode("utf-8")
            if hlen:
                at += idlen + slen
                key = dedupe_key(key, decode_headers(data[at : at + hlen]))
            self.remember(key, sched, store)

    # --- durability ---------------------------------------------------------------------------

    def snapshot(self) -> dict[str, int]:
        return dict(self._entries)

    @staticmethod
    def write(path: Path, entries: dict[str, int], offset: int) -> None:
        """Write `entries` (a `snapshot`) covering message_log up to `offset`, atomically.

        Layout after the head: every store time, then every schedule time (big-endian i64
        arrays), every id's length in characters (u8: an id is at most 128 bytes), then the ids
        as one UTF-8 text: read back with a few bulk decodes instead of one per id."""
        ids = list(entries)
        packed = list(entries.values())
        stores = np.array([v >> _TIME_BITS for v in packed], dtype=">i8")
        scheds = np.array([v & _TIME_MASK for v in packed], dtype=">i8")
        body = b"".join((stores.tobytes(), scheds.tobytes(), bytes(map(len, ids)), "".join(ids).encode("utf-8")))
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            f.write(_HEAD.pack(_MAGIC, offset, len(ids), crc32c.crc32c(body)))
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def load(self, path: Path) -> int | None:
        """Read a saved table; returns the message_log offset it covers, or None when there is no
        usable file (missing or damaged: logged)."""
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("%s: not read (%s); rebuilding the dedupe table from message_log", path, e)
            return None
        entries = _decode_saved(raw)
        if entries is None:
            log.warning("%s: damaged; rebuilding the dedupe table from message_log", path)
            return None
        self._entries, offset = entries
        return offset


def _decode_saved(raw: bytes) -> tuple[dict[str, int], int] | None:
    if len(raw) < _HEAD.size:
        return None
    magic, offset, count, crc = _HEAD.unpack_from(raw, 0)
    body = memoryview(raw)[_HEAD.size :]
    if magic != _MAGIC or crc32c.crc32c(body) != crc or len(body) < 17 * count:
        return None
    stores = np.frombuffer(body, ">i8", count, 0).tolist()
    scheds = np.frombuffer(body, ">i8", count, 8 * count).tolist()
    lengths = body[16 * count : 17 * count]
    try:
        text = bytes(body[17 * count :]).decode("utf-8")
    except UnicodeDecodeError:
        return None
    if sum(lengths) != len(text):
        return None
    ends = list(itertools.accumulate(lengths))
    ids = [text[e - n : e] for e, n in zip(ends, lengths)]
    return dict(zip(ids, [st << _TIME_BITS | sc for st, sc in zip(stores, scheds)])), offset


class Dedupe:
    """The table of one node and its file."""

    def __init__(self, window_ms: int, checkpoint_dir: Path):
        self.table = DedupeTable(window_ms)
        self.path = Path(checkpoint_dir) / FILE_NAME
        #: message_log is needed from here on to rebuild the table (the cleaner keeps it).
        self.saved_offset = 0

    def recover(self, message_log, now_ms: int, chunk_bytes: int = 8 << 20) -> None:
        """Load the saved table, then feed message_log from the offset it covers to the end."""
        self.saved_offset = offset = message_log.resume_offset(self.table.load(self.path), str(self.path))
        for data in message_log.read_from(offset, chunk_bytes):
            self.table.feed(data, 0, len(data))
        self.table.expire(now_ms)

    async def save(self, now_ms: int, replay_offset: int) -> None:
        """Expire, then write the table covering message_log up to `replay_offset` (every record
        before it is in the table; later ones may be too: feeding them again changes nothing)."""
        self.table.expire(now_ms)
        entries = self.table.snapshot()
        try:
            await trio.to_thread.run_sync(DedupeTable.write, self.path, entries, replay_offset)
        except OSError as e:
            log.warning("%s: not saved (%s); will try again", self.path, e)
            return
        self.saved_offset = replay_offset
