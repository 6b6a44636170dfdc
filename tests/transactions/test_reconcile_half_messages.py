"""The Spark reconciliation (a real local session) over a data directory written by a real node
with half messages: one never committed, one rolled back, one committed and delivered. Only the
committed one is scheduled; none is missing, however long after their delivery time it runs."""
from __future__ import annotations

import os
import shutil
import time

import pytest
import trio

from delayserver.client import AsyncProducer
from delayserver.clock import TrioClock
from delayserver.node.server import DelayServer
from tests.procs import spooled
from tests.transactions.test_transactions import config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("java") is None and "JAVA_HOME" not in os.environ,
                       reason="Spark needs Java 17 or newer (no java on PATH, no JAVA_HOME)"),
]


async def write_node(tmp_path) -> tuple[str, int]:
    async with trio.open_nursery() as nursery:
        server = DelayServer(config(tmp_path), clock=TrioClock(time.time_ns() // 1_000_000))
        await nursery.start(server.serve)
        async with AsyncProducer(f"127.0.0.1:{server.port}") as prod:
            await prod.prepare("orders.expire", b"never committed", group="orders", delay=0)
            await prod.rollback(await prod.prepare("orders.expire", b"rolled back", group="orders", delay=0))
            committed = await prod.prepare("orders.expire", b"committed", group="orders", delay=0)
            await prod.commit(committed)
        with trio.fail_after(30):
            while not spooled(server.config.data_dir):
                await trio.sleep(0.02)
        await server.drain()
        nursery.cancel_scope.cancel()
    return str(server.config.data_dir), server.clock.now_ms()


def test_uncommitted_and_rolled_back_half_messages_are_never_missing(tmp_path):
    from spark.reconciliation import reconcile
    from spark.session import get_session

    data_dir, now = trio.run(write_node, tmp_path)
    spark, owned = get_session("local[1]")
    try:
        report = reconcile(spark, [data_dir], as_of=now + 3_600_000)
    finally:
        if owned:
            spark.stop()
    total = report.total
    assert (total.scheduled, total.dispatched, total.missing, total.not_yet_due) == (1, 1, 0, 0)
    assert report.exit_status == 0
