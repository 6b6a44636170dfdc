"""`delayctl schedules`: a running node's recurring schedules.

    delayctl schedules [list] [--server HOST:PORT] [--json]
    delayctl schedules put NAME --subject S --rule '0 2 * * *' [--tz Europe/Berlin] (--body TEXT |
                       --body-file FILE) [--header K=V ...] [--start T] [--end T] [--count N]
                       [--catch-up skip|one|all]
    delayctl schedules pause|resume|delete NAME

`list` prints one line per schedule: name, state (active, paused, finished), next occurrence (UTC),
rule and time zone, subject, occurrences sent. `put`, `pause` and `resume` print the schedule's line.
"""
from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

from delayserver.ctl.producer import DEFAULT_SERVER, _fail, parse_at
from delayserver.message import AddressError, DelayServerError


def register(subparsers) -> None:
    p = subparsers.add_parser("schedules", help="list, create or change recurring schedules")
    p.add_argument("--server", default=DEFAULT_SERVER, help=f"HOST:PORT (default {DEFAULT_SERVER})")
    p.add_argument("--json", action="store_true", help="JSON lines")
    p.set_defaults(run=run_schedules, action="list")
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.add_parser("list", help="every schedule (the default)")
    put = actions.add_parser("put", help="create or replace a schedule")
    put.add_argument("name")
    put.add_argument("--subject", required=True)
    put.add_argument("--rule", required=True, help="cron (5 fields, or 6 with seconds first) or '@every 10m'")
    put.add_argument("--tz", default="UTC", help="time zone of a cron rule (default UTC)")
    body = put.add_mutually_exclusive_group()
    body.add_argument("--body", default="", help="the body, as text")
    body.add_argument("--body-file", type=Path, help="read the body from this file")
    put.add_argument("--header", action="append", default=[], metavar="KEY=VALUE")
    put.add_argument("--start", help="no occurrence before (ISO 8601 or epoch ms)")
    put.add_argument("--end", help="no occurrence at or after (ISO 8601 or epoch ms)")
    put.add_argument("--count", type=int, help="at most this many occurrences")
    put.add_argument("--catch-up", choices=("skip", "one", "all"), default="one",
                     help="occurrences missed while the node was down: none, the latest, or all (default one)")
    for name in ("pause", "resume", "delete"):
        actions.add_parser(name, help=f"{name} a schedule").add_argument("name")


def _line(s: dict, args) -> str:
    if args.json:
        return json.dumps({k: (v.decode("utf-8", "replace") if isinstance(v, bytes) else v) for k, v in s.items()})
    state = "paused" if s["paused"] else "finished" if s["next"] is None else "active"
    nxt = (dt.datetime.fromtimestamp(s["next"] / 1000, dt.timezone.utc).isoformat(timespec="seconds")
           if s["next"] is not None else "-")
    return f"{s['name']}  {state}  next {nxt}  '{s['rule']}' {s['timezone']}  -> {s['subject']}  sent {s['emitted']}"


def run_schedules(args) -> int:
    from delayserver.client import Producer

    try:
        with Producer(args.server) as producer:
            if args.action in (None, "list"):
                for s in producer.schedules():
                    print(_line(s, args))
                return 0
            if args.action == "put":
                body = args.body_file.read_bytes() if args.body_file else args.body.encode("utf-8")
                s = producer.put_schedule(
                    args.name, args.subject, args.rule, body, headers=dict(h.split("=", 1) for h in args.header),
                    timezone=args.tz, start=parse_at(args.start) if args.start else None,
                    end=parse_at(args.end) if args.end else None, count=args.count, catch_up=args.catch_up)
            elif args.action == "delete":
                producer.delete_schedule(args.name)
                return 0
            else:
                s = getattr(producer, f"{args.action}_schedule")(args.name)
            print(_line(s, args))
            return 0
    except AddressError as e:
        print(f"error: --server: {e}", file=sys.stderr)
        return 2
    except DelayServerError as e:
        return _fail(f"{e.code.name}: {e}")
    except (ValueError, OSError, ConnectionError, TimeoutError) as e:
        return _fail(str(e))
