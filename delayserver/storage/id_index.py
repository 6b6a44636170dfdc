"""Per-bucket indexes: what `status` and `cancel` read instead of a whole bucket.

- `IdIndex` (over schedule_log): per bucket, the offset of every SCHEDULED and SCHEDULED_CANCEL
  record under a 24-bit hash of its (schedule_time, message id), packed in one 64-bit key
  ``hash << 40 | offset``: 8 bytes per record. A lookup bisects the sorted runs for the hash and
  reads the few records it names (the real one, plus on average n / 2**24 false candidates) to
  compare their keys: O(log n) and a read or two, never a scan.
- `DispatchIndex` (over dispatch_log): per bucket, schedule offset -> position of its dispatch
  records, 16 bytes per dispatch record.

Both follow their log through `BucketLog.listeners`: an append at the indexed end of a bucket is
indexed at once (the id index and the time index, storage/time_index.py, take each record's type,
time and id from the replayer, which has them in hand; otherwise the records are parsed from the
bytes just written), a truncation drops what it cut. A bucket present when the node starts is
indexed from its segment in slices (`build_step`, driven by `serve`, and `ensure` for a lookup
that cannot wait): the node starts at once, and the index never holds the event loop for longer
than one slice.

The id index is also saved, per bucket, in a worker thread each time a bucket has grown by
`SAVE_EVERY` records: a sorted file `DATA_DIR/index/<bucket>.idx` (a header with the segment offset
it covers, a crc and a random id, then the keys), and after it a journal `<bucket>.idj` of chunks,
each the sorted keys of the records appended since the save before, naming the file's id and the
segment range it covers. A save appends a chunk (the keys indexed since the save before, kept aside
as they are indexed); it writes the file whole (and starts a new journal) only when the journal
holds as many keys as the file, or after a truncation or a failed append. So each key is written
about three times at most, however big the bucket grows; a save used to write the whole bucket's
keys, 80 MB and half a second of CPU every 65,536 records in a bucket of 10,000,000. At start a
bucket's saved keys are read back in one go (the file, then the chunks that chain onto it, each a
sorted run of its own, merged in the background like any other) and only the segment past what
they cover is parsed, so a restart costs a read of 8 bytes per record, not a parse of the segment. A saved index covering more than
the segment holds (the segment was truncated back to the replay checkpoint) loses the keys past
the segment's end; a damaged or unreadable file is ignored (the bucket is indexed from its
segment), and a journal is read up to its first chunk that is damaged, cut short or not of its file.

Keys live in `SortedRuns`: an unsorted tail of a few hundred keys, then sorted numpy runs merged
geometrically (each run at least twice the size of the next), so a bucket of n records has
O(log n) runs. Merges of small runs happen inline (well under a millisecond); bigger ones are
computed in a worker thread by `serve` and swapped in on the trio thread.
"""
from __future__ import annotations

import logging
import os
import struct
import time
from array import array
from pathlib import Path
from typing import Callable

import attrs
import numpy as np
import trio
from crc32c import crc32c

from delayserver.storage.record import (
    HEADER as RECORD_HEADER, HEADER_SIZE as RECORD_HEADER_SIZE, SCHEDULED_CANCEL_HEAD, SCHEDULED_HEAD, RecordError,
    RecordType, dispatch_schedule_offset, iter_checked_records, iter_records, record_size,
)
from delayserver.storage.errors import CorruptSegment
from delayserver.storage.writeback import write_file_paced

try:  # the compiled key making (delayserver/native/records.pyx), when the install built it
    from delayserver.native.records import id_keys as _native_id_keys
except ImportError:
    _native_id_keys = None

log = logging.getLogger("delayserver.storage")

