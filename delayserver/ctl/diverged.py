"""`delayctl diverged DATA_DIR [--redrive HOST:PORT]`: what a node cut from its message_log.

When a node's history diverged from its master's (node/divergence.py), the records past the
divergence point were written by a master the group has since replaced; a message it acknowledged
there never reached the new master. The node copies them to
``DATA_DIR/quarantine/diverged/<offset>-<time>.log`` (`delayctl inspect` decodes it) and lists
every message id and cancel in the ``.json`` beside it. This command lists them; with
``--redrive`` it sends each message again to the delay server given (the current master), with
its own id, subject, body, headers and delivery time (one in the past is delivered at once), plus
a ``redriven-from-diverged`` header naming the listing, then applies each cancel, and notes in
the listing that it was redriven so a second run sends nothing again.
"""
from __future__ import annotations

import datetime as dt
import json
import sys
import time
from pathlib import Path

from delayserver.message import DelayServerError, Handle
from delayserver.node.divergence import list_diverged
from delayserver.storage.errors import StorageError
from delayserver.storage.record import RecordType, decode_payload, iter_records
from delayserver.storage.segment import fsync_dir, fsync_path


def register(subparsers) -> None:
    p = subparsers.add_parser("diverged", help="list (and redrive) what a node cut from a forked message_log")
    p.add_argument("data_dir", type=Path)
    p.add_argument("--json", action="store_true", help="one JSON object per message or cancel")
    p.add_argument("--redrive", metavar="HOST:PORT", help="send the messages and cancels to this delay server")
    p.set_defaults(run=run)


def _iso(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).isoformat(timespec="milliseconds")


def run(args) -> int:
    listings = list_diverged(args.data_dir)
    if args.redrive:
        return _redrive(args.redrive, listings)
    for doc in listings:
        if args.json:
            for kind in ("messages", "cancels"):
                for item in doc[kind]:
                    print(json.dumps({"listing": doc["listing"], "kind": kind[:-1], "master": doc["master"],
                                      "redriven": bool(doc.get("redriven_ms")), **item}))
            continue
        state = f"redriven {_iso(doc['redriven_ms'])}" if doc.get("redriven_ms") else "not redriven"
        print(f"{doc['listing']}: message_log {doc['from_offset']}-{doc['to_offset']} cut "
              f"{_iso(doc['truncated_ms'])} (master then: {doc['master']}), {len(doc['messages'])} messages, "
              f"{len(doc['cancels'])} cancels, {state}")
        for m in doc["messages"]:
            print(f"  message {Handle(m['schedule_time'], m['message_id'])}  {m['subject']}  epoch {m['epoch']}")
        for c in doc["cancels"]:
            print(f"  cancel  {Handle(c['schedule_time'], c['message_id'])}  epoch {c['epoch']}")
    if not listings and not args.json:
        print("nothing diverged")
    return 0


def _redrive(server: str, listings: list[dict]) -> int:
    from delayserver.client import Producer

    todo = [doc for doc in listings if not doc.get("redriven_ms")]
    if not todo:
        print("nothing to redrive")
        return 0
    sent = cancelled = 0
    try:
        with Producer(server) as producer:
            for doc in todo:
                listing = Path(doc["listing"])
                raw = (listing.parent / doc["segment"]).read_bytes()
                for _, rtype, s, e in iter_records(raw):
                    if rtype == RecordType.MESSAGE:
                        m = decode_payload(rtype, raw, s, e)
                        headers = {**m.headers, "redriven-from-diverged": listing.name}
                        producer.send(m.subject, m.body, deliver_at=max(m.schedule_time, 0),
                                      message_id=m.message_id, headers=headers)
                        sent += 1
                    elif rtype == RecordType.CANCEL:
                        c = decode_payload(rtype, raw, s, e)
                        producer.cancel(Handle(c.schedule_time, c.message_id))
                        cancelled += 1
                doc = {k: v for k, v in doc.items() if k != "listing"}
                _replace_listing(listing, {**doc, "redriven_ms": time.time_ns() // 1_000_000})
    except (DelayServerError, ConnectionError, TimeoutError, OSError, StorageError) as e:
        print(f"error after {sent} messages and {cancelled} cancels: {e}", file=sys.stderr)
        return 1
    print(f"redrove {sent} messages and {cancelled} cancels to {server}")
    return 0


def _replace_listing(path: Path, doc: dict) -> None:
    """Replace the listing atomically (temp file, fsync, rename, fsync the directory)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    fsync_path(tmp)
    tmp.replace(path)
    fsync_dir(path.parent)

