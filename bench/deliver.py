"""`ops/bench deliver [--quick] [--transports spool,redis,rabbitmq,nats] [--bridge] [--bucket-load N]
[--rate R[,R...] [--seconds S] [--repeat N]] [--in-order] [--headers] [--profile FILE]`: end-to-end
delivery of messages falling due at a steady rate.

`--rate` runs the workload at each given rate (messages falling due per second, over a window of
`--seconds`, default 10; spool only unless --transports says otherwise) and prints, per transport,
the highest rate that was sustained with lateness P99 <= 10 ms and none early, and the server's
CPU per delivered message at each rate (user plus system time of the server process, from the
window's start to the last delivery; the report gives the event loop's thread's part apart, the
thread all of the node's Python runs on). `--repeat N` runs each rate N times, in rounds over the
rates, and prints each rate's median and range; a rate counts as sustained only when every run of
it met the target (near a core's worth of work, one run's P99 says little).

The real server runs as its own process on a temp data directory, delivering, one run each, to
the spool, to Redis Streams on a redis-server, to a durable RabbitMQ queue (publisher confirms)
on a rabbitmq-server, and to a JetStream stream (publish acks) on a nats-server, each broker
started by the benchmark on a free port. `--bridge` also measures the trio -> asyncio crossing
the RabbitMQ and NATS transports make once per batch. A load
generator process sends the workload (see `workload.py`: by default 100,000 messages of 256 B due
uniformly over 10 s, that is 10,000 msg/s falling due) and every send is acknowledged before the
first message falls due, so the figures are delivery alone. The messages arrive in random order
of their delivery times; with `--in-order`, in the order they fall due, as with one fixed delay
(order timeouts), where a tick's due records lie side by side in schedule_log. With `--headers`
each message carries a header (a trace id, as tracing libraries add one); by default none. Once
the window has passed and everything has arrived, the benchmark reads what was delivered (the
spool files, or XRANGE over the stream) and prints:

- delivered/s: messages over the time from the window's start to the last dispatch, and the
  slowest whole second of the window (delivered in it, against what fell due in it): sustained
  delivery keeps up in every second, not just on average;
- lateness, dispatch time minus schedule time, at P50, P90, P99, P999 and max, where the dispatch
  time is the one the sender stamps on the message as it hands its batch to the broker; for Redis
  also arrival time minus schedule time, the arrival being the millisecond part of the stream
  entry id (Redis's clock, when it took the entry), and for NATS the stream's timestamp of the
  stored message (RabbitMQ stamps none);
- the three 100 ms stretches of the window (by when their messages fell due) whose messages
  were latest at the median, and how long after the server's start the window opened: a pause
  of the whole node (a save of its dedupe table, a slow fsync) makes a stretch or two late, and
  puts a P99 that the rest of the window meets out of reach;
- early deliveries (must be 0), duplicates and missing messages;
- the server's peak RSS (sampled every 50 ms).

Targets on this machine: 10,000 msg/s falling due, sustained, with lateness P99 <= 50 ms and
P999 <= 200 ms.

`--bucket-load N` (spool only): the same workload while a bucket of N messages loads. The data
directory is prepared before the server starts with N pending messages (100 B bodies) in the
one-minute bucket after the window's (written with the storage code, replayed, checkpointed, as a
node leaves it), with `segment_scale = "1m"` and a `load_ahead` that makes that bucket's load begin
2 s into the window; the window's messages are due in the bucket before it, already loaded.
Targets (issue, N = 3,000,000): P99 <= 10 ms, P999 <= 50 ms, none early.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import tempfile
import time
from pathlib import Path

import attrs

from bench.harness import (
    DelayServerProcess, PeakRss, RedisProcess, cpu_seconds, environment_note, format_lateness, lateness_figures,
    loop_stalls_ms, memory_note, mib, now_ms, pids_of, py_spy, run_child, spread, thread_cpu_seconds,
)
from bench.workload import SUBJECT, Delivered, Workload, headers_as_sent, read_stream
from delayserver.metrics import percentile
from delayserver.sender.spool import iter_spool
from delayserver.storage.segment import SLOW_FSYNC_S

FULL = Workload(n=100_000, window_ms=10_000)
QUICK = Workload(n=30_000, window_ms=3_000)
TARGET_P99_MS = 50
TARGET_P999_MS = 200
#: How long after the window closes the benchmark waits for stragglers before counting them missing.
GRACE_MS = 30_000
TRANSPORTS = ("spool", "redis", "rabbitmq", "nats")
#: Whose clock stamps a message's arrival, per transport that has one.
ARRIVAL_CLOCK = {"redis": "Redis", "nats": "JetStream"}


def send_workload(address: str, w: Workload, t0: int, kind: str = "ours", zset_key: str = "") -> dict:
    """Run the load generator process; its JSON result (acked, unacked, seconds, ended_ms)."""
    args = ["-m", "bench.workload", "send", kind, address, w.to_json(), str(t0)]
    return json.loads(run_child(args + ([zset_key] if zset_key else []), timeout=w.lead_ms / 1000 + 120))


def _spool_reader(data_dir: Path):
    """A function returning the spool's new deliveries on each call (reads only what was appended)."""
    cursor_offset = 0

    def more() -> list[Delivered]:
        nonlocal cursor_offset
        cursor = iter_spool(data_dir, SUBJECT, cursor_offset)
        out = [Delivered(m.message_id, m.schedule_time, t, None, tuple(sorted(m.headers.items())))
               for _, t, _, m in cursor]
        cursor_offset = cursor.next_offset
        return out

    return more


