"""What the fault suite shares: a workload whose deliveries can be checked, and the pass rule.

- Every message's body is derived from its id (`body_for`), so a delivered message is checked
  byte for byte without keeping bodies around.
- The `Ledger` keeps what was sent (subject, the earliest time the producer asked for) and what was
  acknowledged (the schedule time of its handle).
- `check_deliveries` applies the pass rule of DESIGN.md "Guarantees" to what a broker received:
  every acknowledged id delivered at least once; nothing unknown, corrupt or early; an id delivered
  again only after an interruption (a kill, a broker outage) that came right after its previous
  delivery, and no more such redeliveries per interruption than the sender can have had in flight.

Knobs are environment variables read through `env_int`, so a long run is a command line away:
``DELAYSERVER_CRASH_ROUNDS=2000 ops/test tests/faults/test_crash_loop.py``.
"""
from __future__ import annotations

import collections
import hashlib
import itertools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable

import attrs
import trio

from delayserver.client import AsyncProducer, Message
from delayserver.message import Handle
from tests.procs import spooled

SUBJECTS = ("faults.orders", "faults.payments", "faults.mail")
EXAMPLES = 10  # offending ids shown per broken rule


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def seeded_rng(name: str = "DELAYSERVER_FAULT_SEED") -> tuple[int, random.Random]:
    """A seed from `name` or a fresh one, printed so that a failure can be replayed with it."""
    seed = env_int(name, random.randrange(1 << 32))
    print(f"{name}={seed}")
    return seed, random.Random(seed)


def body_for(message_id: str) -> bytes:
    """The body every message of the suite carries: 16 to 526 bytes derived from its id."""
    digest = hashlib.blake2b(message_id.encode(), digest_size=16).digest()
    return (digest.hex().encode() * 17)[: 16 + 2 * digest[0]]


@attrs.frozen
class Sent:
    subject: str
    not_before: int  # the earliest delivery time the producer asked for, epoch ms


@attrs.define(eq=False)
class Ledger:
    """What the producers sent and what the server acknowledged."""

    prefix: str = "m"
    sent: dict[str, Sent] = attrs.Factory(dict)
    acked: dict[str, int] = attrs.Factory(dict)  # id -> schedule time of its handle
    unanswered: int = 0  # messages whose request got no answer (connection lost, timeout)
    refused: list[Exception] = attrs.Factory(list)  # result codes other than OK
    _ids: itertools.count = attrs.Factory(itertools.count)

    def new_message(self, rng: random.Random, max_delay_ms: int, min_delay_ms: int = 0) -> Message:
        """A message with a random delay of `min_delay_ms` to `max_delay_ms`, given as a delay or as
        an absolute time."""
        message_id = f"{self.prefix}-{next(self._ids):08d}"
        subject = rng.choice(SUBJECTS)
        delay = rng.randint(min_delay_ms, max_delay_ms)
        now = now_ms()
        self.sent[message_id] = Sent(subject, now + delay)
        if rng.random() < 0.5:
            return Message(subject, body_for(message_id), delay=delay, message_id=message_id)
        return Message(subject, body_for(message_id), deliver_at=now + delay, message_id=message_id)

    def record(self, messages: list[Message], results: list) -> None:
        for m, result in zip(messages, results):
            if isinstance(result, Handle):
                self.acked[m.message_id] = result.schedule_time
            elif isinstance(result, (ConnectionError, TimeoutError)):
                self.unanswered += 1
            else:
                self.refused.append(result)

    def acknowledge(self, message_id: str, schedule_time: int) -> None:
        """Count a message as acknowledged that the server stored and released the ack of, though
        the answer never reached the producer (a kill right after the ack was released)."""
        assert message_id in self.sent, message_id
        self.acked.setdefault(message_id, schedule_time)


