"""Several meta services over one PostgreSQL database, deciding at once: heartbeats reach any of
them, each reaps silent nodes, and promotions race. The epoch history and every answer the nodes
got are then checked: one holder per epoch, no gap, and no epoch granted while an earlier
master's lease (as a node measures it, from the send of its heartbeat) could still run.

Real time, real threads and a real database: the database's clock is the one that decides."""
from __future__ import annotations

import random
import time

import attrs
import pytest
import trio

from delayserver.clock import WallClock
from delayserver.message import ResultCode
from delayserver.meta.pgstore import PostgresMetaStore
from delayserver.meta.service import MetaService

INTERVAL_MS = 40
MISSED = 3
LEASE_MS = INTERVAL_MS * MISSED


@attrs.define
class Answer:
    node_id: str
    sent_ms: float
    role: str
    epoch: int
    service: int


async def run_node(node_id: str, services, answers: list, until: float, rng: random.Random) -> None:
    session = None
    while trio.current_time() < until:
        index = rng.randrange(len(services))
        sent_ms = time.time() * 1000
        if session is None:
            reply = await services[index].handle({"op": "register", "group": "g", "node_id": node_id,
                                                  "address": f"127.0.0.1:{20000 + int(node_id[1:])}"})
            if reply["code"] == ResultCode.OK:
                session = reply["session"]
        else:
            reply = await services[index].handle({"op": "heartbeat", "group": "g", "node_id": node_id,
                                                  "session": session})
            if reply["code"] == ResultCode.NOT_FOUND:
                session = None
        if reply["code"] == ResultCode.OK:
            answers.append(Answer(node_id, sent_ms, reply["role"], reply["epoch"], index))
        else:
            assert reply["code"] in (ResultCode.NOT_FOUND, ResultCode.NODE_ID_TAKEN), reply
        if rng.random() < 0.04:
            await trio.sleep(rng.uniform(LEASE_MS * 1.2, LEASE_MS * 3) / 1000)  # silent: loses its lease
        else:
            await trio.sleep(INTERVAL_MS / 1000)


async def reap_forever(service: MetaService) -> None:
    while True:
        await trio.sleep(INTERVAL_MS / 2000)
        await service.reap()


@pytest.mark.parametrize("seed", [1, 2])
async def test_meta_services_on_one_database_never_grant_an_epoch_while_a_lease_runs(postgres_url, seed):
    stores = [PostgresMetaStore.open(postgres_url) for _ in range(3)]
    services = [MetaService(s, WallClock(), INTERVAL_MS, MISSED) for s in stores]
    answers: list[Answer] = []
    rng = random.Random(seed)
    try:
        for service in services:
            await service.start()
        async with trio.open_nursery() as nursery:
            for service in services:
                nursery.start_soon(reap_forever, service)
            until = trio.current_time() + 4.0
            async with trio.open_nursery() as nodes:
                for i in range(1, 4):
                    nodes.start_soon(run_node, f"n{i}", services, answers, until, random.Random(rng.random()))
            nursery.cancel_scope.cancel()
        history = stores[0].list_epochs("g")
    finally:
        for s in stores:
            s.close()

    epochs = [e for e, _, _ in history]
    assert epochs == list(range(1, len(epochs) + 1)), history
    assert len(epochs) >= 3, f"too few failovers to prove anything: {history}"
    assert {a.service for a in answers} == {0, 1, 2}
    holder = {e: n for e, n, _ in history}
    granted = {e: t for e, _, t in history}
    masters = [a for a in answers if a.role == "master"]
    for a in masters:
        assert holder[a.epoch] == a.node_id, (a, history)
    for epoch in epochs[1:]:
        earlier = [a for a in masters if a.epoch < epoch]
        if earlier:
            last = max(earlier, key=lambda a: a.sent_ms)
            # The node's lease ran until sent_ms + LEASE_MS; the grant came after that.
            assert last.sent_ms + LEASE_MS <= granted[epoch], (last, epoch, granted[epoch])
