"""What a node may do in its delay group: master, slave or fenced, and what follows from each.

The role comes from configuration or from the meta server:

- `replicate_from` set: a slave of that address, for good;
- neither `meta` nor `replicate_from`: a master on its own (a single node);
- `meta` set: whatever the meta server's agent says. Until the agent has an answer, and whenever
  it names no role, the node is fenced: it takes no writes and delivers nothing.

A master following the meta server acknowledges writes only while it holds the current epoch's
lease (FENCED otherwise: a master cut off from the meta server stops acknowledging once its lease
lapses), unless its group is read-only (READ_ONLY); it delivers only under that lease too, or,
with `deliver_through_meta_outage`, while the meta server is unreachable
(`MetaAgent.may_deliver`). A slave takes no writes (NOT_MASTER) and pulls from its master's
address. Every batch a master writes carries its epoch: the meta server's, or for a node without
one the epoch its log already has (0 for a new log).
"""
from __future__ import annotations

import enum

import attrs

from delayserver.message import ResultCode
from delayserver.meta.agent import MetaAgent
from delayserver.meta.store import Role


class RoleState(enum.Enum):
    MASTER = "master"
    SLAVE = "slave"
    FENCED = "fenced"


@attrs.define(eq=False)
class NodeRole:
    replicate_from: str = ""
    follows_meta: bool = False
    #: The meta server's agent, once started (`follows_meta` only).
    agent: MetaAgent | None = None

    @classmethod
    def configured(cls, config) -> NodeRole:
        return cls(replicate_from=config.replicate_from, follows_meta=bool(config.meta))

    def follow(self, agent: MetaAgent) -> None:
        """Take the role the meta server's `agent` says, from now on."""
        assert self.follows_meta, "a node configured without meta has no agent to follow"
        self.agent = agent

    @property
    def state(self) -> RoleState:
        if self.replicate_from:
            return RoleState.SLAVE
        if not self.follows_meta:
            return RoleState.MASTER
        role = self.agent.role if self.agent is not None else None
        if role is Role.MASTER:
            return RoleState.MASTER
        if role is Role.SLAVE:
            return RoleState.SLAVE
        return RoleState.FENCED

    def is_master(self) -> bool:
        """Master by configuration or by the meta server's word (delivery also needs its lease)."""
        return self.state is RoleState.MASTER

    def is_slave(self) -> bool:
        return self.state is RoleState.SLAVE

    def may_deliver(self) -> bool:
        if self.state is not RoleState.MASTER:
            return False
        return not self.follows_meta or self.agent.may_deliver()

    def may_acknowledge(self) -> bool:
        """A write may be acknowledged now: master, and under its lease when following meta."""
        if self.state is not RoleState.MASTER:
            return False
        return not self.follows_meta or self.agent.holds_lease()

    def epoch(self, message_log) -> int:
        """The epoch a batch written now carries."""
        if self.follows_meta and self.agent is not None:
            return self.agent.epoch
        return message_log.epochs.last_epoch

    def master_address(self) -> str | None:
        """The address a slave pulls from (None: not a slave, or no master known)."""
        if self.replicate_from:
            return self.replicate_from
        return self.agent.master_address if self.agent is not None and self.is_slave() else None

    def write_refusal(self) -> ResultCode | None:
        """NOT_MASTER, FENCED or READ_ONLY when this node must not take writes (not the master, a
        master whose lease has lapsed, or the meta server says its group is read-only); None when
        it may."""
        if self.state is not RoleState.MASTER:
            return ResultCode.NOT_MASTER
        if self.follows_meta and not self.agent.holds_lease():
            return ResultCode.FENCED
        if self.follows_meta and self.agent.read_only:
            return ResultCode.READ_ONLY
        return None