async def produce(address: str, ledger: Ledger, rng: random.Random, *, max_delay_ms: int,
                  stop: trio.Event, batch: tuple[int, int] = (1, 48), pause_ms: tuple[int, int] = (0, 20),
                  timeout: float = 3.0) -> None:
    """Send batches of random messages, one request at a time, until `stop` is set or the server is
    gone (a request without an answer ends it: after a kill there is nobody left to answer)."""
    async with AsyncProducer(address, timeout=timeout) as producer:
        while not stop.is_set():
            messages = [ledger.new_message(rng, max_delay_ms) for _ in range(rng.randint(*batch))]
            results = await producer.send_many(messages)
            ledger.record(messages, results)
            if any(isinstance(r, (ConnectionError, TimeoutError)) for r in results):
                return
            await trio.sleep(rng.randint(*pause_ms) / 1000)


async def drive(address: str, ledger: Ledger, rng: random.Random, stop: trio.Event, *, producers: int = 4,
                max_delay_ms: int, grace_s: float = 1.0, **kw) -> None:
    """Run `producers` concurrent producers until `stop` is set; then give them `grace_s` to see
    the answers (or the lost connection) of what they have in flight, and cancel the rest."""
    async with trio.open_nursery() as nursery:
        for i in range(producers):
            nursery.start_soon(lambda r: produce(address, ledger, r, max_delay_ms=max_delay_ms, stop=stop, **kw),
                               random.Random(rng.random()))
        await stop.wait()
        await trio.sleep(0)
        with trio.move_on_after(grace_s):
            while len(nursery.child_tasks) > 0:
                await trio.sleep(0.02)
        nursery.cancel_scope.cancel()


# --- deliveries -----------------------------------------------------------------------------------


@attrs.frozen
class Delivery:
    message_id: str
    subject: str
    body: bytes
    schedule_time: int
    dispatch_time: int


def spool_deliveries(data_dir: Path) -> list[Delivery]:
    """Everything the embedded spool broker holds (its reader checks every record's crc)."""
    return [Delivery(m.message_id, m.subject, m.body, m.schedule_time, t) for t, _, m in spooled(data_dir)]


def redis_deliveries(client, streams: Iterable[str] = SUBJECTS) -> list[Delivery]:
    """Every entry of the Redis streams, read with XRANGE in pages."""
    out = []
    for stream in streams:
        start = "-"
        while True:
            page = client.xrange(stream, min=start, max="+", count=10_000)
            for entry_id, f in page:
                out.append(Delivery(f[b"id"].decode(), f[b"subject"].decode(), f[b"body"],
                                    int(f[b"schedule_time"]), int(f[b"dispatch_time"])))
            if len(page) < 10_000:
                break
            start = "(" + page[-1][0].decode()
    return out


@attrs.frozen
class Report:
    acked: int
    delivered_ids: int
    deliveries: int
    redeliveries_per_cut: dict[int, int]

    def __str__(self) -> str:
        worst = max(self.redeliveries_per_cut.values(), default=0)
        return (f"{self.acked} acknowledged, {self.delivered_ids} ids delivered in {self.deliveries} deliveries, "
                f"{sum(self.redeliveries_per_cut.values())} redeliveries after {len(self.redeliveries_per_cut)} "
                f"interruptions (at most {worst} for one)")


