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

Memory: per id, a dict entry from the id to its position, a list slot, and two 8-byte times in
arrays (`DedupeTable`); `ops/bench dedupe` measures it.
"""
from __future__ import annotations

import itertools
import logging
import os
import struct
import sys
from array import array
from pathlib import Path

import crc32c
import trio

from delayserver.storage.record import MESSAGE_HEAD, RecordType, decode_headers, iter_checked_records

log = logging.getLogger("delayserver.dedupe")

FILE_NAME = "dedupe.bin"
_HEAD = struct.Struct(">8sQQI")  # magic, message_log offset, entry count, crc32c of the entries
_MAGIC = b"DSDEDUP2"
_OFFSET = struct.Struct(">Q")
_OFFSET_AT = 8  # after the magic
_LITTLE_ENDIAN = sys.byteorder == "little"
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
    """id -> (store time, schedule time) of the messages accepted within `window_ms`.

    The entries are kept in acceptance order: the keys in a list, their store and schedule times
    in two arrays, and a dict from key to its position (counted from the first entry ever, so that
    positions never change when the expired front is dropped). Expiry walks the front and stops at
    the first entry inside the window, in time proportional to what it forgets (a dict popped from
    its front is scanned from its start on every pop: quadratic). Saving encodes the entries in
    slices (`encode_slices`) that never hold the event loop long, and nothing is copied whole.
    A key accepted again after its window (not yet expired) gets a new position at the end; the
    old position is left behind, skipped by expiry and overridden when a saved table is read.
    """

    def __init__(self, window_ms: int):
        self.window_ms = window_ms
        self._positions: dict[str, int] = {}
        self._keys: list[str | None] = []  # None: expired, waiting for the front to be dropped
        self._stores = array("q")
        self._scheds = array("q")
        self._base = 0  # the position of _keys[0]
        self._head = 0  # the position of the first entry not expired
        self._encoding = 0  # saves encoding slices: the front is not dropped meanwhile
        self.duplicates = 0
        #: Bumped by every change (a save that finds it as it left it rewrites only the offset).
        self.changes = 0

    def __len__(self) -> int:
        return len(self._positions)

    @property
    def enabled(self) -> bool:
        return self.window_ms > 0

    def find(self, message_id: str, now_ms: int) -> int | None:
        """The schedule time of the message accepted under `message_id` within the window, or None."""
        position = self._positions.get(message_id)
        if position is None:
            return None
        i = position - self._base
        if now_ms - self._stores[i] >= self.window_ms:
            return None
        return self._scheds[i]

    def remember(self, message_id: str, schedule_time: int, store_time: int) -> None:
        """Note an accepted message; a later one under the same id within the window keeps the first
        store time (the window runs from the first acceptance) and takes the newer schedule time (its
        handle). One accepted after the window starts a window of its own."""
        position = self._positions.get(message_id)
        if position is not None:
            i = position - self._base
            if store_time - self._stores[i] < self.window_ms:
                self._scheds[i] = schedule_time
                self.changes += 1
                return
        self._positions[message_id] = self._base + len(self._keys)
        self._keys.append(message_id)
        self._stores.append(store_time)
        self._scheds.append(schedule_time)
        self.changes += 1

    def expire(self, now_ms: int, limit: int | None = None) -> int:
        """Forget the ids accepted more than the window ago (at most `limit` entries looked at, None:
        all); returns how many entries were looked at: under `limit` when the front is inside the
        window."""
        keys, stores, positions = self._keys, self._stores, self._positions
        cutoff, base = now_ms - self.window_ms, self._base
        i = first = self._head - base
        end = len(keys) if limit is None else min(len(keys), first + limit)
        while i < end and stores[i] <= cutoff:
            key = keys[i]
            if positions.get(key) == i + base:  # not accepted again since
                del positions[key]
            keys[i] = None
            i += 1
        if i > first:
            self.changes += 1
        self._head = i + base
        self._drop_front()
        return i - first

    def _drop_front(self) -> None:
        """Give back the memory of the expired front once it is half of what is kept."""
        dropped = self._head - self._base
        if self._encoding or dropped < 4096 or dropped * 2 < len(self._keys):
            return
        del self._keys[:dropped]
        del self._stores[:dropped]
        del self._scheds[:dropped]
        self._base = self._head

    # --- saving -------------------------------------------------------------------------------

    def encode_slices(self, slice_entries: int = 32768):
        """The live entries, encoded in slices of `slice_entries` for `write`: a generator of
        (count, store times, schedule times, id lengths, ids) in the file's layout. Between two
        slices the caller may let other work run; entries remembered meanwhile may or may not be in
        the slices (a saved table covers message_log up to an offset taken before, and what comes
        after it is fed again at start: feeding a record twice changes nothing)."""
        self._encoding += 1
        try:
            at = self._head
            while True:
                at = max(at, self._head)  # what expired meanwhile is left out
                begin = at - self._base
                end = min(len(self._keys), begin + slice_entries)
                if begin >= end:
                    return
                keys = self._keys[begin:end]
                stores, scheds = self._stores[begin:end], self._scheds[begin:end]
                if _LITTLE_ENDIAN:
                    stores.byteswap()
                    scheds.byteswap()
                at += end - begin
                yield (end - begin, stores.tobytes(), scheds.tobytes(), bytes(map(len, keys)),
                       "".join(keys).encode("utf-8"))
        finally:
            self._encoding -= 1

    @staticmethod
    def write(path: Path, slices, offset: int) -> None:
        """Write the entries encoded by `encode_slices` covering message_log up to `offset`,
        atomically (temp file, fsync, rename, fsync of the directory).

        Layout after the head: every store time, then every schedule time (big-endian i64
        arrays), every id's length in characters (u8: an id is at most 128 bytes), then the ids
        as one UTF-8 text: read back with a few bulk decodes instead of one per id."""
        slices = list(slices)
        parts = [[part[k] for part in slices] for k in range(1, 5)]
        count = sum(part[0] for part in slices)
        crc = 0
        for column in parts:
            for chunk in column:
                crc = crc32c.crc32c(chunk, crc)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            f.write(_HEAD.pack(_MAGIC, offset, count, crc))
            for column in parts:
                f.writelines(column)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @staticmethod
    def write_offset(path: Path, offset: int) -> None:
        """Make a saved table cover message_log up to `offset` (nothing in it changed since it was
        written): the head's offset, 8 bytes in one sector, rewritten in place, then fsync.
        Raises OSError (the file is as it was, or names the new offset)."""
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, _OFFSET.pack(offset), _OFFSET_AT)
            os.fsync(fd)
        finally:
            os.close(fd)

    def save_to(self, path: Path, offset: int) -> None:
        """`write` this table's entries at once (tests, benchmarks, tools; a node saves in slices)."""
        DedupeTable.write(path, self.encode_slices(), offset)

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
        saved = _decode_saved(raw)
        if saved is None:
            log.warning("%s: damaged; rebuilding the dedupe table from message_log", path)
            return None
        keys, stores, scheds, offset = saved
        self._keys, self._stores, self._scheds = keys, stores, scheds
        self._base = self._head = 0
        # A key saved twice (accepted again after its window) is at its later position.
        self._positions = dict(zip(keys, range(len(keys))))
        return offset

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


