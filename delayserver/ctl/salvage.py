"""`delayctl salvage DATA_DIR BUCKET`: put every intact record of a quarantined bucket back into
delivery and report exactly which message ids were lost. Run it with the node stopped.

BUCKET is a bucket name (`202611221600`) or `all` (every quarantined bucket). Messages the damage
held are rebuilt from message_log while it still holds them; the ids of those it no longer holds
are reported as lost. Exit 0 when nothing was lost, 1 when something was (or the bucket could not
be salvaged), 2 for usage errors. See delayserver/storage/salvage.py for how.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import attrs

from delayserver.config import ConfigError, parse_duration
from delayserver.storage.buckets import check_scale, parse_bucket_name
from delayserver.storage.salvage import quarantined_buckets, salvage


def register(subparsers) -> None:
    p = subparsers.add_parser("salvage", help="recover a quarantined bucket's intact records, name the lost ids",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("data_dir", type=Path, help="the node's data directory (node stopped)")
    p.add_argument("bucket", help="bucket name (yyyyMMddHHmm) or 'all' for every quarantined bucket")
    p.add_argument("--segment-scale", default="60m",
                   help="the node's segment_scale (default 60m): what a bucket spans")
    p.add_argument("--json", action="store_true", help="one JSON object per bucket")
    p.set_defaults(run=run)


def run(args) -> int:
    data_dir: Path = args.data_dir
    if not (data_dir / "schedule_log").is_dir():
        print(f"error: {data_dir}: not a data directory (no schedule_log)", file=sys.stderr)
        return 2
    try:
        scale = check_scale(parse_duration(args.segment_scale, "--segment-scale"))
        buckets = quarantined_buckets(data_dir) if args.bucket == "all" else [parse_bucket_name(args.bucket)]
    except (ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not buckets:
        print("no quarantined bucket")
        return 0
    failed = False
    for bucket in buckets:
        try:
            report = salvage(data_dir, bucket, segment_scale_ms=scale)
        except (OSError, ValueError) as e:
            print(f"error: bucket {bucket}: not salvaged: {e}", file=sys.stderr)
            failed = True
            continue
        failed = failed or bool(report.lost_ids or report.lost_ranges)
        if args.json:
            print(json.dumps(attrs.asdict(report)))
            continue
        print(f"bucket {report.bucket}: {report.intact} intact records kept, "
              f"{len(report.recovered_ids)} rebuilt from message_log, {len(report.lost_ids)} lost")
        for start, end in report.damaged_ranges:
            print(f"  damaged schedule_log bytes {start}..{end}")
        for mid in report.recovered_ids:
            print(f"  recovered {mid}")
        for mid in report.lost_ids:
            print(f"  LOST {mid}")
        for start, end in report.lost_ranges:
            print(f"  LOST whatever bytes {start}..{end} held that message_log no longer has")
        if report.dispatch_records_dropped or report.dispatch_damaged_ranges:
            print(f"  dispatch_log: {report.dispatch_records_dropped} records dropped, damaged ranges "
                  f"{report.dispatch_damaged_ranges}: those messages may be delivered again")
        print(f"  quarantine lifted; the next start delivers what is pending")
    return 1 if failed else 0
