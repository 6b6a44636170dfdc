"""A node's membership of its delay group through the meta server.

With `meta` configured, the node runs a MetaAgent (register, heartbeat, role and epoch, broker
groups and routes cached in DATA_DIR/meta_cache.json) and follows it:

- it accepts messages only while it is its group's master and the group is not read-only;
- it delivers only while `agent.may_deliver()` (the current master epoch, under a lease);
- its sender uses the meta server's broker groups and routes when the meta server has any, and
  the locally configured broker groups otherwise; a change is applied without dropping anything.
"""
from __future__ import annotations

import logging
import ssl

import trio

from delayserver.meta.agent import MetaAgent
from delayserver.sender.sender import BrokerGroup
from delayserver.sender.transport import make_transport

log = logging.getLogger("delayserver.membership")


def local_groups(server) -> list[BrokerGroup]:
    c = server.config
    return [
        BrokerGroup(g.name, make_transport(g.transport, g.address, g.options, c.data_dir), g.weight,
                    frozenset(g.subjects) if g.subjects is not None else None, spec=("local", g))
        for g in c.broker_groups
    ]


async def start_meta_agent(server, nursery) -> MetaAgent:
    """Register with the meta server (returns even while it is unreachable) and follow it."""
    c = server.config
    advertised = c.advertised_address or f"{c.listen[0]}:{server.port}"
    tls = ssl.create_default_context(cafile=c.meta_tls_ca) if c.meta_tls_ca else None
    agent = MetaAgent(c.meta, c.group, c.node_id or advertised, advertised, server.clock,
                      c.data_dir / "meta_cache.json",
                      deliver_through_meta_outage=c.deliver_through_meta_outage,
                      cluster_secret=c.cluster_secret, tls=tls)
    server.meta_agent = agent
    await nursery.start(agent.run)
    await apply_broker_groups(server, agent)
    nursery.start_soon(_follow, server, agent)
    return agent


async def _follow(server, agent: MetaAgent) -> None:
    role = None
    while True:
        event = agent.changed
        await event.wait()
        if agent.role != role:
            role = agent.role
            log.warning("role is now %s at epoch %d", role.value if role else "none", agent.epoch)
        await apply_broker_groups(server, agent)
        server.sender.ready.set()


async def apply_broker_groups(server, agent: MetaAgent) -> None:
    sender = server.sender
    specs = [s for s in agent.broker_groups() if not s.read_only]
    if not specs:
        if any(not isinstance(g.spec, tuple) for g in sender.groups.values()):
            sender.resolve = None
            await sender.replace_groups(local_groups(server))
        return
    wanted = {s.name: s for s in specs}
    if {name: g.spec for name, g in sender.groups.items()} == wanted:
        return
    groups = []
    for spec in specs:
        kind = spec.transport.value if hasattr(spec.transport, "value") else spec.transport
        # A spool group is each node's own spool in its data directory, whatever address it lists.
        address = "" if kind == "spool" else spec.address
        try:
            transport = make_transport(kind, address, spec.options, server.config.data_dir)
        except ValueError as e:
            log.error("broker group %s from the meta server is unusable: %s", spec.name, e)
            continue
        groups.append(BrokerGroup(spec.name, transport, spec.weight, None, spec=spec))
    sender.resolve = lambda subject: [g.name for g in agent.resolve(subject)]
    await sender.replace_groups(groups)
    log.info("broker groups from the meta server: %s", ", ".join(g.name for g in groups) or "none usable")