def _decode_saved(raw: bytes):
    """(keys, store times, schedule times, offset) of a saved table, or None when it is damaged."""
    if len(raw) < _HEAD.size:
        return None
    magic, offset, count, crc = _HEAD.unpack_from(raw, 0)
    body = memoryview(raw)[_HEAD.size :]
    if magic != _MAGIC or crc32c.crc32c(body) != crc or len(body) < 17 * count:
        return None
    stores, scheds = array("q"), array("q")
    stores.frombytes(body[: 8 * count])
    scheds.frombytes(body[8 * count : 16 * count])
    if _LITTLE_ENDIAN:
        stores.byteswap()
        scheds.byteswap()
    lengths = body[16 * count : 17 * count]
    try:
        text = bytes(body[17 * count :]).decode("utf-8")
    except UnicodeDecodeError:
        return None
    if sum(lengths) != len(text):
        return None
    ends = list(itertools.accumulate(lengths))
    keys = [text[e - n : e] for e, n in zip(ends, lengths)]
    return keys, stores, scheds, offset


class Dedupe:
    """The table of one node and its file."""

    def __init__(self, window_ms: int, checkpoint_dir: Path):
        self.table = DedupeTable(window_ms)
        self.path = Path(checkpoint_dir) / FILE_NAME
        #: message_log is needed from here on to rebuild the table (the cleaner keeps it).
        self.saved_offset = 0
        self._saving = trio.Lock()
        self._saved_changes = -1  # the table's `changes` when it was last saved whole

    def recover(self, message_log, now_ms: int, chunk_bytes: int = 8 << 20) -> None:
        """Load the saved table, then feed message_log from the offset it covers to the end."""
        self.saved_offset = offset = message_log.resume_offset(self.table.load(self.path), str(self.path))
        for data in message_log.read_from(offset, chunk_bytes):
            self.table.feed(data, 0, len(data))
        self.table.expire(now_ms)

    async def save(self, now_ms: int, replay_offset: int, slice_entries: int = 32768) -> None:
        """Expire, then write the table covering message_log up to `replay_offset` (every record
        before it is in the table; later ones may be too: feeding them again changes nothing).

        Expiry and encoding go in slices of `slice_entries`, with the event loop free between
        them; only the file's writing and fsyncs run in a worker thread, and they hold no lock
        Python code waits for (a save of millions of ids used to hold the loop for a tenth of a
        second and more: a copy of the whole table, then conversions in the thread that kept the
        interpreter's lock)."""
        async with self._saving:  # one writer of the file at a time
            while self.table.expire(now_ms, slice_entries) >= slice_entries:
                await trio.lowlevel.checkpoint()
            if self._saved_changes == self.table.changes and self.saved_offset and self.path.exists():
                # Nothing changed since the last save: the records replayed since had no part in
                # the table, so the file covers them too. Rewriting it whole (100 MB and more for
                # millions of ids) would only hold the disk, and the fsyncs of deliveries with it.
                try:
                    await trio.to_thread.run_sync(DedupeTable.write_offset, self.path, replay_offset)
                except OSError as e:
                    log.warning("%s: offset not saved (%s); will try again", self.path, e)
                    return
                self.saved_offset = replay_offset
                return
            changes = self.table.changes
            slices = []
            for part in self.table.encode_slices(slice_entries):
                slices.append(part)
                await trio.lowlevel.checkpoint()
            try:
                await trio.to_thread.run_sync(DedupeTable.write, self.path, slices, replay_offset)
            except OSError as e:
                log.warning("%s: not saved (%s); will try again", self.path, e)
                return
            self.saved_offset = replay_offset
            self._saved_changes = changes