OFFSET_BITS = 40
OFFSET_MASK = (1 << OFFSET_BITS) - 1
HASH_BITS = 24
HASH_MASK = (1 << HASH_BITS) - 1
#: Keys kept unsorted before they are sealed into a run.
TAIL_KEYS = 512
#: Tails up to this many keys are searched key by key; longer ones in numpy.
TAIL_SCAN_KEYS = 64
#: Merges up to this many keys are done inline; bigger ones in a worker thread.
INLINE_MERGE_KEYS = 1 << 16
#: Bytes of segment parsed per build slice (about a millisecond of parsing).
BUILD_SLICE_BYTES = 64 << 10
#: Bytes of segment a worker thread reads at once for the build (what is not in the page cache):
#: indexed a slice at a time from memory, so that the thread's hop is paid once per 16 slices.
BUILD_READ_BYTES = 1 << 20
_EMPTY = np.empty(0, dtype=np.uint64)
#: A bucket's id index is saved again once it holds this many more records than its saved file.
SAVE_EVERY = 1 << 16
# magic, covered offset, key count, crc32c of the keys, crc32c of the segment's first bytes (a
# saved file outliving its segment never passes for the index of a new segment of that bucket).
_SAVED_HEAD = struct.Struct(">8sQQII")
_FINGERPRINT_BYTES = 64
_SAVED_MAGIC = b"DSIDX\x00\x00\x01"
# Version 2 adds a random id after the version 1 head, which the journal's chunks name.
_SAVED_ID = struct.Struct(">Q")
_SAVED_MAGIC_2 = b"DSIDX\x00\x00\x02"
# A journal chunk: magic, the file's id, the segment range [from, to) its keys cover, key count,
# crc32c of these fields and the keys; then the keys, sorted.
_CHUNK = struct.Struct(">8sQQQQI")
_CHUNK_MAGIC = b"DSIDJ\x00\x00\x01"


def key_hash(schedule_time: int, message_id: bytes) -> int:
    """The 24-bit hash of a message key (stable across processes)."""
    return (crc32c(message_id, schedule_time & 0xFFFFFFFF) ^ (schedule_time >> 32)) & HASH_MASK


def _id_keys(ids: list, pos: int) -> list[int]:
    """The keys of the records an append at `pos` added, from their ids as `BucketLog.append` takes
    them (the compiled `delayserver.native.records.id_keys`'s reference)."""
    return [key_hash(sched, mid) << OFFSET_BITS | (pos + at) for at, _, sched, mid in ids]


def _write_saved(path: Path, runs, covered: int, head: int, saved_id: int | None = None) -> int:
    """Write the sorted keys of `runs` to `path` atomically (temp file, fsync, rename), with the
    id `saved_id` (random when None), and remove the journal of the file it replaces."""
    keys = _merge(runs)[0] if runs else _EMPTY
    body = keys.astype(">u8").tobytes()
    tmp = path.with_suffix(".idx.tmp")
    write_file_paced(tmp, (_SAVED_HEAD.pack(_SAVED_MAGIC_2, covered, len(keys), crc32c(body), head),
                           _SAVED_ID.pack(int.from_bytes(os.urandom(8), "big") if saved_id is None else saved_id),
                           body))
    os.replace(tmp, path)
    # Its chunks name the old file's id: left behind by a crash here, they are never read.
    path.with_suffix(".idj").unlink(missing_ok=True)
    return len(keys)


def _append_chunk(path: Path, added, saved_id: int, start: int, covered: int) -> int:
    """Append to the journal `path` one chunk: the keys `added` (those of the records in [start,
    covered)), sorted; fsynced. Returns how many."""
    keys = np.sort(np.frombuffer(added, dtype=np.uint64)) if len(added) else _EMPTY
    body = keys.astype(">u8").tobytes()
    fields = _CHUNK.pack(_CHUNK_MAGIC, saved_id, start, covered, len(keys), 0)[:-4]
    write_file_paced(path, (fields + struct.pack(">I", crc32c(body, crc32c(fields))), body), append=True)
    return len(keys)


