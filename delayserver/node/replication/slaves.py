"""What a master knows of its slaves: how far each got, durably, and whether enough are in sync.

`SlaveStates` keeps, per registered slave node id, the message_log offset it has fsynced (its last
SYNC_MESSAGE_LOG request) and the dispatch_log sizes it holds. The cleaner keeps whatever those
offsets still need, so they are written to DATA_DIR/checkpoint/slaves.json before each cleaner
pass and read back at start: after a master restart the cleaner still knows what its slaves lack
(an offset read back is never ahead of the truth, since offsets only grow). Only registered node
ids count (`Registry`: the group's nodes at the meta server; every node of the cluster when there
is no meta server), so that nobody can pin the cleaner with made-up ids. A slave more than
`max_slave_lag` bytes behind the durable end stops pinning: the cleaner goes on without it.

`InSync` is the sync-mode gate (replication = "sync"): a write is acknowledged once
`min_insync_replicas` slaves have acknowledged its end offset; when they do not within
`sync_timeout_ms`, the write is answered NOT_ENOUGH_REPLICAS and the gate closes: every write is
refused with NOT_ENOUGH_REPLICAS, nothing more is stored, until enough slaves have caught up with
the whole durable log again. The gate starts closed: a master that has heard from no slave yet has
no in-sync slave.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import attrs
import trio

from delayserver.message import DelayServerError
from delayserver.storage.checkpoint import read_checkpoint, write_checkpoint
from delayserver.storage.errors import StorageError

log = logging.getLogger("delayserver.replication")

CHECKPOINT_NAME = "slaves.json"
#: The longest a master holds a slave's SYNC_MESSAGE_LOG request open (master.py).
MAX_LONG_POLL_S = 10.0


@attrs.define(eq=False)
class SlaveState:
    node_id: str
    message_log_offset: int = 0
    dispatch_sizes: dict[int, int] = attrs.field(factory=dict)
    #: False once the slave fell more than max_slave_lag behind: the cleaner goes on without it.
    pinning: bool = True


class Registry:
    """The node ids allowed to pin the cleaner and count as in-sync replicas.

    `ids` None: every id counts (a cluster without a meta server, where the cluster secret is the
    registration). Otherwise the ids the meta server lists for the group, refreshed by `follow`."""

    def __init__(self, ids: set[str] | None = None):
        self.ids = ids

    def __contains__(self, node_id: str) -> bool:
        return self.ids is None or node_id in self.ids

    async def follow(self, client, group: str, own_id: str, interval_s: float = 2.0) -> None:
        """Keep `ids` to the group's nodes at the meta server (`client`: a MetaClient)."""
        from delayserver.meta.client import MetaUnavailable

        self.ids = set()
        last_error = ""
        while True:
            try:
                reply = await client.request("list_nodes", group=group)
                self.ids = {n["node_id"] for n in reply["nodes"] if n["node_id"] != own_id}
                last_error = ""
            except (MetaUnavailable, DelayServerError, OSError, KeyError, TypeError) as e:
                # Keep the last list while the meta server is away; say so once per cause.
                if str(e) != last_error:
                    last_error = str(e)
                    log.warning("cannot list the nodes of group %s (keeping the last list): %s", group, e)
            await trio.sleep(interval_s)


