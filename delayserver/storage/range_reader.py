"""Read one byte range of a segment on its own, as a parallel job splits a big segment: record
boundaries found by resynchronising after the split point, damage classified as recovery does.

A segment of `size` bytes cut at split points is read as ranges ``[start, end)``. The records of a
range are those whose first byte lies in it, on the chain of records (each record's length leads
to the next) that begins at the range's first record:

- the range that starts at 0 starts there; any other starts at its *sync point*, the first offset
  at or after `start` where a whole valid record begins (header, length and crc): the bytes before
  it are the end of a record the previous range reads;
- a range reads past `end` only to finish its last record, then checks that its chain lands on
  the next range's sync point. Where it does not, either the record there is damaged (reported
  here, since the next range skips those bytes), or a record body holds bytes that frame a whole
  valid record and misled the next range's sync: reported as AMBIGUOUS_SPLIT, never silently.

Damage is what `storage.segment.scan` calls it: a bad or incomplete record with no valid record
anywhere after it is a torn tail (TORN_TAIL, the end of what can be read); one followed by a valid
record is corruption (CORRUPT), and reading resumes at that next valid record, so that what is
read does not depend on where the segment was split. The range whose chain meets the damage
reports it, once.

Reads are streamed in chunks of `chunk_bytes` (more only for a record larger than that): memory
is bounded by the chunk, never by the segment.
"""
from __future__ import annotations

import os
import re
from typing import Iterator

import attrs
import crc32c as _crc32c

from delayserver.storage.record import HEADER, HEADER_SIZE, MAX_PAYLOAD_BYTES, VALID_TYPES, checksum

CORRUPT = "CORRUPT"
TORN_TAIL = "TORN_TAIL"
AMBIGUOUS_SPLIT = "AMBIGUOUS_SPLIT"

DEFAULT_CHUNK_BYTES = 8 << 20
#: How far a resync search reads at a time.
_SEARCH_WINDOW = 1 << 20
_TYPE_AT = HEADER_SIZE - 1
_TYPE_BYTE = re.compile(b"[" + b"".join(re.escape(bytes([t])) for t in sorted(VALID_TYPES)) + b"]")
#: The crc seed of each type byte, None for a byte that is not a record type.
_SEEDS = tuple(checksum(t, b"") if t in VALID_TYPES else None for t in range(256))


@attrs.frozen
class Records:
    """Whole valid records of a range: `data` holds the file's bytes from offset `base`, and a
    record starts at each of `positions` (indexes into `data`, ascending)."""

    base: int
    data: bytes
    positions: list[int]


@attrs.frozen
class Damage:
    """Damage met at file offset `offset`; reading resumes at `resume_at` (None: nothing valid
    follows, so nothing more is read)."""

    offset: int
    kind: str
    reason: str
    resume_at: int | None