def _read_keys_file(path: Path):
    """(magic, covered, count, crc, fingerprint, file id or None, keys) of a saved file whose head
    is sound, the keys read into their array as saved (big-endian bytes, not yet checked against
    the crc); None when the head is not sound or the file does not hold `count` keys. One copy of
    the keys from the page cache: tens of MB at millions of messages."""
    with open(path, "rb") as f:
        raw = f.read(_SAVED_HEAD.size + _SAVED_ID.size)
        if len(raw) < _SAVED_HEAD.size:
            return None
        magic, covered, count, crc, head = _SAVED_HEAD.unpack_from(raw, 0)
        if magic not in (_SAVED_MAGIC, _SAVED_MAGIC_2):
            return None
        saved_id = None
        at = _SAVED_HEAD.size
        if magic == _SAVED_MAGIC_2:
            if len(raw) < at + _SAVED_ID.size:
                return None
            (saved_id,) = _SAVED_ID.unpack_from(raw, at)
            at += _SAVED_ID.size
        if os.fstat(f.fileno()).st_size != at + 8 * count:
            return None
        f.seek(at)
        keys = np.fromfile(f, dtype=np.uint64, count=count)
        if len(keys) != count:
            return None
    return magic, covered, count, crc, head, saved_id, keys


def _read_chunks(raw: bytes, saved_id: int, covered: int) -> tuple[list[np.ndarray], int, bool]:
    """The keys of the journal's chunks that chain onto a file of id `saved_id` covering up to
    `covered`, what they cover, and whether that was all of it; reading stops at the first chunk
    that does not chain (a torn or damaged one, or one of another file)."""
    chunks, pos = [], 0
    while pos + _CHUNK.size <= len(raw):
        magic, cid, start, end, count, crc = _CHUNK.unpack_from(raw, pos)
        body_end = pos + _CHUNK.size + 8 * count
        if magic != _CHUNK_MAGIC or cid != saved_id or start != covered or end < start or body_end > len(raw):
            break
        body = memoryview(raw)[pos + _CHUNK.size:body_end]
        if crc32c(body, crc32c(memoryview(raw)[pos:pos + _CHUNK.size - 4])) != crc:
            break
        if count:
            chunks.append(np.frombuffer(body, dtype=">u8").astype(np.uint64))
        covered, pos = end, body_end
    return chunks, covered, pos == len(raw)


def _merge(runs: list[tuple[np.ndarray, np.ndarray | None]]) -> tuple[np.ndarray, np.ndarray | None]:
    """One sorted run from several (stable: equal keys keep their order, older runs first)."""
    keys = np.concatenate([k for k, _ in runs])
    if runs[0][1] is None:
        keys.sort(kind="stable")
        return keys, None
    vals = np.concatenate([v for _, v in runs])
    order = np.argsort(keys, kind="stable")
    return keys[order], vals[order]


