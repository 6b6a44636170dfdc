"""The fault suite's checker on hand-made histories: one test per rule, each with a history that
keeps it and one that breaks it."""
from __future__ import annotations

from tests.jepsen.checker import Ack, Bounds, CancelAck, Delivery, Fault, History, Term, check, check_quarantine

BOUNDS = Bounds(in_flight_before_ms=100, in_flight_after_ms=200, max_per_fault=2)


def history(*ids: str, due: int = 1000) -> History:
    h = History(sent=set(ids), terms=[Term("n1", 1, 0, 5000), Term("n2", 2, 5000)])
    for i in ids:
        h.acks[i] = Ack(i, due, due, "n1", 10)
    return h


def deliver(h: History, message_id: str, at: int, node: str = "n1", due: int = 1000, intact: bool = True) -> None:
    h.deliveries.append(Delivery(message_id, node, due, at, intact))


def test_a_clean_history_breaks_no_rule_in_either_mode():
    h = history("a", "b")
    deliver(h, "a", 1000)
    deliver(h, "b", 1003)
    v = check(h, BOUNDS)
    assert v.problems("sync") == [] and v.problems("async") == []
    assert (v.acked, v.delivered_ids, v.deliveries) == (2, 2, 2)


def test_an_acknowledged_id_never_delivered_is_lost_which_only_sync_mode_refuses():
    h = history("a", "b")
    deliver(h, "a", 1000)
    v = check(h, BOUNDS)
    assert v.lost == ["b"]
    assert any(p.startswith("acknowledged but never delivered (1): b") for p in v.problems("sync"))
    assert v.problems("async") == []


def test_a_cancelled_or_maybe_cancelled_id_is_not_lost_but_a_cancelled_one_must_not_arrive():
    h = history("a", "b", "c")
    h.cancels["a"] = CancelAck("a", "CANCELLED", "n1", 20)
    h.cancel_unknown.add("b")
    deliver(h, "c", 1000)
    assert check(h, BOUNDS).problems("sync") == []
    deliver(h, "a", 1000)
    v = check(h, BOUNDS)
    assert v.cancel_violations == ["a"]
    assert any("delivered after an acknowledged cancel" in p for p in v.problems("sync"))


def test_a_cancel_that_lost_the_race_does_not_excuse_a_missing_delivery():
    h = history("a")
    h.cancels["a"] = CancelAck("a", "ALREADY_DELIVERED", "n1", 20)
    assert check(h, BOUNDS).lost == ["a"]


def test_early_unknown_and_corrupt_deliveries_are_refused_in_both_modes():
    h = history("a", "b", "c", due=1000)
    h.sent.add("d")
    deliver(h, "a", 999)  # before its time
    deliver(h, "b", 1500, due=900)  # scheduled earlier than the acknowledged handle
    deliver(h, "c", 1000, intact=False)
    deliver(h, "x", 1000)  # never sent
    deliver(h, "d", 1200, due=1000)  # sent, answer lost: fine to deliver
    v = check(h, BOUNDS)
    assert [e.split("@")[0] for e in v.early] == ["a", "b"]
    assert v.corrupt == ["c"] and v.unknown == ["x"]
    for mode in ("sync", "async"):
        problems = " ".join(v.problems(mode))
        assert "delivered early (2)" in problems and "corrupt (1)" in problems
        assert "delivered but never sent (1)" in problems


def test_a_redelivery_is_excused_only_when_the_first_delivery_was_in_flight_at_a_fault():
    h = history("a", "b")
    h.faults.append(Fault("kill_master", "n1", 2000, 2100))
    deliver(h, "a", 1950)  # 50 ms before the fault: in flight
    deliver(h, "a", 2500, node="n2")
    deliver(h, "b", 1000)  # a second before: no excuse
    deliver(h, "b", 2600, node="n2")
    v = check(h, BOUNDS)
    assert v.redeliveries_per_fault == {0: 1}
    assert [r.split(":")[0] for r in v.unexplained_redeliveries] == ["b"]
    assert any("redelivered with no fault in flight (1)" in p for p in v.problems("async"))


def test_a_redelivery_by_the_same_node_at_the_same_moment_is_never_excused_without_a_fault():
    h = history("a")
    deliver(h, "a", 1000)
    deliver(h, "a", 1000)
    v = check(h, BOUNDS)
    assert len(v.unexplained_redeliveries) == 1 and v.cross_epoch == []


def test_a_delivery_while_the_fault_lasts_counts_as_in_flight():
    h = history("a")
    h.faults.append(Fault("partition_master", "n1", 2000, 4000))
    deliver(h, "a", 3500)  # the isolated master, before its lease ran out
    deliver(h, "a", 5200, node="n2")
    v = check(h, BOUNDS)
    assert v.unexplained_redeliveries == [] and v.redeliveries_per_fault == {0: 1}


def test_more_redeliveries_for_one_fault_than_the_bound_are_refused():
    ids = [f"m{i}" for i in range(3)]
    h = history(*ids)
    h.faults.append(Fault("kill_master", "n1", 2000, 2000))
    for i in ids:
        deliver(h, i, 1990)
        deliver(h, i, 2400, node="n2")
    v = check(h, BOUNDS)
    assert v.redeliveries_per_fault == {0: 3}
    assert v.over_bound == ["kill_master@2000: 3"]
    assert any("more redeliveries for one fault than the bound" in p for p in v.problems("sync"))


def test_deliveries_under_two_epochs_are_counted_and_refused_outside_a_fault():
    h = history("a", "b")
    h.faults.append(Fault("pause_master", "n1", 4900, 5300))
    deliver(h, "a", 4950)  # n1, epoch 1, in flight at the pause
    deliver(h, "a", 5100, node="n2")  # n2, epoch 2
    deliver(h, "b", 5600)  # n1 after n2's epoch began, past the fault: a deposed master
    deliver(h, "b", 6000, node="n2")
    v = check(h, BOUNDS)
    assert v.cross_epoch == ["a", "b"]
    assert v.cross_epoch_unexplained == ["b"]
    assert v.deposed_deliveries == 1
    assert any("delivered under two epochs with no fault in flight (1): b" in p for p in v.problems("sync"))


def test_the_quarantine_must_name_every_lost_id_and_only_ids_that_were_sent():
    h = history("a", "b", "c")
    assert check_quarantine(["a", "b"], {"a", "b", "c"}, h) == {}
    assert check_quarantine(["a", "b"], {"a", "zz"}, h) == {"lost but not quarantined": ["b"],
                                                            "quarantined but never sent": ["zz"]}


def test_a_group_that_takes_no_write_after_the_last_fault_is_refused():
    h = history("a")
    deliver(h, "a", 1000)
    h.faults.append(Fault("partition_slave", "n2", 3000, 4000))
    v = check(h, BOUNDS)
    assert v.unavailable == ["partition_slave@3000-4000"]
    assert any("nothing acknowledged after the last fault" in p for p in v.problems("async"))
    h.acks["b"] = Ack("b", 5000, 5000, "n1", 4500)
    h.sent.add("b")
    deliver(h, "b", 5000)
    v = check(h, BOUNDS)
    assert v.unavailable == [] and v.acked_after_faults == 1
