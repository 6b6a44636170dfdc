"""`delayctl send`, `cancel`, `status`, `reschedule`, `promote`: talk to a running delay server.

    delayctl send --server 127.0.0.1:20801 --subject orders.expire --delay 30s --body 'order 42'
    delayctl cancel 1795323199529:01a2...
    delayctl status 1795323199529:01a2... --json
    delayctl reschedule 1795323199529:01a2... --delay 2h
    delayctl promote 1795323199529:01a2...
    delayctl send --prepare --group orders --subject orders.expire --delay 30m --body 'order 42'
    delayctl commit 1795323199529:01a2...      (or rollback)
"""
from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

from delayserver.config import ConfigError, parse_duration
from delayserver.message import AddressError, DelayServerError, Handle, MessageState

DEFAULT_SERVER = "127.0.0.1:20801"


def parse_at(text: str) -> int:
    """Epoch ms from ISO 8601 (a time without a zone is UTC) or from an integer of epoch ms."""
    if text.isdigit():
        return int(text)
    try:
        t = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--at: not an ISO 8601 time or epoch ms: {text!r}") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    return int(t.timestamp() * 1000)


def register(subparsers) -> None:
    p = subparsers.add_parser("send", help="schedule one message and print its handle")
    p.add_argument("--server", default=DEFAULT_SERVER, help=f"HOST:PORT (default {DEFAULT_SERVER})")
    p.add_argument("--subject", required=True)
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--delay", help="from now: 500ms, 30s, 5m, 2h, 7d")
    when.add_argument("--at", help="ISO 8601 time (UTC unless a zone is given) or epoch ms")
    when.add_argument("--level", type=int, help="delay level, 1-based (1s 5s 10s 30s 1m ... by default)")
    p.add_argument("--id", help="message id (default: a time-ordered id)")
    body = p.add_mutually_exclusive_group(required=True)
    body.add_argument("--body", help="the body, as text")
    body.add_argument("--body-file", type=Path, help="read the body from this file ('-': stdin)")
    p.add_argument("--header", action="append", default=[], metavar="KEY=VALUE")
    # transactions
    p.add_argument("--prepare", action="store_true",
                   help="store a half message: delivered only once committed (delayctl commit)")
    p.add_argument("--group", help="producer group of the half message (with --prepare)")
    p.add_argument("--check-immunity", help="no check-back before this long (with --prepare): 30s, 5m")
    p.set_defaults(run=run_send)

    for name, helptext in (("commit", "schedule a half message (send --prepare) by its handle"),
                           ("rollback", "drop a half message (send --prepare) by its handle")):
        c = subparsers.add_parser(name, help=helptext)
        c.add_argument("handle", help="the handle printed by send --prepare (SCHEDULE_TIME:ID)")
        c.add_argument("--server", default=DEFAULT_SERVER, help=f"HOST:PORT (default {DEFAULT_SERVER})")
        c.add_argument("--json", action="store_true")
        c.set_defaults(run=run_end, method=name)

    for name, helptext, fn in (("cancel", "cancel a pending message by its handle", run_cancel),
                               ("status", "pending / delivered / cancelled / prepared / unknown, by handle",
                                run_status)):
        c = subparsers.add_parser(name, help=helptext)
        c.add_argument("handle", help="the handle printed by send (SCHEDULE_TIME:ID)")
        c.add_argument("--server", default=DEFAULT_SERVER, help=f"HOST:PORT (default {DEFAULT_SERVER})")
        c.add_argument("--json", action="store_true")
        c.set_defaults(run=fn)

    for name, helptext in (("reschedule", "move a pending message to a new time; prints its new handle"),
                           ("promote", "deliver a pending message now; prints its new handle")):
        c = subparsers.add_parser(name, help=helptext)
        c.add_argument("handle", help="the handle printed by send (SCHEDULE_TIME:ID)")
        c.add_argument("--server", default=DEFAULT_SERVER, help=f"HOST:PORT (default {DEFAULT_SERVER})")
        c.add_argument("--json", action="store_true")
        if name == "reschedule":
            when = c.add_mutually_exclusive_group(required=True)
            when.add_argument("--delay", help="from now: 500ms, 30s, 5m, 2h, 7d")
            when.add_argument("--at", help="ISO 8601 time (UTC unless a zone is given) or epoch ms")
        c.set_defaults(run=run_reschedule, method=name)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def run_send(args) -> int:
    from delayserver.client import Producer

    try:
        if args.body_file is not None:
            body = sys.stdin.buffer.read() if str(args.body_file) == "-" else args.body_file.read_bytes()
        else:
            body = args.body.encode("utf-8")
        headers = dict(h.split("=", 1) for h in args.header)
        kw = {"delay": parse_duration(args.delay, "--delay")} if args.delay else (
            {"deliver_at": parse_at(args.at)} if args.at else {"delay_level": args.level})
        if (args.group or args.check_immunity) and not args.prepare:
            raise ValueError("--group and --check-immunity go with --prepare")
        if args.prepare:
            if not args.group:
                raise ValueError("--prepare needs --group (the producer group the server checks back with)")
            immunity = parse_duration(args.check_immunity, "--check-immunity") if args.check_immunity else 0
    except (ValueError, ConfigError, OSError) as e:
        return _fail(str(e))
    try:
        with Producer(args.server) as producer:
            if args.prepare:
                handle = producer.prepare(args.subject, body, group=args.group, check_immunity_ms=immunity,
                                          message_id=args.id, headers=headers, **kw)
            else:
                handle = producer.send(args.subject, body, message_id=args.id, headers=headers, **kw)
    except AddressError as e:
        print(f"error: --server: {e}", file=sys.stderr)
        return 2
    except DelayServerError as e:
        return _fail(f"{e.code.name}: {e}")
    except (ConnectionError, TimeoutError) as e:
        return _fail(str(e))
    print(handle)
    return 0


