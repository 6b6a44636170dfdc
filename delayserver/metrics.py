"""A node's metrics through prometheus-client: its own registry, served at /metrics.

    curl -s 127.0.0.1:20802/metrics

Counters and gauges are read from the node's services at scrape time by one collector (nothing
in the hot paths changes); lateness and acknowledgement latency are histograms observed as
deliveries and acknowledgements happen. Per broker group: delivered, retried, parked, in flight
(queued or in the transport) and breaker state. Replication lag in bytes and seconds, pending
messages per bucket (from the backlog's cached counts).

Renamed from the hand-written text: `delayserver_lateness_ms{quantile=...}` (a summary over the
last 100,000 deliveries) is now the histogram `delayserver_lateness_seconds`; every other name is
kept.
"""
from __future__ import annotations

import bisect
import collections
import functools
import itertools
import time

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from delayserver.storage.segment import FSYNC_BUCKETS, FSYNC_TIMES, storage_failures

#: Lateness bounds in seconds: a precise delay server lives in the first few.
LATENESS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: The same bounds in milliseconds, the unit lateness is measured in: a whole number of ms falls
#: at the bound it would in seconds (ms / 1000 <= bound exactly when ms <= bound * 1000).
LATENESS_BOUNDS_MS = (1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000, 60_000)
_LATENESS_SLOT = functools.partial(bisect.bisect_left, LATENESS_BOUNDS_MS)
#: The slot of each whole number of ms from 0 up to a second, looked up rather than bisected.
_LATENESS_SLOT_OF_MS = [_LATENESS_SLOT(ms) for ms in range(1001)]
ACK_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BREAKER_STATES = ("closed", "half-open", "open")


def percentile(sorted_values: list[int], q: float) -> int:
    """Nearest-rank percentile of an already sorted list (0 when empty)."""
    if not sorted_values:
        return 0
    rank = max(0, min(len(sorted_values) - 1, int(round(q * len(sorted_values) + 0.5)) - 1))
    return sorted_values[rank]


def _tally(counts: list[int], bounds: tuple[float, ...], values) -> None:
    """Count each of `values` at the first of `bounds` it is under or at (the last slot: over
    them all), as a Prometheus histogram's `le` buckets do."""
    for value in values:
        counts[bisect.bisect_left(bounds, value)] += 1


def lateness_slots(lateness_ms) -> collections.Counter:
    """How many of `lateness_ms` fall at each slot of LATENESS_BUCKETS (the last: over them all),
    as `_tally` counts them in seconds."""
    if lateness_ms and 0 <= min(lateness_ms) and max(lateness_ms) < len(_LATENESS_SLOT_OF_MS):  # the usual batch
        return collections.Counter(map(_LATENESS_SLOT_OF_MS.__getitem__, lateness_ms))
    return collections.Counter(map(_LATENESS_SLOT, lateness_ms))


def _add_slots(counts: list[int], slots: collections.Counter) -> None:
    for slot, n in slots.items():
        counts[slot] += n


