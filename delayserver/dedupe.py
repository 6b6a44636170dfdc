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
message_log offset replay had reached when the table was copied. Later saves append only what
changed since (the ids remembered, the handles moved) to `checkpoint/dedupe.journal`, one checked
chunk each with the offset it covers, so that a save costs what changed, not the whole table
(hundreds of MB for millions of ids, once a minute). Once the journal is half the size of the
table file, or after an append failed (no later fsync of that file is trusted), the next save
writes the table whole again and starts a new journal; a journal's chunks name the table file
they extend, so those of a replaced one are ignored. At start the file
and the journal's valid chunks are read back and message_log from the last offset they cover on is
fed again (`recover`), so the table survives a restart; the cleaner keeps message_log from that
offset (node/server.py). A damaged file is ignored with a warning and the table is rebuilt from
what message_log still holds; a torn journal chunk ends the journal there.

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
JOURNAL_NAME = "dedupe.journal"
# magic, message_log offset, entry count, crc32c of the entries, the file's id (random: a
# journal chunk names the file it extends)
_HEAD = struct.Struct(">8sQQIQ")
_MAGIC = b"DSDEDUP3"
_HEAD_V2 = struct.Struct(">8sQQI")  # the same without the id: read, and never extended
_MAGIC_V2 = b"DSDEDUP2"
_OFFSET = struct.Struct(">Q")
_OFFSET_AT = 8  # after the magic
# A journal chunk: magic, the id of the table file it extends, the message_log offset it covers,
# entry count, body length, crc32c of the head before it and the body. The body has the table
# file's layout.
_CHUNK = struct.Struct(">8sQQIII")
_CHUNK_MAGIC = b"DSDEDJ01"
#: A journal is never compacted before it holds this much.
JOURNAL_MIN_COMPACT_BYTES = 1 << 20
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
        #: Entries before this position are in the saved files (a journal chunk takes the rest).
        self.saved_to = 0
        # Positions whose schedule time changed since the last save took them (`take_updates`).
        self._updates: list[int] = []

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
                self._updates.append(position)
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

    def encode_slices(self, slice_entries: int = 32768, start: int = 0, reached: list | None = None):
        """The live entries from position `start` on, encoded in slices of `slice_entries` for
        `write`: a generator of (count, store times, schedule times, id lengths, ids) in the file's
        layout. Between two slices the caller may let other work run; entries remembered meanwhile
        may or may not be in the slices (a saved table covers message_log up to an offset taken
        before, and what comes after it is fed again at start: feeding a record twice changes
        nothing). `reached`, when given, gets the position the slices end at."""
        self._encoding += 1
        try:
            at = start
            while True:
                at = max(at, self._head)  # what expired meanwhile is left out
                begin = at - self._base
                end = min(len(self._keys), begin + slice_entries)
                if begin >= end:
                    if reached is not None:
                        reached.append(at)
                    return
                keys = self._keys[begin:end]
                stores, scheds = self._stores[begin:end], self._scheds[begin:end]
                at += end - begin
                yield self._encoded(keys, stores, scheds)
        finally:
            self._encoding -= 1

    @staticmethod
    def _encoded(keys, stores, scheds) -> tuple:
        if _LITTLE_ENDIAN:
            stores.byteswap()
            scheds.byteswap()
        return (len(keys), stores.tobytes(), scheds.tobytes(), bytes(map(len, keys)), "".join(keys).encode("utf-8"))

    def take_updates(self) -> list[int]:
        """The positions whose handle moved since the last call (a journal chunk's first part)."""
        updates, self._updates = self._updates, []
        return updates

    def give_back_updates(self, updates: list[int]) -> None:
        """Positions a failed save took: the next one writes them."""
        self._updates[:0] = updates

    def encode_updates(self, updates: list[int]):
        """The entries at `updates` that are still live, encoded as `encode_slices` does (one
        slice): written again after the ones they change, they win when read back."""
        keys, stores, scheds = [], array("q"), array("q")
        positions, base = self._positions, self._base
        for position in sorted(set(updates)):
            if position < self._head:
                continue
            i = position - base
            key = self._keys[i]
            if key is not None and positions.get(key) == position:
                keys.append(key)
                stores.append(self._stores[i])
                scheds.append(self._scheds[i])
        return self._encoded(keys, stores, scheds) if keys else None

    def extend(self, keys: list, stores: array, scheds: array) -> None:
        """Add saved entries after the ones there (a journal chunk read back: they are saved)."""
        first = self._base + len(self._keys)
        self._keys.extend(keys)
        self._stores.extend(stores)
        self._scheds.extend(scheds)
        self._positions.update(zip(keys, range(first, first + len(keys))))
        self.saved_to = first + len(keys)

    @staticmethod
    def write(path: Path, slices, offset: int) -> int:
        """Write the entries encoded by `encode_slices` covering message_log up to `offset`,
        atomically (temp file, fsync, rename, fsync of the directory); returns the new file's id
        (`base_id`).

        Layout after the head: every store time, then every schedule time (big-endian i64
        arrays), every id's length in characters (u8: an id is at most 128 bytes), then the ids
        as one UTF-8 text: read back with a few bulk decodes instead of one per id."""
        count, parts, crc = _columns(slices)
        file_id = int.from_bytes(os.urandom(8), "big")
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            f.write(_HEAD.pack(_MAGIC, offset, count, crc, file_id))
            for column in parts:
                f.writelines(column)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        return file_id

    @staticmethod
    def append_chunk(path: Path, valid_bytes: int, base_id: int, slices, offset: int) -> int:
        """Append a journal chunk of the entries encoded in `slices`, covering message_log up to
        `offset`, to the journal at `path` after its first `valid_bytes` (a torn chunk a failed
        save left past them is cut first), then fsync. Returns the journal's new size."""
        count, parts, _ = _columns(slices)
        body = b"".join(b"".join(column) for column in parts)
        head = _CHUNK.pack(_CHUNK_MAGIC, base_id, offset, count, len(body), 0)[:-4]
        crc = crc32c.crc32c(body, crc32c.crc32c(head))
        created = not path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, valid_bytes)
            data = head + struct.pack(">I", crc) + body
            written = 0
            while written < len(data):
                written += os.pwrite(fd, memoryview(data)[written:], valid_bytes + written)
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            _fsync_dir(path.parent)
        return valid_bytes + len(data)

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
        self.saved_to = len(keys)
        self._updates = []
        self.loaded_base_id = base_id(raw)
        return offset

    #: The id of the table file last read by `load` (journal chunks name it).
    loaded_base_id: int | None = None

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


