"""The per-bucket time index: what `browse` pages through instead of a bucket's segment.

Per bucket, every SCHEDULED record under one 64-bit key ``(schedule_time - bucket) << 40 | offset``
(a bucket is at most an hour, 2**22 ms, so the time fits in the 24 high bits): sorted, the keys are
the bucket's messages in delivery-time order, ties in log order. It follows schedule_log like the
id index (storage/id_index.py: appends indexed at once, truncations dropped, buckets present at
start built in slices) and costs 8 bytes per message. It is saved as the id index is (a sorted
file per bucket and a journal of what was added since) and read back at start; what was not saved
is built from the segments in the background, and a browse of a bucket not built yet builds that
bucket first.

`page` answers "the next n keys after this one, in this order" with a bisection per sorted run
and at most n keys taken from each: O(runs * (log size + n)), whatever the bucket's size.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from delayserver.storage.id_index import OFFSET_BITS, OFFSET_MASK, IdIndex, SortedRuns, _Bucket
from delayserver.storage.record import SCHEDULED_HEAD, RecordType

try:  # the compiled key making (delayserver/native/records.pyx), when the install built it
    from delayserver.native.records import time_keys as _native_time_keys
except ImportError:
    _native_time_keys = None

#: Keys per bucket are < this: 24 bits of time within the bucket above 40 bits of offset.
KEY_LIMIT = 1 << 64


def time_key(schedule_time: int, scale_ms: int, offset: int) -> int:
    return (schedule_time % scale_ms) << OFFSET_BITS | offset


def _time_keys(ids: list, pos: int, scale_ms: int) -> list[int]:
    """The keys of the SCHEDULED records an append at `pos` added, from their ids as
    `BucketLog.append` takes them (the compiled `delayserver.native.records.time_keys`'s reference)."""
    scheduled = RecordType.SCHEDULED
    return [time_key(sched, scale_ms, pos + at) for at, rtype, sched, _ in ids if rtype == scheduled]


def key_parts(bucket: int, key: int) -> tuple[int, int]:
    """(schedule_time, offset) of a key of `bucket`."""
    return bucket + (key >> OFFSET_BITS), key & OFFSET_MASK


class TimeIndex(IdIndex):
    """Per bucket: the SCHEDULED records in (schedule time, offset) order.

    An IdIndex in all but its keys: it inherits the saving and reading back of sorted keys (the
    file format holds any sorted uint64 keys), not the id lookups (`candidates` is not used)."""

    def __init__(self, bucket_log, scale_ms: int, directory: Path | None = None):
        assert scale_ms < 1 << (64 - OFFSET_BITS), "a bucket's times must fit in 24 bits"
        self.scale_ms = scale_ms
        super().__init__(bucket_log, directory)

    def _add(self, b: _Bucket, rtype: int, data, s: int, e: int, offset: int) -> None:
        if rtype == RecordType.SCHEDULED:
            self._keep(b, time_key(SCHEDULED_HEAD.unpack_from(data, s)[2], self.scale_ms, offset))

    def _add_ids(self, b: _Bucket, pos: int, ids: list, data) -> bool:
        keys = _native_time_keys(ids, pos, self.scale_ms) if _native_time_keys is not None else None
        self._keep_all(b, _time_keys(ids, pos, self.scale_ms) if keys is None else keys)
        return True

    def _drop_from(self, b: _Bucket, size: int) -> None:
        b.runs.drop_where(lambda keys, vals: (keys & np.uint64(OFFSET_MASK)) < np.uint64(size))

    def page(self, bucket: int, lo: int, hi: int, n: int, newest_first: bool = False) -> list[int]:
        """Up to `n` keys of `bucket` in ``[lo, hi)``: the smallest ones ascending, or with
        `newest_first` the largest ones descending."""
        b = self.buckets.get(bucket)
        if b is None or n <= 0 or lo >= hi:
            return []
        b.runs.seal()
        bounds = np.array([lo, min(hi, KEY_LIMIT - 1)], dtype=np.uint64)
        picked = []
        for keys, _ in b.runs.runs:
            i, j = (int(x) for x in keys.searchsorted(bounds))
            picked.append(keys[max(i, j - n):j] if newest_first else keys[i:min(j, i + n)])
        if not picked:
            return []
        merged = np.sort(np.concatenate(picked))
        chosen = merged[::-1][:n] if newest_first else merged[:n]
        return [int(k) for k in chosen]
