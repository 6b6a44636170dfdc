"""The schedules of a node and where each one has got to, followed from message_log.

Two kinds of message_log record move it, in log order, on a master and on its slaves alike (the
replayer hands the records of each pass to `feed_records`):

- SCHEDULE records, the changes: ``{"op": "put", "schedule": {...}, "from": ms}`` (create or
  replace; occurrences start after `from`, the time of the change, or the schedule's start),
  ``{"op": "pause", "name": n}``, ``{"op": "resume", "name": n, "from": ms}`` (occurrences missed
  while paused are not sent), ``{"op": "delete", "name": n}``;
- the occurrence messages themselves (id ``schedule:<name>:<time>``): each moves its schedule's
  cursor, the latest occurrence sent, to its time, and counts it.

Applying a record twice changes nothing (a put sets the whole state, an occurrence at or before
the cursor is not counted again), so a replay pass that is retried, or a restart that feeds
message_log again from the saved offset, leaves the same state.

Saved as a checkpoint file (`checkpoint/schedules.json`: written atomically, with a crc) holding
the message_log offset replay had reached; at start it is read back and message_log from that
offset on is fed again (`recover`); the cleaner keeps message_log from that offset.
"""
from __future__ import annotations

import logging
from pathlib import Path

import attrs
import trio

from delayserver.schedules.rules import parse_rule
from delayserver.schedules.spec import ID_PREFIX, ScheduleSpec, parse_occurrence_id
from delayserver.storage.checkpoint import CorruptCheckpoint, read_checkpoint, write_checkpoint
from delayserver.storage.record import (
    MESSAGE_HEAD, RecordType, decode_schedule_change, iter_checked_records,
)
from delayserver.wakeup import Wakeup

log = logging.getLogger("delayserver.schedules")

FILE_NAME = "schedules.json"
_PREFIX = ID_PREFIX.encode()
_MESSAGE_HEAD_SIZE = MESSAGE_HEAD.size


@attrs.define(eq=False)
class ScheduleState:
    spec: ScheduleSpec
    anchor: int  # the time of the definition (start, or the put): @every counts from it
    cursor: int  # the latest occurrence sent (or anchor - 1 before the first)
    emitted: int = 0
    paused: bool = False

    @property
    def rule(self):
        return parse_rule(self.spec.rule, self.spec.timezone, self.anchor)

    def to_json(self) -> dict:
        return {"schedule": self.spec.to_json(), "anchor": self.anchor, "cursor": self.cursor,
                "emitted": self.emitted, "paused": self.paused}

    @classmethod
    def from_json(cls, obj: dict) -> ScheduleState:
        return cls(ScheduleSpec.from_json(obj["schedule"], max_body_bytes=1 << 62), obj["anchor"], obj["cursor"],
                   obj["emitted"], obj["paused"])


class Registry:
    #: The id prefix of the only MESSAGE records `feed_records` looks at (occurrences).
    id_prefix = _PREFIX

    def __init__(self, checkpoint_dir: Path):
        self.path = Path(checkpoint_dir) / FILE_NAME
        self.schedules: dict[str, ScheduleState] = {}
        #: Set on every change and every occurrence: the emitter plans again.
        self.changed = Wakeup()
        #: Held by a change request and by the emitter while it sends: an occurrence of the old
        #: definition is never sent after the change cancelled what was pending.
        self.lock = trio.Lock()
        #: message_log is needed from here on to rebuild the registry (the cleaner keeps it).
        self.saved_offset = 0

    # --- following message_log ----------------------------------------------------------------

    def feed_records(self, data, records: list[tuple[int, int, int]]) -> None:
        """Apply ``(type, payload_start, payload_end)`` records of `data`, in order (the replayer's
        hook, once per pass). Most are messages of no schedule: told by their id's first bytes."""
        prefix, at, stop = _PREFIX, _MESSAGE_HEAD_SIZE, _MESSAGE_HEAD_SIZE + len(_PREFIX)
        message = RecordType.MESSAGE
        for rtype, s, e in records:
            if rtype != message or data[s + at : s + stop] == prefix:
                self.feed_record(rtype, data, s, e)

    def feed_record(self, rtype: int, data, s: int, e: int) -> None:
        """Apply one message_log record whose payload is `data[s:e]`."""
        if rtype == RecordType.SCHEDULE:
            self.apply(decode_schedule_change(data, s, e).change)
        elif rtype == RecordType.MESSAGE:
            at = s + _MESSAGE_HEAD_SIZE
            if data[at : at + len(_PREFIX)] == _PREFIX:  # the id starts right after the head
                idlen = MESSAGE_HEAD.unpack_from(data, s)[4]
                parsed = parse_occurrence_id(bytes(data[at : at + idlen]).decode("utf-8"))
                if parsed is not None:
                    self.advance(*parsed)

    def apply(self, change: dict) -> None:
        op = change.get("op")
        if op == "put":
            spec = ScheduleSpec.from_json(change["schedule"], max_body_bytes=1 << 62)
            anchor = max(change["from"], spec.start or 0)
            self.schedules[spec.name] = ScheduleState(spec, anchor, anchor - 1)
        elif op == "delete":
            self.schedules.pop(change["name"], None)
        elif op in ("pause", "resume"):
            state = self.schedules.get(change["name"])
            if state is not None:
                state.paused = op == "pause"
                if op == "resume":
                    state.cursor = max(state.cursor, change["from"] - 1)
        else:
            log.error("unknown schedule change %r: ignored", change)
            return
        self.changed.set()

    def advance(self, name: str, occurrence: int) -> None:
        """An occurrence of `name` was sent (or found in message_log)."""
        state = self.schedules.get(name)
        if state is not None and occurrence > state.cursor:
            state.cursor = occurrence
            state.emitted += 1
            self.changed.set()

    # --- durability ---------------------------------------------------------------------------

    async def save(self, offset: int) -> None:
        """Write every schedule's state, covering message_log up to `offset` (in a worker thread).
        Raises StorageError."""
        data = {"message_log_offset": offset, "schedules": [s.to_json() for s in self.schedules.values()]}
        await trio.to_thread.run_sync(write_checkpoint, self.path, data)
        self.saved_offset = offset

    def recover(self, message_log, chunk_bytes: int = 8 << 20) -> None:
        """Read the saved state, then feed message_log from the offset it covers to the end."""
        offset = None
        try:
            saved = read_checkpoint(self.path)
        except CorruptCheckpoint as e:
            log.error("%s; rebuilding the schedules from message_log", e)
            saved = None
        if saved is not None:
            self.schedules = {s["schedule"]["name"]: ScheduleState.from_json(s) for s in saved["schedules"]}
            offset = saved["message_log_offset"]
        self.saved_offset = offset = message_log.resume_offset(offset, str(self.path))
        for data in message_log.read_from(offset, chunk_bytes):
            for _, rtype, s, e in iter_checked_records(data):
                self.feed_record(rtype, data, s, e)
