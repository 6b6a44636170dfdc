"""Browse: list messages by subject (exact or glob), delivery-time range and state, paged by a
cursor, oldest or newest first, from the indexes, never by scanning the data directory.

A page walks the buckets that meet the time range, in order, and in each the time index
(storage/time_index.py) hands out the next keys after the cursor. Each candidate is read up to its
headers (its body only when asked), matched against the subject, and its state found from the
indexes: delivered if the dispatch index has it, cancelled if the id index names a cancel of its
key after it, pending otherwise. A page stops when it is full or once it has examined
`max_examined` messages (a rare subject or state in a big bucket): its cursor then says where to
go on, so no request holds the event loop for long, and the caller pages on until the cursor is
None.

The cursor is ``<schedule_time>.<offset>`` of the last message examined: the next page starts
strictly after it, in the page's order. It stays valid while the node runs and across restarts
(segments are append-only; a cleaned bucket is simply gone).
"""
from __future__ import annotations

import fnmatch
import re

import attrs
import trio

from delayserver.lookup import read_records
from delayserver.message import InvalidMessage, MessageState
from delayserver.storage.buckets import bucket_start
from delayserver.storage.record import (
    HEADER_SIZE, SCHEDULED_HEAD, RecordType, cancel_key, decode_dispatch, decode_headers,
)
from delayserver.storage.time_index import TimeIndex, key_parts, time_key

MAX_LIMIT = 1000
MAX_EXAMINED = 10_000
READ_GUESS_BYTES = 512
STATES = {"pending": MessageState.PENDING, "delivered": MessageState.DELIVERED,
          "cancelled": MessageState.CANCELLED}
_CURSOR_RE = re.compile(r"(\d{1,15})\.(\d{1,13})")
_GLOB_CHARS = set("*?[")


class BadBrowse(InvalidMessage):
    """A browse request that cannot be answered as asked (BAD_REQUEST)."""


@attrs.frozen
class BrowseQuery:
    subject: str | None = None  # exact, or a glob (*, ?, [...])
    states: frozenset[MessageState] = frozenset({MessageState.PENDING})
    since: int | None = None  # delivery time from (inclusive), epoch ms
    until: int | None = None  # delivery time to (exclusive)
    newest_first: bool = False
    limit: int = 100
    cursor: str | None = None
    bodies: bool = False

    @classmethod
    def from_json(cls, obj) -> BrowseQuery:
        """The query of a BROWSE request body; raises BadBrowse naming what is wrong."""
        if not isinstance(obj, dict):
            raise BadBrowse("a browse request is a JSON object")
        unknown = set(obj) - {"subject", "states", "since", "until", "order", "limit", "cursor", "bodies"}
        if unknown:
            raise BadBrowse(f"unknown field {sorted(unknown)[0]!r}")
        subject = obj.get("subject")
        if subject is not None and (not isinstance(subject, str) or not 1 <= len(subject) <= 255):
            raise BadBrowse("subject: 1 to 255 characters (a glob may use * ? [...])")
        states = obj.get("states", ["pending"])
        if not isinstance(states, list) or not states or any(s not in STATES for s in states):
            raise BadBrowse(f"states: a non-empty list of {', '.join(STATES)}")
        times = {}
        for name in ("since", "until"):
            v = obj.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise BadBrowse(f"{name}: epoch milliseconds")
            times[name] = v
        order = obj.get("order", "oldest")
        if order not in ("oldest", "newest"):
            raise BadBrowse("order: 'oldest' or 'newest'")
        limit = obj.get("limit", 100)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            raise BadBrowse(f"limit: 1 to {MAX_LIMIT}")
        cursor = obj.get("cursor")
        if cursor is not None and (not isinstance(cursor, str) or not _CURSOR_RE.fullmatch(cursor)):
            raise BadBrowse("cursor: the cursor a previous page returned")
        bodies = obj.get("bodies", False)
        if not isinstance(bodies, bool):
            raise BadBrowse("bodies: true or false")
        return cls(subject, frozenset(STATES[s] for s in states), times["since"], times["until"],
                   order == "newest", limit, cursor, bodies)

    def matches_subject(self, subject: str) -> bool:
        if self.subject is None:
            return True
        if _GLOB_CHARS.isdisjoint(self.subject):
            return subject == self.subject
        return fnmatch.fnmatchcase(subject, self.subject)


@attrs.frozen
class Listed:
    """One message of a page."""

    message_id: str
    subject: str
    schedule_time: int
    store_time: int
    state: MessageState
    headers: dict
    body: bytes | None = None
    dispatch_time: int = 0
    broker_group: str = ""


@attrs.frozen
class Page:
    messages: list[Listed]
    cursor: str | None  # None: nothing more
    examined: int


