"""A due record damaged after it was loaded: the due queue hands it to `on_corrupt` (the node
quarantines its bucket), settles it and gives out the others, instead of stopping delivery."""
from __future__ import annotations

import pytest

from delayserver.storage.errors import CorruptSegment
from delayserver.storage.record import iter_records
from delayserver.wheel.due_queue import DueQueue
from tests.pipeline_node import START_MS, Node


def _damaged_node(tmp_path):
    node = Node(tmp_path, START_MS)
    due_at = START_MS + 500
    node.send([(f"m-{i}", due_at) for i in range(5)])
    node.replay_all()
    node.load_all()
    [bucket] = node.store.schedule_log.buckets()
    path = node.store.schedule_log.path(bucket)
    raw = bytearray(path.read_bytes())
    offsets = [pos for pos, *_ in iter_records(bytes(raw))]
    raw[offsets[2] + 30] ^= 0xFF  # inside the third record, after the loader read it
    path.write_bytes(bytes(raw))
    node.now = due_at + 10
    node.ticks.advance(node.now)
    return node, bucket


def test_an_unreadable_due_record_is_quarantined_settled_and_skipped(tmp_path):
    node, bucket = _damaged_node(tmp_path)
    quarantined = []
    due = DueQueue(node.ticks, on_corrupt=lambda b, e: quarantined.append((b, e)))
    taken = due.take(100)
    assert sorted(d.message.message_id for d in taken) == ["m-0", "m-1", "m-3", "m-4"]
    [(b, error)] = quarantined
    assert b == bucket and isinstance(error, CorruptSegment)
    assert len(node.ticks.inflight) == 4  # the damaged one is settled in memory, not owed


def test_without_on_corrupt_the_error_is_raised(tmp_path):
    node, _ = _damaged_node(tmp_path)
    with pytest.raises(CorruptSegment):
        DueQueue(node.ticks).take(100)