def _stream_reader(broker: RedisProcess, stack: contextlib.ExitStack):
    """A function returning the stream's new deliveries on each call."""
    client = broker.client()
    stack.callback(client.close)
    last = b"0-0"

    def more() -> list[Delivered]:
        nonlocal last
        out, last = read_stream(client, SUBJECT, last)
        return out

    return more


def _wait_delivered(count_new, expected: int, until_ms: int) -> list[Delivered]:
    """Sleep through the window (reading would take CPU from the server), then collect until
    `expected` distinct ids have arrived or `until_ms` passes."""
    time.sleep(max(0, until_ms - GRACE_MS - now_ms()) / 1000)
    delivered: list[Delivered] = []
    ids: set[str] = set()
    while True:
        new = count_new()
        delivered.extend(new)
        ids.update(d.message_id for d in new)
        if len(ids) >= expected or now_ms() > until_ms:
            return delivered
        time.sleep(0.2)


def sustained(delivered: list[Delivered], schedule: list[int], t0: int, window_ms: int) -> tuple[int, int]:
    """(delivered, fell due) in the whole second of the window where the fewest were delivered."""
    by_second_out = collections.Counter((d.dispatch_time - t0) // 1000 for d in delivered)
    by_second_due = collections.Counter((t - t0) // 1000 for t in schedule)
    seconds = range(max(1, window_ms // 1000))
    slowest = min(seconds, key=lambda s: by_second_out[s])
    return by_second_out[slowest], by_second_due[slowest]


def _broker(transport: str, tmp: Path, stack: contextlib.ExitStack):
    """Start the broker `transport` delivers to; (its broker group's config text, a function
    returning a reader of what arrived). None for the spool."""
    if transport == "spool":
        return None
    if transport == "redis":
        broker = RedisProcess(tmp / "broker").start()
        stack.callback(broker.stop)
        return (f'transport = "redis"\naddress = "{broker.address}"\n', lambda: _stream_reader(broker, stack))
    from bench import broker_readers
    from bench.brokers import NatsProcess, RabbitMqProcess, nats_executable

    if transport == "rabbitmq":
        broker = RabbitMqProcess(tmp / "broker").start()
        stack.callback(broker.stop)
        broker_readers.declare_queue(broker.url, SUBJECT)
        return (f'transport = "rabbitmq"\naddress = "{broker.url}"\n',
                lambda: broker_readers.queue_reader(broker.url, SUBJECT))
    if transport == "nats":
        broker = NatsProcess(nats_executable(), tmp / "broker").start()
        stack.callback(broker.stop)
        broker_readers.add_stream(broker.url, SUBJECT)
        return (f'transport = "nats"\naddress = "{broker.url}"\n',
                lambda: broker_readers.stream_reader(broker.url, SUBJECT))
    raise ValueError(f"no deliver benchmark for transport {transport!r}")


MINUTE_MS = 60_000
BUCKET_LOAD_BODY = b"x" * 100
#: How far into the window the big bucket's load begins.
BUCKET_LOAD_AT_MS = 2_000


def _encode_seconds_per_message(sample: int = 20_000) -> float:
    from delayserver.storage.record import RecordType, encode_message_fields, encode_record

    began = time.perf_counter()
    for i in range(sample):
        encode_record(RecordType.MESSAGE, encode_message_fields(
            f"load-{i:010d}", "bench.load", BUCKET_LOAD_BODY, 1_800_000_000_000 + i, {}, 1_800_000_000_000, i + 1))
    return (time.perf_counter() - began) / sample


def prepare_bucket(root: Path, n: int, bucket: int) -> float:
    """N pending messages in `bucket` (one minute), as a node leaves them; returns seconds taken."""
    from delayserver.replayer import Replayer
    from delayserver.storage.record import RecordType, encode_message_fields, encode_record
    from delayserver.storage.store import Store
    from delayserver.wheel.tick_manager import TickManager

    began = time.perf_counter()
    store = Store.open(root, segment_scale_ms=MINUTE_MS)
    now = now_ms()
    for first in range(0, n, 4096):
        store.message_log.append(b"".join(
            encode_record(RecordType.MESSAGE, encode_message_fields(
                f"load-{i:010d}", "bench.load", BUCKET_LOAD_BODY, bucket + (i * 7919) % MINUTE_MS, {}, now, i + 1))
            for i in range(first, min(first + 4096, n))))
    store.message_log.sync()
    Replayer.open(store, TickManager(store, now_ms=now)).checkpoint()
    save_index(store, root)
    save_followers(store, now)
    store.close()
    return time.perf_counter() - began


def save_followers(store, now: int) -> None:
    """Save the dedupe table (the default window), the schedules' state and message_log's epoch
    history, covering all of message_log, as a running node would have: without them, the node
    rebuilds each from the whole of message_log at start (and writes the dedupe table whole while
    the benchmark measures)."""
    import attrs
    import trio

    from delayserver.config import Config
    from delayserver.dedupe import Dedupe
    from delayserver.schedules.registry import Registry as ScheduleRegistry
    from delayserver.storage.epochs import EpochHistory

    EpochHistory.open(store.message_log)  # a node's first start reads the log and writes the file

    dedupe = Dedupe(attrs.fields(Config).dedupe_window_ms.default, store.checkpoint_dir)
    dedupe.recover(store.message_log, now, dedupe.load())
    schedules = ScheduleRegistry(store.checkpoint_dir)
    schedules.recover(store.message_log)

    async def save():
        await dedupe.save(now, store.message_log.end_offset)
        await schedules.save(store.message_log.end_offset)

    trio.run(save)


def save_index(store, root: Path) -> None:
    """Save the id index and the time index of every bucket, as a running node would have (a
    version without them has nothing to save): without them, the node builds them from the
    segments after it starts, on its event loop, while the benchmark measures."""
    try:
        from delayserver.lookup import Lookup
        from delayserver.storage.time_index import TimeIndex
    except ImportError:
        return
    import trio

    lookup = Lookup(store, root / "index")
    times = TimeIndex(store.schedule_log, store.segment_scale_ms, root / "index" / "time")

    async def save():
        for index in (lookup.ids, times):
            for bucket in store.schedule_log.buckets():
                await index.ensure(bucket)
            await index.save(every=1)

    trio.run(save)


def run_deliver(transport: str, w: Workload, bucket_load: int = 0, profile: str = "") -> dict:
    """One run, delivering to `transport` (one of TRANSPORTS); the measured figures as a dict.
    With `profile`, py-spy samples the server over the window and writes its stacks to that file.

    With `bucket_load`, a bucket of that many messages loads during the window (module docstring)."""
    with tempfile.TemporaryDirectory(prefix="bench-deliver-") as tmp, contextlib.ExitStack() as stack:
        tmp = Path(tmp)
        config = None
        t0 = None
        if bucket_load:
            # The window lies in one minute bucket W, starting 3 s into it; the big bucket is W + 1.
            # Room for preparing the data directory (timed on a sample: encoding, then replay and
            # indexing take about as long again each, and a margin) and starting the server.
            w_start = now_ms() + w.lead_ms + int(bucket_load * _encode_seconds_per_message() * 8 * 1000) + 30_000
            w_start += MINUTE_MS - w_start % MINUTE_MS
            t0 = w_start + 3_000
            big = w_start + MINUTE_MS
            seconds = prepare_bucket(tmp / "data", bucket_load, big)
            config = tmp / "server.toml"
            config.write_text(f'segment_scale = "1m"\nload_ahead = {big - (t0 + BUCKET_LOAD_AT_MS)}\n')
            print(f"  prepared {bucket_load:,} pending messages in the next bucket in {seconds:.1f} s; its "
                  f"load begins {BUCKET_LOAD_AT_MS / 1000:g} s into the window", flush=True)
        broker = _broker(transport, tmp, stack)
        if broker is not None:
            config = tmp / "server.toml"
            config.write_text(f'[[broker_group]]\nname = "{transport}"\n{broker[0]}')
        server = DelayServerProcess(tmp / "data", config)
        stack.callback(server.stop)
        server.start(timeout=600)
        started = now_ms()
        if t0 is None:
            t0 = now_ms() + w.lead_ms
        elif t0 - now_ms() < w.lead_ms:
            raise RuntimeError("preparing the bucket took longer than planned: no room left to send before the window")
        until = t0 + w.window_ms + GRACE_MS
        with PeakRss(lambda: pids_of(server)) as rss:
            load = send_workload(server.address, w, t0)
            new = broker[1]() if broker is not None else _spool_reader(tmp / "data")
            time.sleep(max(0, t0 - now_ms()) / 1000)
            cpu_at_t0 = cpu_seconds(server.process)
            loop_at_t0 = thread_cpu_seconds(server.process.pid, server.process.pid)
            spy = py_spy(server.process.pid, w.window_ms / 1000, profile) if profile else None
            delivered = _wait_delivered(new, load["acked"], until)
            if spy is not None:
                spy.wait(60)
            if server.process.poll() is not None:
                raise RuntimeError(f"the server exited ({server.process.returncode}); its log:\n"
                                   + server.log_path.read_text()[-5000:])
            cpu = cpu_seconds(server.process) - cpu_at_t0
            loop_cpu = thread_cpu_seconds(server.process.pid, server.process.pid) - loop_at_t0
            server_log = server.log_path.read_text(errors="replace").splitlines()
            stalls = [line for line in server_log if "event loop blocked" in line]
            stall_ms = loop_stalls_ms("\n".join(stalls))
            slow_fsyncs = slow_fsyncs_between(server_log, t0, until)
        return {**_figures(w, t0, load, delivered, rss.peak, with_arrival=transport in ("redis", "nats")),
                # (the readers of RabbitMQ and NATS do not read the headers back)
                "headers_as_sent": ((headers_as_sent(delivered), len(delivered))
                                    if w.headers and transport in ("spool", "redis") else None),
                "cpu_seconds": cpu, "loop_cpu_seconds": loop_cpu, "stalls": stalls, "stall_ms": stall_ms,
                "slow_fsyncs": slow_fsyncs,
                "peak_file": rss.peak_file,
                "window_after_start_ms": t0 - started}


_SLOW_FSYNC = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*slow fsync: .* took (\d+) ms"
                         r"(?:.*\((\d+) more slow fsyncs)?")


def slow_fsyncs_between(log_lines: list[str], start_ms: int, end_ms: int) -> tuple[int, int]:
    """(how many fsyncs the server logged as slow between `start_ms` and `end_ms`, the longest of
    those logged, in ms) from its log (storage/segment.py: a line a second at most, counting the
    others): a stretch of late deliveries with no slow event-loop step is then the disk's."""
    count = longest = 0
    for line in log_lines:
        m = _SLOW_FSYNC.match(line)
        if m is None:
            continue
        at = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) * 1000 + int(m.group(2))
        if start_ms <= at <= end_ms:
            count += 1 + int(m.group(4) or 0)
            longest = max(longest, int(m.group(3)))
    return count, longest


#: The stretches of the window `worst_stretches` compares, by when their messages fell due.
STRETCH_MS = 100


def worst_stretches(delivered: list[Delivered], t0: int, count: int = 3, width_ms: int = STRETCH_MS) -> list[dict]:
    """The `count` stretches of `width_ms` (by schedule time, from `t0`) whose messages were the
    latest at the median, in time order: where in the window the tail of the lateness came from
    (a pause of the whole node makes one or two stretches late, not the window's spread). Each:
    its start in ms after `t0`, how many fell due in it, their lateness P50 and max."""
    by: dict[int, list[int]] = {}
    for d in delivered:
        by.setdefault((d.schedule_time - t0) // width_ms, []).append(d.dispatch_time - d.schedule_time)
    stretches = [{"at_ms": k * width_ms, "n": len(v), "p50": percentile(sorted(v), 0.5), "max": max(v)}
                 for k, v in by.items()]
    worst = sorted(stretches, key=lambda x: (-x["p50"], -x["max"], x["at_ms"]))[:count]
    return sorted(worst, key=lambda x: x["at_ms"])


def _figures(w: Workload, t0: int, load: dict, delivered: list[Delivered], peak_rss: int, *, with_arrival: bool) -> dict:
    schedule = w.schedule(t0)
    ids = {d.message_id for d in delivered}
    acked = load["acked"]
    last = max((d.dispatch_time for d in delivered), default=t0)
    out_n, due_n = sustained(delivered, schedule, t0, w.window_ms)
    return {
        "acked": acked,
        "send_seconds": load["seconds"],
        "lead_after_sends_ms": t0 - load["ended_ms"],
        "delivered": len(ids),
        "duplicates": len(delivered) - len(ids),
        "missing": acked - len(ids),
        "delivered_per_s": len(ids) / max(0.001, (last - t0) / 1000),
        "slowest_second": out_n,
        "slowest_second_due": due_n,
        "dispatch": lateness_figures([d.dispatch_time - d.schedule_time for d in delivered]),
        "worst_stretches": worst_stretches(delivered, t0),
        "arrival": (lateness_figures([d.arrival_time - d.schedule_time for d in delivered])
                    if with_arrival else None),
        "peak_rss": peak_rss,
    }


def report(transport: str, w: Workload, r: dict, bucket_load: int = 0) -> str:
    lines = [
        f"deliver {transport}: {w.describe()}",
        f"  sends: {r['acked']:,} acknowledged in {r['send_seconds']:.1f} s; the window opened "
        f"{r['lead_after_sends_ms'] / 1000:.1f} s after the last acknowledgement"
        + ("" if r["lead_after_sends_ms"] >= 0 else " (OVERLAP: some messages fell due while sending)"),
        f"  delivered {r['delivered']:,} (missing {r['missing']}, duplicates {r['duplicates']}): "
        f"{r['delivered_per_s']:,.0f} msg/s from window start to last dispatch; slowest second "
        f"{r['slowest_second']:,} delivered, {r['slowest_second_due']:,} fell due",
        f"  lateness, dispatch - schedule: {format_lateness(r['dispatch'])}",
        f"  latest {STRETCH_MS} ms stretches (by when due; the window opened "
        f"{r['window_after_start_ms'] / 1000:.1f} s after the server started): "
        + "; ".join(f"{x['at_ms'] / 1000:.1f} s in, P50 {x['p50']} ms, max {x['max']} ms"
                    for x in r["worst_stretches"]),
    ]
    if r.get("headers_as_sent") is not None:
        carried, deliveries = r["headers_as_sent"]
        lines.append(f"  headers: {carried:,} of the {deliveries:,} deliveries carried the header sent")
    if r["arrival"] is not None:
        lines.append(f"  lateness, arrival in {ARRIVAL_CLOCK[transport]} - schedule: {format_lateness(r['arrival'])}")
    file_pages = "" if "peak_file" not in r else (
        f" ({mib(r['peak_file'])} of it file pages at most: mapped files, shared with the page cache, the segments the "
        f"read-ahead maps and the interpreter's libraries)")
    lines.append(f"  server: peak RSS {mib(r['peak_rss'])}{file_pages}; CPU {r['cpu_seconds']:.1f} s from window start to the "
                 f"last delivery ({r['cpu_seconds'] / max(1, r['delivered']) * 1e6:.0f} us per message"
                 + ("" if "loop_cpu_seconds" not in r else
                    f", {r['loop_cpu_seconds'] / max(1, r['delivered']) * 1e6:.1f} us of it on the event loop's thread")
                 + ")")
    slow, longest = r.get("slow_fsyncs", (0, 0))
    lines.append(f"  disk: {slow} fsyncs of {SLOW_FSYNC_S * 1000:g} ms or more in the window"
                 + (f" (the longest logged {longest} ms): deliveries waiting for them waited as long" if slow else ""))
    stalls, stall_ms = r.get("stalls", []), r.get("stall_ms", [])
    lines.append(f"  event loop: {len(stall_ms)} task steps over 100 ms"
                 + (f" (the longest {max(stall_ms)} ms)" if stall_ms else "")
                 + "".join(f"\n    {line.strip()[-160:]}" for line in stalls[:5]))
    late = r["dispatch"]
    if bucket_load:
        misses = [f"P99 {late['p99']} > 10 ms"] * (late["p99"] > 10) + [f"P999 {late['p999']} > 50 ms"] * (
            late["p999"] > 50) + [f"{late['early']} early"] * bool(late["early"])
        lines.append(f"  targets while {bucket_load:,} messages load (P99 <= 10 ms, P999 <= 50 ms, none early): "
                     + ("met" if not misses else "MISSED: " + ", ".join(misses)))
        return "\n".join(lines)
    misses = []
    if r["slowest_second"] < 0.95 * r["slowest_second_due"] or r["missing"]:
        misses.append("throughput")
    if late["p99"] > TARGET_P99_MS:
        misses.append(f"P99 {late['p99']} > {TARGET_P99_MS} ms")
    if late["p999"] > TARGET_P999_MS:
        misses.append(f"P999 {late['p999']} > {TARGET_P999_MS} ms")
    if late["early"]:
        misses.append(f"{late['early']} early")
    lines.append(f"  targets (sustained, P99 <= {TARGET_P99_MS} ms, P999 <= {TARGET_P999_MS} ms, none early): "
                 + ("met" if not misses else "MISSED: " + ", ".join(misses)))
    return "\n".join(lines)


#: The lateness target a `--rate` run is judged by.
RATE_TARGET_P99_MS = 10


def rate_workload(rate: int, seconds: float, in_order: bool = False, headers: bool = False) -> Workload:
    return Workload(n=int(rate * seconds), window_ms=int(seconds * 1000), in_order=in_order, headers=headers)


def meets_rate_target(r: dict) -> bool:
    """Sustained (every whole second delivered at least 95% of what fell due in it, nothing missing),
    P99 lateness within RATE_TARGET_P99_MS, none early."""
    return (r["slowest_second"] >= 0.95 * r["slowest_second_due"] and not r["missing"]
            and r["dispatch"]["p99"] <= RATE_TARGET_P99_MS and not r["dispatch"]["early"])


def rate_sweep(rates: list[int], seconds: float, transports: list[str], in_order: bool = False,
               profile: str = "", repeat: int = 1, headers: bool = False) -> None:
    """`repeat` runs per (transport, rate), in rounds over the rates; then, per transport, each
    rate's P99 and CPU per delivered message over its runs, and the highest rate that met the
    target in every run."""
    for transport in transports:
        if transport not in TRANSPORTS:
            raise SystemExit(f"unknown transport {transport!r}")
        runs: dict[int, list[tuple[bool, int, float]]] = {rate: [] for rate in rates}
        for round_ in range(repeat):
            for rate in rates:
                w = rate_workload(rate, seconds, in_order, headers)
                suffix = f".{transport}.{rate}" + (f".{round_ + 1}" if repeat > 1 else "")
                r = run_deliver(transport, w, profile=profile and f"{profile}{suffix}")
                print(report(transport, w, r), flush=True)
                ok = meets_rate_target(r)
                runs[rate].append((ok, r["dispatch"]["p99"], r["cpu_seconds"] / max(1, r["delivered"]) * 1e6))
                print(f"  at {rate:,} msg/s falling due: P99 <= {RATE_TARGET_P99_MS} ms sustained: "
                      f"{'met' if ok else 'MISSED'}; load average now {environment_note()}", flush=True)
        for line in sweep_summary(transport, seconds, runs):
            print(line, flush=True)


def sweep_summary(transport: str, seconds: float, runs: dict[int, list[tuple[bool, int, float]]]) -> list[str]:
    """The closing lines of a rate sweep from each rate's runs, ``(met, P99 ms, us of CPU per
    message)``: one run's figures as they are; several runs' as their median (min-max), with how
    many met the target. A rate counts as sustained only when every one of its runs met it."""
    parts = []
    for rate, figures in runs.items():
        met = sum(ok for ok, _, _ in figures)
        part = (f"{rate:,}/s P99 {spread([p99 for _, p99, _ in figures], '.0f')} ms, "
                f"{spread([cpu for _, _, cpu in figures], '.1f')} us CPU per message")
        if len(figures) > 1:
            part += f", met in {met} of {len(figures)} runs"
        parts.append(part)
    many = max(len(figures) for figures in runs.values()) > 1
    sustained = [rate for rate, figures in runs.items() if figures and all(ok for ok, _, _ in figures)]
    return [
        f"deliver {transport} rate sweep over {seconds:g} s windows"
        + (" (median (min-max) over the runs)" if many else "") + ": " + "; ".join(parts),
        f"  highest rate sustained with P99 <= {RATE_TARGET_P99_MS} ms"
        + (" in every run" if many else "") + ": "
        + (f"{max(sustained):,} msg/s" if sustained else "none of those measured"),
    ]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="ops/bench deliver")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK.describe()} instead of {FULL.describe()}")
    parser.add_argument("--transports", default=",".join(TRANSPORTS),
                        help=f"comma-separated, from {', '.join(TRANSPORTS)} (default: all)")
    parser.add_argument("--bridge", action="store_true",
                        help="also measure one trio -> asyncio crossing (the rabbitmq and nats transports' bridge)")
    parser.add_argument("--bucket-load", type=int, default=0, metavar="N",
                        help="deliver (spool only) while a bucket of N messages loads")
    parser.add_argument("--rate", default="", metavar="R[,R...]",
                        help="messages falling due per second (one run per rate, each transport); prints the "
                             f"highest rate sustained with P99 <= {RATE_TARGET_P99_MS} ms")
    parser.add_argument("--seconds", type=float, default=10.0, help="the window's length with --rate (default 10)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="with --rate: N runs of each rate, in rounds; prints each rate's median and range "
                             "(default 1)")
    parser.add_argument("--in-order", action="store_true",
                        help="messages sent in the order they fall due (as with one fixed delay), not in random order")
    parser.add_argument("--headers", action="store_true",
                        help="each message with a header (a trace id), as tracing adds one")
    parser.add_argument("--profile", default="", metavar="FILE",
                        help="sample the server with py-spy over the window; collapsed stacks to FILE (with "
                             "--rate: FILE.<transport>.<rate>, one per run, .<run> added with --repeat)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat takes a whole number of at least 1")
    w = attrs.evolve(QUICK if args.quick else FULL, in_order=args.in_order, headers=args.headers)
    print(f"deliver benchmark on {environment_note()}; flush=sync; {memory_note()}", flush=True)
    if args.rate:
        transports = args.transports.split(",") if args.transports != ",".join(TRANSPORTS) else ["spool"]
        return rate_sweep([int(r) for r in args.rate.split(",")], args.seconds, transports, args.in_order,
                          args.profile, args.repeat, args.headers)
    if args.bucket_load:
        print(report("spool", w, run_deliver("spool", w, args.bucket_load, args.profile), args.bucket_load), flush=True)
        return
    if args.bridge:
        from bench.broker_readers import bridge_cost

        sequential, parallel = bridge_cost()
        print(f"asyncio bridge: {sequential:.1f} us per crossing one at a time; {parallel:,.0f} crossings/s "
              f"with 64 trio tasks at once", flush=True)
    for transport in args.transports.split(","):
        if transport not in TRANSPORTS:
            parser.error(f"unknown transport {transport!r}")
        print(report(transport, w, run_deliver(transport, w, profile=args.profile and f"{args.profile}.{transport}")),
              flush=True)
