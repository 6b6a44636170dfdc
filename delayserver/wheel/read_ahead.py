"""The records of messages about to fall due, read into memory ahead of time by a worker thread.

Delivering a message means reading its record from its schedule_log segment on the event loop
(page cache only, `TickManager.read_messages`). For messages that arrived in random order of
their due time those records lie anywhere in a segment of hundreds of megabytes, one read each:
at 40,000 msg/s falling due (`ops/bench deliver --transports spool --rate 40000`) the reading
kernel took 2.1 s of the event loop for the 400,000 records, 5.3 us each (1.7 us in a loop of
its own, dearer while the other core runs the fsyncs of the spool and dispatch_log), and a fifth
of the loop's samples (py-spy).

So `prefetch_due` (prefetch.py), which looks ahead every 100 ms at what falls due within the next
second, has a worker thread read those records (`read_ahead`, all of its reads with the
interpreter's lock released) and keeps their bytes here, per bucket and offset, up to
`max_bytes`: the event loop then decodes a due message from memory. What is over the budget is
only advised to the kernel (posix_fadvise), as before.

The bytes are not trusted further than the file: they are checked (crc, layout) where they are
decoded, and a record that does not check is read again from its segment, where damage is met and
reported. A record is taken out when it is read for delivery. The bucket's records are forgotten
when its segment is truncated or removed (`BucketLog.listeners`), everything when the tick manager
is reset, and a worker's read that began before any of these is dropped (`epoch`). Records that
nothing takes (a bucket whose messages were all moved elsewhere) go once their bucket is over.
"""
from __future__ import annotations

import itertools
import os

from delayserver.storage.record import HEADER, HEADER_SIZE

try:
    from delayserver.native.records import HeldRecords, SegmentMap
    from delayserver.native.records import ahead_put as _native_put
    from delayserver.native.records import ahead_take as _native_take
    from delayserver.native.records import read_ahead as _native_read_ahead
except ImportError:  # not built: the references below, and a dict per bucket
    _native_read_ahead = _native_take = _native_put = SegmentMap = None
    HeldRecords = dict

#: The most the records read ahead may hold at once (bytes of records; `read_ahead_bytes`).
MAX_BYTES = 64 << 20
#: Read ahead what falls due within this long (`read_ahead`; prefetch.py does the reading).
HORIZON_MS = 1000
#: A record bigger than this is not read ahead (read when due, as any other).
MAX_RECORD_BYTES = 64 << 10
#: The first read of a record read ahead: most records are smaller.
FIRST_READ_BYTES = 512


def _read_ahead_py(fd: int, size: int, offsets: list[int], first_read: int, max_record: int) -> dict[int, bytes]:
    """The reference of `records.read_ahead`: {offset: the record's bytes as the file holds them
    (header included, not checked)}, an offset left out where the length there runs past `size`
    or over `max_record`, or a read fails."""
    out: dict[int, bytes] = {}
    for offset in offsets:
        try:
            head = os.pread(fd, max(0, min(first_read, size - offset)), offset)
            if len(head) < HEADER_SIZE:
                continue
            length = HEADER_SIZE + HEADER.unpack_from(head)[1]
            if length > max_record or offset + length > size:
                continue
            data = head[:length] if length <= len(head) else os.pread(fd, length, offset)
            if len(data) == length:
                out[offset] = data
        except OSError:
            continue
    return out


def read_records(fd: int, size: int, offsets: list[int], first_read: int = FIRST_READ_BYTES,
                 max_record: int = MAX_RECORD_BYTES, mapped=None) -> dict[int, bytes]:
    """{offset: the record's bytes} (see `_read_ahead_py`): the compiled kernel where it is
    built, the reference otherwise or for input it leaves to it. `mapped`: a `SegmentMap` of the
    file to copy from rather than read (only while the file cannot be truncated: prefetch.py)."""
    if _native_read_ahead is not None:
        got = _native_read_ahead(fd, size, offsets, first_read, max_record, mapped=mapped)
        if got is not None:
            return got
    return _read_ahead_py(fd, size, offsets, first_read, max_record)