class SlaveStates:
    def __init__(self, checkpoint_dir: Path, *, registry: Registry | None = None, max_lag_bytes: int = 1 << 30):
        self.path = Path(checkpoint_dir) / CHECKPOINT_NAME
        self.registry = registry or Registry()
        self.max_lag_bytes = max_lag_bytes
        self.states: dict[str, SlaveState] = {}
        self._new = False  # a slave not in the checkpoint yet
        self._load()

    def _load(self) -> None:
        try:
            data = read_checkpoint(self.path) or {}
            for node_id, s in data.get("slaves", {}).items():
                self.states[node_id] = SlaveState(
                    node_id, int(s["message_log_offset"]), {int(b): int(n) for b, n in s["dispatch_sizes"].items()},
                    bool(s.get("pinning", True)))
        except (StorageError, KeyError, ValueError, TypeError, AttributeError) as e:
            # Losing it only lets the cleaner go further than a slave wanted (a slave that then
            # finds its records cleaned resyncs from a snapshot); say so.
            log.error("slave offsets not read back from %s (%s): the cleaner ignores slaves until they pull again",
                      self.path, e)
            self.states.clear()

    def save(self) -> None:
        """Write the offsets atomically (raises StorageError subtypes)."""
        self._new = False
        write_checkpoint(self.path, {"slaves": {
            s.node_id: {"message_log_offset": s.message_log_offset, "pinning": s.pinning,
                        "dispatch_sizes": {str(b): n for b, n in s.dispatch_sizes.items()}}
            for s in self.states.values()}})

    def _state(self, node_id: str) -> SlaveState | None:
        if node_id not in self.registry:
            return None
        state = self.states.get(node_id)
        if state is None:
            state = self.states[node_id] = SlaveState(node_id)
            log.info("slave %s pulls from this master", node_id)
            self._new = True
        return state

    def pulled_message_log(self, node_id: str, offset: int, durable_end: int) -> bool:
        """Note a registered slave's message_log pull at `offset`; False for an unregistered id. A
        slave seen for the first time is written to the checkpoint at once (raises StorageError
        subtypes), so that no restart can forget it before the next cleaner pass."""
        state = self._state(node_id)
        if state is None:
            return False
        state.message_log_offset = offset
        self._check_lag(state, durable_end)
        if self._new:
            self.save()
        return True

    def _check_lag(self, state: SlaveState, durable_end: int) -> None:
        lagging = durable_end - state.message_log_offset > self.max_lag_bytes
        if lagging and state.pinning:
            log.warning("slave %s is %d bytes behind (max_slave_lag %d): it no longer holds back the cleaner",
                        state.node_id, durable_end - state.message_log_offset, self.max_lag_bytes)
        elif not lagging and not state.pinning:
            log.info("slave %s is back within max_slave_lag", state.node_id)
        state.pinning = not lagging

    def pulled_dispatch_log(self, node_id: str, sizes: dict[int, int]) -> None:
        state = self._state(node_id)
        if state is not None:
            state.dispatch_sizes = dict(sizes)

    def pinning(self, durable_end: int) -> list[SlaveState]:
        """The slaves that hold back the cleaner: registered, and within max_slave_lag of
        `durable_end` (a slave that stopped pulling stops pinning once the log runs that far)."""
        for s in self.states.values():
            self._check_lag(s, durable_end)
        return [s for s in self.states.values() if s.pinning and s.node_id in self.registry]


class InSync:
    """The sync-mode acknowledgement gate (see the module docstring)."""

    def __init__(self, *, min_insync_replicas: int, timeout_s: float, durable_end: Callable[[], int]):
        self.min_insync_replicas = min_insync_replicas
        self.timeout_s = timeout_s
        self.durable_end = durable_end
        self.acked: dict[str, int] = {}
        self._seen: dict[str, float] = {}  # trio time of each slave's last acknowledgement
        self.closed = True
        self.timeouts = 0
        self._changed = trio.Event()

    def acknowledged(self, node_id: str, offset: int) -> None:
        """A registered slave holds message_log fsynced up to `offset` (lower than before: it
        started over, from a snapshot or a new disk)."""
        self._seen[node_id] = trio.current_time()
        self.acked[node_id] = offset
        if self.closed and self._enough(self.durable_end()):
            self.closed = False
            log.warning("%d slave(s) in sync at offset %d: accepting writes again", self.min_insync_replicas,
                        self.durable_end())
        self._changed.set()
        self._changed = trio.Event()

    def in_sync(self, end: int) -> int:
        """Slaves that hold `end` and were heard from lately: an acknowledgement older than a long
        poll plus the timeout is from a slave gone, or from before this node was last promoted."""
        recent = trio.current_time() - self.timeout_s - MAX_LONG_POLL_S
        return sum(1 for node, o in self.acked.items() if o >= end and self._seen[node] >= recent)

    def _enough(self, end: int) -> bool:
        return self.in_sync(end) >= self.min_insync_replicas

    def refuses(self) -> bool:
        return self.closed

    async def replicated(self, end: int) -> bool:
        """Wait until enough slaves hold message_log up to `end`; False (and the gate closes) when
        they do not within the timeout."""
        with trio.move_on_after(self.timeout_s):
            while not self._enough(end):
                await self._changed.wait()
            return True
        if not self.closed:
            self.closed = True
            log.error("no %d slave(s) acknowledged offset %d within sync_timeout_ms: refusing writes with "
                      "NOT_ENOUGH_REPLICAS until a slave catches up", self.min_insync_replicas, end)
        self.timeouts += 1
        return False
