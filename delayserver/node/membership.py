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

from delayserver.meta.agent import MetaAgent
from delayserver.node.role import NodeRole
from delayserver.sender.groups import TransportKind
from delayserver.sender.sender import BrokerGroup, Sender
from delayserver.sender.transport import make_transport

log = logging.getLogger("delayserver.membership")


def local_groups(config) -> list[BrokerGroup]:
    """The broker groups of the node's configuration."""
    return [
        BrokerGroup(g.name, make_transport(g.transport.value, g.address, g.options, config.data_dir), g.weight,
                    frozenset(g.subjects) if g.subjects is not None else None, spec=g)
        for g in config.broker_groups
    ]


async def follow_meta(config, clock, port: int, role: NodeRole, sender: Sender, nursery) -> MetaAgent:
    """Register with the meta server (returns even while it is unreachable), make `role` follow
    its word, and keep `sender`'s broker groups in line with the meta server's."""
    advertised = config.advertised_address or f"{config.listen[0]}:{port}"
    tls = ssl.create_default_context(cafile=config.meta_tls_ca) if config.meta_tls_ca else None
    agent = MetaAgent(config.meta, config.group, config.node_id or advertised, advertised, clock,
                      config.data_dir / "meta_cache.json",
                      deliver_through_meta_outage=config.deliver_through_meta_outage,
                      cluster_secret=config.cluster_secret, tls=tls)
    role.follow(agent)
    await nursery.start(agent.run)
    await apply_broker_groups(config, sender, agent)
    nursery.start_soon(_follow, config, sender, agent)
    return agent


async def _follow(config, sender: Sender, agent: MetaAgent) -> None:
    role = None
    while True:
        event = agent.changed
        await event.wait()
        if agent.role != role:
            role = agent.role
            log.warning("role is now %s at epoch %d", role.value if role else "none", agent.epoch)
        await apply_broker_groups(config, sender, agent)
        sender.dispatch_now()


async def apply_broker_groups(config, sender: Sender, agent: MetaAgent) -> None:
    specs = [s for s in agent.broker_groups() if not s.read_only]
    if not specs:
        if any(g.spec not in config.broker_groups for g in sender.groups.values()):
            sender.resolve = None
            await sender.replace_groups(local_groups(config))
        return
    wanted = {s.name: s for s in specs}
    if {name: g.spec for name, g in sender.groups.items()} == wanted:
        return
    groups = []
    for spec in specs:
        # A spool group is each node's own spool in its data directory, whatever address it lists.
        address = "" if spec.transport is TransportKind.SPOOL else spec.address
        try:
            transport = make_transport(spec.transport.value, address, spec.options, config.data_dir)
        except ValueError as e:
            log.error("broker group %s from the meta server is unusable: %s", spec.name, e)
            continue
        groups.append(BrokerGroup(spec.name, transport, spec.weight, None, spec=spec))
    sender.resolve = lambda subject: [g.name for g in agent.resolve(subject)]
    await sender.replace_groups(groups)
    log.info("broker groups from the meta server: %s", ", ".join(g.name for g in groups) or "none usable")
