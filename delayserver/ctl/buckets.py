"""`delayctl buckets DATA_DIR`: per bucket, how many messages are scheduled, dispatched,
cancelled and pending (and dispatched twice), then the totals. Read-only.

A torn tail is counted up to its last whole record (and reported on stderr); a bucket with
corruption is reported, left out of the totals, and makes the exit code 1. A bucket the node
quarantined (a damaged record found while delivering) is shown as QUARANTINED with the file, offset
and reason, and makes the exit code 1 until `delayctl salvage` lifts it.

Half messages (transactional sends) are counted apart, per bucket of their delivery time: those
still PREPARED (not committed or rolled back yet), and how many were committed, rolled back,
checked (check-back requests) and parked on `%TRANS_CHECK_MAX%<group>`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import attrs

from delayserver.ctl.progress import Progress
from delayserver.storage.bucket_log import BucketLog
from delayserver.storage.quarantine import Quarantined, list_quarantined
from delayserver.storage.buckets import bucket_name
from delayserver.storage.errors import CorruptSegment
from delayserver.storage.store import BucketStats, bucket_stats
from delayserver.transactions.state import Count, HalfMessages, read_half_messages

COLUMNS = ("scheduled", "dispatched", "cancelled", "pending", "duplicate_dispatches")
HEADINGS = ("SCHEDULED", "DISPATCHED", "CANCELLED", "PENDING", "DUPLICATES")


def register(subparsers) -> None:
    p = subparsers.add_parser("buckets", help="scheduled / dispatched / cancelled / pending per bucket",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("data_dir", type=Path, help="the node's data directory")
    p.add_argument("--json", action="store_true", help="JSON lines: one object per bucket, then the totals")
    p.set_defaults(run=run)


def run(args) -> int:
    data_dir: Path = args.data_dir
    if not (data_dir / "schedule_log").is_dir():
        print(f"error: {data_dir}: not a data directory (no schedule_log)", file=sys.stderr)
        return 1
    schedule_log = BucketLog.open(data_dir / "schedule_log", readonly=True)
    dispatch_log = BucketLog.open(data_dir / "dispatch_log", readonly=True)
    buckets = sorted(set(schedule_log.buckets()) | set(dispatch_log.buckets()))
    rows, damaged = [], []
    with Progress(len(buckets), "buckets") as progress:
        for bucket in buckets:
            try:
                schedule_log.recover_tail(bucket)
                dispatch_log.recover_tail(bucket)
                rows.append(bucket_stats(schedule_log, dispatch_log, bucket))
            except CorruptSegment as e:
                damaged.append(e)
            progress.advance(1)
    schedule_log.close()
    dispatch_log.close()
    quarantined = list_quarantined(data_dir)
    totals = {c: sum(getattr(row, c) for row in rows) for c in COLUMNS}
    (print_json if args.json else print_table)(rows, totals, quarantined)
    # transactions
    try:
        print_half_messages(read_half_messages(data_dir), args.json)
    except CorruptSegment as e:
        damaged.append(e)
    for e in damaged:
        print(f"error: {e}", file=sys.stderr)
    for q in quarantined.values():
        print(f"error: bucket {bucket_name(q.bucket)} QUARANTINED: {q.path} offset {q.offset}: {q.reason} "
              f"(delayctl salvage {data_dir} {bucket_name(q.bucket)})", file=sys.stderr)
    return 1 if damaged or quarantined else 0


def _quarantine_note(q: Quarantined) -> str:
    return f"QUARANTINED {q.path} offset {q.offset}: {q.reason}"


def print_table(rows: list[BucketStats], totals: dict, quarantined: dict[int, Quarantined]) -> None:
    print(f"{'BUCKET':<14}" + "".join(f"{h:>12}" for h in HEADINGS))
    shown = set()
    for row in rows:
        note = f"  {_quarantine_note(quarantined[row.bucket])}" if row.bucket in quarantined else ""
        shown.add(row.bucket)
        print(f"{bucket_name(row.bucket):<14}" + "".join(f"{getattr(row, c):>12}" for c in COLUMNS) + note)
    for bucket, q in sorted(quarantined.items()):
        if bucket not in shown:
            print(f"{bucket_name(bucket):<14}  {_quarantine_note(q)}")
    print(f"{'total':<14}" + "".join(f"{totals[c]:>12}" for c in COLUMNS))


def print_json(rows: list[BucketStats], totals: dict, quarantined: dict[int, Quarantined]) -> None:
    shown = set()
    for row in rows:
        extra = {}
        if row.bucket in quarantined:
            extra = {"state": "QUARANTINED", "quarantine": attrs.asdict(quarantined[row.bucket])}
        shown.add(row.bucket)
        print(json.dumps({**attrs.asdict(row), "bucket": bucket_name(row.bucket), **extra}))
    for bucket, q in sorted(quarantined.items()):
        if bucket not in shown:
            print(json.dumps({"bucket": bucket_name(bucket), "state": "QUARANTINED", "quarantine": attrs.asdict(q)}))
    print(json.dumps({"bucket": "total", **totals}))


# --- transactions -----------------------------------------------------------------------------

HALF_COLUMNS = ("prepared", "committed", "rolled_back", "checked", "parked")


def half_message_rows(halves: HalfMessages) -> list[dict]:
    """Per bucket: half messages open now (PREPARED), and what was committed, rolled back, checked
    and parked, from the node's counters."""
    open_by_bucket: dict[int, int] = {}
    for half in halves.unresolved():
        bucket = half.schedule_time - half.schedule_time % halves.segment_scale_ms
        open_by_bucket[bucket] = open_by_bucket.get(bucket, 0) + 1
    rows = []
    for bucket in sorted(set(halves.counts) | set(open_by_bucket)):
        counts = halves.counts.get(bucket, [0] * len(Count))
        rows.append({"bucket": bucket, "prepared": open_by_bucket.get(bucket, 0),
                     "committed": counts[Count.COMMITTED], "rolled_back": counts[Count.ROLLED_BACK],
                     "checked": counts[Count.CHECKED], "parked": counts[Count.PARKED]})
    return rows


def print_half_messages(halves: HalfMessages, as_json: bool) -> None:
    rows = half_message_rows(halves)
    if not rows:
        return
    totals = {c: sum(row[c] for row in rows) for c in HALF_COLUMNS}
    if as_json:
        for row in rows:
            print(json.dumps({"half_messages": True, **row, "bucket": bucket_name(row["bucket"])}))
        print(json.dumps({"half_messages": True, "bucket": "total", **totals}))
        return
    print()
    print(f"{'HALF MESSAGES':<14}" + "".join(f"{c.upper():>12}" for c in HALF_COLUMNS))
    for row in rows:
        print(f"{bucket_name(row['bucket']):<14}" + "".join(f"{row[c]:>12}" for c in HALF_COLUMNS))
    print(f"{'total':<14}" + "".join(f"{totals[c]:>12}" for c in HALF_COLUMNS))