class RecentHistogram:
    """Counts of values per bound over the last `window_s` seconds, in `slice_s` slices: what the
    console shows as "lateness of the last minutes" and the delivery rate. Bounded memory."""

    def __init__(self, bounds: tuple[float, ...], window_s: int = 300, slice_s: int = 10, clock=time.monotonic):
        self.bounds = bounds
        self.window_s, self.slice_s = window_s, slice_s
        self.clock = clock
        self._slices: collections.deque[tuple[int, list[int]]] = collections.deque()

    def _current(self) -> list[int]:
        index = int(self.clock() // self.slice_s)
        if not self._slices or self._slices[-1][0] != index:
            self._slices.append((index, [0] * (len(self.bounds) + 1)))
            oldest = index - self.window_s // self.slice_s
            while self._slices and self._slices[0][0] <= oldest:
                self._slices.popleft()
        return self._slices[-1][1]

    def observe(self, value: float) -> None:
        self.observe_many((value,))

    def observe_many(self, values) -> None:
        _tally(self._current(), self.bounds, values)

    def add_counts(self, slots: collections.Counter) -> None:
        """Add counts already tallied per slot of `bounds` (`lateness_slots`)."""
        _add_slots(self._current(), slots)

    def counts(self, within_s: int | None = None) -> list[int]:
        """Per bound (the last one: over the highest bound), over the last `within_s` seconds."""
        self._current()
        since = int(self.clock() // self.slice_s) - (within_s or self.window_s) // self.slice_s
        total = [0] * (len(self.bounds) + 1)
        for index, counts in self._slices:
            if index > since:
                total = [a + b for a, b in zip(total, counts)]
        return total


class BatchHistogram(Collector):
    """A histogram with one label, observed a batch at a time: each value costs one lookup of its
    slot (`lateness_slots`), the batch one addition per slot into its label's counts
    (prometheus-client's `Histogram.observe` takes a lock and walks the bounds, per value: 2.6 us
    of a delivered message's server CPU went to the two lateness histograms). Exposed at scrape
    time as a histogram family of the same name and shape."""

    def __init__(self, name: str, documentation: str, label: str, bounds: tuple[float, ...]):
        self.name, self.documentation, self.label, self.bounds = name, documentation, label, bounds
        self._counts: dict[str, list[int]] = {}  # label value -> count per bound, then over the last
        self._sums: dict[str, float] = {}

    def add_counts(self, label_value: str, slots: collections.Counter, total: float) -> None:
        """Observe values already tallied per slot of `bounds` (`lateness_slots`), whose sum is
        `total`."""
        counts = self._counts.get(label_value)
        if counts is None:
            counts = self._counts[label_value] = [0] * (len(self.bounds) + 1)
        _add_slots(counts, slots)
        self._sums[label_value] = self._sums.get(label_value, 0.0) + total

    def collect(self):
        yield histogram_family(self.name, self.documentation, self.label, self.bounds, self._counts, self._sums)


def histogram_family(name: str, documentation: str, label: str, bounds: tuple[float, ...],
                     counts: dict[str, list[int]], sums: dict[str, float]) -> HistogramMetricFamily:
    """A histogram family of one label from per-label counts laid out as `_tally` counts them
    (per bound, then over the last) and their sums."""
    family = HistogramMetricFamily(name, documentation, labels=[label])
    for label_value, per_bound in counts.items():
        cumulative = list(itertools.accumulate(per_bound))
        buckets = [(floatToGoString(bound), n) for bound, n in zip(bounds, cumulative)]
        family.add_metric([label_value], buckets + [("+Inf", cumulative[-1])], sums[label_value])
    return family


def _fsync_families():
    """The process's fsync times (storage/segment.py `FSYNC_TIMES`), per log."""
    counts, sums = FSYNC_TIMES.snapshot()
    yield histogram_family("delayserver_fsync_seconds", "How long each fsync of the node's logs, checkpoints and spool took.",
                           "log", FSYNC_BUCKETS, counts, sums)
    yield _gauge("delayserver_fsync_longest_seconds", "The longest fsync since the process started.",
                 FSYNC_TIMES.longest_s)


class NodeMetrics:
    """The registry of one node; `register_node(node)` adds the collector that reads the rest from
    the node's services (a `NodeView`) at scrape time."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        self.lateness = BatchHistogram(
            "delayserver_lateness_seconds", "Delivery time minus schedule time of delivered messages.",
            "broker_group", LATENESS_BUCKETS)
        self.registry.register(self.lateness)
        self.ack_latency = Histogram(
            "delayserver_ack_latency_seconds",
            "From a send request's arrival to its acknowledgement (durable), per request.",
            ["api"], buckets=ACK_BUCKETS, registry=self.registry)
        self.recent_lateness = RecentHistogram(LATENESS_BUCKETS)

    def delivered(self, group: str, lateness_ms: list[int]) -> None:
        """The sender's hook: these messages were acknowledged by `group`. Their lateness is
        tallied once, in C-level passes, for both histograms."""
        slots = lateness_slots(lateness_ms)
        self.lateness.add_counts(group, slots, sum(lateness_ms) / 1000)
        self.recent_lateness.add_counts(slots)

    def acknowledged(self, api: str, seconds: float) -> None:
        """The message operations' hook: a send request through `api` was answered."""
        self.ack_latency.labels(api).observe(seconds)

    def register_node(self, node, backlog=None) -> None:
        self.registry.register(_NodeCollector(node, backlog))


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name.removesuffix("_total"), doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class _NodeCollector(Collector):
    def __init__(self, node, backlog):
        self.node = node
        self.backlog = backlog

    def collect(self):
        s = self.node
        ticks, receiver, replayer, sender = s.ticks, s.receiver, s.replayer, s.sender
        yield _counter("delayserver_received_total", "Messages accepted (durable) by this node.", receiver.appended)
        yield _counter("delayserver_commit_batches_total", "Group-commit batches written.", receiver.batches)
        yield _gauge("delayserver_read_only", "1 while the node refuses writes after a failed fsync or an I/O error.",
                     int(bool(receiver.read_only_reason)))
        yield _gauge("delayserver_storage_failures", "Files of the data directory whose fsync or write failed.",
                     len(storage_failures(s.store.root)))
        yield _gauge("delayserver_quarantined_buckets", "Buckets quarantined for a damaged record.",
                     len(s.store.quarantined()))
        yield _gauge("delayserver_disk_full", "1 while new messages are refused for lack of disk space.",
                     int(bool(s.disk.full)))
        yield _gauge("delayserver_message_log_end_offset", "End offset of message_log.",
                     s.store.message_log.end_offset)
        yield _gauge("delayserver_message_log_durable_offset", "message_log offset up to which data is fsynced.",
                     receiver.durable_offset)
        yield _gauge("delayserver_replay_offset", "message_log offset replayed into schedule_log.", replayer.offset)
        yield _gauge("delayserver_replay_checkpoint_offset", "Replay offset of the last checkpoint.",
                     replayer.checkpointed_offset)
        yield _counter("delayserver_replayed_total", "Records replayed into schedule_log.", replayer.replayed)
        yield _gauge("delayserver_wheel_entries", "Messages waiting in the timing wheel.", len(ticks.wheel))
        yield _counter("delayserver_fired_total", "Messages handed from the wheel to the sender.", ticks.fired)
        yield _counter("delayserver_cancelled_dropped_total", "Cancelled messages dropped before delivery.",
                       ticks.cancelled_drops)
        yield _gauge("delayserver_loading_cursor_bucket", "Start (epoch ms) of the bucket being loaded.",
                     ticks.loading_bucket or 0)
        yield _gauge("delayserver_loading_cursor_end_offset", "End offset pinned when its loading began.",
                     ticks.loading_end)
        yield _gauge("delayserver_loaded_cursor_offset", "Offset up to which the loading bucket is in memory.",
                     ticks.loaded_offset)
        yield _gauge("delayserver_connections", "Open producer connections.", s.connections())
        yield _counter("delayserver_delivered_total", "Messages delivered (acknowledged by a broker).",
                       sender.delivered)
        yield _counter("delayserver_load_disk_reads_total",
                       "Load slices whose segment range was not in the page cache (read in a worker thread).",
                       ticks.load_disk_reads)
        yield _counter("delayserver_due_disk_reads_total",
                       "Due records read from disk in a worker thread (not in the page cache).",
                       sender.due.disk_reads)
        yield _counter("delayserver_due_read_ahead_total",
                       "Due records decoded from what a worker thread read ahead (no read at delivery).",
                       ticks.ahead.hits)
        yield _gauge("delayserver_read_ahead_bytes", "Bytes of records read ahead, waiting to fall due.",
                     ticks.ahead.held_bytes)
        yield _counter("delayserver_dispatch_log_fsyncs_total",
                       "fsyncs of dispatch_log, each covering every batch acknowledged while the one before ran.",
                       sender.dispatch_fsyncs)
        yield _counter("delayserver_retries_total", "Delivery attempts that will be retried.", sender.retried)
        yield _counter("delayserver_parked_total", "Messages a broker rejected for good (parked).",
                       sender.parked_count)
        yield _gauge("delayserver_inflight", "Deliveries in flight.", len(ticks.inflight))
        yield _gauge("delayserver_due_waiting", "Due messages waiting for room in flight.", len(ticks.ready))
        yield _gauge("delayserver_retry_waiting", "Deliveries waiting for their retry back-off.",
                     sender.metrics()["delayserver_retry_waiting"])
        watch = s.loop_watch
        yield _counter("delayserver_event_loop_slow_steps_total",
                       f"Task steps that held the event loop for {watch.threshold_s * 1000:g} ms or more.",
                       watch.slow_steps)
        yield _gauge("delayserver_event_loop_longest_step_seconds", "The longest task step since the node started.",
                     watch.longest_s)
        yield _counter("delayserver_gc_pause_seconds_total",
                       "CPU time of the event loop's thread in garbage collection since the node started.", watch.gc_seconds)
        yield _gauge("delayserver_gc_longest_pause_seconds", "The longest garbage collection (CPU time) since the node started.",
                     watch.gc_longest_s)
        yield from _fsync_families()
        yield from self._groups(sender)
        yield from self._replication(s)
        yield from self._transactions(s.replayer.transactions)
        if self.backlog is not None:
            pending = GaugeMetricFamily("delayserver_bucket_pending",
                                        "Pending messages per bucket (UTC start), for buckets holding any.",
                                        labels=["bucket"])
            for row in self.backlog.rows():
                if row["pending"]:  # a drained bucket's series ends rather than staying at 0
                    pending.add_metric([row["bucket"]], row["pending"])
            yield pending
            yield _gauge("delayserver_pending", "Pending messages in all buckets.", self.backlog.total_pending())

    def _transactions(self, halves):
        """Half messages: open now, and what replay applied (the same figures on master and slaves)."""
        yield _gauge("delayserver_half_messages_prepared", "Half messages prepared and not resolved yet.",
                     len(halves.unresolved()))
        events = CounterMetricFamily("delayserver_half_messages",
                                     "Half-message events: prepared, committed, rolled back, checked, parked.",
                                     labels=["event"])
        for name, value in zip(("prepared", "committed", "rolled_back", "checked", "parked"), halves.totals()):
            events.add_metric([name], value)
        yield events

    def _groups(self, sender):
        delivered = CounterMetricFamily("delayserver_broker_group_delivered", "Messages delivered, per broker group.",
                                        labels=["broker_group"])
        retried = CounterMetricFamily("delayserver_broker_group_retried", "Deliveries retried, per broker group.",
                                      labels=["broker_group"])
        parked = CounterMetricFamily("delayserver_broker_group_parked", "Messages parked, per broker group.",
                                     labels=["broker_group"])
        failed = CounterMetricFamily("delayserver_broker_group_failed_batches", "Batches that failed whole.",
                                     labels=["broker_group"])
        inflight = GaugeMetricFamily("delayserver_broker_group_inflight",
                                     "Deliveries held against a broker group's in-flight budget (queued, in its transport, split or waiting to retry).",
                                     labels=["broker_group"])
        breaker = GaugeMetricFamily("delayserver_broker_group_breaker",
                                    "1 for the circuit breaker's current state.", labels=["broker_group", "state"])
        for g in list(sender.groups.values()):
            delivered.add_metric([g.name], g.sent)
            retried.add_metric([g.name], g.retried)
            parked.add_metric([g.name], g.parked)
            failed.add_metric([g.name], g.failed_batches)
            inflight.add_metric([g.name], g.inflight)
            for state in BREAKER_STATES:
                breaker.add_metric([g.name, state], int(g.breaker.state == state))
        yield from (delivered, retried, parked, failed, inflight, breaker)

    def _replication(self, s):
        lag_bytes = GaugeMetricFamily("delayserver_replication_lag_bytes",
                                      "message_log bytes a slave is behind its master (on the master: per slave).",
                                      labels=["peer"])
        lag_seconds = GaugeMetricFamily("delayserver_replication_lag_seconds",
                                        "How long a slave has been behind its master (0 when caught up).",
                                        labels=["peer"])
        durable = s.receiver.durable_offset
        for node, offset in list(s.master.message_log_offsets.items()):
            lag_bytes.add_metric([node], max(0, durable - offset))
        slave = s.slave
        if slave is not None and s.role.is_slave():
            peer = s.role.master_address() or ""
            lag_bytes.add_metric([peer], slave.lag_bytes)
            lag_seconds.add_metric([peer], slave.lag_seconds())
        yield lag_bytes
        yield lag_seconds
