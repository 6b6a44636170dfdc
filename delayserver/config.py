"""Configuration of a delay-server node: defaults, TOML loading, validation naming the option.

Durations are milliseconds as integers, or strings with a unit: "250ms", "30s", "5m", "1h", "2d",
"2y" (365 days). Sizes are bytes as integers, or strings like "64MiB", "4KiB".
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import attrs

from delayserver.message import MAX_BODY_BYTES, AddressError, parse_address as _parse_address
from delayserver.protocol import DEFAULT_MAX_FRAME_BYTES, DEFAULT_PORT
from delayserver.sender.groups import (
    DEFAULT_BATCHES_IN_FLIGHT, DEFAULT_MAX_INFLIGHT, DEFAULT_SEND_BATCH_SIZE, DEFAULT_SEND_WAIT_MS, BrokerGroupSpec,
    TransportKind,
)
from delayserver.sender.transport import check_options
from delayserver.storage.buckets import MINUTE_MS
from delayserver.wheel.read_ahead import HORIZON_MS as READ_AHEAD_MS, MAX_BYTES as READ_AHEAD_BYTES

DEFAULT_DELAY_LEVELS = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"

_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "y": 365 * 86_400_000}
_UNITS_B = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9}


class ConfigError(ValueError):
    """Invalid configuration; the message names the option."""


def parse_duration(value: Any, option: str = "duration") -> int:
    """Milliseconds from an int or a string like "30s"; ConfigError names `option` otherwise."""
    if isinstance(value, bool):
        raise ConfigError(f"{option}: expected a duration, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{option}: must not be negative, got {value}")
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+)\s*(ms|s|m|h|d|y)\s*", value)
        if m:
            return int(m.group(1)) * _UNITS_MS[m.group(2)]
        if value.strip() == "0":  # zero needs no unit ("0" turns dedupe_window off, as 0 does)
            return 0
    raise ConfigError(f"{option}: expected a duration such as 500ms, 30s, 5m, 1h, 2y; got {value!r}")


def parse_size(value: Any, option: str = "size") -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+)\s*([KMG]i?B|B)?\s*", value, re.IGNORECASE)
        if m and int(m.group(1)) > 0:
            return int(m.group(1)) * _UNITS_B[(m.group(2) or "").lower()]
    raise ConfigError(f"{option}: expected a positive size such as 4096 or 64MiB; got {value!r}")


def parse_delay_levels(text: str, option: str = "delay_levels") -> tuple[int, ...]:
    """RocketMQ-style levels: level N (1-based) is the N-th duration of the string."""
    if not isinstance(text, str) or not text.split():
        raise ConfigError(f"{option}: expected durations separated by spaces, got {text!r}")
    return tuple(parse_duration(part, option) for part in text.split())


def parse_address(text: str, option: str = "listen", default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """`message.parse_address` (port 0 allowed: a listener lets the system pick), with a
    ConfigError naming `option`."""
    try:
        return _parse_address(text, default_port=default_port, allow_port_zero=True)
    except AddressError as e:
        raise ConfigError(f"{option}: expected HOST:PORT, got {text!r} ({e})") from None


@attrs.frozen
class Config:
    data_dir: Path = Path("var")
    listen: tuple[str, int] = ("127.0.0.1", DEFAULT_PORT)
    metrics_listen: tuple[str, int] | None = None
    http_listen: tuple[str, int] | None = None
    log_format: str = "text"
    flush: str = "sync"
    flush_interval_ms: int = 10
    max_message_bytes: int = 4 << 20
    max_delay_ms: int = 2 * _UNITS_MS["y"]
    segment_scale_ms: int = 60 * MINUTE_MS
    load_ahead_ms: int | None = None
    read_ahead_ms: int = READ_AHEAD_MS
    read_ahead_bytes: int = READ_AHEAD_BYTES
    message_log_segment_bytes: int = 64 << 20
    tick_ms: int = 10
    wheel_slots: int = 1 << 13
    delay_levels: tuple[int, ...] = parse_delay_levels(DEFAULT_DELAY_LEVELS)
    checkpoint_interval_ms: int = 1000
    send_batch_size: int = DEFAULT_SEND_BATCH_SIZE
    send_wait_ms: int = DEFAULT_SEND_WAIT_MS
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    send_batches_in_flight: int = DEFAULT_BATCHES_IN_FLIGHT
    max_connections: int = 1024
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    idle_timeout_ms: int = 300_000
    frame_timeout_ms: int = 10_000
    max_queued_messages: int = 100_000
    max_queued_bytes: int = 64 << 20
    max_connection_bytes: int = 16 << 20
    max_buffered_bytes: int = 256 << 20
    reserve_bytes: int = 16 << 20
    retention_ms: int = 3_600_000
    cleaner_interval_ms: int = 60_000
    meta: str | None = None
    group: str = "default"
    node_id: str = ""
    advertised_address: str = ""
    replicate_from: str = ""
    auth_secret: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    # Shared by the nodes, the meta servers and operators (not producers): the meta server
    # requires it for registrations, heartbeats and changes.
    cluster_secret: str = ""
    meta_tls_ca: str = ""
    deliver_through_meta_outage: bool = True
    # Replication: sync acknowledgements, the slaves that hold back the cleaner.
    replication: str = "async"
    sync_timeout_ms: int = 5000
    min_insync_replicas: int = 1
    max_slave_lag: int = 1 << 30
    broker_groups: tuple[BrokerGroupSpec, ...] = (BrokerGroupSpec("spool"),)
    # Idempotent send: a message id accepted within this window is answered with its first handle
    # (0 turns it off).
    dedupe_window_ms: int = _UNITS_MS["d"]
    # transactions: half messages and their check-back (RocketMQ's defaults)
    transaction_timeout_ms: int = 6_000
    check_interval_ms: int = 60_000
    check_max: int = 15
    check_spacing_ms: int = 10
    check_answer_timeout_ms: int = 3_000

    @classmethod
    def load(cls, path: Path | None = None, **overrides) -> "Config":
        """Read a TOML file (optional) and apply overrides (raw values, as from the command line).

        Raises ConfigError naming the first invalid or unknown option.
        """
        raw: dict[str, Any] = {}
        if path is not None:
            try:
                raw = tomllib.loads(Path(path).read_text())
            except OSError as e:
                raise ConfigError(f"--config: cannot read {path}: {e.strerror}") from None
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"--config: {path} is not valid TOML: {e}") from None
        raw.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Config":
        known = {f.name for f in attrs.fields(cls)} | {"max_delay", "segment_scale", "load_ahead", "read_ahead",
                                                       "dedupe_window"}
        for key in raw:
            if key not in known and key != "broker_group":
                raise ConfigError(f"{key}: unknown option")
        kw: dict[str, Any] = {}
        get = raw.get
        if "data_dir" in raw:
            kw["data_dir"] = Path(raw["data_dir"])
        if "listen" in raw:
            kw["listen"] = parse_address(raw["listen"], "listen")
        if "metrics_listen" in raw:
            kw["metrics_listen"] = parse_address(raw["metrics_listen"], "metrics_listen", 20802)
        if "http_listen" in raw:
            kw["http_listen"] = parse_address(raw["http_listen"], "http_listen", 20803)
        if "log_format" in raw:
            if raw["log_format"] not in ("text", "json"):
                raise ConfigError(f"log_format: expected 'text' or 'json', got {raw['log_format']!r}")
            kw["log_format"] = raw["log_format"]
        if "flush" in raw:
            if raw["flush"] not in ("sync", "async"):
                raise ConfigError(f"flush: expected 'sync' or 'async', got {raw['flush']!r}")
            kw["flush"] = raw["flush"]
        for name in ("flush_interval_ms", "checkpoint_interval_ms", "send_wait_ms", "idle_timeout_ms",
                     "frame_timeout_ms", "retention_ms", "cleaner_interval_ms"):
            if name in raw:
                kw[name] = parse_duration(raw[name], name)
        name = "read_ahead" if "read_ahead" in raw else "read_ahead_ms"
        if name in raw:
            kw["read_ahead_ms"] = parse_duration(raw[name], name)
            if kw["read_ahead_ms"] <= 0:
                raise ConfigError(f"{name}: must be positive, got {raw[name]!r}")
        for name in ("read_ahead_bytes", "reserve_bytes"):  # sizes that 0 turns off
            if name in raw:
                kw[name] = 0 if raw[name] == 0 else parse_size(raw[name], name)
        for name in ("max_message_bytes", "message_log_segment_bytes", "max_frame_bytes", "max_queued_bytes",
                     "max_connection_bytes", "max_buffered_bytes"):
            if name in raw:
                kw[name] = parse_size(raw[name], name)
        if kw.get("max_message_bytes", 0) > MAX_BODY_BYTES:
            # Clients refuse a larger body before sending it: no node may promise to take one.
            raise ConfigError(f"max_message_bytes: at most {MAX_BODY_BYTES} (8MiB), got {kw['max_message_bytes']}")
        for name in ("send_batch_size", "send_batches_in_flight", "max_inflight", "max_connections", "max_queued_messages",
                     "tick_ms", "wheel_slots"):
            if name in raw:
                v = raw[name]
                if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                    raise ConfigError(f"{name}: expected a positive integer, got {v!r}")
                kw[name] = v
        if "wheel_slots" in kw and kw["wheel_slots"] & (kw["wheel_slots"] - 1):
            raise ConfigError(f"wheel_slots: must be a power of two, got {kw['wheel_slots']}")
        if get("max_delay") is not None or get("max_delay_ms") is not None:
            kw["max_delay_ms"] = parse_duration(get("max_delay", get("max_delay_ms")), "max_delay")
        scale = get("segment_scale", get("segment_scale_ms"))
        if scale is not None:
            ms = parse_duration(scale, "segment_scale")
            if ms % MINUTE_MS or not 1 <= ms // MINUTE_MS <= 60:
                raise ConfigError(f"segment_scale: must be 1 to 60 whole minutes, got {scale!r}")
            kw["segment_scale_ms"] = ms
        ahead = get("load_ahead", get("load_ahead_ms"))
        if ahead is not None:
            kw["load_ahead_ms"] = parse_duration(ahead, "load_ahead")
        if "delay_levels" in raw:
            kw["delay_levels"] = parse_delay_levels(raw["delay_levels"])
        if "deliver_through_meta_outage" in raw:
            if not isinstance(raw["deliver_through_meta_outage"], bool):
                raise ConfigError("deliver_through_meta_outage: expected true or false")
            kw["deliver_through_meta_outage"] = raw["deliver_through_meta_outage"]
        elif raw.get("replication", "async") == "sync":
            # Off by default in sync mode: a master cut off from meta stops delivering with its lease.
            kw["deliver_through_meta_outage"] = False
        if raw.get("advertised_address"):
            parse_address(raw["advertised_address"], "advertised_address")
        if raw.get("meta"):
            for address in str(raw["meta"]).split(","):
                parse_address(address.strip(), "meta", 20800)
        if raw.get("replicate_from"):
            parse_address(raw["replicate_from"], "replicate_from")
        if bool(raw.get("tls_cert")) != bool(raw.get("tls_key")):
            raise ConfigError("tls_cert: tls_cert and tls_key go together (PEM certificate chain and its key)")
        for name in ("tls_cert", "tls_key", "tls_ca", "meta_tls_ca"):
            if raw.get(name) and not Path(raw[name]).is_file():
                raise ConfigError(f"{name}: no such file {raw[name]!r}")
        for name in ("meta", "group", "node_id", "advertised_address", "replicate_from", "auth_secret",
                     "tls_cert", "tls_key", "tls_ca", "cluster_secret", "meta_tls_ca"):
            if name in raw:
                if not isinstance(raw[name], str):
                    raise ConfigError(f"{name}: expected a string, got {raw[name]!r}")
                kw[name] = raw[name]
        # Idempotent send
        if get("dedupe_window") is not None or get("dedupe_window_ms") is not None:
            kw["dedupe_window_ms"] = parse_duration(get("dedupe_window", get("dedupe_window_ms")), "dedupe_window")
        # transactions
        for name in ("transaction_timeout_ms", "check_interval_ms", "check_spacing_ms", "check_answer_timeout_ms"):
            if name in raw:
                kw[name] = parse_duration(raw[name], name)
        if "check_max" in raw:
            v = raw["check_max"]
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"check_max: expected a positive integer, got {v!r}")
            kw["check_max"] = v
        # Replication: sync acknowledgements, the slaves that hold back the cleaner.
        if "replication" in raw:
            if raw["replication"] not in ("async", "sync"):
                raise ConfigError(f"replication: expected 'async' or 'sync', got {raw['replication']!r}")
            kw["replication"] = raw["replication"]
        if "sync_timeout_ms" in raw:
            kw["sync_timeout_ms"] = parse_duration(raw["sync_timeout_ms"], "sync_timeout_ms")
            if kw["sync_timeout_ms"] <= 0:
                raise ConfigError("sync_timeout_ms: must be more than 0")
        if "min_insync_replicas" in raw:
            v = raw["min_insync_replicas"]
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"min_insync_replicas: expected a positive integer, got {v!r}")
            kw["min_insync_replicas"] = v
        if "max_slave_lag" in raw:
            kw["max_slave_lag"] = parse_size(raw["max_slave_lag"], "max_slave_lag")
        groups = get("broker_group", get("broker_groups"))
        if groups is not None:
            kw["broker_groups"] = _broker_groups(groups)
        return cls(**kw)

    @property
    def effective_load_ahead_ms(self) -> int:
        return self.segment_scale_ms // 2 if self.load_ahead_ms is None else self.load_ahead_ms


def _broker_groups(items: Any) -> tuple[BrokerGroupSpec, ...]:
    if not isinstance(items, list) or not items:
        raise ConfigError("broker_group: expected a non-empty array of tables ([[broker_group]])")
    out, names = [], set()
    for i, item in enumerate(items):
        where = f"broker_group[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise ConfigError(f"{where}.name: every broker group needs a name")
        if item["name"] in names:
            raise ConfigError(f"{where}.name: duplicate broker group {item['name']!r}")
        names.add(item["name"])
        unknown = set(item) - {"name", "transport", "address", "weight", "subjects", "options"}
        if unknown:
            raise ConfigError(f"{where}.{sorted(unknown)[0]}: unknown option")
        transport = item.get("transport", "spool")
        kinds = [k.value for k in TransportKind]
        if transport not in kinds:
            raise ConfigError(f"{where}.transport: expected one of {', '.join(kinds)}, got {transport!r}")
        weight = item.get("weight", 1)
        if not isinstance(weight, int) or isinstance(weight, bool) or weight <= 0:
            raise ConfigError(f"{where}.weight: expected a positive integer, got {weight!r}")
        subjects = item.get("subjects")
        if subjects is not None and (not isinstance(subjects, list) or not all(isinstance(s, str) for s in subjects)):
            raise ConfigError(f"{where}.subjects: expected an array of subject names")
        if transport != "spool" and not item.get("address"):
            raise ConfigError(f"{where}.address: required for the {transport} transport")
        if not isinstance(item.get("options", {}), dict):
            raise ConfigError(f"{where}.options: expected a table")
        spec = BrokerGroupSpec(item["name"], TransportKind(transport), str(item.get("address", "")), weight,
                               options=dict(item.get("options", {})),
                               subjects=tuple(subjects) if subjects is not None else None)
        try:
            # A bad address or option stops the start with a clear message, not a traceback.
            check_options(spec)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
        out.append(spec)
    return tuple(out)
