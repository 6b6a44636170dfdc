"""A broker group as a value: what it is called, how to reach it, how much traffic it takes.

One class, `BrokerGroupSpec`, whoever names the group: a node's configuration (`[[broker_group]]`),
the meta server's store, the meta agent's cache. The sender builds its running broker group (a
transport, a queue, a circuit breaker) from one; `TransportKind` names which transport.
"""
from __future__ import annotations

import enum
from typing import Any, Mapping

import attrs

#: How each broker group's traffic is sent, by default: for the node's configuration (`Config`)
#: as for a Sender built alone.
DEFAULT_SEND_BATCH_SIZE = 256
DEFAULT_SEND_WAIT_MS = 2
#: Each group's in-flight budget.
DEFAULT_MAX_INFLIGHT = 20_000
DEFAULT_BATCHES_IN_FLIGHT = 16


class TransportKind(str, enum.Enum):
    SPOOL = "spool"
    REDIS = "redis"
    HTTP = "http"
    RABBITMQ = "rabbitmq"
    NATS = "nats"


@attrs.frozen
class BrokerGroupSpec:
    """How to reach a broker group: its transport, address, weight and transport options;
    `subjects` limits it to those subjects (None: every subject; a meta server routes instead);
    a `read_only` group takes no deliveries."""

    name: str
    transport: TransportKind = TransportKind.SPOOL
    address: str = ""
    weight: int = 1
    read_only: bool = False
    options: Mapping[str, Any] = attrs.field(factory=dict)
    subjects: tuple[str, ...] | None = None

    def to_json(self) -> dict:
        obj = {
            "name": self.name,
            "transport": self.transport.value,
            "address": self.address,
            "weight": self.weight,
            "read_only": self.read_only,
            "options": dict(self.options),
        }
        if self.subjects is not None:
            obj["subjects"] = list(self.subjects)
        return obj

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> BrokerGroupSpec:
        """Raises KeyError, TypeError or ValueError for an object not made by `to_json`."""
        subjects = obj.get("subjects")
        return cls(
            name=str(obj["name"]),
            transport=TransportKind(obj["transport"]),
            address=str(obj["address"]),
            weight=int(obj["weight"]),
            read_only=bool(obj["read_only"]),
            options=dict(obj["options"]),
            subjects=tuple(str(s) for s in subjects) if subjects is not None else None,
        )