def _columns(slices) -> tuple[int, list, int]:
    """(entry count, the four columns' parts, crc32c of the columns) of encoded slices."""
    slices = [part for part in slices if part is not None]
    parts = [[part[k] for part in slices] for k in range(1, 5)]
    crc = 0
    for column in parts:
        for chunk in column:
            crc = crc32c.crc32c(chunk, crc)
    return sum(part[0] for part in slices), parts, crc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def base_id(raw: bytes) -> int | None:
    """The id of the table file whose bytes (its head, at least) are `raw`, which journal chunks
    name; None for a file of the format before journals."""
    return _HEAD.unpack_from(raw, 0)[4] if raw[:8] == _MAGIC else None


def read_journal(raw: bytes, base: int):
    """The chunks of a journal that extend the table file `base`, in order, up to the first one
    that is damaged, torn, or extends another file: a list of (keys, store times, schedule times,
    offset), and where the last good one ends."""
    chunks, pos = [], 0
    while pos + _CHUNK.size <= len(raw):
        magic, chunk_base, offset, count, length, crc = _CHUNK.unpack_from(raw, pos)
        end = pos + _CHUNK.size + length
        if magic != _CHUNK_MAGIC or chunk_base != base or end > len(raw):
            break
        body = memoryview(raw)[pos + _CHUNK.size : end]
        if crc32c.crc32c(body, crc32c.crc32c(raw[pos : pos + _CHUNK.size - 4])) != crc:
            break
        entries = _decode_columns(body, count)
        if entries is None:
            break
        chunks.append((*entries, offset))
        pos = end
    return chunks, pos


def _decode_saved(raw: bytes):
    """(keys, store times, schedule times, offset) of a saved table, or None when it is damaged."""
    head = _HEAD if raw[:8] == _MAGIC else _HEAD_V2
    if len(raw) < head.size:
        return None
    magic, offset, count, crc = head.unpack_from(raw, 0)[:4]
    body = memoryview(raw)[head.size :]
    if magic not in (_MAGIC, _MAGIC_V2) or crc32c.crc32c(body) != crc:
        return None
    entries = _decode_columns(body, count)
    return None if entries is None else (*entries, offset)


def _decode_columns(body, count: int):
    """(keys, store times, schedule times) of `count` entries in the table file's layout, or None
    when they do not add up."""
    if len(body) < 17 * count:
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
    return keys, stores, scheds


