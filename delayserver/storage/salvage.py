"""Salvage a quarantined bucket: every intact record back into delivery, the lost ids named.

Run on a stopped node's data directory (`delayctl salvage DATA_DIR BUCKET`). For the bucket's
schedule segment:

1. Every record is read, resynchronizing past damage (the next offset where a whole valid record
   starts), so every intact record is kept, before and after the damage.
2. A damaged range lay between two intact records, whose message_log offsets bound what it held
   (a segment is its records in message_log order). Every MESSAGE or CANCEL record of this bucket
   that message_log still holds in that range is rebuilt exactly as replay builds it: those
   messages are recovered, not lost. What message_log no longer holds (cleaned) is lost: the ids
   still legible in the damaged bytes are reported, with the byte range.
3. The segment is rewritten (temp file, fsync, rename, directory fsync) in message_log order.
   When nothing was lost it is byte for byte what replay wrote, so dispatch_log's offsets stand;
   otherwise dispatch_log is rewritten with its offsets moved to the records' new places, and the
   replay checkpoint's size for the bucket too.
4. A damaged dispatch_log keeps its intact records; what the damage held was delivered at least
   once and may be delivered again (reported).
5. The quarantine marker is removed: the next start loads the bucket, skipping what dispatch_log
   records as delivered.
"""
from __future__ import annotations

import os
from pathlib import Path

import attrs

from delayserver.storage.buckets import bucket_name, parse_bucket_name
from delayserver.storage.checkpoint import read_checkpoint, write_checkpoint
from delayserver.storage.quarantine import list_quarantined, release
from delayserver.storage.record import (
    CANCEL_HEAD, MESSAGE_HEAD, OFFSET, SCHEDULED_HEAD, RecordType, decode_dispatch, decode_scheduled,
    decode_scheduled_cancel, encode_dispatch, encode_record, parse_record,
)
from delayserver.storage.reader import Damage, find_valid_record_after, read_records
from delayserver.storage.segment import fsync_dir, fsync_fd, read_file
from delayserver.storage.store import REPLAY_CHECKPOINT


@attrs.define
class SalvageReport:
    bucket: str
    intact: int = 0
    recovered_ids: list[str] = attrs.Factory(list)  # rebuilt from message_log
    lost_ids: list[str] = attrs.Factory(list)  # damaged and no longer in message_log
    lost_ranges: list[tuple[int, int]] = attrs.Factory(list)  # damaged bytes nothing could rebuild
    damaged_ranges: list[tuple[int, int]] = attrs.Factory(list)  # in the schedule segment
    dispatch_damaged_ranges: list[tuple[int, int]] = attrs.Factory(list)
    dispatch_records_dropped: int = 0
    rewritten: bool = False


@attrs.frozen
class _Rec:
    mlo: int  # message_log offset it was replayed from
    raw: bytes  # the whole record
    message_id: str
    old_offset: int | None  # where it was in the damaged segment (None: rebuilt)


def walk(buf: bytes) -> tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]]:
    """Every whole valid record ``(pos, rtype, start, stop)`` of `buf`, resynchronizing past damage,
    and the damaged ranges ``(start, end)``."""
    records, damaged = [], []
    pos, end = 0, len(buf)
    while pos < end:
        found: list[Damage] = []
        records.extend(read_records(buf, start=pos, report=found.append))
        if not found:
            break
        at = found[0].offset
        nxt = find_valid_record_after(buf, at)
        damaged.append((at, end if nxt is None else nxt))
        if nxt is None:
            break
        pos = nxt
    return records, damaged


def _message_log_records(data_dir: Path):
    """``(offset, rtype, payload)`` of message_log's whole records, oldest first, up to damage."""
    for path in sorted((data_dir / "message_log").glob("*.log")):
        stem = path.name[:-4]
        if len(stem) != 20 or not stem.isdigit():
            continue
        base = int(stem)
        data = read_file(path)
        for pos, rtype, s, e in read_records(data, report=_up_to_damage):
            yield base + pos, rtype, data[s:e]


def _up_to_damage(damage: Damage) -> None:
    """Reading a message_log segment stops at its first damage; what follows is not used."""


def _message_log_start(data_dir: Path) -> int | None:
    bases = [int(p.name[:-4]) for p in (data_dir / "message_log").glob("*.log")
             if len(p.name) == 24 and p.name[:20].isdigit()]
    return min(bases) if bases else None


def _legible_ids(buf: bytes, belongs) -> list[str]:
    """Ids of the scheduled messages whose fixed fields are still legible in damaged bytes: a
    SCHEDULED head with a schedule time of this bucket, followed by a UTF-8 id of its length."""
    found = []
    for p in range(0, max(0, len(buf) - SCHEDULED_HEAD.size) + 1):
        _, _, sched, _, _, idlen, _, _, _ = SCHEDULED_HEAD.unpack_from(buf, p)
        if not idlen or not belongs(sched):
            continue
        raw = buf[p + SCHEDULED_HEAD.size : p + SCHEDULED_HEAD.size + idlen]
        if len(raw) == idlen:
            try:
                found.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                continue
    return found


