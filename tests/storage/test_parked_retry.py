"""A failed park is retried with back-off until its record is durable, never raised (no crash)."""
from __future__ import annotations

import attrs
import trio

from delayserver import failpoints
from delayserver.sender.parked import ParkedLog, iter_parked
from delayserver.storage.record import Message


@attrs.define
class _Delivery:
    message: Message
    attempt: int = 3
    schedule_offset: int = 42


async def test_a_failed_park_write_is_retried_with_back_off_and_lands_once(tmp_path, autojump_clock):
    parked = ParkedLog(tmp_path / "parked")
    failpoints.set_io_faults("write:parked:EIO,write:parked:ENOSPC")  # the first two writes fail
    try:
        start = trio.current_time()
        await parked.park(_Delivery(Message("m-1", "q", b"body", 1000, {})), "rejected", 2000)
        waited = trio.current_time() - start
    finally:
        failpoints.set_io_faults("")
    parked.close()
    assert 0.3 <= waited < 1, "two failures: 0.1 s then 0.2 s of back-off"
    assert [p.message.message_id for _, p in iter_parked(tmp_path / "parked")] == ["m-1"]
