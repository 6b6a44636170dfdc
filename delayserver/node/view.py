"""The services of a running node, handed to what reports on it and acts through it: the HTTP
API's adapter (`node/http/ops.py`) and the metrics collector (`metrics.py`).

It names each collaborator instead of handing over the node itself; what changes while the node
runs (open connections) is read through a callable.
"""
from __future__ import annotations

from typing import Callable

import attrs

from delayserver.clock import WallClock
from delayserver.config import Config
from delayserver.loopwatch import LoopWatch
from delayserver.node.operations import MessageOperations
from delayserver.node.receiver import DiskSpace, Receiver
from delayserver.node.replication import Master, Slave
from delayserver.node.role import NodeRole
from delayserver.replayer import Replayer
from delayserver.sender.sender import Sender
from delayserver.storage.store import Store
from delayserver.wheel.tick_manager import TickManager


@attrs.frozen
class NodeView:
    config: Config
    clock: WallClock
    port: int  # the producer port, bound
    store: Store
    receiver: Receiver
    disk: DiskSpace
    replayer: Replayer
    ticks: TickManager
    sender: Sender
    master: Master
    slave: Slave | None  # None on a node that never follows a master
    role: NodeRole
    operations: MessageOperations
    connections: Callable[[], int]  # open producer connections
    loop_watch: LoopWatch

    @property
    def node_id(self) -> str:
        return self.config.node_id or f"{self.config.listen[0]}:{self.port}"
