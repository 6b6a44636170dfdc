"""The delayed-message workload of the end-to-end benchmarks, its load generator, and the readers
of what was delivered.

A workload is N messages (ids `bench-00000000`...) with delivery times drawn uniformly, from a fixed
seed, over a window that starts at `t0`; the benchmark picks `t0` far enough ahead that every send
is acknowledged before the first message falls due, so what follows measures delivery alone.

The load generator runs in its own process (`python -m bench.workload send KIND ...`):
`producers` concurrent producers, each with its own connection, each sending its share (message i
goes to producer i % producers) in batches of `batch`, one batch in flight at a time. KIND `ours`
sends through `AsyncProducer` (one SEND frame per batch, acknowledged once stored durably); KIND
`zset` is the sorted-set delay queue's producer side (one ZADD per batch, the due time as score and
the message as a JSON member, as Sidekiq's push_bulk does); KIND `rq` schedules one RQ job per
message with rq-scheduler's `enqueue_at` (see `rq_queue.py`). It prints, as JSON, how many messages
were acknowledged, which were not, and how long the sends took.
"""
from __future__ import annotations

import json
import random
import sys
import threading
import time

import attrs
import redis

from delayserver.sender.redis_streams import HEADER_PREFIX  # how the Redis transport writes a header

SUBJECT = "bench.delay"


@attrs.frozen
class Workload:
    n: int
    window_ms: int
    producers: int = 16
    batch: int = 64
    body_bytes: int = 256
    seed: int = 1
    #: Delivery times rising with the id, so that messages arrive in the order they fall due (as
    #: with one fixed delay: order timeouts); by default they arrive in random order.
    in_order: bool = False
    #: Each message carries a header, a trace id as tracing libraries add one (`--headers`).
    headers: bool = False

    @property
    def due_per_s(self) -> float:
        return self.n / (self.window_ms / 1000)

    @property
    def lead_ms(self) -> int:
        """How far ahead of the start of the sends the window opens: room for the sends to finish
        at 10,000 msg/s (about a third of what the server acknowledges with fsync on a 2-core
        machine), plus startup."""
        return 3000 + self.n * 1000 // 10_000

    def schedule(self, t0_ms: int) -> list[int]:
        """Delivery time (epoch ms) of each message, in id order."""
        rng = random.Random(self.seed)
        times = [t0_ms + int(rng.random() * self.window_ms) for _ in range(self.n)]
        return sorted(times) if self.in_order else times

    def describe(self) -> str:
        return (f"{self.n:,} messages of {self.body_bytes} B due uniformly over {self.window_ms / 1000:g} s "
                f"({self.due_per_s:,.0f} msg/s falling due), sent beforehand by {self.producers} producers "
                f"in batches of {self.batch}" + (", in the order they fall due" if self.in_order else "")
                + (f", each with a header ({TRACE_HEADER}: 32 hex digits)" if self.headers else ""))

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Workload":
        return cls(**json.loads(text))


#: The header of `Workload.headers`: the message's trace id.
TRACE_HEADER = "trace-id"


def message_headers(i: int) -> dict[str, str]:
    """The headers message i carries with `Workload.headers`."""
    return {TRACE_HEADER: f"{i * 2654435761 % 2**128:032x}"}


def message_id(i: int) -> str:
    return f"bench-{i:08d}"


def zset_member(i: int, schedule_time: int, body: str) -> str:
    """The sorted-set member of message i: the whole message as JSON (ids make members unique)."""
    return json.dumps({"id": message_id(i), "subject": SUBJECT, "schedule_time": str(schedule_time),
                       "body": body}, separators=(",", ":"))


# --- sending (in the load process) ----------------------------------------------------------------


def _shares(w: Workload) -> list[list[list[int]]]:
    """Per producer, its batches of message indexes."""
    out = []
    for k in range(w.producers):
        mine = list(range(k, w.n, w.producers))
        out.append([mine[j : j + w.batch] for j in range(0, len(mine), w.batch)])
    return out


async def _send_ours(address: str, w: Workload, times: list[int], unacked: list[int]) -> None:
    import trio

    from delayserver.client import AsyncProducer, Message

    body = b"x" * w.body_bytes

    async def producer(batches: list[list[int]]) -> None:
        async with AsyncProducer(address, timeout=60) as prod:
            for batch in batches:
                msgs = [Message(SUBJECT, body, deliver_at=times[i], message_id=message_id(i),
                                headers=message_headers(i) if w.headers else {}) for i in batch]
                results = await prod.send_many(msgs, batch=len(msgs))
                unacked.extend(i for i, r in zip(batch, results) if isinstance(r, Exception))

    async with trio.open_nursery() as nursery:
        for batches in _shares(w):
            nursery.start_soon(producer, batches)


