"""What a recurring schedule is, and the checks a definition passes before it is stored.

A definition, as JSON (the protocol, the HTTP API, the saved registry)::

    {"name": "nightly-report", "subject": "reports.nightly", "body": "<base64>", "headers": {},
     "rule": "0 2 * * *", "timezone": "Europe/Berlin", "start": null, "end": null, "count": null,
     "catch_up": "one"}

- name: 1-64 of ``[A-Za-z0-9._-]``; each occurrence's message id is ``schedule:<name>:<time>``
  (the occurrence time in epoch ms), so that a restart never sends an occurrence twice.
- start / end (epoch ms): no occurrence before start or at or after end. count: at most that
  many occurrences from the definition on (an update starts the count again).
- catch_up: what happens to occurrences missed while the node was down (or the schedule's start
  lies in the past): ``skip`` them, send the latest ``one`` of them, or send ``all`` of them (at
  most MAX_CATCH_UP), each at once; then the schedule goes on with its next future occurrence.
"""
from __future__ import annotations

import base64
import binascii
import re

import attrs

from delayserver.message import DEFAULT_MAX_BODY_BYTES, InvalidMessage, MAX_TIME_MS, encode_subject
from delayserver.schedules.rules import BadRule, parse_rule, time_zone
from delayserver.storage.record import encode_headers

NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
CATCH_UP = ("skip", "one", "all")
MAX_CATCH_UP = 1000
ID_PREFIX = "schedule:"


class BadSchedule(InvalidMessage):
    """A schedule definition or request that cannot be taken (BAD_REQUEST); says why."""


def occurrence_id(name: str, occurrence_ms: int) -> str:
    return f"{ID_PREFIX}{name}:{occurrence_ms}"


def parse_occurrence_id(message_id: str) -> tuple[str, int] | None:
    """(name, occurrence time) of an occurrence's message id, or None for another id."""
    if not message_id.startswith(ID_PREFIX):
        return None
    name, _, when = message_id[len(ID_PREFIX):].rpartition(":")
    if not NAME_RE.fullmatch(name) or not when.isdigit():
        return None
    return name, int(when)


@attrs.frozen
class ScheduleSpec:
    name: str
    subject: str
    rule: str
    body: bytes = b""
    headers: dict = attrs.field(factory=dict)
    timezone: str = "UTC"
    start: int | None = None
    end: int | None = None
    count: int | None = None
    catch_up: str = "one"

    def to_json(self) -> dict:
        return {"name": self.name, "subject": self.subject, "body": base64.b64encode(self.body).decode("ascii"),
                "headers": dict(self.headers), "rule": self.rule, "timezone": self.timezone, "start": self.start,
                "end": self.end, "count": self.count, "catch_up": self.catch_up}

    @classmethod
    def from_json(cls, obj, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> ScheduleSpec:
        """The definition `obj` describes; raises BadSchedule (or another InvalidMessage: a bad
        subject or headers) naming what is wrong."""
        if not isinstance(obj, dict):
            raise BadSchedule("a schedule is a JSON object")
        unknown = set(obj) - {"name", "subject", "body", "headers", "rule", "timezone", "start", "end", "count",
                              "catch_up"}
        if unknown:
            raise BadSchedule(f"unknown field {sorted(unknown)[0]!r}")
        name = obj.get("name")
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise BadSchedule("name: 1 to 64 of [A-Za-z0-9._-]")
        encode_subject(obj.get("subject"))
        try:
            body = base64.b64decode(obj.get("body") or "", validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise BadSchedule("body: base64") from None
        if len(body) > max_body_bytes:
            raise BadSchedule(f"body: {len(body)} bytes, over the limit of {max_body_bytes}")
        headers = obj.get("headers") or {}
        encode_headers(headers)
        zone = obj.get("timezone") or "UTC"
        times = {}
        for field in ("start", "end"):
            v = obj.get(field)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TIME_MS):
                raise BadSchedule(f"{field}: epoch milliseconds")
            times[field] = v
        if times["start"] is not None and times["end"] is not None and times["end"] <= times["start"]:
            raise BadSchedule("end: must be after start")
        count = obj.get("count")
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise BadSchedule("count: a whole number from 1")
        catch_up = obj.get("catch_up") or "one"
        if catch_up not in CATCH_UP:
            raise BadSchedule(f"catch_up: one of {', '.join(CATCH_UP)}")
        try:
            time_zone(zone) if isinstance(zone, str) else time_zone("")
            parse_rule(obj.get("rule"), zone, 0)
        except BadRule as e:
            raise BadSchedule(str(e)) from None
        return cls(name, obj["subject"], " ".join(obj["rule"].split()), body, dict(headers), zone,
                   times["start"], times["end"], count, catch_up)