class Dedupe:
    """The table of one node, its file and its journal."""

    def __init__(self, window_ms: int, checkpoint_dir: Path):
        self.table = DedupeTable(window_ms)
        self.path = Path(checkpoint_dir) / FILE_NAME
        self.journal_path = Path(checkpoint_dir) / JOURNAL_NAME
        #: message_log is needed from here on to rebuild the table (the cleaner keeps it).
        self.saved_offset = 0
        self._saving = trio.Lock()
        self._saved_changes = -1  # the table's `changes` when it was last saved
        self._base_id: int | None = None  # the table file the journal extends (None: none usable)
        self._base_bytes = 0
        self.journal_bytes = 0  # the journal's valid length: what the next chunk follows

    def recover(self, message_log, now_ms: int, chunk_bytes: int = 8 << 20) -> None:
        """Load the saved table and its journal, then feed message_log from the offset they cover
        to the end."""
        self.saved_offset = offset = message_log.resume_offset(self.load(), str(self.path))
        for data in message_log.read_from(offset, chunk_bytes):
            self.table.feed(data, 0, len(data))
        self.table.expire(now_ms)

    def load(self) -> int | None:
        """Read the table file and the journal chunks that extend it; the message_log offset they
        cover, or None when there is no usable table file."""
        offset = self.table.load(self.path)
        if offset is None:
            return None
        self.saved_offset = offset
        self._base_id = self.table.loaded_base_id
        self._base_bytes = self.path.stat().st_size
        try:
            raw = self.journal_path.read_bytes()
        except FileNotFoundError:
            return offset
        except OSError as e:
            log.warning("%s: not read (%s); the table is rebuilt from message_log past its file", self.journal_path, e)
            return offset
        chunks, self.journal_bytes = read_journal(raw, self._base_id)
        if self.journal_bytes < len(raw) and chunks:
            log.warning("%s: %d bytes past the last whole chunk ignored (a save cut short)",
                        self.journal_path, len(raw) - self.journal_bytes)
        for keys, stores, scheds, offset in chunks:
            self.table.extend(keys, stores, scheds)
            self.saved_offset = offset
        return self.saved_offset

    async def save(self, now_ms: int, replay_offset: int, slice_entries: int = 32768) -> None:
        """Expire, then save the table covering message_log up to `replay_offset` (every record
        before it is in the table; later ones may be too: feeding them again changes nothing):
        what changed since the last save, as a journal chunk, or the whole table when there is no
        table file to extend or the journal has grown to half its size.

        Expiry and encoding go in slices of `slice_entries`, with the event loop free between
        them; only the files' writing and fsyncs run in a worker thread, and they hold no lock
        Python code waits for (a save of millions of ids used to hold the loop for a tenth of a
        second and more: a copy of the whole table, then conversions in the thread that kept the
        interpreter's lock)."""
        async with self._saving:  # one writer of the files at a time
            while self.table.expire(now_ms, slice_entries) >= slice_entries:
                await trio.lowlevel.checkpoint()
            whole = self._base_id is None or not self.saved_offset or not self.path.exists() \
                or self.journal_bytes > max(self._base_bytes // 2, JOURNAL_MIN_COMPACT_BYTES)
            if not whole and self._saved_changes == self.table.changes and not self.journal_bytes:
                # Nothing changed since the table file was written: the records replayed since
                # had no part in the table, so the file covers them too.
                try:
                    await trio.to_thread.run_sync(DedupeTable.write_offset, self.path, replay_offset)
                except OSError as e:
                    log.warning("%s: offset not saved (%s); will try again", self.path, e)
                    return
                self.saved_offset = replay_offset
                return
            changes = self.table.changes
            updates = self.table.take_updates()
            reached: list[int] = []
            slices = [] if whole else [self.table.encode_updates(updates)]
            start = 0 if whole else self.table.saved_to
            for part in self.table.encode_slices(slice_entries, start, reached):
                slices.append(part)
                await trio.lowlevel.checkpoint()
            try:
                if whole:
                    await trio.to_thread.run_sync(self._write_whole, slices, replay_offset)
                else:
                    self.journal_bytes = await trio.to_thread.run_sync(
                        DedupeTable.append_chunk, self.journal_path, self.journal_bytes, self._base_id,
                        slices, replay_offset)
            except OSError as e:
                target = self.path if whole else self.journal_path
                log.warning("%s: not saved (%s); will try again, writing the table whole", target, e)
                self.table.give_back_updates(updates)
                # No later fsync of a file whose fsync failed is trusted (storage/segment.py): the
                # journal is not appended to again, the next save writes a new table file.
                self._base_id = None
                return
            self.table.saved_to = reached[0]
            self.saved_offset = replay_offset
            self._saved_changes = changes

    def _write_whole(self, slices, offset: int) -> None:
        """Write the table file, then remove the journal (a worker thread's part of a save): the
        next chunk starts a new file, never one whose fsync may have failed. The old chunks name
        the file replaced, so none is applied to the new one whether or not the removal reaches
        the disk: it needs no fsync."""
        self._base_id = DedupeTable.write(self.path, slices, offset)
        self._base_bytes = self.path.stat().st_size
        self.journal_bytes = 0
        self.journal_path.unlink(missing_ok=True)
