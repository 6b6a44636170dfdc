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
import ssl
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

import attrs

from delayserver.sender.groups import BrokerGroupSpec, TransportKind

#: Worker threads one transport (one broker group) may hold at once for its blocking calls. Each
#: transport that blocks in threads has a limiter of its own, not trio's default one, so that a
#: broker or a spool disk that stops answering holds only these, not the threads the rest of the
#: process shares (the node's own fsyncs and reads have theirs: `delayserver.storage.threads`);
#: its calls beyond this wait for one of its threads.
TRANSPORT_THREADS = 8


class OutboundMessage(NamedTuple):
    """One due message on its way to a broker. Times are epoch ms; `attempt` is 1 on the first try.
    A named tuple: one is built per delivered message (a frozen attrs class pays a call per field)."""

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

#: The header names under which the rabbitmq and nats transports carry a message's own fields,
#: next to its headers (a message header of the same name is overwritten by ours).
DELAY_HEADERS = ("delayserver-id", "delayserver-subject", "delayserver-schedule-time",
                 "delayserver-dispatch-time", "delayserver-attempt")


def delay_header_values(m: OutboundMessage) -> tuple[str, str, int, int, int]:
    """The values of DELAY_HEADERS for `m`, in that order."""
    return m.message_id, m.subject, m.schedule_time, m.dispatch_time, m.attempt


class Transport(abc.ABC):
    """A connection to one broker group; safe to use from several trio tasks at once."""

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """A short description for logs: the kind and where it delivers."""

    @abc.abstractmethod
    async def send_batch(self, messages: Sequence[OutboundMessage]) -> list[DeliveryResult]:
        """Deliver `messages`; one result per message, same order. A broker's failure, whatever
        its client library raises for it, is a result; raises only for programming errors, which
        the sender logs and takes as RETRY for the whole batch."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release connections and files. The transport is not used afterwards."""

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()


def make_transport(kind: str, address: str, options: Mapping[str, Any], data_dir: Path) -> Transport:
    """Build the transport of a broker group from its configuration.

    `kind` is a TransportKind value. Raises ValueError naming the bad field (kind, address or the option)
    for a configuration that cannot work; nothing connects until the first batch. The modules of
    the other transports are imported only when used, since their client libraries are optional
    extras.
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
    if kind == "rabbitmq":
        try:
            from delayserver.sender.rabbitmq import RabbitMqTransport
        except ImportError as e:
            raise ValueError(f"the rabbitmq transport needs the aio-pika package (pip install 'delayserver[rabbitmq]'): {e}") from None
        return RabbitMqTransport.from_config(address, options)
    if kind == "nats":
        try:
            from delayserver.sender.nats_jetstream import NatsJetStreamTransport
        except ImportError as e:
            raise ValueError(f"the nats transport needs the nats-py package (pip install 'delayserver[nats]'): {e}") from None
        return NatsJetStreamTransport.from_config(address, options)
    raise ValueError(f"transport kind {kind!r} is not one of {', '.join(repr(k.value) for k in TransportKind)}")


#: The kinds whose address and options `check_options` judges by building the transport: their
#: constructors connect nothing and touch no file.
_CHECKED_UP_FRONT = (TransportKind.RABBITMQ, TransportKind.NATS)


def check_options(spec: BrokerGroupSpec) -> None:
    """Raise ValueError naming the field when a broker group's address or options cannot work, so
    a node's start and the meta server's add/update refuse it before any delivery is tried.

    Done for the rabbitmq and nats kinds (built once here and dropped; nothing connects)."""
    if spec.transport in _CHECKED_UP_FRONT:
        make_transport(spec.transport.value, spec.address, spec.options, Path("."))


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


def str_option(kind: str, options: Mapping[str, Any], key: str, default: str | None) -> str | None:
    """The string option `key`, or `default` when absent; ValueError if it is not a string."""
    value = options.get(key, default)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{kind} transport: option {key!r} must be a string, got {value!r}")
    return value


def template_option(kind: str, options: Mapping[str, Any], key: str, default: str) -> str:
    """A non-empty name template that may use only {subject}; ValueError naming `key` otherwise."""
    template = options.get(key, default)
    if not isinstance(template, str) or not template:
        raise ValueError(f"{kind} transport: option {key!r} must be a non-empty string, got {template!r}")
    try:
        template.format(subject="subject")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"{kind} transport: option {key!r} {template!r} may use only {{subject}}: {e!r}") from None
    return template


#: The TLS options of the rabbitmq and nats transports.
TLS_OPTIONS = {"tls_ca_file", "tls_cert_file", "tls_key_file"}


def tls_context(kind: str, options: Mapping[str, Any], required: bool) -> ssl.SSLContext | None:
    """The client TLS context the options ask for, or None when they ask for none and `required`
    (the address's scheme asks for TLS) is false.

    `tls_ca_file` is the CA bundle that signs the server's certificate (default: the system's);
    `tls_cert_file` and `tls_key_file` are a client certificate and its key, both or neither.
    The server's host name is checked. Raises ValueError naming the option whose file is missing
    or unreadable.
    """
    ca, cert, key = (str_option(kind, options, name, None) for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"))
    if not (required or ca or cert or key):
        return None
    if bool(cert) != bool(key):
        raise ValueError(f"{kind} transport: options 'tls_cert_file' and 'tls_key_file' go together")
    try:
        context = ssl.create_default_context(cafile=ca or None)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"{kind} transport: option 'tls_ca_file' {ca!r}: {e}") from None
    if cert:
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"{kind} transport: options 'tls_cert_file'/'tls_key_file' {cert!r}, {key!r}: {e}") from None
    return context
