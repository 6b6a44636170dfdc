"""Status of one message by its handle: locate the bucket, read its segment and dispatch_log.

A handle (schedule time, id) names every record of that id in that bucket; a producer that sent
the same id twice for the same time has two messages and sees the state of the most advanced one.
"""
from __future__ import annotations

import attrs

from delayserver.protocol import MessageState
from delayserver.storage.buckets import bucket_start
from delayserver.storage.record import DISPATCH_HEAD, RecordType, decode_dispatch, scheduled_key
from delayserver.wheel.tick_manager import cancel_key


@attrs.frozen
class Found:
    state: MessageState
    dispatch_time: int = 0
    broker_group: str = ""
    offsets: tuple[int, ...] = ()


def lookup(store, schedule_time: int, message_id: str) -> Found:
    """What the logs say of a message. Raises CorruptSegment on damage."""
    bucket = bucket_start(schedule_time, store.segment_scale_ms)
    if bucket not in store.schedule_log.sizes:
        return Found(MessageState.UNKNOWN)
    offsets: list[int] = []
    cancelled: set[int] = set()
    for offset, rtype, payload in store.schedule_log.records(bucket):
        if rtype == RecordType.SCHEDULED:
            _, sched, _, mid = scheduled_key(payload, 0)
            if sched == schedule_time and mid == message_id:
                offsets.append(offset)
        elif rtype == RecordType.SCHEDULED_CANCEL:
            if cancel_key(payload) == (schedule_time, message_id):
                cancelled.update(offsets)
    if not offsets:
        return Found(MessageState.UNKNOWN)
    wanted = set(offsets)
    for _, rtype, payload in store.dispatch_log.records(bucket):
        if rtype == RecordType.DISPATCH and DISPATCH_HEAD.unpack_from(payload, 0)[0] in wanted:
            d = decode_dispatch(payload)
            return Found(MessageState.DELIVERED, d.dispatch_time, d.broker_group, tuple(offsets))
    if wanted <= cancelled:
        return Found(MessageState.CANCELLED, offsets=tuple(offsets))
    return Found(MessageState.PENDING, offsets=tuple(offsets))
