"""Finding the divergence point, leader-epoch style, between two message_logs (pure logic: the
master's answer is computed from a real log in memory, without a socket; the processes test is
test_divergence_processes.py), and the quarantine of the divergent suffix."""
from __future__ import annotations

import json
import types

import pytest
import trio

from delayserver import protocol as p
from delayserver.node.divergence import answer_epoch_end, find_divergence, list_diverged, quarantine_suffix
from delayserver.storage.message_log import MessageLog
from delayserver.storage.record import Cancel, RecordType, encode_cancel, encode_epoch_record, encode_record
from tests.damage import message_record


def build(path, batches) -> MessageLog:
    """A log of `batches`: (epoch, message numbers); returns it open."""
    log = MessageLog.open(path, 1 << 20)
    for epoch, numbers in batches:
        log.append(encode_epoch_record(epoch) + b"".join(message_record(i) for i in numbers), epoch)
    return log


class Master:
    """What a slave's connection reaches: a master's answer to SYNC_EPOCH_END."""

    def __init__(self, log: MessageLog):
        self.store = types.SimpleNamespace(message_log=log)
        self.receiver = types.SimpleNamespace(durable_offset=log.end_offset)
        self.asked: list[int] = []

    async def request(self, command, payload: bytes) -> bytes:
        assert command == p.Command.SYNC_EPOCH_END
        self.asked.append(int.from_bytes(payload, "big"))
        return answer_epoch_end(self.store, self.receiver, payload)


def offset_of(log: MessageLog, number: int) -> int:
    wanted = message_record(number)
    return next(off for off, rtype, payload in log.iter_from(0)
                if rtype == RecordType.MESSAGE and payload == wanted[9:])


def diverge(replica: MessageLog, master: MessageLog) -> tuple[int, list[int]]:
    conn = Master(master)
    return trio.run(find_divergence, conn, replica), conn.asked


def test_logs_that_agree_have_no_divergence(tmp_path):
    common = [(1, [0, 1]), (2, [2])]
    master = build(tmp_path / "m", common + [(3, [3])])
    replica = build(tmp_path / "s", common)
    assert diverge(replica, master) == (replica.end_offset, [2])


def test_a_longer_replica_of_the_same_epoch_is_cut_at_the_masters_end_of_it(tmp_path):
    master = build(tmp_path / "m", [(1, [0, 1])])
    replica = build(tmp_path / "s", [(1, [0, 1]), (1, [2, 3])])
    assert diverge(replica, master)[0] == master.end_offset


def test_a_shorter_forked_replica_is_cut_where_the_new_epoch_began(tmp_path):
    master = build(tmp_path / "m", [(1, [0, 1]), (2, [5, 6, 7, 8, 9])])
    replica = build(tmp_path / "s", [(1, [0, 1]), (1, [2])])
    point, _ = diverge(replica, master)
    assert point == offset_of(replica, 2) - len(encode_epoch_record(1)) < replica.end_offset < master.end_offset


def test_divergence_across_several_epochs_takes_several_rounds(tmp_path):
    # Kafka's KIP-279 case: the replica's epoch 3 is unknown to the master, whose epoch 2 began
    # inside what the replica holds as epoch 1.
    master = build(tmp_path / "m", [(1, [0, 1]), (2, [2, 3]), (4, [4])])
    replica = build(tmp_path / "s", [(1, [0, 1]), (1, [12, 13]), (3, [14])])
    point, asked = diverge(replica, master)
    assert point == master.epochs.end_offset_for(1, master.end_offset)[1]
    assert asked == [3, 1, 1]


def test_logs_from_before_epochs_compare_by_length_only(tmp_path):
    master = MessageLog.open(tmp_path / "m", 1 << 20)
    replica = MessageLog.open(tmp_path / "s", 1 << 20)
    master.append(message_record(0))
    replica.append(message_record(0) + message_record(1))
    assert diverge(replica, master)[0] == master.end_offset


def test_only_the_masters_durable_records_count(tmp_path):
    master = build(tmp_path / "m", [(1, [0, 1])])
    conn = Master(master)
    conn.receiver.durable_offset = offset_of(master, 1)
    replica = build(tmp_path / "s", [(1, [0, 1])])
    assert trio.run(find_divergence, conn, replica) == offset_of(master, 1)


@pytest.mark.parametrize("payload", [b"", b"\x00" * 7, b"\x00" * 9])
def test_a_malformed_request_is_a_protocol_error(tmp_path, payload):
    conn = Master(build(tmp_path / "m", [(1, [0])]))
    with pytest.raises(p.RemoteProtocolError):
        answer_epoch_end(conn.store, conn.receiver, payload)


def test_the_quarantine_copies_the_suffix_byte_for_byte_and_names_every_message_and_cancel(tmp_path):
    log = build(tmp_path / "s", [(1, [0, 1]), (2, [2, 3])])
    start = offset_of(log, 1)
    log.append(encode_epoch_record(2) + encode_record(RecordType.CANCEL, encode_cancel(Cancel("m-0", 1_800_000_000_000))))
    listing = quarantine_suffix(tmp_path / "data", log, start, "10.0.0.2:20801")
    [doc] = list_diverged(tmp_path / "data")
    assert doc["listing"] == str(listing) and doc["master"] == "10.0.0.2:20801"
    assert [(m["message_id"], m["epoch"]) for m in doc["messages"]] == [("m-1", 1), ("m-2", 2), ("m-3", 2)]
    assert [(c["message_id"], c["epoch"]) for c in doc["cancels"]] == [("m-0", 2)]
    raw = (listing.parent / doc["segment"]).read_bytes()
    assert raw == log.read(start, 1 << 20)[0]
    assert (doc["from_offset"], doc["to_offset"]) == (start, log.end_offset)
    assert json.loads(listing.read_text())["messages"][0]["offset"] == start