class Browser:
    """Pages of a store's messages, from its time index and the id and dispatch indexes."""

    def __init__(self, store, lookup, time_index: TimeIndex):
        self.store = store
        self.lookup = lookup
        self.times = time_index

    async def page(self, q: BrowseQuery, *, max_examined: int = MAX_EXAMINED) -> Page:
        scale = self.store.segment_scale_ms
        lo_time = q.since if q.since is not None else 0
        hi_time = q.until if q.until is not None else 1 << 62
        after = None
        if q.cursor is not None:
            t, off = (int(x) for x in q.cursor.split("."))
            after = (t, off)
        buckets = [b for b in self.store.schedule_log.buckets()
                   if b + scale > lo_time and b < hi_time]
        if q.newest_first:
            buckets.reverse()
        if after is not None:
            cb = bucket_start(after[0], scale)
            buckets = [b for b in buckets if (b <= cb if q.newest_first else b >= cb)]
        out: list[Listed] = []
        examined = 0
        last = None
        for bucket in buckets:
            await self.times.ensure(bucket)
            await self.lookup.ids.ensure(bucket)
            await self.lookup.dispatches.ensure(bucket)
            lo = time_key(max(lo_time, bucket), scale, 0) if lo_time > bucket else 0
            hi = time_key(hi_time, scale, 0) if hi_time < bucket + scale else 1 << 63
            if after is not None and bucket_start(after[0], scale) == bucket:
                k = time_key(after[0], scale, after[1])
                if q.newest_first:
                    hi = min(hi, k)
                else:
                    lo = max(lo, k + 1)
            while True:
                want = min(q.limit - len(out), max_examined - examined)
                keys = self.times.page(bucket, lo, hi, want, q.newest_first)
                for key in keys:
                    examined += 1
                    sched, offset = key_parts(bucket, key)
                    last = (sched, offset)
                    item = await self._examine(q, bucket, offset, sched)
                    if item is not None:
                        out.append(item)
                if keys:
                    if q.newest_first:
                        hi = keys[-1]
                    else:
                        lo = keys[-1] + 1
                if len(out) >= q.limit or examined >= max_examined:
                    return Page(out, f"{last[0]}.{last[1]}", examined)
                if len(keys) < want:
                    break
                await trio.lowlevel.checkpoint()
        return Page(out, None, examined)

    async def _examine(self, q: BrowseQuery, bucket: int, offset: int, sched: int) -> Listed | None:
        """The message at `offset` if it matches the query (read up to its headers, its body
        only when the query asks for bodies)."""
        log_ = self.store.schedule_log
        data = await _read(log_, bucket, offset, offset + READ_GUESS_BYTES)
        s = HEADER_SIZE
        _mlo, store, _sched, _seq, _flags, idlen, slen, hlen, blen = SCHEDULED_HEAD.unpack_from(data, s)
        at = s + SCHEDULED_HEAD.size
        need = at + idlen + slen + hlen + (blen if q.bodies else 0)
        if need > len(data):
            data = await _read(log_, bucket, offset, offset + need)
        message_id = data[at : at + idlen].decode("utf-8")
        subject = data[at + idlen : at + idlen + slen].decode("utf-8")
        if not q.matches_subject(subject):
            return None
        state, dispatch_time, group = await self._state(bucket, offset, sched, message_id)
        if state not in q.states:
            return None
        h_at = at + idlen + slen
        headers = decode_headers(data[h_at : h_at + hlen]) if hlen else {}
        body = bytes(data[h_at + hlen : h_at + hlen + blen]) if q.bodies else None
        return Listed(message_id, subject, sched, store, state, headers, body, dispatch_time, group)

    async def _state(self, bucket: int, offset: int, sched: int, message_id: str) -> tuple[MessageState, int, str]:
        log_ = self.store.schedule_log
        position = self.lookup.dispatches.first(bucket, offset)
        if position is not None:
            [(_, data, s, e)] = await read_records(self.store.dispatch_log, bucket, [position])
            d = decode_dispatch(data, s, e)
            return MessageState.DELIVERED, d.dispatch_time, d.broker_group
        for other in self.lookup.ids.candidates(bucket, sched, message_id):
            if other > offset:
                [(rtype, data, s, _)] = await read_records(log_, bucket, [other])
                if rtype == RecordType.SCHEDULED_CANCEL and cancel_key(data, s) == (sched, message_id):
                    return MessageState.CANCELLED, 0, ""
        return MessageState.PENDING, 0, ""


async def _read(log_, bucket: int, start: int, end: int) -> bytes:
    """`log_.read(bucket, start, end)` from the page cache on the event loop, or in a worker
    thread when the disk must be read: a page of a big bucket, mostly on disk, never holds the
    loop while the disk seeks."""
    data = log_.read_cached(bucket, start, end)
    if data is None:
        data = await trio.to_thread.run_sync(log_.range_reader(bucket, start, end))
    return data
