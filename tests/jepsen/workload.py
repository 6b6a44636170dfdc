"""What the fault suite does to a cluster while the nemesis works: producers that send to whoever
is master, a canceller, and the consumer that reads what each node delivered.

Every send and cancel is recorded in a `History` (see `checker`): an id goes into `sent` before
its request leaves, into `acks` only when the server answered OK, with the node that answered. A
cancel whose answer never came is in `cancel_unknown`: it may or may not have taken effect.
"""
from __future__ import annotations

import itertools
import random

import attrs
import trio

from delayserver.client import AsyncProducer, Message
from delayserver.message import DelayServerError, Handle
from tests.faults.harness import body_for
from tests.jepsen.checker import Ack, CancelAck, Delivery, History
from tests.jepsen.cluster import Cluster, Observer, now_ms
from tests.procs import spooled

SUBJECTS = ("jepsen.orders", "jepsen.mail")


@attrs.define(eq=False)
class Workload:
    history: History
    observer: Observer
    rng: random.Random
    max_delay_ms: int = 3000
    refused: dict[str, int] = attrs.Factory(dict)  # result code name -> count
    unanswered: int = 0
    _ids: itertools.count = attrs.Factory(itertools.count)

    def _message(self) -> Message:
        message_id = f"j-{next(self._ids):07d}"
        self.history.sent.add(message_id)
        return Message(self.rng.choice(SUBJECTS), body_for(message_id),
                       delay=self.rng.randint(0, self.max_delay_ms), message_id=message_id)

    async def produce(self, stop: trio.Event) -> None:
        """Send small batches to the master of the moment until `stop`; on NOT_MASTER or a lost
        connection, ask the observer again."""
        while not stop.is_set():
            node = self.observer.master
            if node is None:
                await trio.sleep(0.05)
                continue
            async with AsyncProducer(self.observer.cluster.address(node), timeout=2.0) as producer:
                while not stop.is_set() and node == self.observer.master:
                    messages = [self._message() for _ in range(self.rng.randint(1, 6))]
                    asked = now_ms()
                    results = await producer.send_many(messages)
                    if not self._record(node, asked, messages, results):
                        await trio.sleep(0.1)
                        break
                    await trio.sleep(self.rng.randint(10, 40) / 1000)

    def _record(self, node: str, asked: int, messages: list[Message], results: list) -> bool:
        at, ok = now_ms(), True
        for m, r in zip(messages, results):
            if isinstance(r, Handle):
                self.history.acks[m.message_id] = Ack(m.message_id, r.schedule_time, asked + m.delay, node, at)
            elif isinstance(r, (ConnectionError, TimeoutError, OSError)):
                self.unanswered += 1
                ok = False
            else:
                name = getattr(getattr(r, "code", None), "name", type(r).__name__)
                self.refused[name] = self.refused.get(name, 0) + 1
                ok = False
        return ok

    async def cancel(self, stop: trio.Event, share: float = 0.1) -> None:
        """Cancel about `share` of the acknowledged messages that are still a while from due."""
        done: set[str] = set()
        while not stop.is_set():
            await trio.sleep(0.05)
            node = self.observer.master
            soon = now_ms() + 800
            candidates = [a for a in list(self.history.acks.values())[-200:]
                          if a.message_id not in done and a.schedule_time > soon]
            if node is None or not candidates:
                continue
            chosen = [a for a in candidates if self.rng.random() < share]
            done.update(a.message_id for a in candidates)
            if not chosen:
                continue
            async with AsyncProducer(self.observer.cluster.address(node), timeout=2.0) as producer:
                for ack in chosen:
                    self.history.cancel_unknown.add(ack.message_id)
                    try:
                        outcome = await producer.cancel(Handle(ack.schedule_time, ack.message_id))
                    except DelayServerError:  # refused (NOT_MASTER, ...): not applied
                        self.history.cancel_unknown.discard(ack.message_id)
                        break
                    except (ConnectionError, TimeoutError, OSError):
                        break
                    self.history.cancel_unknown.discard(ack.message_id)
                    self.history.cancels[ack.message_id] = CancelAck(ack.message_id, outcome.name, node, now_ms())

    def deliveries(self, cluster: Cluster) -> list[Delivery]:
        """What every node's spool holds, with the node that delivered it."""
        out = []
        for name, data_dir in cluster.data_dirs.items():
            for dispatch_time, _, m in spooled(data_dir):
                out.append(Delivery(m.message_id, name, m.schedule_time, dispatch_time,
                                    m.body == body_for(m.message_id) and m.subject in SUBJECTS))
        return out

    def expected(self) -> set[str]:
        """The ids that must be delivered: acknowledged, and not cancelled (or maybe cancelled)."""
        cancelled = {i for i, c in self.history.cancels.items() if c.outcome in ("CANCELLED", "ALREADY_CANCELLED")}
        return set(self.history.acks) - cancelled - self.history.cancel_unknown