async def _send_zset(address: str, w: Workload, times: list[int], unacked: list[int], key: str) -> None:
    import asyncio

    import redis.asyncio as aioredis

    host, port = address.rsplit(":", 1)
    body = "x" * w.body_bytes
    client = aioredis.Redis(host=host, port=int(port), max_connections=w.producers, socket_timeout=60)

    async def producer(batches: list[list[int]]) -> None:
        for batch in batches:
            try:
                await client.zadd(key, {zset_member(i, times[i], body): times[i] for i in batch})
            except redis.RedisError:
                unacked.extend(batch)

    try:
        await asyncio.gather(*(producer(b) for b in _shares(w)))
    finally:
        await client.aclose()


def _import_client(kind: str) -> None:
    """Import the modules `kind`'s sends use, so that the sends' time leaves out Python's imports
    (about 65 ms for trio and our client here, within a run of about a second)."""
    if kind == "ours":
        import trio  # noqa: F401

        import delayserver.client  # noqa: F401
    elif kind == "rq":
        import rq_scheduler  # noqa: F401
    else:
        import asyncio  # noqa: F401

        import redis.asyncio  # noqa: F401


def send(kind: str, address: str, w: Workload, t0_ms: int, zset_key: str = "") -> dict:
    times = w.schedule(t0_ms)
    unacked: list[int] = []
    _import_client(kind)
    start = time.perf_counter()
    if kind == "ours":
        import trio

        trio.run(_send_ours, address, w, times, unacked)
    elif kind == "rq":
        from bench.rq_queue import send as send_rq

        send_rq(address, _shares(w), times, "x" * w.body_bytes, unacked)
    else:
        import asyncio

        asyncio.run(_send_zset(address, w, times, unacked, zset_key))
    seconds = time.perf_counter() - start
    return {"acked": w.n - len(unacked), "unacked": sorted(unacked), "seconds": seconds, "ended_ms": time.time_ns() // 1_000_000}


# --- reading what was delivered -----------------------------------------------------------------


@attrs.frozen
class Delivered:
    """One delivered message: its id, schedule time, the dispatch time it carries and, for a Redis
    stream, the time the broker took it (the millisecond part of its entry id)."""

    message_id: str
    schedule_time: int
    dispatch_time: int
    arrival_time: int | None = None
    headers: tuple = ()  # its headers' items, sorted


def _from_entry(entry_id: bytes, fields: dict) -> Delivered:
    prefix = HEADER_PREFIX.encode()
    headers = tuple(sorted((k[len(prefix):].decode(), v.decode()) for k, v in fields.items() if k.startswith(prefix)))
    return Delivered(fields[b"id"].decode(), int(fields[b"schedule_time"]), int(fields[b"dispatch_time"]),
                     int(entry_id.split(b"-", 1)[0]), headers)


def headers_as_sent(delivered: list["Delivered"]) -> int:
    """How many of `delivered` carry the headers `message_headers` gave them (`Workload.headers`)."""
    return sum(d.headers == tuple(sorted(message_headers(int(d.message_id.rsplit("-", 1)[1])).items()))
               for d in delivered)


def read_stream(client: redis.Redis, stream: str, after: bytes = b"0-0", count: int = 10_000) -> tuple[list[Delivered], bytes]:
    """The entries of `stream` after entry id `after`, oldest first, and the last id read."""
    out: list[Delivered] = []
    while True:
        entries = client.xrange(stream, b"(" + after, "+", count=count)
        out.extend(_from_entry(eid, fields) for eid, fields in entries)
        if entries:
            after = entries[-1][0]
        if len(entries) < count:
            return out, after


class StreamConsumer:
    """A consumer reading `stream` as entries arrive (XREAD BLOCK, in a thread), keeping each as a
    Delivered. It rides out its Redis going away (a kill -9, a restart) by reconnecting; entries
    it already read stay counted even if the restarted Redis has lost them."""

    def __init__(self, host: str, port: int, stream: str):
        self._client = redis.Redis(host=host, port=port, socket_timeout=2, socket_connect_timeout=1)
        self._stream = stream
        self._last = b"0-0"
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="stream-consumer")
        self.delivered: list[Delivered] = []
        self.seen: set[str] = set()

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                reply = self._client.xread({self._stream: self._last}, count=5000, block=100)
            except redis.RedisError:
                self._stopped.wait(0.05)
                continue
            for _, entries in reply:
                for eid, fields in entries:
                    d = _from_entry(eid, fields)
                    self.delivered.append(d)
                    self.seen.add(d.message_id)
                    self._last = eid

    def arrived(self) -> int:
        """How many distinct messages it has read so far."""
        return len(self.seen)

    def __enter__(self) -> "StreamConsumer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopped.set()
        self._thread.join()
        self._client.close()


if __name__ == "__main__":
    kind, address, workload, t0 = sys.argv[2], sys.argv[3], Workload.from_json(sys.argv[4]), int(sys.argv[5])
    key = sys.argv[6] if len(sys.argv) > 6 else ""
    print(json.dumps(send(kind, address, workload, t0, key)))
