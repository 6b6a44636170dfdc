"""`delayctl list`: browse a running node's messages by subject, time range and state.

    delayctl list --server 127.0.0.1:20801 --subject 'orders.*' --state pending --limit 20
    delayctl list --from 2026-11-22T16:00Z --to 2026-11-22T17:00Z --newest --json
    delayctl list --all --state cancelled          # every page, not only the first

One line per message: handle, state, delivery time (UTC), subject. Without --all the cursor of the
next page, if any, goes to stderr as ``next: --cursor C``.
"""
from __future__ import annotations

import base64
import datetime as dt
import json
import sys

from delayserver.ctl.producer import DEFAULT_SERVER, _fail, parse_at
from delayserver.message import AddressError, DelayServerError


def register(subparsers) -> None:
    p = subparsers.add_parser("list", help="list messages by subject, time range and state, page by page")
    p.add_argument("--server", default=DEFAULT_SERVER, help=f"HOST:PORT (default {DEFAULT_SERVER})")
    p.add_argument("--subject", help="exact subject, or a glob: 'orders.*'")
    p.add_argument("--state", action="append", choices=("pending", "delivered", "cancelled"),
                   help="repeat for several (default: pending)")
    p.add_argument("--from", dest="since", help="delivery time from (ISO 8601 or epoch ms)")
    p.add_argument("--to", dest="until", help="delivery time before (ISO 8601 or epoch ms)")
    p.add_argument("--newest", action="store_true", help="newest delivery time first")
    p.add_argument("--limit", type=int, default=100, help="messages per page, 1-1000 (default 100)")
    p.add_argument("--cursor", help="where the previous page stopped")
    p.add_argument("--all", action="store_true", help="every page")
    p.add_argument("--bodies", action="store_true", help="include bodies (JSON: base64)")
    p.add_argument("--json", action="store_true", help="JSON lines")
    p.set_defaults(run=run_list)


def _line(m, args) -> str:
    if args.json:
        out = {"handle": str(m.handle), "id": m.handle.message_id, "subject": m.subject, "state": m.state.name.lower(),
               "schedule_time": m.handle.schedule_time, "store_time": m.store_time, "headers": dict(m.headers)}
        if m.dispatch_time:
            out["dispatch_time"], out["broker_group"] = m.dispatch_time, m.broker_group
        if m.body is not None:
            out["body"] = base64.b64encode(m.body).decode("ascii")
        return json.dumps(out)
    due = dt.datetime.fromtimestamp(m.handle.schedule_time / 1000, dt.timezone.utc).isoformat(timespec="milliseconds")
    line = f"{m.handle}  {m.state.name.lower():<9}  {due}  {m.subject}"
    if m.body is not None:
        line += "  " + m.body.decode("utf-8", "replace")
    return line


def run_list(args) -> int:
    from delayserver.client import Producer

    try:
        query = dict(subject=args.subject, states=args.state or ["pending"], newest_first=args.newest,
                     limit=args.limit, bodies=args.bodies,
                     since=parse_at(args.since) if args.since else None,
                     until=parse_at(args.until) if args.until else None)
    except ValueError as e:
        return _fail(str(e))
    try:
        with Producer(args.server) as producer:
            cursor = args.cursor
            while True:
                page = producer.browse(**query, cursor=cursor)
                for m in page.messages:
                    print(_line(m, args))
                cursor = page.cursor
                if cursor is None or not args.all:
                    break
    except AddressError as e:
        print(f"error: --server: {e}", file=sys.stderr)
        return 2
    except DelayServerError as e:
        return _fail(f"{e.code.name}: {e}")
    except (ConnectionError, TimeoutError) as e:
        return _fail(str(e))
    if cursor is not None:
        print(f"next: --cursor {cursor}", file=sys.stderr)
    return 0