def _ask(args, method: str, **kw):
    """Run one producer call on the handle in `args`; (handle, answer) or an exit code."""
    from delayserver.client import Producer

    try:
        handle = Handle.parse(args.handle)
        with Producer(args.server) as producer:
            return handle, getattr(producer, method)(handle, **kw)
    except AddressError as e:
        print(f"error: --server: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        return _fail(f"bad handle: {e}")
    except DelayServerError as e:
        return _fail(f"{e.code.name}: {e}")
    except (ConnectionError, TimeoutError) as e:
        return _fail(str(e))


def run_cancel(args) -> int:
    answer = _ask(args, "cancel")
    if isinstance(answer, int):
        return answer
    handle, outcome = answer
    name = outcome.name.lower()
    print(json.dumps({"handle": str(handle), "outcome": name}) if args.json else name)
    return 0 if name in ("cancelled", "already_cancelled") else 1


def _iso(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).isoformat(timespec="milliseconds")


def run_end(args) -> int:
    answer = _ask(args, args.method)
    if isinstance(answer, int):
        return answer
    handle, state = answer
    name = {"COMMIT": "committed", "ROLLBACK": "rolled back"}[state.name]
    print(json.dumps({"handle": str(handle), "state": name}) if args.json else name)
    return 0


def run_status(args) -> int:
    answer = _ask(args, "status")
    if isinstance(answer, int):
        return answer
    handle, status = answer
    state = status.state.name.lower()
    if args.json:
        fields = {"handle": str(handle), "state": state, "dispatch_time": status.dispatch_time or None,
                  "broker_group": status.broker_group or None}
        if status.state == MessageState.PREPARED:
            fields |= {"checks": status.checks, "next_check_time": status.next_check_time}
        print(json.dumps(fields))
    elif status.state == MessageState.PREPARED:
        print(f"{state}: checked {status.checks} time(s), next check at {_iso(status.next_check_time)}")
    elif status.dispatch_time:
        when = dt.datetime.fromtimestamp(status.dispatch_time / 1000, dt.timezone.utc).isoformat(timespec="milliseconds")
        print(f"{state} at {when} to {status.broker_group}")
    else:
        print(state)
    return 0


def run_reschedule(args) -> int:
    """Prints the new handle (exit 0), or who won instead (exit 1)."""
    kw = {}
    if args.method == "reschedule":
        try:
            kw = {"delay": parse_duration(args.delay, "--delay")} if args.delay else {"deliver_at": parse_at(args.at)}
        except (ValueError, ConfigError) as e:
            return _fail(str(e))
    answer = _ask(args, args.method, **kw)
    if isinstance(answer, int):
        return answer
    handle, moved = answer
    name = moved.outcome.name.lower()
    if args.json:
        print(json.dumps({"handle": str(handle), "outcome": name,
                          "new_handle": str(moved.handle) if moved.handle else None}))
    else:
        print(moved.handle if moved.handle else name)
    return 0 if moved.handle else 1
