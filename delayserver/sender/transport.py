"""What every transport promises the sender, and the one place a transport is built from config.

A transport delivers batches of due messages to one broker group. `send_batch` returns one
DeliveryResult per message, in order, and never raises for a broker, disk or network failure:
those become RETRY (try again later, perhaps on another group) or REJECTED (this broker will never
take the message). Only programming errors raise. Delivery is at least once: a batch that fails
half-way is reported RETRY as a whole, so part of it may arrive twice; every delivered message
carries its id for dedupe.
"""
from __future__ import annotations

import abc
import enum
from pathlib import Path
from typing import Any, Mapping, Sequence

import attrs


@attrs.frozen
class OutboundMessage:
    """One due message on its way to a broker. Times are epoch ms; `attempt` is 1 on the first try."""

    message_id: str
    subject: str
    body: bytes
    headers: Mapping[str, str]
    schedule_time: int
    dispatch_time: int
    attempt: int


class Outcome(enum.Enum):
    ACKED = "acked"
    #: A transient failure: send again later, maybe to another broker group.
    RETRY = "retry"
    #: A permanent one: this broker will never take the message (a subject it does not serve).
    REJECTED = "rejected"


@attrs.frozen
class DeliveryResult:
    outcome: Outcome
    detail: str = ""


ACKED = DeliveryResult(Outcome.ACKED)


class Transport(abc.ABC):
    """A connection to one broker group; safe to use from several trio tasks at once."""

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """A short description for logs: the kind and where it delivers."""

    @abc.abstractmethod
    async def send_batch(self, messages: Sequence[OutboundMessage]) -> list[DeliveryResult]:
        """Deliver `messages`; one result per message, same order. Raises only for programming errors."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release connections and files. The transport is not used afterwards."""

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()


def make_transport(kind: str, address: str, options: Mapping[str, Any], data_dir: Path) -> Transport:
    """Build the transport of a broker group from its configuration.

    `kind` is "spool", "redis" or "http". Raises ValueError naming the bad field (kind, address or
    the option) for a configuration that cannot work. The redis and http modules are imported only
    when used, since their client libraries are optional extras.
    """
    if kind == "spool":
        from delayserver.sender.spool import SpoolTransport

        return SpoolTransport.from_config(address, options, Path(data_dir))
    if kind == "redis":
        from delayserver.sender.redis_streams import RedisTransport

        return RedisTransport.from_config(address, options)
    if kind == "http":
        from delayserver.sender.http_webhook import HttpTransport

        return HttpTransport.from_config(address, options)
    raise ValueError(f"transport kind {kind!r} is not one of 'spool', 'redis', 'http'")


# --- option checking shared by the transports ---------------------------------------------------


def check_option_names(kind: str, options: Mapping[str, Any], known: set[str]) -> None:
    """Raise ValueError naming the first option `kind` does not know (a typo must not pass silently)."""
    for key in options:
        if key not in known:
            allowed = ", ".join(sorted(known)) or "none"
            raise ValueError(f"{kind} transport: unknown option {key!r} (allowed: {allowed})")


def int_option(kind: str, options: Mapping[str, Any], key: str, default: int | None, minimum: int = 1) -> int | None:
    """The integer option `key`, or `default` when absent or None; ValueError if it is not an int >= minimum."""
    value = options.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{kind} transport: option {key!r} must be an integer >= {minimum}, got {value!r}")
    return value
