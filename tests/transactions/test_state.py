"""Half-message state and the transactional codecs, as pure logic: records applied in order, the
checkpoint snapshot, the check schedule, and the wire payloads."""
from __future__ import annotations

import pytest

from delayserver import protocol as p
from delayserver.message import MessageState, ResultCode, TimeKind, TimeSpec, TransactionState
from delayserver.storage.record import (
    Cancel, Message, ParkReason, RecordType, TxnCheck, TxnPark, encode_cancel, encode_message, encode_prepare,
    encode_record, encode_txn_check, encode_txn_park, iter_records,
)
from delayserver.transactions import state as state_module
from delayserver.transactions.state import Count, HalfMessages

T = 1_795_000_000_000
HOUR = 3_600_000


def prepare(mid: str, store: int = T, sched: int = T + HOUR, immunity: int = 0, group: str = "orders") -> bytes:
    return encode_prepare(group, immunity, encode_message(Message(mid, "s", b"body", sched, {}, store)))


def commit(mid: str, sched: int = T + HOUR) -> bytes:
    return encode_message(Message(mid, "s", b"body", sched, {}, T + 5))


def apply_all(halves: HalfMessages, records: list[tuple[int, bytes]]) -> None:
    buf = b"".join(encode_record(t, payload) for t, payload in records)
    for offset, rtype, s, e in iter_records(buf):
        halves.apply(offset, rtype, buf, s, e)


def test_records_open_check_and_resolve_half_messages_in_order():
    halves = HalfMessages(HOUR)
    apply_all(halves, [
        (RecordType.PREPARE, prepare("a")), (RecordType.PREPARE, prepare("b")), (RecordType.PREPARE, prepare("c")),
        (RecordType.PREPARE, prepare("a")),  # a second PREPARE of an open one opens nothing
        (RecordType.TXN_CHECK, encode_txn_check(TxnCheck("a", T + HOUR, 1, T + 6000))),
        (RecordType.COMMIT, commit("a")),
        (RecordType.COMMIT, commit("a")),  # resolved once
        (RecordType.ROLLBACK, encode_cancel(Cancel("b", T + HOUR, T + 7))),
        (RecordType.COMMIT, commit("b")),  # too late: rolled back stays rolled back
        (RecordType.TXN_PARK, encode_txn_park(TxnPark("c", T + HOUR, ParkReason.CHECK_MAX, T + 9))),
        (RecordType.ROLLBACK, encode_cancel(Cancel("c", T + HOUR, T + 10))),  # parked stays parked
    ])
    assert halves.outcome((T + HOUR, "a")) == TransactionState.COMMIT
    assert halves.outcome((T + HOUR, "b")) == TransactionState.ROLLBACK
    assert halves.outcome((T + HOUR, "c")) == TransactionState.PARKED
    assert halves.unresolved() == [] and [h.message_id for h in halves.to_park] == ["c"]
    assert halves.totals() == [3, 1, 1, 1, 1]
    parked = halves.to_park[0]
    assert halves.pinned_offset == parked.offset  # kept until its PARKED record is written
    halves.parked_written(parked)
    assert halves.open == {} and halves.pinned_offset is None


def test_the_first_check_comes_after_the_timeout_or_the_immunity_then_every_interval():
    halves = HalfMessages(HOUR)
    apply_all(halves, [(RecordType.PREPARE, prepare("a")), (RecordType.PREPARE, prepare("b", immunity=60_000))])
    a, b = halves.open[(T + HOUR, "a")], halves.open[(T + HOUR, "b")]
    assert a.next_check_time(6000, 60_000) == T + 6000
    assert b.next_check_time(6000, 60_000) == T + 60_000
    apply_all(halves, [(RecordType.TXN_CHECK, encode_txn_check(TxnCheck("a", T + HOUR, 1, T + 6100)))])
    assert (a.checks, a.next_check_time(6000, 60_000)) == (1, T + 66_100)


def test_a_snapshot_restores_the_same_state_and_what_is_left_to_park():
    halves = HalfMessages(HOUR)
    apply_all(halves, [
        (RecordType.PREPARE, prepare("a")), (RecordType.PREPARE, prepare("b")), (RecordType.PREPARE, prepare("c")),
        (RecordType.TXN_CHECK, encode_txn_check(TxnCheck("a", T + HOUR, 2, T + 6000))),
        (RecordType.COMMIT, commit("b")),
        (RecordType.TXN_PARK, encode_txn_park(TxnPark("c", T + HOUR, ParkReason.RETENTION, T + 9))),
    ])
    again = HalfMessages(HOUR)
    again.restore(halves.snapshot())
    assert again.snapshot() == halves.snapshot()
    assert [(h.message_id, h.parking) for h in again.to_park] == [("c", ParkReason.RETENTION)]
    assert again.open[(T + HOUR, "a")].checks == 2
    assert again.counts == {T + HOUR - (T + HOUR) % HOUR: [3, 1, 0, 1, 1]}
    assert again.pinned_offset == min(h.offset for h in halves.open.values())


def test_resolutions_are_remembered_only_so_far_back(monkeypatch):
    monkeypatch.setattr(state_module, "REMEMBERED_RESOLUTIONS", 2)
    halves = HalfMessages(HOUR)
    records = []
    for mid in "abc":
        records += [(RecordType.PREPARE, prepare(mid)), (RecordType.ROLLBACK, encode_cancel(Cancel(mid, T + HOUR)))]
    apply_all(halves, records)
    assert [k[1] for k in halves.resolved] == ["b", "c"]
    assert halves.counts[T + HOUR - (T + HOUR) % HOUR][Count.ROLLED_BACK] == 3


def test_transactional_payloads_round_trip_on_the_wire():
    item = p.SendItem("id-1", "orders.expire", TimeSpec(TimeKind.DELAY, 5000), b"body", {"k": "v"})
    assert p.decode_prepare_request(p.encode_prepare_request("orders", 30_000, item)) == ("orders", 30_000, item)
    result = p.TransactionResult(ResultCode.TXN_RESOLVED, "already rolled back", TransactionState.ROLLBACK)
    assert p.decode_transaction_response(p.encode_transaction_response(result)) == result
    check = p.CheckRequest("orders", 3, p.SendItem("id-1", "s", TimeSpec(TimeKind.AT, T), b"b", {}))
    assert p.decode_check_request(p.encode_check_request(check)) == check
    for state in (TransactionState.COMMIT, TransactionState.ROLLBACK, TransactionState.UNKNOWN):
        assert p.decode_check_response(p.encode_check_response(state)) == state
    assert p.decode_register_request(p.encode_register_request("orders")) == "orders"
    prepared = p.StatusResult(ResultCode.OK, "prepared", MessageState.PREPARED, 0, "", 2, T + 60_000)
    assert p.decode_status_response(p.encode_status_response(prepared)) == prepared


@pytest.mark.parametrize("decode, payload", [
    (p.decode_prepare_request, b""),
    (p.decode_prepare_request, b"\x00\x01g" + bytes(8) + p.encode_send_request([])),  # no message
    (p.decode_transaction_response, b"\x00\x00\x09\x00\x00\x00\x00"),  # state 9
    (p.decode_check_request, b"\x00\x00\x00\x01"),
    (p.decode_check_response, b"\x04"),  # PARKED is not an answer
    (p.decode_check_response, b"\x01\x01"),
    (p.decode_register_request, b"\x00\x05ab"),
])
def test_bad_transactional_payloads_are_protocol_errors(decode, payload):
    with pytest.raises(p.RemoteProtocolError):
        decode(payload)
