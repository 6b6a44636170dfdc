"""Columnar decoding: the records of a chunk straight into Arrow arrays, a column at a time.

The framing reader (`delayserver.storage.range_reader`) has checked every record's crc once and
says where each starts. Here the fixed head of every record of a type is gathered with one numpy
fancy index over the chunk and viewed through a big-endian structured dtype (the layouts of
`delayserver.storage.record`); strings are gathered into Arrow string buffers the same way and
checked as UTF-8 by Arrow. Nothing is decoded per record in Python, and a column nobody asked for
is never built: bodies only when `body` is asked for, headers (the one per-record decode) only
when `headers` is.

A record whose crc holds but whose fields do not add up to its length, whose strings are not
UTF-8, or whose type does not belong to the log is corruption of that one record: it comes back
as (offset, reason) and the records around it are decoded.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from delayserver.storage.record import (
    CANCEL_HEAD, DISPATCH_HEAD, HEADER_SIZE, OFFSET, SCHEDULED_HEAD, RecordType, decode_headers,
)

SCHEDULED = np.dtype([("message_log_offset", ">i8"), ("store_time", ">i8"), ("schedule_time", ">i8"),
                      ("sequence", ">i8"), ("flags", ">u2"), ("id_len", "u1"), ("subject_len", "u1"),
                      ("headers_len", ">u4"), ("body_len", ">u4")])
SCHEDULED_CANCEL = np.dtype([("message_log_offset", ">i8"), ("store_time", ">i8"), ("schedule_time", ">i8"),
                             ("sequence", ">i8"), ("id_len", "u1")])
DISPATCH = np.dtype([("schedule_offset", ">i8"), ("dispatch_time", ">i8"), ("group_len", "u1")])
assert SCHEDULED.itemsize == SCHEDULED_HEAD.size
assert SCHEDULED_CANCEL.itemsize == OFFSET.size + CANCEL_HEAD.size
assert DISPATCH.itemsize == DISPATCH_HEAD.size


class Decoded:
    """The rows of one record type from one chunk: `columns` by name, `count` rows."""

    __slots__ = ("record_type", "columns", "count")

    def __init__(self, record_type: str, columns: dict[str, pa.Array], count: int):
        self.record_type = record_type
        self.columns = columns
        self.count = count


def frame(data: bytes, base: int, positions: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(the chunk as bytes, record types, payload starts, payload lengths) of the records at
    `positions` of `data`."""
    a = np.frombuffer(data, dtype=np.uint8)
    at = np.asarray(positions, dtype=np.int64)
    heads = _gather(a, at, 9).view(np.dtype([("crc", ">u4"), ("length", ">u4"), ("type", "u1")])).ravel()
    return a, heads["type"], at + HEADER_SIZE, heads["length"].astype(np.int64)


def decode(log: str, data: bytes, base: int, positions: list[int], wanted: frozenset[str]
           ) -> tuple[list[Decoded], list[tuple[int, str]]]:
    """Decode the records at `positions` of `data` (file offset `base`) for the columns `wanted`.

    Returns the rows by record type, and the (file offset, reason) of each record that is corrupt.
    """
    a, types, starts, lengths = frame(data, base, positions)
    offsets = base + starts - HEADER_SIZE
    decoders = _LOGS[log]
    out, bad = [], []
    for rtype in np.unique(types).tolist():
        mask = types == rtype
        if rtype not in decoders:
            name = RecordType(rtype).name
            bad += [(int(o), f"a {name} record does not belong in this log") for o in offsets[mask]]
            continue
        decoded, problems = decoders[rtype](a, starts[mask], lengths[mask], offsets[mask], wanted)
        if decoded.count:
            out.append(decoded)
        bad += problems
    bad.sort()
    return out, bad


