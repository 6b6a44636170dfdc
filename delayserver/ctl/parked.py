"""`delayctl parked DATA_DIR` and `delayctl redrive DATA_DIR --server HOST:PORT`.

A parked message is one a broker rejected for good. `parked` lists those not yet redriven;
`redrive` sends each of them again through a delay server, due at once, with its own id (so
consumers can dedupe) and a `redriven-from` header naming its original handle, then records that
they were redriven.
"""
from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

from delayserver.message import DelayServerError, Handle
from delayserver.sender.parked import iter_parked, redriven_offset, set_redriven_offset
from delayserver.storage.errors import StorageError


def register(subparsers) -> None:
    p = subparsers.add_parser("parked", help="list messages a broker rejected for good")
    p.add_argument("data_dir", type=Path)
    p.add_argument("--all", action="store_true", help="include those already redriven")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_parked)
    r = subparsers.add_parser("redrive", help="send parked messages again, due at once")
    r.add_argument("data_dir", type=Path)
    r.add_argument("--server", default="127.0.0.1:20801", help="delay server HOST:PORT")
    r.set_defaults(run=run_redrive)


def _iso(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).isoformat(timespec="milliseconds")


def run_parked(args) -> int:
    directory = args.data_dir / "parked"
    start = 0 if args.all else redriven_offset(directory)
    try:
        for offset, p in iter_parked(directory, start):
            m = p.message
            if args.json:
                print(json.dumps({"offset": offset, "id": m.message_id, "subject": m.subject,
                                  "handle": str(Handle(m.schedule_time, m.message_id)),
                                  "parked_time": p.parked_time, "attempt": p.attempt, "reason": p.reason,
                                  "body_bytes": len(m.body)}))
            else:
                print(f"{_iso(p.parked_time)}  {m.subject}  {Handle(m.schedule_time, m.message_id)}  "
                      f"attempt {p.attempt}  {p.reason}")
    except StorageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def run_redrive(args) -> int:
    from delayserver.client import Producer

    directory = args.data_dir / "parked"
    start = redriven_offset(directory)
    todo = list(iter_parked(directory, start))
    if not todo:
        print("nothing to redrive")
        return 0
    end = start
    sent = 0
    try:
        with Producer(args.server) as producer:
            for offset, p in todo:
                m = p.message
                headers = {**m.headers, "redriven-from": str(Handle(m.schedule_time, m.message_id))}
                producer.send(m.subject, m.body, delay=0, message_id=m.message_id, headers=headers)
                end = offset + 1
                sent += 1
    except (DelayServerError, ConnectionError, TimeoutError) as e:
        print(f"error after {sent} of {len(todo)}: {e}", file=sys.stderr)
        return 1
    finally:
        if end > start:
            set_redriven_offset(directory, end)
    print(f"redrove {sent} message(s)")
    return 0