def _keep_py(held: dict[int, bytes], records: dict[int, bytes], room: int) -> tuple[int, int]:
    """The reference of `records.ahead_put`: each of `records` not in `held` yet put there, in
    order, while their bytes fit in `room` (the first that does not fit ends it); returns how many
    were kept and their bytes."""
    kept = added = 0
    for offset, data in records.items():
        if offset in held:
            continue
        if added + len(data) > room:
            break
        held[offset] = data
        added += len(data)
        kept += 1
    return kept, added


def _take_py(held: dict[int, bytes], offsets: list[int]) -> tuple[list, int, int]:
    """The reference of `records.ahead_take`: per offset the bytes `held` has for it (taken out) or
    None, how many were found, and their bytes."""
    got = list(map(held.pop, offsets, itertools.repeat(None, len(offsets))))
    found = len(got) - got.count(None)
    return got, found, sum(map(len, filter(None, got))) if found else 0


class ReadAhead:
    """Records read ahead, per bucket and offset (a `BucketLog` listener of schedule_log)."""

    def __init__(self, max_bytes: int = MAX_BYTES):
        self.max_bytes = max_bytes
        # Per bucket, {offset: bytes}: a compiled `HeldRecords` where the install built it (no key
        # object per record: the loop's take of a record put there a second earlier touched three
        # cold places in a dict), a dict otherwise.
        self.records: dict[int, dict[int, bytes]] = {}
        self.held_bytes = 0
        # Bumped whenever what is held may no longer be what the segments hold: a worker's read
        # that began before is dropped (`put`).
        self.epoch = 0
        self.hits = 0  # records handed out (read for delivery from here)

    @property
    def room(self) -> int:
        return max(0, self.max_bytes - self.held_bytes)

    def put(self, bucket: int, records: dict[int, bytes], epoch: int) -> int:
        """Keep what a worker read ({offset: bytes}) if nothing changed since it began (`epoch`),
        within the budget; returns how many records were kept: those not held already (each is
        asked for once, mostly), the first ones while they fit. The compiled kernel
        (`records.ahead_put`, into a `HeldRecords`) where it is built, `_keep_py` (into a dict)
        otherwise."""
        if epoch != self.epoch or not records:
            return 0
        keep, table = (_keep_py, dict) if _native_put is None else (_native_put, HeldRecords)
        held = self.records.get(bucket)
        if held is None:
            held = self.records[bucket] = table()
        kept, added = keep(held, records, self.max_bytes - self.held_bytes)
        if not held:
            del self.records[bucket]
        self.held_bytes += added
        return kept

    def take(self, bucket: int, offsets: list[int]) -> list | None:
        """Per offset, the bytes held for it (taken out), or None; None when the bucket has none.
        The compiled kernel (`records.ahead_take`) where it is built, `_take_py` otherwise."""
        held = self.records.get(bucket)
        if held is None:
            return None
        got, found, freed = (_native_take if _native_take is not None else _take_py)(held, offsets)
        if found:
            self.hits += found
            self.held_bytes -= freed
            if not held:
                self._drop(bucket)
        return got

    def forget_before(self, bucket_end_before: int, scale_ms: int) -> None:
        """Forget the buckets whose time range ended before `bucket_end_before` (epoch ms)."""
        for bucket in [b for b in self.records if b + scale_ms < bucket_end_before]:
            self._drop(bucket)

    def clear(self) -> None:
        self.records.clear()
        self.held_bytes = 0
        self.epoch += 1

    def _drop(self, bucket: int) -> None:
        self.held_bytes -= sum(map(len, self.records.pop(bucket, {}).values()))

    # --- BucketLog listener ----------------------------------------------------------------------

    def appended(self, bucket: int, pos: int, data, ids=None) -> None:
        pass  # records are written once: an append changes nothing held

    def truncated(self, bucket: int, size: int) -> None:
        self._drop(bucket)
        self.epoch += 1

    def removed(self, bucket: int) -> None:
        self._drop(bucket)
        self.epoch += 1