def check_deliveries(ledger: Ledger, deliveries: list[Delivery], *, cuts: list[int] = (), window_ms: int = 1000,
                     max_per_cut: int = 0, context: str = "") -> Report:
    """The pass rule (module docstring). `cuts` are the moments (epoch ms) the delivery path was
    interrupted: a kill -9, a broker going down. A delivery that is not an id's last must be
    followed by a cut within `window_ms`, before the id's next delivery; and no cut may be followed
    by more than `max_per_cut` redeliveries. Raises AssertionError naming examples of each broken rule.
    """
    problems: dict[str, list[str]] = collections.defaultdict(list)
    by_id: dict[str, list[Delivery]] = collections.defaultdict(list)
    for d in deliveries:
        by_id[d.message_id].append(d)
        sent = ledger.sent.get(d.message_id)
        if sent is None:
            problems["delivered but never sent"].append(d.message_id)
            continue
        if d.body != body_for(d.message_id) or d.subject != sent.subject:
            problems["corrupt (body or subject differs from what was sent)"].append(d.message_id)
        if d.schedule_time < sent.not_before:
            problems["scheduled before the time the producer asked for"].append(
                f"{d.message_id}: {d.schedule_time} < {sent.not_before}")
        if d.message_id in ledger.acked and d.schedule_time != ledger.acked[d.message_id]:
            problems["schedule time differs from the acknowledged handle"].append(d.message_id)
        if d.dispatch_time < d.schedule_time:
            problems["delivered before its time"].append(
                f"{d.message_id}: dispatched {d.dispatch_time} < scheduled {d.schedule_time}")
    lost = sorted(set(ledger.acked) - set(by_id))
    if lost:
        problems[f"acknowledged but never delivered ({len(lost)})"] = lost
    sorted_cuts = sorted(cuts)
    per_cut: collections.Counter[int] = collections.Counter()
    for message_id, ds in by_id.items():
        if len(ds) == 1:
            continue
        ds.sort(key=lambda d: d.dispatch_time)
        for first, again in zip(ds, ds[1:]):
            cut = _cut_after(sorted_cuts, first.dispatch_time, window_ms)
            if cut is None or cut > again.dispatch_time:
                problems["delivered again with no interruption right after the earlier delivery"].append(
                    f"{message_id}: at {first.dispatch_time} and {again.dispatch_time}")
            else:
                per_cut[cut] += 1
    for cut, n in per_cut.items():
        if n > max_per_cut:
            problems[f"more redeliveries after one interruption than can be in flight ({max_per_cut})"].append(
                f"{n} after the cut at {cut}")
    report = Report(len(ledger.acked), len(by_id), len(deliveries), dict(per_cut))
    if problems:
        lines = [f"{context}: {report}" if context else str(report)]
        for rule, examples in problems.items():
            lines.append(f"- {rule}: {', '.join(map(str, examples[:EXAMPLES]))}"
                         + (f" (+{len(examples) - EXAMPLES} more)" if len(examples) > EXAMPLES else ""))
        raise AssertionError("\n".join(lines))
    return report


def _cut_after(cuts: list[int], t: int, window_ms: int) -> int | None:
    """The first cut at or after `t`, if it came within `window_ms`."""
    for cut in cuts:
        if cut >= t:
            return cut if cut - t <= window_ms else None
    return None


def wait_until_delivered(ledger: Ledger, read, *, timeout_s: float, interval_s: float = 0.5) -> list[Delivery]:
    """Poll `read()` (a list of deliveries) until every acknowledged id is in it, or `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        deliveries = read()
        if set(ledger.acked) <= {d.message_id for d in deliveries} or time.monotonic() > deadline:
            return deliveries
        time.sleep(interval_s)


# --- the server's files and tools -----------------------------------------------------------------


def toml_value(value) -> str:
    """Ints, strings, lists and dicts (as inline tables) in TOML."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} = {toml_value(v)}" for key, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(map(toml_value, value)) + "]"
    return json.dumps(value)


def write_config(path: Path, options: dict, broker_groups: list[dict] = ()) -> Path:
    """A TOML config file from options and broker groups."""
    lines = [f"{key} = {toml_value(value)}" for key, value in options.items()]
    for group in broker_groups:
        lines.append("[[broker_group]]")
        lines += [f"{key} = {toml_value(value)}" for key, value in group.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def delayctl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "delayserver.ctl", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def assert_verify_passes(data_dir: Path) -> None:
    result = delayctl("verify", data_dir)
    assert result.returncode == 0, f"delayctl verify {data_dir} failed:\n{result.stdout}\n{result.stderr}"


def bucket_totals(data_dir: Path) -> dict:
    """`delayctl buckets --json`: the totals line (scheduled, dispatched, cancelled, pending, ...)."""
    result = delayctl("buckets", data_dir, "--json")
    assert result.returncode == 0, f"delayctl buckets failed:\n{result.stdout}\n{result.stderr}"
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    return rows[-1]


def pending_buckets(data_dir: Path, due_before_ms: int) -> list[dict]:
    """`delayctl buckets --json` rows of buckets that start before `due_before_ms` and still hold
    pending messages."""
    from delayserver.storage.buckets import parse_bucket_name

    result = delayctl("buckets", data_dir, "--json")
    assert result.returncode == 0, f"delayctl buckets failed:\n{result.stdout}\n{result.stderr}"
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    return [r for r in rows[:-1] if r["pending"] and parse_bucket_name(r["bucket"]) < due_before_ms]