def _gather(a: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """The `width` bytes at each of `starts`, as an (n, width) contiguous array."""
    return a[starts[:, None] + np.arange(width)]


def _heads(a: np.ndarray, starts: np.ndarray, lengths: np.ndarray, dtype: np.dtype):
    """The fixed heads of the records long enough to hold one, and the mask of those records."""
    fits = lengths >= dtype.itemsize
    return _gather(a, starts[fits], dtype.itemsize).view(dtype).ravel(), fits


def _strings(a: np.ndarray, starts: np.ndarray, lengths: np.ndarray, binary: bool = False) -> pa.Array:
    """An Arrow string (or binary) array of the byte ranges [start, start + length) of `a` (a chunk,
    well under the 2 GiB of 32-bit offsets)."""
    lengths = lengths.astype(np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    index = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
    return pa.Array.from_buffers(pa.binary() if binary else pa.string(), len(lengths),
                                 [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(a[index])])


def _rows_that_decode(a, fits, add_up, offsets, name: str, strings: dict):
    """Which of the records long enough for a head decode: their fields add up to their length and
    their strings are UTF-8 (Arrow checks a whole column at once; only a column that fails is
    looked at row by row). Returns the indexes of those heads, their string columns, and (offset,
    reason) of the rest."""
    fitting = np.flatnonzero(fits)
    problems = [(int(o), f"{name} payload does not decode (fields do not add up to its length)")
                for o in np.concatenate([offsets[~fits], offsets[fitting[~add_up]]])]
    sel = np.flatnonzero(add_up)
    built, not_utf8 = {}, np.zeros(len(sel), dtype=bool)
    for key, (starts, lengths) in strings.items():
        built[key] = _strings(a, starts[sel], lengths[sel])
        try:
            built[key].validate(full=True)
        except pa.ArrowInvalid:
            for i, (s, n) in enumerate(zip(starts[sel].tolist(), lengths[sel].tolist())):
                try:
                    a[s:s + n].tobytes().decode("utf-8")
                except UnicodeDecodeError:
                    not_utf8[i] = True
    if not_utf8.any():
        problems += [(int(o), f"{name} payload does not decode (a string is not UTF-8)")
                     for o in offsets[fitting[sel[not_utf8]]]]
        sel = sel[~not_utf8]
        built = {key: _strings(a, starts[sel], lengths[sel]) for key, (starts, lengths) in strings.items()}
    return sel, built, problems


def _numbers(heads, names, wanted) -> dict[str, pa.Array]:
    return {name: pa.array(heads[name].astype(kind)) for name, kind in names if name in wanted}


_TIMES = (("message_log_offset", np.int64), ("store_time", np.int64), ("schedule_time", np.int64),
          ("sequence", np.int64))


def _scheduled(a, starts, lengths, offsets, wanted):
    heads, fits = _heads(a, starts, lengths, SCHEDULED)
    s, n = starts[fits], lengths[fits]
    id_at = s + SCHEDULED.itemsize
    subject_at = id_at + heads["id_len"]
    headers_at = subject_at + heads["subject_len"]
    body_at = headers_at + heads["headers_len"]
    add_up = body_at + heads["body_len"] == s + n
    sel, strings, problems = _rows_that_decode(a, fits, add_up, offsets, "SCHEDULED", {
        "message_id": (id_at, heads["id_len"]), "subject": (subject_at, heads["subject_len"])})
    heads, kept = heads[sel], offsets[np.flatnonzero(fits)[sel]]
    out = {"offset": pa.array(kept)} if "offset" in wanted else {}
    out |= _numbers(heads, _TIMES + (("flags", np.int32),), wanted)
    if "body_size" in wanted:
        out["body_size"] = pa.array(heads["body_len"].astype(np.int32))
    out |= {k: v for k, v in strings.items() if k in wanted}
    if "body" in wanted:
        out["body"] = _strings(a, body_at[sel], heads["body_len"], binary=True)
    if "headers" in wanted:
        problems += _headers(a, headers_at[sel], heads["headers_len"], kept, out)
    return Decoded("SCHEDULED", out, len(sel)), problems


def _headers(a, starts, lengths, offsets, out) -> list:
    """The headers column, decoded per record (the one field that is): a block that does not
    decode leaves the map null and is reported."""
    values, problems = [], []
    for s, n, o in zip(starts.tolist(), lengths.tolist(), offsets.tolist()):
        try:
            values.append(list(decode_headers(a[s:s + n].tobytes()).items()) if n else [])
        except (ValueError, UnicodeDecodeError) as e:
            values.append(None)
            problems.append((o, f"SCHEDULED headers do not decode ({e})"))
    out["headers"] = pa.array(values, type=pa.map_(pa.string(), pa.string()))
    return problems


def _scheduled_cancel(a, starts, lengths, offsets, wanted):
    heads, fits = _heads(a, starts, lengths, SCHEDULED_CANCEL)
    s, n = starts[fits], lengths[fits]
    id_at = s + SCHEDULED_CANCEL.itemsize
    add_up = id_at + heads["id_len"] == s + n
    sel, strings, problems = _rows_that_decode(a, fits, add_up, offsets, "SCHEDULED_CANCEL",
                                               {"message_id": (id_at, heads["id_len"])})
    heads, kept = heads[sel], offsets[np.flatnonzero(fits)[sel]]
    out = {"offset": pa.array(kept)} if "offset" in wanted else {}
    out |= _numbers(heads, _TIMES, wanted)
    out |= {k: v for k, v in strings.items() if k in wanted}
    return Decoded("SCHEDULED_CANCEL", out, len(sel)), problems


def _dispatch(a, starts, lengths, offsets, wanted):
    heads, fits = _heads(a, starts, lengths, DISPATCH)
    s, n = starts[fits], lengths[fits]
    group_at = s + DISPATCH.itemsize
    # The message_log offset after the group is absent in records written before it was added.
    group_end = group_at + heads["group_len"]
    add_up = (group_end == s + n) | (group_end + 8 == s + n)
    sel, strings, problems = _rows_that_decode(a, fits, add_up, offsets, "DISPATCH",
                                               {"broker_group": (group_at, heads["group_len"])})
    heads, kept = heads[sel], offsets[np.flatnonzero(fits)[sel]]
    out = {"offset": pa.array(kept)} if "offset" in wanted else {}
    out |= _numbers(heads, (("schedule_offset", np.int64), ("dispatch_time", np.int64)), wanted)
    out |= {k: v for k, v in strings.items() if k in wanted}
    return Decoded("DISPATCH", out, len(sel)), problems


_LOGS = {
    "schedule_log": {int(RecordType.SCHEDULED): _scheduled, int(RecordType.SCHEDULED_CANCEL): _scheduled_cancel},
    "dispatch_log": {int(RecordType.DISPATCH): _dispatch},
}
