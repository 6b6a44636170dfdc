"""A node's role: master, slave or fenced, from configuration or the meta server's word, and what
each may do (the agent here is a stand-in: the role's rules are pure logic)."""
from __future__ import annotations

import types

import attrs
import pytest

from delayserver.config import Config
from delayserver.message import ResultCode
from delayserver.meta.store import Role
from delayserver.node.role import NodeRole, RoleState


@attrs.define
class Agent:
    role: Role | None = None
    read_only: bool = False
    master_address: str | None = None
    lease: bool = True
    delivers_through_outage: bool = False  # deliver_through_meta_outage, and meta unreachable
    epoch: int = 0

    def holds_lease(self) -> bool:
        return self.role is Role.MASTER and self.lease

    def may_deliver(self) -> bool:
        return self.lease or self.delivers_through_outage


def test_a_single_node_is_master_takes_writes_and_delivers():
    role = NodeRole.configured(Config())
    assert role.state is RoleState.MASTER and role.is_master() and not role.is_slave()
    assert role.may_deliver() and role.write_refusal() is None and role.master_address() is None


def test_replicate_from_makes_a_slave_for_good():
    role = NodeRole.configured(Config.from_dict({"replicate_from": "127.0.0.1:9"}))
    assert role.state is RoleState.SLAVE and role.is_slave() and not role.may_deliver()
    assert role.write_refusal() is ResultCode.NOT_MASTER and role.master_address() == "127.0.0.1:9"


def test_a_node_following_meta_is_fenced_until_the_agent_names_its_role():
    role = NodeRole.configured(Config.from_dict({"meta": "127.0.0.1:9"}))
    assert role.state is RoleState.FENCED
    assert not role.may_deliver() and role.write_refusal() is ResultCode.NOT_MASTER
    agent = Agent()
    role.follow(agent)
    assert role.state is RoleState.FENCED and role.master_address() is None


@pytest.mark.parametrize("read_only, lease, outage, refusal, delivers", [
    (False, True, False, None, True),
    (True, True, False, ResultCode.READ_ONLY, True),
    (False, False, False, ResultCode.FENCED, False),  # the lease ran out: no acks, no delivery
    (False, False, True, ResultCode.FENCED, True),  # deliver_through_meta_outage: delivery only
])
def test_a_meta_master_acknowledges_and_delivers_only_under_its_lease(read_only, lease, outage, refusal, delivers):
    role = NodeRole(follows_meta=True)
    role.follow(Agent(Role.MASTER, read_only=read_only, lease=lease, delivers_through_outage=outage))
    assert role.is_master() and role.write_refusal() is refusal and role.may_deliver() is delivers
    assert role.may_acknowledge() is lease


def test_a_meta_slave_pulls_from_the_master_the_agent_names():
    role = NodeRole(follows_meta=True)
    agent = Agent(Role.SLAVE, master_address="10.0.0.1:20801")
    role.follow(agent)
    assert role.is_slave() and role.master_address() == "10.0.0.1:20801"
    assert role.write_refusal() is ResultCode.NOT_MASTER and not role.may_deliver()
    agent.role = Role.MASTER  # promoted
    assert role.is_master() and role.master_address() is None and role.write_refusal() is None


def test_deliver_through_meta_outage_is_off_by_default_with_sync_replication():
    if "replication" not in {f.name for f in attrs.fields(Config)}:
        pytest.skip('no replication = "sync" in this build')
    assert Config.from_dict({"replication": "sync"}).deliver_through_meta_outage is False
    assert Config.from_dict({"replication": "async"}).deliver_through_meta_outage is True
    assert Config.from_dict({"replication": "sync", "deliver_through_meta_outage": True}).deliver_through_meta_outage


def test_a_node_writes_the_epoch_of_the_meta_server_or_else_its_logs_last():
    log = types.SimpleNamespace(epochs=types.SimpleNamespace(last_epoch=6))
    assert NodeRole.configured(Config()).epoch(log) == 6
    role = NodeRole(follows_meta=True)
    role.follow(Agent(Role.MASTER, epoch=9))
    assert role.epoch(log) == 9
