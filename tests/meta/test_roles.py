"""Roles and epochs as pure functions: grants, promotion, fencing, and the invariants under any
sequence of registrations, heartbeats and expiries."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delayserver.meta import roles
from delayserver.meta.store import NodeState, Role


def reg(group, nodes, node_id, *, now=0, eligible=True, session=None):
    return roles.register(group, nodes, name="g", node_id=node_id, address=f"{node_id}:1", eligible=eligible,
                          session=session or f"{node_id}-{now}", now_ms=now)


def node(nodes, node_id):
    return next(n for n in nodes if n.node_id == node_id)


def told(group, nodes, node_id):
    return roles.role_of(group, node(nodes, node_id)), group.master_epoch


def test_the_first_node_becomes_master_with_epoch_1_and_the_next_a_slave():
    group, nodes = reg(None, [], "a")
    assert told(group, nodes, "a") == (Role.MASTER, 1)
    group, nodes = reg(group, nodes, "b")
    assert told(group, nodes, "b") == (Role.SLAVE, 1)
    assert told(group, nodes, "a") == (Role.MASTER, 1)


def test_a_node_wanting_slave_is_never_master():
    group, nodes = reg(None, [], "a", eligible=False)
    assert told(group, nodes, "a") == (Role.SLAVE, 0)
    assert roles.master_of(nodes) is None
    group, nodes = reg(group, nodes, "b")
    assert told(group, nodes, "b") == (Role.MASTER, 1)


def test_an_expired_master_is_replaced_by_a_live_slave_with_a_new_epoch():
    group, nodes = reg(None, [], "a", now=0)
    group, nodes = reg(group, nodes, "b", now=0)
    group, nodes = roles.heartbeat(group, nodes, node_id="b", session="b-0", now_ms=100)
    group, nodes = roles.expire(group, nodes, deadline_ms=50)
    assert node(nodes, "a").state is NodeState.DOWN
    assert told(group, nodes, "b") == (Role.MASTER, 2)
    assert told(group, nodes, "a") == (Role.SLAVE, 2)


def test_a_returning_old_master_is_told_it_is_a_slave_at_the_new_epoch():
    group, nodes = reg(None, [], "a", now=0)
    group, nodes = reg(group, nodes, "b", now=0)
    group, nodes = roles.heartbeat(group, nodes, node_id="b", session="b-0", now_ms=100)
    group, nodes = roles.expire(group, nodes, deadline_ms=50)
    group, nodes = roles.heartbeat(group, nodes, node_id="a", session="a-0", now_ms=200)
    assert told(group, nodes, "a") == (Role.SLAVE, 2)
    assert node(nodes, "a").state is NodeState.UP
    group, nodes = reg(group, nodes, "a", now=300)
    assert told(group, nodes, "a") == (Role.SLAVE, 2)


def test_a_master_marked_down_with_no_one_to_take_over_keeps_its_epoch_on_return():
    group, nodes = reg(None, [], "a", now=0)
    group, nodes = roles.expire(group, nodes, deadline_ms=10)
    assert node(nodes, "a").state is NodeState.DOWN
    group, nodes = roles.heartbeat(group, nodes, node_id="a", session="a-0", now_ms=20)
    assert told(group, nodes, "a") == (Role.MASTER, 1)


def test_a_slave_coming_up_while_the_master_is_down_takes_over():
    group, nodes = reg(None, [], "a", now=0)
    group, nodes = roles.expire(group, nodes, deadline_ms=10)
    group, nodes = reg(group, nodes, "b", now=20)
    assert told(group, nodes, "b") == (Role.MASTER, 2)
    assert told(group, nodes, "a") == (Role.SLAVE, 2)


def test_a_master_registering_again_stays_master_with_a_new_epoch_and_fences_its_old_session():
    group, nodes = reg(None, [], "a", now=0)
    group, nodes = reg(group, nodes, "b", now=0)
    group, nodes = reg(group, nodes, "a", now=5, session="a-new")
    assert told(group, nodes, "a") == (Role.MASTER, 2)
    with pytest.raises(roles.NotRegistered, match="registered again"):
        roles.heartbeat(group, nodes, node_id="a", session="a-0", now_ms=6)


def test_heartbeats_from_unknown_nodes_are_refused():
    with pytest.raises(roles.NotRegistered):
        roles.heartbeat(None, [], node_id="a", session="x", now_ms=0)
    group, nodes = reg(None, [], "a")
    with pytest.raises(roles.NotRegistered):
        roles.heartbeat(group, nodes, node_id="b", session="x", now_ms=0)


def test_promotion_picks_the_smallest_live_eligible_node_id():
    group, nodes = reg(None, [], "m", now=0)
    for n in ("c", "b", "a"):
        group, nodes = reg(group, nodes, n, now=100, eligible=n != "a")
    group, nodes = roles.expire(group, nodes, deadline_ms=50)
    assert roles.master_of(nodes).node_id == "b"


events = st.lists(
    st.tuples(st.sampled_from(["register", "heartbeat", "expire"]), st.sampled_from("abc"), st.booleans()),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(events)
def test_roles_never_two_masters(steps):
    """Whatever happens: at most one node is told master, at the current epoch; epochs only grow;
    and a node is told master at an epoch only if that epoch was granted to it."""
    group, nodes, now = None, [], 0
    sessions = {}
    granted = {}  # epoch -> node id
    for op, node_id, eligible in steps:
        now += 10
        before = group.master_epoch if group else 0
        if op == "register":
            sessions[node_id] = f"{node_id}-{now}"
            group, nodes = reg(group, nodes, node_id, now=now, eligible=eligible, session=sessions[node_id])
        elif op == "heartbeat" and node_id in sessions:
            try:
                group, nodes = roles.heartbeat(group, nodes, node_id=node_id, session=sessions[node_id], now_ms=now)
            except roles.NotRegistered:
                pass
        elif op == "expire" and group is not None:
            group, nodes = roles.expire(group, nodes, deadline_ms=now - 15)
        if group is None:
            continue
        assert group.master_epoch >= before
        masters = [n for n in nodes if roles.role_of(group, n) is Role.MASTER]
        assert len(masters) <= 1
        if group.master_epoch > before:
            assert group.master_epoch == before + 1
            granted[group.master_epoch] = masters[0].node_id
        for m in masters:
            assert granted[group.master_epoch] == m.node_id
            assert m.eligible
