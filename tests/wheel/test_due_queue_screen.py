"""The due queue's screening of what it takes: a cancelled message is dropped (a cancel applies
within its own bucket only) and a moving one held; the rest goes out as read, in due order,
whichever buckets a batch spans."""
from __future__ import annotations

from delayserver.wheel.due_queue import DueQueue
from tests.pipeline_node import SCALE_MS, START_MS, Node


def _due(node: Node, until: int) -> None:
    node.replay_all()
    node.load_all()
    node.now = until
    node.tick()


async def test_a_cancel_drops_its_message_only_in_its_own_bucket(tmp_path):
    node = Node(tmp_path, START_MS, load_ahead_ms=2 * SCALE_MS)
    first, second = START_MS + 500, START_MS + SCALE_MS + 500  # two buckets
    node.send([("x", first), ("a", first + 1), ("x", second), ("b", second + 1)])
    node.cancel("x", second)
    _due(node, second + 10)
    due = DueQueue(node.ticks)
    taken = await due.take(100)
    assert [(d.message.message_id, d.message.schedule_time) for d in taken] == [
        ("x", first), ("a", first + 1), ("b", second + 1)]
    assert len({d.bucket for d in taken}) == 2
    assert due.cancelled == 1 and node.ticks.cancelled_drops == 1


async def test_a_message_due_while_it_moves_is_held_in_a_bucket_without_cancels(tmp_path):
    node = Node(tmp_path, START_MS)
    at = START_MS + 500
    node.send([("a", at), ("m", at + 1), ("b", at + 2)])
    _due(node, at + 10)
    [bucket] = node.store.schedule_log.buckets()
    assert not node.ticks.cancels.get(bucket)
    node.ticks.begin_move(at + 1, "m")
    due = DueQueue(node.ticks)
    assert [d.message.message_id for d in await due.take(100)] == ["a", "b"]
    [held] = node.ticks.moving[(at + 1, "m")]
    node.ticks.end_move(at + 1, "m", moved=False)  # the move failed: due again
    [again] = await due.take(100)
    assert again.ref == held and again.message.message_id == "m"