class SortedRuns:
    """A multiset of uint64 keys, each with an optional uint64 value, answering range queries.

    Values, when used, are kept beside their keys; equal keys come out in insertion order.
    """

    def __init__(self, with_values: bool = False):
        self.with_values = with_values
        self._tail_keys = array("Q")
        self._tail_vals = array("Q") if with_values else None
        self.runs: list[tuple[np.ndarray, np.ndarray | None]] = []
        self.version = 0  # bumped by anything but an append: an async merge result is then stale

    def __len__(self) -> int:
        return len(self._tail_keys) + sum(len(k) for k, _ in self.runs)

    @property
    def nbytes(self) -> int:
        tail = self._tail_keys.itemsize * self._tail_keys.buffer_info()[1]
        if self._tail_vals is not None:
            tail *= 2
        return tail + sum(k.nbytes + (0 if v is None else v.nbytes) for k, v in self.runs)

    def add(self, key: int, value: int = 0) -> None:
        self._tail_keys.append(key)
        if self._tail_vals is not None:
            self._tail_vals.append(value)
        if len(self._tail_keys) >= TAIL_KEYS:
            self.seal()

    def extend(self, keys) -> None:
        """`add` of each of `keys`, a list or an array "Q" (an index without values)."""
        self._tail_keys.extend(keys)
        if len(self._tail_keys) >= TAIL_KEYS:
            self.seal()

    def extend_pairs(self, keys, values) -> None:
        """`add` of each of `keys` (a list or an array "Q") with its value (an index with values)."""
        self._tail_keys.extend(keys)
        self._tail_vals.extend(values)
        if len(self._tail_keys) >= TAIL_KEYS:
            self.seal()

    def seal(self) -> None:
        """Turn the tail into a sorted run, merging small runs inline."""
        if not self._tail_keys:
            return
        keys = np.array(self._tail_keys, dtype=np.uint64)
        vals = np.array(self._tail_vals, dtype=np.uint64) if self._tail_vals is not None else None
        self._tail_keys = array("Q")
        if vals is not None:
            self._tail_vals = array("Q")
        self.runs.append(_merge([(keys, vals)]))
        i = self.merge_start(INLINE_MERGE_KEYS)
        if i is not None:
            self.runs[i:] = [_merge(self.runs[i:])]

    def merge_start(self, limit: int | None = None) -> int | None:
        """The first run of the suffix due for merging (each run must be over twice the size of
        all the runs after it), or None; with `limit`, only a suffix of at most `limit` keys."""
        runs = self.runs
        total = 0
        start = None
        for i in range(len(runs) - 1, 0, -1):
            total += len(runs[i][0])
            if len(runs[i - 1][0]) <= 2 * total:
                if limit is not None and total + len(runs[i - 1][0]) > limit:
                    break
                start = i - 1
                total += len(runs[i - 1][0])
        return start

    def find(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """``(key, value)`` of every key in ``[lo, hi)``: older entries first for equal keys."""
        out: list[tuple[int, int]] = []
        # numpy scalars of the runs' type: a Python int would make searchsorted convert the run.
        bounds = np.array([lo, min(hi, (1 << 64) - 1)], dtype=np.uint64)
        for keys, vals in self.runs:
            i, j = keys.searchsorted(bounds).tolist()
            for x in range(i, j):
                out.append((int(keys[x]), 0 if vals is None else int(vals[x])))
        tail, tv = self._tail_keys, self._tail_vals
        if len(tail) <= TAIL_SCAN_KEYS:
            hits = [x for x, key in enumerate(tail) if lo <= key < hi]
        else:  # compared in numpy over the tail's own buffer (a 512-key loop took 30 us)
            view = np.frombuffer(tail, dtype=np.uint64)
            inside = view >= bounds[0]
            if hi < 1 << 64:
                inside &= view < bounds[1]
            del view  # the array may not grow while a view of its buffer lives
            hits = np.flatnonzero(inside).tolist()
        for x in hits:
            out.append((tail[x], 0 if tv is None else tv[x]))
        return out

    def drop_where(self, keep) -> None:
        """Keep only entries for which the vectorised predicate `keep(keys, vals)` holds."""
        self.seal()
        kept = []
        for keys, vals in self.runs:
            mask = keep(keys, vals)
            if not mask.all():
                keys, vals = keys[mask], (None if vals is None else vals[mask])
            if len(keys):
                kept.append((keys, vals))
        self.runs = kept
        self.version += 1

    async def compact(self) -> bool:
        """Do one merge too big for the event loop in a worker thread; True if one was due."""
        i = self.merge_start()
        if i is None:
            return False
        picked = self.runs[i:]
        version = self.version
        merged = await trio.to_thread.run_sync(_merge, picked)
        # The same run objects still in place (compared by identity: `==` would compare the numpy
        # arrays inside, and raise for runs an inline merge replaced meanwhile).
        current = self.runs[i : i + len(picked)]
        if self.version == version and len(current) == len(picked) and all(a is b for a, b in zip(current, picked)):
            self.runs[i : i + len(picked)] = [merged]
        return True


class _Bucket:
    __slots__ = ("covered", "cuts", "ahead", "reading", "runs", "saved", "saved_id", "saved_covered", "saved_base",
                 "saved_version", "unsaved", "collecting")

    def __init__(self, with_values: bool):
        self.covered = 0  # the segment is indexed from 0 up to here
        self.cuts = 0  # truncations of the segment seen (a slice read before one is stale)
        self.ahead = None  # (start, cuts, bytes) read from disk in a worker thread, not indexed yet
        self.reading = None  # a trio.Event while a worker thread reads for this bucket
        self.runs = SortedRuns(with_values)
        self.saved = 0  # keys saved, in the file and its journal
        self.saved_id = None  # the saved file's id: None, none that a chunk may follow
        self.saved_covered = 0  # what the file and its journal cover
        self.saved_base = 0  # keys in the file
        self.saved_version = 0  # runs.version when saved (a truncation since: write whole)
        self.unsaved = array("Q")  # keys indexed since the last save, while collecting
        self.collecting = False  # the next save may append a chunk, or a save is under way


@attrs.frozen
class SliceRead:
    """A slice of a segment `build_slice` left to a worker thread: `read()` returns its bytes."""
    index: "_LogIndex"
    bucket: int
    owner: _Bucket  # the bucket's entry when it was asked for (a new one after a removal)
    start: int
    cuts: int
    read: Callable[[], bytes]


class _LogIndex:
    """What both indexes share: following a BucketLog, building buckets from their segments."""

    with_values = False

    def __init__(self, bucket_log):
        self.log = bucket_log
        self.buckets: dict[int, _Bucket] = {}
        for bucket in bucket_log.buckets():
            self.buckets[bucket] = _Bucket(self.with_values)
        bucket_log.listeners.append(self)

    # --- following the log --------------------------------------------------------------------

    def appended(self, bucket: int, pos: int, data, ids: list | None = None) -> None:
        """`data` was appended at `pos`; `ids` as `BucketLog.append` takes them, or None."""
        b = self.buckets.get(bucket)
        if b is None:
            b = self.buckets[bucket] = _Bucket(self.with_values)
        if pos != b.covered:
            return  # an older part is not indexed yet: the build reads this too, from the segment
        if ids is not None and self._add_ids(b, pos, ids, data):
            b.covered = pos + len(data)
            return
        self._index(bucket, b, data, pos, checked=True)

    def _add_ids(self, b: _Bucket, pos: int, ids: list, data) -> bool:
        """Index the records of an append from their ids; False when this index needs the records."""
        return False

    def truncated(self, bucket: int, size: int) -> None:
        b = self.buckets.get(bucket)
        if b is None:
            return
        b.cuts += 1
        if b.covered <= size:
            return
        self._drop_from(b, size)
        b.covered = size

    def removed(self, bucket: int) -> None:
        self.buckets.pop(bucket, None)

    # --- building -----------------------------------------------------------------------------

    def unbuilt(self) -> list[int]:
        return [bucket for bucket, b in self.buckets.items() if b.covered < self.log.size(bucket)]

    def build_slice(self, bucket: int, max_bytes: int = BUILD_SLICE_BYTES, *, cached_only: bool = False):
        """Index one slice of the bucket's segment; True while more is left.

        With `cached_only` a slice is not read on the calling (event loop's) thread unless it is in
        the page cache, or among the bytes a worker thread has read for the build: otherwise the
        answer is a SliceRead, which `read_slice` reads in a worker thread, and the next call
        indexes (`build_slice_async` does both). Raises CorruptSegment on damage (nothing past it
        is indexed)."""
        b = self.buckets.get(bucket)
        if b is None:  # (not setdefault: a status or cancel calls this, and a _Bucket is not free)
            b = self.buckets[bucket] = _Bucket(self.with_values)
        size = self.log.size(bucket)
        if b.covered >= size:
            return False
        if b.ahead is not None:
            start, cuts, data = b.ahead
            b.ahead = None
            if start == b.covered and cuts == b.cuts:  # (else cut back, or grown here, since it was read)
                return self._index_slice(bucket, b, start, data, max_bytes, cached_only, keep=True)
        return self._read_slice(bucket, b, b.covered, min(size, b.covered + max_bytes), cached_only)

    def _read_slice(self, bucket: int, b: _Bucket, start: int, end: int, cached_only: bool):
        if cached_only:
            data = self.log.read_cached(bucket, start, end)
            if data is None:
                far = min(self.log.size(bucket), max(end, start + BUILD_READ_BYTES))
                return SliceRead(self, bucket, b, start, b.cuts, self.log.range_reader(bucket, start, far))
        else:
            data = self.log.read(bucket, start, end)
        return self._index_slice(bucket, b, start, data, len(data), cached_only, keep=False)

    def _index_slice(self, bucket: int, b: _Bucket, start: int, data, max_bytes: int, cached_only: bool, *,
                     keep: bool):
        """Index the whole records of `data` (read at `start`) in its first `max_bytes`, or its
        first record when that one is longer; with `keep`, what is left of `data` is kept for the
        next slice."""
        consumed = self._index(bucket, b, data[:max_bytes], start, checked=False)
        if consumed == 0 and len(data) > max_bytes:  # one record bigger than a slice: that record alone
            consumed = self._index(bucket, b, data[: record_size(data, 0)], start, checked=False)
        size = self.log.size(bucket)
        if consumed == 0:  # one record bigger than what was read, or cut short by the segment's end
            need = record_size(data, 0) if len(data) >= RECORD_HEADER_SIZE else len(data) + 1
            if len(data) >= need or start + len(data) >= size:
                raise CorruptSegment(self.log.path(bucket), start, "record cut short before the end")
            return self._read_slice(bucket, b, start, min(size, start + need), cached_only)
        if keep and consumed < len(data):
            b.ahead = (start + consumed, b.cuts, data[consumed:])
        return b.covered < size

    async def read_slice(self, step: "SliceRead") -> None:
        """Read `step` in a worker thread and keep the bytes for the bucket's next `build_slice`;
        while another caller's read for the bucket is under way, wait for that one instead. Bytes
        the segment no longer holds as they were read (cut back since, or the bucket removed) are
        dropped: the next `build_slice` reads again, or finds nothing left to index."""
        b = step.owner
        if b.reading is not None:
            await b.reading.wait()
            return
        b.reading = done = trio.Event()
        try:
            data = await trio.to_thread.run_sync(step.read)
        except FileNotFoundError:
            if step.bucket in self.log.sizes:
                raise
            return  # the cleaner removed the bucket meanwhile
        finally:
            b.reading = None
            done.set()
        if self.buckets.get(step.bucket) is b and b.cuts == step.cuts and b.covered == step.start:
            b.ahead = (step.start, step.cuts, memoryview(data))

    async def build_slice_async(self, bucket: int, max_bytes: int = BUILD_SLICE_BYTES) -> bool:
        """`build_slice`, reading from the page cache on the event loop and what is not in memory
        in a worker thread; True while more is left."""
        while True:
            step = self.build_slice(bucket, max_bytes, cached_only=True)
            if type(step) is not SliceRead:
                return step
            await self.read_slice(step)

    async def ensure(self, bucket: int) -> None:
        """Return once the bucket's index covers its whole segment (built in slices meanwhile)."""
        while await self.build_slice_async(bucket):
            await trio.lowlevel.checkpoint()

    async def serve(self, *, slice_s: float = 0.001, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Build what the node started with, then keep the runs merged; never more than a slice
        of work at a time on the event loop."""
        task_status.started()
        started = time.monotonic()
        pending = self.unbuilt()
        for bucket in pending:
            try:
                while await self.build_slice_async(bucket):
                    await trio.lowlevel.checkpoint()
            except CorruptSegment as e:
                # A torn tail the loader truncates before it loads the bucket, or damage the
                # operator must see: a lookup in this bucket builds on from here, or reports it.
                log.warning("%s: not indexed past %s", type(self).__name__, e)
        if pending:
            log.info("%s: %d buckets indexed in %.2f s", type(self).__name__, len(pending),
                     time.monotonic() - started)
        while True:
            worked = False
            for b in list(self.buckets.values()):
                worked |= await b.runs.compact()
            worked |= bool(await self.save())
            await trio.sleep(0.05 if worked else 1.0)

    async def save(self, every: int = SAVE_EVERY) -> int:
        """Save what has grown (only the id index is saved); returns how many buckets were."""
        return 0

    def _index(self, bucket: int, b: _Bucket, data, start: int, *, checked: bool) -> int:
        consumed = 0
        walk = iter_checked_records if checked else iter_records
        try:
            for pos, rtype, s, e in walk(data):
                self._add(b, rtype, data, s, e, start + pos)
                consumed = e
        except RecordError as err:
            b.covered = start + consumed
            raise CorruptSegment(self.log.path(bucket), start + err.offset, err.reason) from None
        b.covered = start + consumed
        return consumed

    def nbytes(self) -> int:
        return sum(b.runs.nbytes for b in self.buckets.values())

    def entries(self) -> int:
        return sum(len(b.runs) for b in self.buckets.values())


class IdIndex(_LogIndex):
    """(schedule_time, message id) -> offsets of its SCHEDULED and SCHEDULED_CANCEL records.

    With `directory`, saved there per bucket and read back at start (module docstring)."""

    def __init__(self, bucket_log, directory: Path | None = None):
        super().__init__(bucket_log)
        self.directory = None if directory is None else Path(directory)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            for bucket, b in self.buckets.items():
                self._read_saved(bucket, b)

    def _saved_path(self, bucket: int) -> Path:
        from delayserver.storage.buckets import bucket_name

        return self.directory / (bucket_name(bucket) + ".idx")

    def _read_saved(self, bucket: int, b: _Bucket) -> None:
        path = self._saved_path(bucket)
        try:
            saved_file = _read_keys_file(path)
        except FileNotFoundError:
            return
        except OSError as e:
            log.warning("%s: not read (%s); the bucket is indexed from its segment", path, e)
            return
        if saved_file is not None:
            magic, covered, count, crc, head, saved_id, keys = saved_file
            if crc32c(keys) == crc and head == self._fingerprint(bucket):
                keys.byteswap(inplace=True)  # read as saved (big-endian), checked, then made native
                runs = [(keys, None)] if count else []
                saved = count
                if magic == _SAVED_MAGIC_2:
                    b.saved_id = saved_id
                    b.saved_base = count
                    chunks, covered, whole = _read_chunks(self._read_journal(bucket), b.saved_id, covered)
                    runs += [(k, None) for k in chunks]
                    saved += sum(len(k) for k in chunks)
                    if not whole:  # a chunk appended after what was not read would never be read
                        b.saved_id = None
                    b.collecting = b.saved_id is not None
                b.runs.runs = runs
                b.covered = b.saved_covered = covered
                b.saved = saved
                size = self.log.size(bucket)
                if covered > size:
                    self.truncated(bucket, size)
                return
        log.warning("%s: damaged; the bucket is indexed from its segment", path)

    def _read_journal(self, bucket: int) -> bytes:
        path = self._saved_path(bucket).with_suffix(".idj")
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return b""
        except OSError as e:
            log.warning("%s: not read (%s); the bucket is indexed from its segment past the file", path, e)
            return b""

    def _fingerprint(self, bucket: int) -> int:
        return crc32c(self.log.read(bucket, 0, _FINGERPRINT_BYTES))

    async def save(self, every: int = SAVE_EVERY) -> int:
        """Save, in a worker thread, each bucket grown by `every` records since its last save;
        returns how many were saved. Raises nothing for a failed write (logged, tried again later)."""
        if self.directory is None:
            return 0
        saved = 0
        for bucket, b in list(self.buckets.items()):
            if len(b.runs) - b.saved < every or b.covered < self.log.size(bucket):
                continue
            b.runs.seal()
            runs, covered, version = list(b.runs.runs), b.covered, b.runs.version
            added, b.unsaved = b.unsaved, array("Q")
            b.collecting = True  # what is indexed while this save runs goes to the next one
            path = self._saved_path(bucket)
            whole = (b.saved_id is None or version != b.saved_version
                     or b.saved - b.saved_base >= b.saved_base)
            try:
                if whole:
                    saved_id = int.from_bytes(os.urandom(8), "big")
                    count = await trio.to_thread.run_sync(_write_saved, path, runs, covered,
                                                          self._fingerprint(bucket), saved_id)
                else:
                    count = await trio.to_thread.run_sync(_append_chunk, path.with_suffix(".idj"), added,
                                                          b.saved_id, b.saved_covered, covered)
            except OSError as e:
                log.warning("%s: not saved (%s); will try again", path, e)
                # A chunk may be half written: the next save writes the file whole.
                b.saved_id, b.collecting = None, False
                b.unsaved = array("Q")
                continue
            if self.buckets.get(bucket) is not b:  # removed meanwhile
                path.unlink(missing_ok=True)
                path.with_suffix(".idj").unlink(missing_ok=True)
                continue
            if whole:
                b.saved_id, b.saved_base, b.saved = saved_id, count, count
            else:
                b.saved += count
            b.saved_covered, b.saved_version = covered, version
            saved += 1
        return saved

    def removed(self, bucket: int) -> None:
        super().removed(bucket)
        if self.directory is not None:
            self._saved_path(bucket).unlink(missing_ok=True)
            self._saved_path(bucket).with_suffix(".idj").unlink(missing_ok=True)

    def _add(self, b: _Bucket, rtype: int, data, s: int, e: int, offset: int) -> None:
        if rtype == RecordType.SCHEDULED:
            head = SCHEDULED_HEAD.unpack_from(data, s)
            sched, idlen = head[2], head[5]
            at = s + SCHEDULED_HEAD.size
        elif rtype == RecordType.SCHEDULED_CANCEL:
            _, _, sched, _, idlen = SCHEDULED_CANCEL_HEAD.unpack_from(data, s)
            at = s + SCHEDULED_CANCEL_HEAD.size
        else:
            return
        self._keep(b, key_hash(sched, bytes(data[at : min(at + idlen, e)])) << OFFSET_BITS | offset)

    def _add_ids(self, b: _Bucket, pos: int, ids: list, data) -> bool:
        keys = _native_id_keys(ids, pos) if _native_id_keys is not None else None
        self._keep_all(b, _id_keys(ids, pos) if keys is None else keys)
        return True

    @staticmethod
    def _keep(b: _Bucket, key: int) -> None:
        """Index `key`, and keep it aside for the next save's chunk when the bucket collects."""
        b.runs.add(key)
        if b.collecting:
            b.unsaved.append(key)

    @staticmethod
    def _keep_all(b: _Bucket, keys) -> None:
        """`_keep` of each of `keys` (a list, or the compiled kernels' array "Q"), in one call."""
        b.runs.extend(keys)
        if b.collecting:
            b.unsaved.extend(keys)

    def _drop_from(self, b: _Bucket, size: int) -> None:
        b.runs.drop_where(lambda keys, vals: (keys & np.uint64(OFFSET_MASK)) < np.uint64(size))

    def candidates(self, bucket: int, schedule_time: int, message_id: str) -> list[int]:
        """Offsets of records that may carry this key, in offset order (read them to be sure)."""
        b = self.buckets.get(bucket)
        if b is None:
            return []
        h = key_hash(schedule_time, message_id.encode("utf-8"))
        return sorted(k & OFFSET_MASK for k, _ in b.runs.find(h << OFFSET_BITS, (h + 1) << OFFSET_BITS))


class DispatchIndex(_LogIndex):
    """schedule offset -> positions of its dispatch records in the bucket's dispatch_log."""

    with_values = True

    def _add(self, b: _Bucket, rtype: int, data, s: int, e: int, offset: int) -> None:
        if rtype == RecordType.DISPATCH:
            b.runs.add(dispatch_schedule_offset(data, s), offset)

    def _add_ids(self, b: _Bucket, pos: int, ids: list, data) -> bool:
        """The dispatch records of an append as the sender names them (`BucketLog.append`: their
        schedule offsets, a list or an array "Q", the records all of one length): indexed without
        parsing them again."""
        n = len(ids)
        size = len(data) // n if n else 0
        if not n or size * n != len(data) or size < RECORD_HEADER_SIZE:
            return False
        _, length, rtype = RECORD_HEADER.unpack_from(data, 0)
        if rtype != RecordType.DISPATCH or RECORD_HEADER_SIZE + length != size:
            return False  # not one record per offset
        b.runs.extend_pairs(ids, range(pos, pos + len(data), size))
        return True

    def _drop_from(self, b: _Bucket, size: int) -> None:
        b.runs.drop_where(lambda keys, vals: vals < np.uint64(size))

    def first(self, bucket: int, schedule_offset: int) -> int | None:
        """Position of the first dispatch record of that schedule offset, or None."""
        b = self.buckets.get(bucket)
        if b is None:
            return None
        found = b.runs.find(schedule_offset, schedule_offset + 1)
        return min(v for _, v in found) if found else None

    def offsets(self, bucket: int) -> np.ndarray:
        """Every dispatched schedule offset of the bucket (sorted, may repeat)."""
        b = self.buckets.get(bucket)
        if b is None:
            return _EMPTY
        b.runs.seal()
        if not b.runs.runs:
            return _EMPTY
        return np.sort(np.concatenate([k for k, _ in b.runs.runs]))
