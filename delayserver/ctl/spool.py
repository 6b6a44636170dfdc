"""`delayctl tail DATA_DIR --subject S [--follow] [--json]`: read what the spool broker received.

    delayctl tail var/node --subject orders.expire --follow
"""
from __future__ import annotations

import base64
import datetime as dt
import json
import sys
import time
from pathlib import Path

from delayserver.sender.spool import SpoolCorrupt, iter_spool, list_spool_subjects


def register(subparsers) -> None:
    p = subparsers.add_parser("tail", help="print the messages delivered to a spool subject")
    p.add_argument("data_dir", type=Path, help="the node's data directory")
    p.add_argument("--subject", help="the subject (default: list the spooled subjects)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new deliveries")
    p.add_argument("--json", action="store_true", help="JSON lines, body in base64")
    p.add_argument("--poll-ms", type=int, default=200,
                   help="how often --follow looks for new deliveries (default 200 ms)")
    p.set_defaults(run=run)


def _iso(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).isoformat(timespec="milliseconds")


def _print(offset, dispatch_time, attempt, m, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"offset": offset, "id": m.message_id, "subject": m.subject,
                          "schedule_time": m.schedule_time, "dispatch_time": dispatch_time,
                          "lateness_ms": dispatch_time - m.schedule_time, "attempt": attempt,
                          "headers": dict(m.headers), "body": base64.b64encode(m.body).decode()}))
    else:
        body = m.body.decode("utf-8", "replace")
        print(f"{_iso(dispatch_time)}  {m.message_id}  due {_iso(m.schedule_time)} "
              f"(+{dispatch_time - m.schedule_time} ms, attempt {attempt})  {body[:200]}")
    sys.stdout.flush()


def run(args) -> int:
    if args.subject is None:
        for subject in list_spool_subjects(args.data_dir):
            print(subject)
        return 0
    offset = 0
    try:
        while True:
            cursor = iter_spool(args.data_dir, args.subject, offset)
            for rec in cursor:
                _print(*rec, args.json)
            offset = cursor.next_offset
            if not args.follow:
                return 0
            time.sleep(args.poll_ms / 1000)
    except SpoolCorrupt as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