def salvage(data_dir: Path, bucket: int, *, segment_scale_ms: int) -> SalvageReport:
    data_dir = Path(data_dir)
    report = SalvageReport(bucket_name(bucket))
    schedule_path = data_dir / "schedule_log" / f"{bucket_name(bucket)}.log"
    dispatch_path = data_dir / "dispatch_log" / f"{bucket_name(bucket)}.log"
    buf = read_file(schedule_path) if schedule_path.exists() else b""
    records, damaged = walk(buf)
    report.damaged_ranges = damaged
    kept: list[_Rec] = []
    for pos, rtype, s, e in records:
        if rtype == RecordType.SCHEDULED:
            mlo, message = decode_scheduled(buf, s, e)
            mid = message.message_id
        elif rtype == RecordType.SCHEDULED_CANCEL:
            mlo, cancel = decode_scheduled_cancel(buf, s, e)
            mid = cancel.message_id
        else:
            raise ValueError(f"{schedule_path}: {RecordType(rtype).name} record at offset {pos} does not belong here")
        kept.append(_Rec(mlo, buf[pos:e], mid, pos))
    report.intact = len(kept)

    # What each damaged range held: message_log records between its intact neighbours.
    others = sorted(parse_bucket_name(p.name[:-4]) for p in (data_dir / "schedule_log").glob("*.log")
                    if p.name[:-4].isdigit() and len(p.name) == 16)
    next_bucket = next((b for b in others if b > bucket), None)

    def belongs(sched: int) -> bool:
        return bucket <= sched < bucket + segment_scale_ms and (next_bucket is None or sched < next_bucket)

    gaps = []
    by_pos = sorted(kept, key=lambda r: r.old_offset)
    for start, end in damaged:
        before = [r.mlo for r in by_pos if r.old_offset < start]
        after = [r.mlo for r in by_pos if r.old_offset >= end]
        gaps.append((max(before) + 1 if before else 0, min(after) if after else None, start, end))
    recovered: list[_Rec] = []
    if gaps:
        have = {r.mlo for r in kept}
        for off, rtype, payload in _message_log_records(data_dir):
            if off in have or not any(lo <= off and (hi is None or off < hi) for lo, hi, _, _ in gaps):
                continue
            if rtype in (RecordType.MESSAGE, RecordType.COMMIT):  # a COMMIT is a MESSAGE payload
                _, sched, _, _, idlen, *_ = MESSAGE_HEAD.unpack_from(payload, 0)
                kind = RecordType.SCHEDULED
            elif rtype == RecordType.CANCEL:
                _, sched, _, idlen = CANCEL_HEAD.unpack_from(payload, 0)
                kind = RecordType.SCHEDULED_CANCEL
            else:
                continue
            if not belongs(sched):
                continue
            raw = encode_record(kind, OFFSET.pack(off) + payload)
            _, s, e = parse_record(raw, 0)
            mid = (decode_scheduled(raw, s, e)[1].message_id if kind == RecordType.SCHEDULED
                   else decode_scheduled_cancel(raw, s, e)[1].message_id)
            recovered.append(_Rec(off, raw, mid, None))
        report.recovered_ids = [r.message_id for r in recovered]
        # A range message_log no longer covers lost what it held.
        start_offset = _message_log_start(data_dir)
        for lo, hi, start, end in gaps:
            if start_offset is None or lo < start_offset:
                report.lost_ranges.append((start, end))
                recovered_here = {r.message_id for r in recovered if lo <= r.mlo and (hi is None or r.mlo < hi)}
                report.lost_ids += [i for i in _legible_ids(buf[start:end], belongs) if i not in recovered_here]

    rebuilt = sorted(kept + recovered, key=lambda r: r.mlo)
    new_bytes = b"".join(r.raw for r in rebuilt)
    moved: dict[int, int] = {}
    pos = 0
    for r in rebuilt:
        if r.old_offset is not None:
            moved[r.old_offset] = pos
        pos += len(r.raw)

    # dispatch_log: intact records, offsets moved to the records' new places.
    dispatch_out = None
    if dispatch_path.exists():
        dbuf = read_file(dispatch_path)
        drecs, ddamaged = walk(dbuf)
        report.dispatch_damaged_ranges = ddamaged
        if ddamaged or new_bytes != buf:
            parts = []
            for dpos, rtype, s, e in drecs:
                if rtype != RecordType.DISPATCH:
                    continue
                d = decode_dispatch(dbuf, s, e)
                if d.schedule_offset not in moved:
                    report.dispatch_records_dropped += 1
                    continue
                parts.append(encode_record(RecordType.DISPATCH, encode_dispatch(
                    attrs.evolve(d, schedule_offset=moved[d.schedule_offset]))))
            dispatch_out = b"".join(parts)

    checkpoint_path = data_dir / "checkpoint" / REPLAY_CHECKPOINT
    if new_bytes != buf:
        _replace(schedule_path, new_bytes)
        report.rewritten = True
        cp = read_checkpoint(checkpoint_path)
        if cp is not None and bucket_name(bucket) in cp.get("schedule_sizes", {}):
            replayed_to = cp.get("message_log_offset", 0)
            cp["schedule_sizes"][bucket_name(bucket)] = sum(len(r.raw) for r in rebuilt if r.mlo < replayed_to)
            write_checkpoint(checkpoint_path, cp)
    if dispatch_out is not None:
        _replace(dispatch_path, dispatch_out)
    release(data_dir, bucket)
    return report


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.salvage.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        written = 0
        while written < len(view):
            written += os.write(fd, view[written:])
        fsync_fd(fd, tmp)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def quarantined_buckets(data_dir: Path) -> list[int]:
    return sorted(list_quarantined(data_dir))
