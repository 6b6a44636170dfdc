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

Memory: per id remembered since the node started, the id's string, a slot of the map from id to
position (`_positions_map`: 24 bytes of the compiled `IdMap`, at most half of its slots used, or a
dict entry when the install has no compiled kernels), a list slot, and two 8-byte times and a
4-byte hash in arrays (`DedupeTable`). The ids read back at start stay in the
columns they were saved in (`_Saved`: the ids' text, their offsets, a hash of each and the order
of the hashes), the text left in the file's read-only mapping: no Python object per id, so that
ten million ids are read back in about half a second, not the 12 to 14 s it takes to build ten
million strings and a dict of them. `ops/bench dedupe` measures both.

File layout (format 4): a head (magic, message_log offset, entry count, crc32c of the body, the
file's id), then the columns: every store time, every schedule time (big-endian i64), every id's
length in characters (u8: an id is at most 128 bytes), a 32-bit hash of each id's UTF-8
(`key_hash`, big-endian u32), the entries' indexes sorted by that hash (u32), the hashes in that
order (u32), then the ids as one UTF-8 text. A journal chunk's body has the same columns. Format
3 (no hash or order columns) and 2 (no file id either) are still read; the next save after
reading one writes the table whole in format 4.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import mmap
import os
import struct
import sys
from array import array
from pathlib import Path

import crc32c
import numpy as np
import trio
import xxhash

from delayserver.storage.record import MESSAGE_HEAD, RecordType, decode_headers, iter_checked_records
from delayserver.storage.writeback import write_file_paced, write_paced

try:  # the compiled bookkeeping (delayserver/native/dedupe.pyx), when the install built it
    from delayserver.native.dedupe import remember_many as _native_remember_many
except ImportError:
    _native_remember_many = None
try:  # the compiled map of ids to positions (delayserver/native/idmap.pyx)
    from delayserver.native.idmap import IdMap
except ImportError:
    IdMap = None

log = logging.getLogger("delayserver.dedupe")

FILE_NAME = "dedupe.bin"
JOURNAL_NAME = "dedupe.journal"
# magic, message_log offset, entry count, crc32c of the entries, the file's id (random: a
# journal chunk names the file it extends)
_HEAD = struct.Struct(">8sQQIQ")
_MAGIC = b"DSDEDUP4"
_MAGIC_V3 = b"DSDEDUP3"  # the same head; columns without the hashes and their order
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
#: The most of the event loop a save's expiry and encoding take (`Dedupe.save`; after a slice that
#: took t it waits t * (1 - share) / share): unpaced, a whole save of 500,000 ids made the messages
#: falling due meanwhile at 50,000 msg/s 13 to 22 ms late at the median, against 4 ms over the
#: whole window (the stretch line of `ops/bench deliver`; README's delivery rows).
SAVE_LOOP_SHARE = 0.25
_LITTLE_ENDIAN = sys.byteorder == "little"
_MESSAGE_HEAD_SIZE = MESSAGE_HEAD.size


#: Headers that make a send a new attempt of a message that keeps its id.
ATTEMPT_HEADERS = ("reconsume-times", "redriven-from")


def key_hash(raw: bytes) -> int:
    """The saved hash of a key's UTF-8: 32 bits of xxh3, stable across processes and versions."""
    return xxhash.xxh3_64_intdigest(raw) & 0xFFFFFFFF


def _positions_map(entries=()):
    """The table's map of key -> position, with `entries`: the compiled `IdMap` when the install
    built it (its own probes, positions held as machine integers: 157 against 176 bytes an id,
    the id's string included, in `ops/bench dedupe`), else a dict (`_positions_dict`). Both
    answer `get`, `in`, `[]`, `del`, `len`, `items` alike."""
    if IdMap is None:
        return _positions_dict(entries)
    positions = IdMap()
    positions.update(entries)
    return positions


def _positions_dict(entries=()) -> dict:
    """A dict for the table's key -> position, with `entries`, that keeps each key's hash beside
    it. A dict whose keys have all been strings (CPython's own layout for them) keeps none: to
    tell a key it looks for from one in the slot it probes, it reads that key's string object,
    one more cache miss per slot probed, and in a table of millions of ids every probe of a new
    id misses the cache (two a message: when its request is admitted, when it is remembered).
    Once any other key has been in it, a dict keeps the general layout, hash beside key, through
    every resize after: here a key that is not a string goes in and out before any id. Measured
    with 2,000,000 ids (28 characters): a lookup of an id it does not hold 190 ns against 290, for
    11 bytes more per id (the hash, 8, and the larger table)."""
    positions: dict = {None: None}
    del positions[None]
    positions.update(entries)
    return positions


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

    The entries read back at start (`load`, `restore`) are the first positions; their keys stay in
    `_saved` (a `_Saved`), not in the dict, and their list slots hold None. A key is looked for in
    the dict first (everything remembered since start is there, and is newer), then there.
    """

    def __init__(self, window_ms: int):
        self.window_ms = window_ms
        self._positions = _positions_map()
        self._keys: list[str | None] = []  # None: expired, waiting for the front to be dropped
        self._stores = array("q")
        self._scheds = array("q")
        self._hashes = array("I")  # key_hash of each key, as saved
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
        self._saved: _Saved | None = None  # the entries read back at start, positions 0 .. n - 1

    def __len__(self) -> int:
        """How many ids the table holds (not yet expired)."""
        saved = self._saved
        return len(self._positions) + (0 if saved is None else saved.live_from(self._head))

    def _saved_position(self, key: str, raw: bytes | None = None, h: int | None = None) -> int | None:
        """The position of `key` among the entries read back at start, when it is live there.
        `raw`, `h`: its UTF-8 and `key_hash` of it, when the caller has them."""
        raw = key.encode("utf-8") if raw is None else raw
        position = self._saved.find(raw, key_hash(raw) if h is None else h)
        return None if position is None or position < self._head else position

    @property
    def enabled(self) -> bool:
        return self.window_ms > 0

    def screen(self) -> tuple:
        """``(ids, saved)``, for a caller screening many ids to skip `find` for most of those the
        table does not hold: `ids`, the ids accepted since start (id -> position); `saved`, None
        when no entry read back at start is live (then an id not in `ids` is not known: `find`
        answers None), else ``(shift, bitmap)``: an id not in `ids` is known only if bit
        ``key_hash(its UTF-8) >> shift`` of `bitmap` is set (`_Saved.bits`)."""
        saved = self._saved
        return self._positions, None if saved is None else saved.bits

    def find(self, message_id: str, now_ms: int) -> int | None:
        """The schedule time of the message accepted under `message_id` within the window, or None."""
        position = self._positions.get(message_id)
        if position is None:
            if self._saved is None:
                return None
            position = self._saved_position(message_id)
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
        self.remember_many(((message_id, schedule_time),), store_time)

    def remember_many(self, entries, store_time: int) -> None:
        """`remember` of each ``(message_id, schedule_time)`` of `entries`, in order, all accepted
        at `store_time` (a request's messages). The compiled kernel (delayserver/native/dedupe.pyx)
        when built, else `_remember_many_py`."""
        if _native_remember_many is None:
            return self._remember_many_py(entries, store_time)
        self._remember_compiled(entries, store_time, None)

    def remember_accepted(self, keys: list, accepted: list, store_time: int) -> None:
        """`remember_many` of ``(keys[i], when)`` of each ``(i, when)`` of `accepted` (a stored
        request's: `admit`'s keys and accepted), without the list of those pairs made first when
        the kernel is built."""
        if _native_remember_many is None:
            return self._remember_many_py([(keys[i], when) for i, when in accepted], store_time)
        self._remember_compiled(accepted, store_time, keys)

    def _remember_compiled(self, entries, store_time: int, request_keys: list | None) -> None:
        """The compiled kernel over the table's columns (its `request_keys`: delayserver/native/dedupe.pyx)."""
        self.changes += _native_remember_many(
            self._positions, self._keys, self._stores, self._scheds, self._hashes, self._updates, self._base,
            self.window_ms, entries, store_time, self._saved, self._saved_position, request_keys)

    def _remember_many_py(self, entries, store_time: int) -> None:
        """`remember_many` in Python, the table's columns bound once, no call per id: the compiled
        kernel's reference."""
        positions, keys, stores, scheds, hashes = self._positions, self._keys, self._stores, self._scheds, self._hashes
        saved, base, window = self._saved, self._base, self.window_ms
        for message_id, schedule_time in entries:
            position = positions.get(message_id)
            h = None
            if position is None and saved is not None:  # its hash is taken once, for the lookup and to keep
                raw = message_id.encode("utf-8")
                h = key_hash(raw)
                position = self._saved_position(message_id, raw, h)
                if position is not None and store_time - stores[position - base] >= window:
                    saved.supersede(position)  # its window is over: the dict's new entry is its current one
                    position = None
            if position is not None:
                i = position - base
                if store_time - stores[i] < window:
                    scheds[i] = schedule_time
                    self._updates.append(position)
                    self.changes += 1
                    continue
            positions[message_id] = base + len(keys)
            keys.append(message_id)
            stores.append(store_time)
            scheds.append(schedule_time)
            hashes.append(key_hash(message_id.encode("utf-8")) if h is None else h)
            self.changes += 1

    def expire(self, now_ms: int, limit: int | None = None) -> int:
        """Forget the ids accepted more than the window ago (at most `limit` entries looked at, None:
        all); returns how many entries were looked at: under `limit` when the front is inside the
        window."""
        keys, stores, positions = self._keys, self._stores, self._positions
        cutoff, base = now_ms - self.window_ms, self._base
        i = first = self._head - base
        end = len(keys) if limit is None else min(len(keys), first + limit)
        remove_if = getattr(positions, "remove_if", None)  # (an IdMap's: one probe, not two)
        while i < end and stores[i] <= cutoff:
            key = keys[i]
            if remove_if is not None:
                remove_if(key, i + base)
            elif positions.get(key) == i + base:  # not accepted again since
                del positions[key]
            keys[i] = None
            i += 1
        if i > first:
            self.changes += 1
        self._head = i + base
        if self._saved is not None and self._head >= len(self._saved):
            self._saved = None  # every entry read back at start has expired
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
        del self._hashes[:dropped]
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
                saved = self._saved if self._saved is not None and at < len(self._saved) else None
                if saved is not None:  # entries read back at start: a slice ends where they do
                    end = min(end, len(saved) - self._base)
                if begin >= end:
                    if reached is not None:
                        reached.append(at)
                    return
                stores, scheds, hashes = self._stores[begin:end], self._scheds[begin:end], self._hashes[begin:end]
                if saved is not None:
                    lengths, text = saved.columns(at, at + end - begin)
                else:
                    keys = self._keys[begin:end]
                    lengths, text = bytes(map(len, keys)), "".join(keys).encode("utf-8")
                at += end - begin
                yield self._encoded(end - begin, stores, scheds, lengths, hashes, text)
        finally:
            self._encoding -= 1

    @staticmethod
    def _encoded(count: int, stores: array, scheds: array, lengths: bytes, hashes: array, text: bytes) -> tuple:
        """A slice for `write`: (count, store times, schedule times, lengths, hashes, text), the
        times and hashes (native arrays, changed in place) made big-endian."""
        if _LITTLE_ENDIAN:
            stores.byteswap()
            scheds.byteswap()
            hashes.byteswap()
        return count, stores.tobytes(), scheds.tobytes(), lengths, hashes.tobytes(), text

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
        keys, stores, scheds, hashes = [], array("q"), array("q"), array("I")
        positions, base, saved = self._positions, self._base, self._saved
        for position in sorted(set(updates)):
            if position < self._head:
                continue
            i = position - base
            key = self._keys[i]
            if key is None and saved is not None and position < len(saved):
                key = saved.key(position)
                current = key not in positions and self._saved_position(key) == position
            else:
                current = key is not None and positions.get(key) == position
            if current:
                keys.append(key)
                stores.append(self._stores[i])
                scheds.append(self._scheds[i])
                hashes.append(self._hashes[i])
        if not keys:
            return None
        return self._encoded(len(keys), stores, scheds, bytes(map(len, keys)), hashes, "".join(keys).encode("utf-8"))

    @staticmethod
    def write(path: Path, slices, offset: int) -> int:
        """Write the entries encoded by `encode_slices` covering message_log up to `offset`,
        atomically (temp file, fsync, rename, fsync of the directory); returns the new file's id
        (`base_id`).

        Layout after the head: the columns of the module docstring, read back with a few bulk
        decodes instead of one per id."""
        count, parts, crc = _columns(slices)
        file_id = int.from_bytes(os.urandom(8), "big")
        tmp = path.with_name(f".{path.name}.tmp")
        # Paced (storage/writeback.py): its fsync does not flush tens of MB at once, in front of
        # the spool's and dispatch_log's fsyncs.
        head = _HEAD.pack(_MAGIC, offset, count, crc, file_id)
        write_file_paced(tmp, itertools.chain((head,), itertools.chain.from_iterable(parts)))
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
            write_paced(fd, (data,), valid_bytes)  # (a busy minute's chunk can be tens of MB)
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
        read = _read_table_file(path)
        if read is None:
            return None
        self.restore([read[1]])
        return read[1].offset

    def restore(self, parts: list[_Columns], pool: concurrent.futures.Executor | None = None) -> None:
        """Take the entries of a saved table file and of the journal chunks that extend it, in
        order, as the table's (it must be empty). A key saved twice (accepted again after its
        window, or its handle moved) is at its later position. `pool`: where parts of the work
        run beside the rest (`_Saved`)."""
        count = sum(len(part) for part in parts)
        parts = [part for part in parts if len(part)] or parts[:1]  # a chunk of no entries only moved the offset
        self._stores, self._scheds = _joined([part.stores for part in parts]), _joined([part.scheds for part in parts])
        self._base = self._head = 0
        self._updates = []
        self.saved_to = count
        if all(part.hashes is not None and part.ascii for part in parts):
            # An ASCII id's length in characters is its length in bytes: no id is decoded.
            self._saved = _Saved(parts, pool)
            self._hashes = _joined([part.hashes for part in parts])
            self._keys = [None] * count
            self._positions = _positions_map()
            self._saved.ready()
            return
        keys = [key for part in parts for key in part.keys()]
        self._hashes = array("I", (key_hash(key.encode("utf-8")) for key in keys))
        self._keys = keys
        self._positions = _positions_map(zip(keys, range(count)))

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
    """(entry count, the columns' parts in the file's layout, crc32c of the columns) of encoded
    slices: the order of the hashes is sorted here (a worker thread's part of a save)."""
    slices = [part for part in slices if part is not None]
    parts = [[part[k] for part in slices] for k in range(1, 6)]
    # As numpy arrays, written through the buffer protocol: a `tobytes` of tens of MB would hold
    # the interpreter's lock, and the event loop with it, for its whole copy.
    hashes = np.frombuffer(b"".join(parts[3]), dtype=">u4").astype(np.uint32)
    order = np.argsort(hashes, kind="stable")
    parts[4:4] = [[order.astype(">u4")], [hashes[order].astype(">u4")]]
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
    return _HEAD.unpack_from(raw, 0)[4] if raw[:8] in (_MAGIC, _MAGIC_V3) else None


def read_journal(raw: bytes, base: int, hashed: bool = True):
    """The chunks of a journal that extend the table file `base`, in order, up to the first one
    that is damaged, torn, or extends another file: a list of (columns, offset), and where the
    last good one ends. `hashed`: the chunks have format 4's columns (their file is of format 4)."""
    chunks, pos = [], 0
    while pos + _CHUNK.size <= len(raw):
        magic, chunk_base, offset, count, length, crc = _CHUNK.unpack_from(raw, pos)
        end = pos + _CHUNK.size + length
        if magic != _CHUNK_MAGIC or chunk_base != base or end > len(raw):
            break
        body = memoryview(raw)[pos + _CHUNK.size : end]
        if crc32c.crc32c(body, crc32c.crc32c(raw[pos : pos + _CHUNK.size - 4])) != crc:
            break
        columns = _Columns.decode(body, count, hashed, offset)
        if columns is None:
            break
        chunks.append((columns, offset))
        pos = end
    return chunks, pos


def _read_table_file(path: Path, pool: concurrent.futures.Executor | None = None):
    """(the file's mapped bytes, its entries) of a saved table file, or None when there is none or
    it is not usable (logged)."""
    try:
        raw = _map(path)  # the ids' text stays in the mapping (`_Columns.decode`)
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("%s: not read (%s); rebuilding the dedupe table from message_log", path, e)
        return None
    saved = _decode_saved(raw, pool)
    if saved is None:
        log.warning("%s: damaged; rebuilding the dedupe table from message_log", path)
        return None
    return raw, saved


def _decode_saved(raw: bytes, pool: concurrent.futures.Executor | None = None) -> _Columns | None:
    """The entries of a saved table (their `offset` is the one it covers), or None when it is
    damaged. With `pool`, the body's crc is taken there while this thread decodes it (the crc runs
    outside the interpreter's lock: 0.08 s of hundreds of MB)."""
    head = _HEAD if raw[:8] in (_MAGIC, _MAGIC_V3) else _HEAD_V2
    if len(raw) < head.size:
        return None
    magic, offset, count, crc = head.unpack_from(raw, 0)[:4]
    body = memoryview(raw)[head.size :]
    if magic not in (_MAGIC, _MAGIC_V3, _MAGIC_V2):
        return None
    checked = _beside(pool, crc32c.crc32c, body)
    columns = _Columns.decode(body, count, magic == _MAGIC, offset)
    return columns if checked.result() == crc else None


def _beside(pool: concurrent.futures.Executor | None, fn, *args) -> concurrent.futures.Future:
    """`fn(*args)` submitted to `pool` to run beside the caller's work, or run now without one."""
    if pool is not None:
        return pool.submit(fn, *args)
    done = concurrent.futures.Future()
    done.set_result(fn(*args))
    return done


class _Columns:
    """The entries of a table file or a journal chunk, as saved (module docstring)."""

    def __init__(self, stores: array, scheds: array, lengths, hashes, order, sorted_, text, offset: int,
                 ascii_: bool):
        self.stores, self.scheds, self.lengths = stores, scheds, lengths
        # each entry's hash (an array("I")), and the entries' order by hash with the hashes in that
        # order (numpy uint32 arrays); all None in format 3 and before
        self.hashes, self.order, self.sorted = hashes, order, sorted_
        # `text`: bytes-like (read-only: a slice of it is hashable), all ASCII when `ascii`
        self.text, self.offset, self.ascii = text, offset, ascii_

    def __len__(self) -> int:
        return len(self.stores)

    @classmethod
    def decode(cls, body, count: int, hashed: bool, offset: int) -> _Columns | None:
        """The `count` entries of `body`, or None when they do not add up."""
        fixed = 29 if hashed else 17  # bytes per entry before the text
        if len(body) < fixed * count:
            return None
        stores, scheds = _native(array("q"), body[: 8 * count]), _native(array("q"), body[8 * count : 16 * count])
        lengths = np.frombuffer(body[16 * count : 17 * count], dtype=np.uint8)
        hashes = order = sorted_ = None
        if hashed:
            # The table keeps each entry's hash in an array (`DedupeTable._hashes`): made here once.
            hashes = _native(array("I"), body[17 * count : 21 * count])
            order, sorted_ = (np.frombuffer(body[at : at + 4 * count], dtype=">u4").astype(np.uint32)
                              for at in (21 * count, 25 * count))
            if count and order.max() >= count:
                return None
        # The ids' text stays where it was read (a table file is mapped, not copied: 160 MB at ten
        # million ids); the mapping lives as long as the entries read back.
        text = body[fixed * count :]
        ascii_ = _is_ascii(text)
        if ascii_:
            if int(lengths.sum(dtype=np.int64)) != len(text):
                return None
        else:
            try:
                decoded = str(text, "utf-8")
            except UnicodeDecodeError:
                return None
            if int(lengths.sum(dtype=np.int64)) != len(decoded):
                return None
        return cls(stores, scheds, lengths, hashes, order, sorted_, text, offset, ascii_)

    def keys(self) -> list[str]:
        """The ids, one string each (the slow way, for a text that is not all ASCII)."""
        text = str(self.text, "utf-8")
        ends = list(itertools.accumulate(self.lengths.tolist()))
        return [text[e - n : e] for e, n in zip(ends, self.lengths.tolist())]


def _joined(columns: list[array]) -> array:
    """The parts' column as one array: the only part's own (no copy), or a new one (the parts are
    left as they are: `_Saved` counts positions by their lengths)."""
    if len(columns) == 1:
        return columns[0]
    joined = array(columns[0].typecode)
    for column in columns:
        joined.extend(column)
    return joined


def _native(column: array, data) -> array:
    """`column` extended with the big-endian values of `data`, in native order."""
    column.frombytes(data)
    if _LITTLE_ENDIAN:
        column.byteswap()
    return column


def _is_ascii(text) -> bool:
    """Whether bytes-like `text` is all ASCII (a numpy reduction: outside the interpreter's lock)."""
    return not len(text) or int(np.frombuffer(text, dtype=np.uint8).max()) < 0x80


def _map(path: Path):
    """The file's bytes, mapped read-only: read through the page cache, without a copy of the
    whole file (the ids' text is kept in the mapping; the rest is copied out by the decoding). A
    save replaces the file by a rename, never rewriting it in place but for the head's offset, so
    the mapping keeps what was read. An empty file reads as b""."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else b""


def _bitmap(sorted_: np.ndarray) -> tuple[int, bytes]:
    """(shift, bitmap): a bit for each value of the top bits of sorted 32-bit hashes, 8 bits or
    more per hash, so that most hashes not among them are told by one bit (h >> shift). Built in
    slices of the sorted hashes, each a run of the bitmap's bytes: no temporary of the bitmap's
    size in bits, whose pages a scatter would fault in one by one."""
    bits = max(8 * len(sorted_), 1 << 16).bit_length()
    shift = np.uint32(32 - bits)
    bitmap = np.zeros(1 << (bits - 3), dtype=np.uint8)
    for at in range(0, len(sorted_), 1 << 18):
        top = sorted_[at : at + (1 << 18)] >> shift
        byte = top >> np.uint32(3)
        bit = np.left_shift(np.uint8(1), (top & np.uint32(7)).astype(np.uint8))
        first = np.flatnonzero(np.concatenate(([True], byte[1:] != byte[:-1])))
        bitmap[byte[first]] |= np.bitwise_or.reduceat(bit, first)  # a byte may span two slices: |=
    return int(shift), bitmap.tobytes()


def _starts(lengths: np.ndarray, width, step: int = 1 << 18) -> np.ndarray:
    """Where each id starts in the text, and where the last ends, from the ids' lengths (u8). In
    slices widened one at a time: a cumsum that converts as it adds takes ten times as long, and a
    widened copy of the whole column is 40 MB more to fault in at ten million ids."""
    starts = np.empty(len(lengths) + 1, dtype=width)
    starts[0] = carry = 0
    for at in range(0, len(lengths), step):
        part = starts[at + 1 : at + 1 + step]
        np.cumsum(lengths[at : at + step].astype(width), out=part)
        if carry:
            part += carry
        carry = int(part[-1])
    return starts


def _merged(parts: list[_Columns]) -> tuple[np.ndarray, np.ndarray]:
    """(order, sorted hashes) of the entries of `parts`, positions counted across them: the later
    parts (journal chunks, smaller than the file together) sorted, then merged into the first
    part's sorted run in one pass, equal hashes in position order."""
    first = parts[0]
    hashes = np.concatenate([np.frombuffer(part.hashes, dtype=np.uint32) for part in parts[1:]])
    rank = np.argsort(hashes, kind="stable")
    later = hashes[rank]
    at = first.sorted.searchsorted(later, side="right")
    order = np.insert(first.order, at, (rank + len(first)).astype(np.uint32))
    return order, np.insert(first.sorted, at, later)


class _Saved:
    """The keys of the entries a table read back at start (positions 0 .. n - 1), as columns: the
    ids' ASCII text and where each starts, and the positions in the order of their hashes
    (`key_hash`), with those hashes, to bisect. `current` is false for an entry a later one
    replaced: the same key saved again (read back), or accepted again after its window (the
    dict's then)."""

    def __init__(self, parts: list[_Columns], pool: concurrent.futures.Executor | None = None):
        """`parts`: at least one; none empty but the only one (`DedupeTable.restore` leaves out
        journal chunks of no entries). With `pool`, the bitmap is built there while the rest is
        read back; `ready` waits for it, and must be called before the first `find`."""
        self.text = parts[0].text if len(parts) == 1 else b"".join(part.text for part in parts)
        lengths = np.concatenate([part.lengths for part in parts])
        width = np.int32 if len(self.text) < 1 << 31 else np.int64  # 4 bytes per id where they do
        self.starts = _starts(lengths, width)
        self.order, self.sorted = (parts[0].order, parts[0].sorted) if len(parts) == 1 else _merged(parts)
        self._search = self.sorted.searchsorted
        self._building = _beside(pool, _bitmap, self.sorted)
        self._shift, self._bitmap = 0, b""
        self.current = np.ones(len(lengths), dtype=bool)
        self.current[self._replaced()] = False

    def ready(self) -> None:
        """Take the bitmap built beside the rest of the read-back."""
        self._shift, self._bitmap = self._building.result()

    @property
    def bits(self) -> tuple[int, bytes]:
        """(shift, bitmap): a key whose hash h has bit h >> shift of the bitmap clear is not
        among these (the compiled kernels screen ids with it, without a call to `find`)."""
        return self._shift, self._bitmap

    def _replaced(self) -> list[int]:
        """The positions of keys saved again later (read back, or a handle moved): only the last
        is current. They share a hash, so they are neighbours in hash order, in position order
        (with the rare other key of the same hash)."""
        sorted_ = self.sorted
        same = np.flatnonzero(sorted_[1:] == sorted_[:-1])
        if not len(same):
            return []
        members = np.union1d(same, same + 1)  # every entry whose hash another entry has too
        positions = self.order[members].astype(np.int64)
        hashes = sorted_[members].tolist()
        text = self.text
        keys = [text[a:b] for a, b in zip(self.starts[positions].tolist(), self.starts[positions + 1].tolist())]
        positions = positions.tolist()
        replaced, later, run = [], set(), None
        for k in range(len(members) - 1, -1, -1):  # each run of one hash from its last entry
            if hashes[k] != run:
                run, later = hashes[k], set()
            if keys[k] in later:
                replaced.append(positions[k])
            else:
                later.add(keys[k])
        return replaced

    def __len__(self) -> int:
        return len(self.current)

    def _bytes(self, position: int) -> bytes:
        return self.text[self.starts[position] : self.starts[position + 1]]

    def key(self, position: int) -> str:
        return str(self._bytes(position), "ascii")

    def find(self, raw: bytes, h: int) -> int | None:
        """The position of the current entry whose key's UTF-8 is `raw` (`h`: its `key_hash`), or
        None."""
        bit = h >> self._shift
        if not self._bitmap[bit >> 3] >> (bit & 7) & 1:
            return None
        sorted_ = self.sorted
        i = int(self._search(np.uint32(h)))
        found = None
        while i < len(sorted_) and sorted_[i] == h:
            p = int(self.order[i])
            if self.current[p] and self._bytes(p) == raw:
                found = p
            i += 1
        return found

    def supersede(self, position: int) -> None:
        self.current[position] = False

    def live_from(self, head: int) -> int:
        """How many current entries are at `head` or after."""
        return int(np.count_nonzero(self.current[head:]))

    def columns(self, start: int, end: int) -> tuple[bytes, bytes]:
        """(lengths, text) of the entries start .. end - 1, as `_encoded` takes them."""
        starts = self.starts
        return (starts[start + 1 : end + 1] - starts[start:end]).astype(np.uint8).tobytes(), \
            self.text[starts[start] : starts[end]]


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
        #: What a slice's time is read from (trio's clock; tests give one that counts slices).
        self.work_clock = trio.current_time

    @classmethod
    def read(cls, window_ms: int, checkpoint_dir: Path) -> tuple[Dedupe, int | None]:
        """A node's table with its saved entries read back (`load`), and the offset they cover."""
        dedupe = cls(window_ms, checkpoint_dir)
        return dedupe, dedupe.load() if dedupe.table.enabled else None

    def recover(self, message_log, now_ms: int, saved: int | None, chunk_bytes: int = 8 << 20) -> None:
        """Feed message_log from `saved` to its end: the offset the saved table and its journal
        cover, as `load` (or `read`) gave it when it read them back (None: nothing saved)."""
        self.saved_offset = offset = message_log.resume_offset(saved, str(self.path))
        for data in message_log.read_from(offset, chunk_bytes):
            self.table.feed(data, 0, len(data))
        self.table.expire(now_ms)

    def load(self) -> int | None:
        """Read the table file and the journal chunks that extend it; the message_log offset they
        cover, or None when there is no usable table file. Its checksums and the bitmap run in a
        second thread beside the copies (both mostly outside the interpreter's lock)."""
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dedupe-check") as pool:
            read = _read_table_file(self.path, pool)
            return None if read is None else self._read_back(*read, pool)

    def _read_back(self, raw, saved: _Columns, pool: concurrent.futures.Executor) -> int:
        self.saved_offset = saved.offset
        hashed = raw[:8] == _MAGIC
        # A file of an older format is not extended: the next save writes the table whole.
        self._base_id = base_id(raw) if hashed else None
        self._base_bytes = len(raw)
        parts = [saved]
        try:
            journal = self.journal_path.read_bytes()
        except FileNotFoundError:
            journal = b""
        except OSError as e:
            log.warning("%s: not read (%s); the table is rebuilt from message_log past its file", self.journal_path, e)
            journal = b""
        chunk_base = base_id(raw)
        if journal and chunk_base is not None:
            chunks, self.journal_bytes = read_journal(journal, chunk_base, hashed)
            if self.journal_bytes < len(journal) and chunks:
                log.warning("%s: %d bytes past the last whole chunk ignored (a save cut short)",
                            self.journal_path, len(journal) - self.journal_bytes)
            for columns, offset in chunks:
                parts.append(columns)
                self.saved_offset = offset
        self.table.restore(parts, pool)
        self._saved_changes = self.table.changes  # as saved: what recovery feeds or expires is not
        return self.saved_offset

    async def save(self, now_ms: int, replay_offset: int, slice_entries: int = 8192,
                   loop_share: float = SAVE_LOOP_SHARE) -> None:
        """Expire, then save the table covering message_log up to `replay_offset` (every record
        before it is in the table; later ones may be too: feeding them again changes nothing):
        what changed since the last save, as a journal chunk, or the whole table when there is no
        table file to extend or the journal has grown to half its size.

        Expiry and encoding go in slices of `slice_entries` (8,192 ids: about a millisecond
        each), and after each the save lets the rest of the loop run for three times as long as
        the slice took, so that however many ids it writes it never takes more than a quarter of
        the loop from delivery and acknowledgements (`loop_share`; 1.0: no pauses, as a node that
        is stopping saves). Only the files' writing and fsyncs run in a
        worker thread, and they hold no lock Python code waits for (a save of millions of ids
        used to hold the loop for a tenth of a second and more: a copy of the whole table, then
        conversions in the thread that kept the interpreter's lock)."""
        async with self._saving:  # one writer of the files at a time
            began = self.work_clock()
            while self.table.expire(now_ms, slice_entries) >= slice_entries:
                began = await self._pause(began, loop_share)
            whole = self._base_id is None or not self.saved_offset or not self.path.exists() \
                or self.journal_bytes > max(self._base_bytes // 2, JOURNAL_MIN_COMPACT_BYTES)
            unchanged = not whole and self._saved_changes == self.table.changes
            if unchanged and replay_offset == self.saved_offset:
                return  # the files hold this table at this offset already (a stop right after a start)
            if unchanged and not self.journal_bytes:
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
            began = self.work_clock()
            for part in self.table.encode_slices(slice_entries, start, reached):
                slices.append(part)
                began = await self._pause(began, loop_share)
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

    async def _pause(self, began: float, share: float) -> float:
        """Let the rest of the event loop run after a slice of a save that began at `began`, long
        enough that the save keeps to `share` of the loop; returns when the next begins."""
        worked = max(0.0, self.work_clock() - began)
        await trio.sleep(worked * (1 - share) / share)
        return self.work_clock()

    def _write_whole(self, slices, offset: int) -> None:
        """Write the table file, then remove the journal (a worker thread's part of a save): the
        next chunk starts a new file, never one whose fsync may have failed. The old chunks name
        the file replaced, so none is applied to the new one whether or not the removal reaches
        the disk: it needs no fsync."""
        self._base_id = DedupeTable.write(self.path, slices, offset)
        self._base_bytes = self.path.stat().st_size
        self.journal_bytes = 0
        self.journal_path.unlink(missing_ok=True)
