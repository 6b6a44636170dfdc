"""Roles and epochs of the nodes of one delay group, as pure functions of the group's state.

Rules (each function takes the group and its nodes and returns them changed):

- A grant of mastership always comes with a new epoch: `master_epoch + 1`. The first live eligible
  node of a group becomes master with epoch 1.
- At most one node of a group has the role master; its `epoch` is the group's `master_epoch`.
  Granting mastership to a node makes any former master a slave in the same step.
- A group whose master is down (or that has none) promotes a live eligible node, if there is one:
  the registering node first, else the live eligible node with the smallest node id.
- A node that registers again gets a new session; heartbeats from the older session are refused
  (`NotRegistered`), so an older incarnation of a node is never told it is master. A master that
  registers again stays master, with a new epoch.
- A node id is bound to its session while the node is live (up, heard from after `live_after_ms`):
  registering it again needs that session (`previous_session`: the same node, restarted), and is
  refused otherwise (`NodeIdTaken`), so no one can take over a live node's id and role.
- A registration repeated with the session it proposed (a retry, maybe through another meta
  server, of one whose answer was lost) is a heartbeat: the node keeps that registration.
- A down node that heartbeats with its current session is up again, in whatever role its record
  has: a master that was marked down while no other node could take over is still the only holder
  of the current epoch, so it may go on.
- `expire` marks down the nodes whose last heartbeat is older than the deadline it is given.

Why two masters never both deliver: a node delivers only while it holds a lease, renewed by each
heartbeat the meta server answers with role master and measured by the node from the moment it
sent that heartbeat. A master is marked down only after a whole lease has passed since the meta
server last heard from it, and only then can another node be granted a newer epoch; from then on
the former master is told it is a slave.
"""
from __future__ import annotations

import attrs

from delayserver.meta.store import DelayGroup, Node, NodeState, Role


class NotRegistered(Exception):
    """The node has no registration, or a later registration replaced the one it uses."""


class NodeIdTaken(Exception):
    """A live node holds this node id under another session."""


def register(
    group: DelayGroup | None, nodes: list[Node], *, name: str, node_id: str, address: str,
    eligible: bool, session: str, now_ms: int, previous_session: str | None = None,
    live_after_ms: int | None = None,
) -> tuple[DelayGroup, list[Node]]:
    """The group after `node_id` (re-)registers with a fresh `session`; creates the group if new.

    With `live_after_ms`, raises NodeIdTaken when the node id is held by a node that is up, was
    heard from after `live_after_ms`, and whose session is not `previous_session`."""
    group = group or DelayGroup(name)
    old = next((n for n in nodes if n.node_id == node_id), None)
    if old is not None and old.session == session:
        return heartbeat(group, nodes, node_id=node_id, session=session, now_ms=now_ms)
    if (live_after_ms is not None and old is not None and old.state is NodeState.UP
            and old.last_heartbeat_ms > live_after_ms and old.session != previous_session):
        raise NodeIdTaken(f"node id {node_id!r} of delay group {name!r} is held by a live node "
                          f"(last heard from {now_ms - old.last_heartbeat_ms} ms ago, at {old.address}); "
                          "a node registers again under its id with its previous session, or once the "
                          "holder is down")
    others = [n for n in nodes if n.node_id != node_id]
    node = Node(name, node_id, address, Role.SLAVE, NodeState.UP, now_ms, group.master_epoch,
                eligible, session)
    # A former registration of this node, master or not, is superseded here: with role slave in
    # `node`, the grant below is a fresh one with a new epoch.
    if eligible and not any(n.role is Role.MASTER and n.state is NodeState.UP for n in others):
        group, others, node = _grant(group, others, node)
    return _settle(group, others + [node])


def heartbeat(
    group: DelayGroup | None, nodes: list[Node], *, node_id: str, session: str, now_ms: int,
) -> tuple[DelayGroup, list[Node]]:
    """The group after a heartbeat of `node_id`; raises NotRegistered for an unknown node or session."""
    node = next((n for n in nodes if n.node_id == node_id), None)
    if group is None or node is None:
        raise NotRegistered(f"node {node_id!r} is not registered in delay group "
                            f"{group.name if group else '?'!r}; register again")
    if node.session != session:
        raise NotRegistered(f"node {node_id!r} registered again since this session; register again")
    node = attrs.evolve(node, state=NodeState.UP, last_heartbeat_ms=now_ms)
    return _settle(group, [node if n.node_id == node_id else n for n in nodes])


def expire(group: DelayGroup, nodes: list[Node], *, deadline_ms: int) -> tuple[DelayGroup, list[Node]]:
    """The group after marking down the up nodes last heard from before `deadline_ms`."""
    nodes = [
        attrs.evolve(n, state=NodeState.DOWN)
        if n.state is NodeState.UP and n.last_heartbeat_ms < deadline_ms else n
        for n in nodes
    ]
    return _settle(group, nodes)


def master_of(nodes: list[Node]) -> Node | None:
    """The node with the role master, whether up or down (None if no node has it)."""
    masters = [n for n in nodes if n.role is Role.MASTER]
    assert len(masters) <= 1, masters  # test_roles_never_two_masters
    return masters[0] if masters else None


def role_of(group: DelayGroup, node: Node) -> Role:
    """What to tell `node`: master only if it holds the group's current epoch."""
    if node.role is Role.MASTER and node.epoch == group.master_epoch:
        return Role.MASTER
    return Role.SLAVE


def _settle(group: DelayGroup, nodes: list[Node]) -> tuple[DelayGroup, list[Node]]:
    """Promote a live eligible node when the master is down or missing; tell each node the epoch."""
    master = master_of(nodes)
    if master is None or master.state is NodeState.DOWN:
        candidates = sorted((n for n in nodes if n.state is NodeState.UP and n.eligible),
                            key=lambda n: n.node_id)
        if candidates:
            chosen = candidates[0]
            others = [n for n in nodes if n is not chosen]
            group, others, chosen = _grant(group, others, chosen)
            nodes = others + [chosen]
    nodes = [n if n.role is Role.MASTER else attrs.evolve(n, epoch=group.master_epoch) for n in nodes]
    return group, sorted(nodes, key=lambda n: n.node_id)


def _grant(group: DelayGroup, others: list[Node], node: Node) -> tuple[DelayGroup, list[Node], Node]:
    epoch = group.master_epoch + 1
    group = attrs.evolve(group, master_epoch=epoch)
    others = [attrs.evolve(n, role=Role.SLAVE) if n.role is Role.MASTER else n for n in others]
    return group, others, attrs.evolve(node, role=Role.MASTER, epoch=epoch)