def read_range(path, start: int, end: int, size: int, *,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[Records | Damage]:
    """Yield the records of ``[start, end)`` of the segment at `path`, read as if it were `size`
    bytes long (its length when the job was planned), and the damage met, in file order.

    Raises OSError when the file cannot be read.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        yield from _read_range(fd, start, end, size, chunk_bytes)
    finally:
        os.close(fd)


def _read_range(fd: int, start: int, end: int, size: int, chunk_bytes: int) -> Iterator[Records | Damage]:
    end = min(end, size)
    pos = 0 if start == 0 else find_record(fd, size, start)
    if pos is None or pos >= end:
        return
    want = chunk_bytes
    while pos < end:
        data = os.pread(fd, min(want, size - pos), pos)
        positions, walked, problem, need = _walk(data, end - pos, size - pos)
        if positions:
            yield Records(pos, data, positions)
        pos += walked
        want = max(chunk_bytes, need)
        if problem is not None:
            damage = _damage(fd, size, pos, problem)
            yield damage
            if damage.resume_at is None:
                return
            pos = damage.resume_at
    if pos < size:
        yield from _check_next_sync(fd, size, end, pos)


def _walk(data: bytes, own: int, left: int) -> tuple[list[int], int, str | None, int]:
    """Walk whole valid records of `data` (the file from the walk's position on, `left` bytes of
    it to the end) that start before `own`. Returns (positions, bytes walked, the problem of the
    record where it stopped or None, bytes a read must hold to get past it)."""
    # Every reader's hot path: globals bound to locals, one crc per record, nothing decoded.
    unpack, crc32c, seeds, view = HEADER.unpack_from, _crc32c.crc32c, _SEEDS, memoryview(data)
    header_size, cap, n = HEADER_SIZE, MAX_PAYLOAD_BYTES, len(data)
    positions = []
    append = positions.append
    i = 0
    while i < own:
        if i + header_size > n:
            return positions, i, "incomplete record" if i + header_size > left else None, header_size
        crc, length, rtype = unpack(data, i)
        seed = seeds[rtype]
        if seed is None:
            return positions, i, f"unknown record type {rtype}", 0
        if length > cap:
            return positions, i, f"declared length {length} over the cap", 0
        stop = i + header_size + length
        if stop > n:
            return positions, i, "incomplete record" if stop > left else None, stop - i
        if crc32c(view[i + header_size:stop], value=seed) != crc:
            return positions, i, "crc mismatch", 0
        append(i)
        i = stop
    return positions, i, None, 0


def _damage(fd: int, size: int, pos: int, problem: str) -> Damage:
    following = find_record(fd, size, pos + 1)
    if following is None:
        return Damage(pos, TORN_TAIL, f"{problem}; nothing valid follows: {size - pos} bytes not read", None)
    return Damage(pos, CORRUPT, f"{problem}; valid records follow at {following}: "
                                f"{following - pos} bytes not read", following)


def _check_next_sync(fd: int, size: int, end: int, pos: int) -> Iterator[Damage]:
    """The chain left this range at `pos` (>= end): the next range must start there."""
    sync = find_record(fd, size, end)
    if sync == pos:
        return
    if sync is None or sync > pos:
        # The record at pos is not valid (a valid one would be the sync point or precede it), and
        # the next range skips the bytes up to its sync point: the damage is this range's to tell.
        yield _damage(fd, size, pos, problem_at(fd, size, pos) or "not a record")
        return
    yield Damage(sync, AMBIGUOUS_SPLIT,
                 f"the split at {end} resynchronised at {sync}, inside the record that ends at {pos}: "
                 f"a message body frames a whole record there; the records between may be misread "
                 f"(read this segment unsplit)", pos)


def problem_at(fd: int, size: int, pos: int) -> str | None:
    """Why no whole valid record starts at `pos`, or None when one does."""
    head = os.pread(fd, HEADER_SIZE, pos)
    if len(head) < HEADER_SIZE:
        return "incomplete record"
    crc, length, rtype = HEADER.unpack(head)
    if rtype not in VALID_TYPES:
        return f"unknown record type {rtype}"
    if length > MAX_PAYLOAD_BYTES:
        return f"declared length {length} over the cap"
    if pos + HEADER_SIZE + length > size:
        return "incomplete record"
    if checksum(rtype, os.pread(fd, length, pos + HEADER_SIZE)) != crc:
        return "crc mismatch"
    return None


def find_record(fd: int, size: int, pos: int) -> int | None:
    """The first offset at or after `pos` where a whole valid record starts, or None.

    The test is recovery's (`storage.segment.find_valid_record_after`), over a file read in
    windows: candidates are the offsets whose type byte is a record type, found by a regex search.
    """
    window = pos
    while window < size:
        # A window's candidates start in [window, window + _SEARCH_WINDOW); their headers fit.
        data = os.pread(fd, min(_SEARCH_WINDOW + HEADER_SIZE, size - window), window)
        for match in _TYPE_BYTE.finditer(data, _TYPE_AT):
            candidate = match.start() - _TYPE_AT
            if candidate >= _SEARCH_WINDOW:
                break
            if _valid_at(fd, size, data, window, candidate):
                return window + candidate
        window += _SEARCH_WINDOW
    return None


def _valid_at(fd: int, size: int, data: bytes, base: int, i: int) -> bool:
    crc, length, rtype = HEADER.unpack_from(data, i)
    if length > MAX_PAYLOAD_BYTES or base + i + HEADER_SIZE + length > size:
        return False
    stop = i + HEADER_SIZE + length
    payload = memoryview(data)[i + HEADER_SIZE:stop] if stop <= len(data) else os.pread(
        fd, length, base + i + HEADER_SIZE)
    return checksum(rtype, payload) == crc
