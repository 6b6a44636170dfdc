"""`delayctl inspect PATH`: decode one segment (message_log, schedule_log, dispatch_log, spool,
parked) or one checkpoint file, as a table for people or, with --json, one JSON object a line.

The kind of segment is told by the type of its records. Bodies are shown by size and crc32c, or
with --bodies in base64. On damage the records before it are printed, then the error naming file
and offset; the exit code is 1 (a torn tail counts: the file as it stands is damaged).
"""
from __future__ import annotations

import base64
import datetime as _dt
import json
import sys
from pathlib import Path

import attrs
import crc32c

from delayserver.ctl.progress import Progress
from delayserver.ctl.segments import LOG_OF_TYPE, SegmentFile
from delayserver.storage.checkpoint import CorruptCheckpoint, read_checkpoint
from delayserver.storage.record import Message, RecordType

_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)


def register(subparsers) -> None:
    p = subparsers.add_parser("inspect", help="decode a segment or a checkpoint file",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("path", type=Path, help="a segment file (*.log) or a checkpoint (*.json)")
    p.add_argument("--json", action="store_true", help="JSON lines, one object per record")
    p.add_argument("--bodies", action="store_true", help="show bodies in base64, not by size and crc32c")
    p.set_defaults(run=run)


def run(args) -> int:
    path: Path = args.path
    if not path.is_file():
        print(f"error: {path}: not a file", file=sys.stderr)
        return 1
    if path.suffix == ".json" or _is_json(path):
        return inspect_checkpoint(path, as_json=args.json)
    return inspect_segment(path, as_json=args.json, bodies=args.bodies)


def _is_json(path: Path) -> bool:
    """A checkpoint under another name (a record's first byte is rarely `{`, and then not JSON)."""
    with open(path, "rb") as f:
        if f.read(1) != b"{":
            return False
    try:
        json.loads(path.read_bytes())
    except ValueError:
        return False
    return True


def inspect_checkpoint(path: Path, *, as_json: bool) -> int:
    try:
        data = read_checkpoint(path)
    except CorruptCheckpoint as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if data is None:
        print(f"error: {path}: no such file", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(data, sort_keys=True))
    else:
        print(f"{path}: checkpoint")
        for key in sorted(data):
            print(f"  {key:<24} {json.dumps(data[key], sort_keys=True)}")
    return 0


def inspect_segment(path: Path, *, as_json: bool, bodies: bool) -> int:
    segment = SegmentFile(path)
    count = 0
    with Progress(segment.size, path.name) as progress:
        last = 0
        for offset, rtype, value in segment.records():
            if count == 0 and not as_json:
                print(f"{path}: {LOG_OF_TYPE[rtype]} segment, {segment.size} bytes")
                print(f"{'OFFSET':>12}  {'TYPE':<16}  FIELDS")
            fields = show_body(record_fields(rtype, value), bodies)
            if as_json:
                print(json.dumps({"offset": offset, "type": RecordType(rtype).name, **fields}, ensure_ascii=False))
            else:
                print(f"{offset:>12}  {RecordType(rtype).name:<16}  {format_fields(fields)}")
            count += 1
            progress.advance(offset - last)
            last = offset
    if not as_json:
        print(f"{count} records" if count else f"{path}: no whole records in {segment.size} bytes")
    if segment.damage is not None:
        print(f"error: {segment.damage}", file=sys.stderr)
        return 1
    return 0


def message_fields(m: Message) -> dict:
    return {
        "message_id": m.message_id, "subject": m.subject, "schedule_time": m.schedule_time,
        "store_time": m.store_time, "sequence": m.sequence, "flags": m.flags,
        "headers": dict(m.headers), "body": m.body,
    }


def record_fields(rtype: int, value) -> dict:
    """The fields of a decoded record, flat, in the order people read them."""
    if rtype in (RecordType.MESSAGE, RecordType.COMMIT):
        return message_fields(value)
    if rtype == RecordType.PREPARE:
        return {"group": value.group, "check_immunity_ms": value.check_immunity_ms,
                **message_fields(value.message), "sequence": value.sequence}
    if rtype == RecordType.SCHEDULED:
        offset, message = value
        return {"message_log_offset": offset, **message_fields(message)}
    if rtype == RecordType.SCHEDULED_CANCEL:
        offset, cancel = value
        return {"message_log_offset": offset, **attrs.asdict(cancel)}
    if rtype == RecordType.DELIVERED:
        when, attempt, message = value
        return {"dispatch_time": when, "attempt": attempt, **message_fields(message)}
    if rtype == RecordType.PARKED:
        fields = attrs.asdict(value, recurse=False)
        message = fields.pop("message")
        return {**fields, **message_fields(message)}
    return attrs.asdict(value)


def show_body(fields: dict, bodies: bool) -> dict:
    if "body" in fields:
        body = fields.pop("body")
        if bodies:
            fields["body"] = base64.b64encode(body).decode("ascii")
        else:
            fields["body_size"] = len(body)
            fields["body_crc32c"] = crc32c.crc32c(body)
    return fields


def format_time(ms: int) -> str:
    """Epoch ms as UTC ISO 8601, to the millisecond."""
    return (_EPOCH + _dt.timedelta(milliseconds=ms)).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def format_fields(fields: dict) -> str:
    parts = []
    for key, value in fields.items():
        if key.endswith("_time"):
            text = format_time(value)
        elif key == "body_crc32c":
            text = f"{value:08x}"
        elif isinstance(value, int):
            text = str(value)
        else:
            text = json.dumps(value, ensure_ascii=False, sort_keys=True)
        parts.append(f"{key}={text}")
    return "  ".join(parts)
