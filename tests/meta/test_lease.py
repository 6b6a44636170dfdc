"""Master leases against the meta server's failure timeout, under trio's MockClock (autojump):
the lease a master holds is shorter than the time after which the meta server marks it down, so
a master cut off from the meta server has stopped acknowledging and delivering before any other
node is granted a newer epoch."""
from __future__ import annotations

import pytest
import trio

from delayserver.meta.service import lease_margin_ms
from delayserver.meta.store import Role
from tests.meta.test_server import INTERVAL_MS, agent, client, meta_server, running, store  # noqa: F401 (a fixture)

CLOCK_BASE_MS = 1_700_000_000_000  # the meta server's TrioClock in test_server.meta_server


@pytest.mark.parametrize("failure_timeout_ms, margin_ms", [(300, 100), (3000, 300), (15_000, 1500), (100, 50)])
def test_the_lease_is_shorter_than_the_failure_timeout(failure_timeout_ms, margin_ms):
    assert lease_margin_ms(failure_timeout_ms) == margin_ms


async def test_heartbeats_grant_a_lease_shorter_than_the_failure_timeout(store, tmp_path, autojump_clock):
    async with meta_server(store) as address, client(address) as c:
        reply = await c.request("register", group="g1", node_id="a", address="127.0.0.1:1")
        assert reply["role"] == "master"
        assert reply["lease_ms"] == 3 * INTERVAL_MS - lease_margin_ms(3 * INTERVAL_MS)
        beat = await c.request("heartbeat", group="g1", node_id="a", session=reply["session"])
        assert beat["lease_ms"] == reply["lease_ms"]


async def test_a_master_cut_off_loses_its_lease_before_a_slave_is_promoted(store, tmp_path, autojump_clock):
    async with meta_server(store) as address, client(address) as c:
        a = agent(address, "a", tmp_path)
        b = agent(address, "b", tmp_path, want_role="master")
        async with running(a, b) as (a_scope, _):
            with trio.fail_after(30):
                while not (a.holds_lease() and b.role is Role.SLAVE):
                    await trio.sleep(0.01)
            a_scope.cancel()  # a hears nothing from the meta server from now on
            while a.holds_lease():
                await trio.sleep(0.001)
            lease_ended = trio.current_time()
            assert not a.may_deliver()
            with trio.fail_after(30):
                while b.role is not Role.MASTER:
                    await trio.sleep(0.01)
            [_, second] = (await c.request("epoch_history", group="g1"))["epochs"]
            granted = (second["granted_ms"] - CLOCK_BASE_MS) / 1000
            assert second["node_id"] == "b"
            assert granted - lease_ended >= lease_margin_ms(3 * INTERVAL_MS) / 1000 - 0.01
