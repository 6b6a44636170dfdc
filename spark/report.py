"""The result of a reconciliation: figures in total, per node, per bucket (each node's own), per
subject and per broker group (of a message's first dispatch; "-": not dispatched); as text or JSON.

What the figures mean (each scheduled message, a SCHEDULED record, is exactly one of dispatched,
cancelled, missing or not yet due):
- dispatched: its offset has a dispatch_log record, even if a cancel follows (the cancel lost);
- cancelled: a later SCHEDULED_CANCEL of its (schedule time, id) in its segment, and not dispatched;
- missing: neither, and due before the as-of time;
- not_yet_due: neither, and due at or after the as-of time;
- duplicated: dispatched more than once (a part of dispatched);
- early: first dispatched before its schedule time (a part of dispatched; should be 0);
- orphan_dispatches: dispatch records whose offset holds no readable scheduled message (follows
  damage to the schedule segment);
- lateness_ms: first dispatch time minus schedule time over dispatched messages, at P50, P90, P99,
  P99.9 (nearest rank: the smallest lateness that many of them are within; exact, computed on the
  executors) and max; None when nothing was dispatched;
- lateness_histogram: how many dispatched messages fall in each bin of HISTOGRAM_BINS (the first is
  "early", below 0 ms); None when nothing was dispatched.

Half messages (transactional sends) reach schedule_log only when committed: one still prepared,
rolled back or parked on `%TRANS_CHECK_MAX%<group>` is never scheduled, so never missing; a
committed one is scheduled, dispatched or missing as any message is (its SCHEDULED record has the
FLAG_TRANSACTIONAL bit in `flags`). `delayctl buckets` counts the half messages themselves.
"""
from __future__ import annotations

import datetime as _dt

import attrs

PERCENTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999))
LEVELS = ("total", "node", "bucket", "subject", "broker_group")
#: Lower edges of the lateness histogram's bins, in ms; a bin runs to the next edge, the last one
#: has no upper edge, and before the first (0) is one more bin, "early".
HISTOGRAM_EDGES_MS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 60_000,
                      300_000, 3_600_000)
#: (from_ms, to_ms) of each bin, None where it is open.
HISTOGRAM_BINS = ((None, 0),) + tuple(zip(HISTOGRAM_EDGES_MS, HISTOGRAM_EDGES_MS[1:] + (None,)))
COUNTS = ("scheduled", "cancelled", "dispatched", "duplicated", "missing", "not_yet_due", "orphan_dispatches",
          "early")
LATENESS = tuple(name for name, _ in PERCENTILES) + ("max",)
_LATENESS_LABELS = {"p50": "P50", "p90": "P90", "p99": "P99", "p999": "P99.9", "max": "max"}


@attrs.frozen
class Figures:
    scheduled: int = 0
    cancelled: int = 0
    dispatched: int = 0
    duplicated: int = 0
    missing: int = 0
    not_yet_due: int = 0
    orphan_dispatches: int = 0
    early: int = 0
    lateness_ms: dict[str, int] | None = None
    lateness_histogram: tuple[int, ...] | None = None

    def to_json(self) -> dict:
        out = attrs.asdict(self)
        if self.lateness_histogram is not None:
            out["lateness_histogram"] = [{"from_ms": low, "to_ms": high, "count": n}
                                         for (low, high), n in zip(HISTOGRAM_BINS, self.lateness_histogram)]
        return out


@attrs.frozen
class Damage:
    """A CORRUPT, TORN_TAIL or AMBIGUOUS_SPLIT row of a data source: what and where."""

    file: str
    offset: int
    kind: str
    error: str

    def to_json(self) -> dict:
        return attrs.asdict(self)


@attrs.frozen
class Report:
    as_of: int
    data_dirs: tuple[str, ...]
    total: Figures
    nodes: dict[str, Figures]
    buckets: dict[tuple[str, str], Figures]
    subjects: dict[str | None, Figures] = attrs.field(factory=dict)
    broker_groups: dict[str | None, Figures] = attrs.field(factory=dict)
    damage: tuple[Damage, ...] = ()
    torn_tails: tuple[Damage, ...] = ()
    #: {"missing": {"parquet": dir, "csv": dir}, "duplicated": {...}, ...} when written.
    outputs: dict[str, dict[str, str]] = attrs.field(factory=dict)
    #: The levels with more keys than the report holds (all of them are in the written summary).
    truncated: tuple[str, ...] = ()
    #: Damage found in all (the report holds the first ones).
    damage_count: int = 0

    @property
    def exit_status(self) -> int:
        """0 when nothing is missing and nothing is damaged, else 1."""
        return 1 if self.total.missing or self.total.early or self.damage else 0

    def to_json(self) -> dict:
        return {
            "as_of": self.as_of,
            "as_of_utc": utc(self.as_of),
            "data_dirs": list(self.data_dirs),
            "total": self.total.to_json(),
            "nodes": [{"node": node, **f.to_json()} for node, f in self.nodes.items()],
            "buckets": [{"node": node, "bucket": bucket, **f.to_json()}
                        for (node, bucket), f in self.buckets.items()],
            "subjects": [{"subject": subject, **f.to_json()} for subject, f in self.subjects.items()],
            "broker_groups": [{"broker_group": group, **f.to_json()} for group, f in self.broker_groups.items()],
            "truncated": list(self.truncated),
            "damage_count": self.damage_count,
            "damage": [d.to_json() for d in self.damage],
            "torn_tails": [d.to_json() for d in self.torn_tails],
            "outputs": self.outputs,
            "exit_status": self.exit_status,
        }

    def render(self) -> str:
        """The terminal summary: a table per node, the totals, then damage and where the ids are."""
        lines = [f"Reconciliation as of {utc(self.as_of)} ({self.as_of} ms), "
                 f"{len(self.data_dirs)} data director{'y' if len(self.data_dirs) == 1 else 'ies'}", ""]
        for node, figures in self.nodes.items():
            lines += _node_table(node, figures, {b: f for (n, b), f in self.buckets.items() if n == node})
        lines += _table("subject", "SUBJECT", self.subjects)
        lines += _table("broker group (of the first dispatch)", "BROKER_GROUP", self.broker_groups)
        lines += _summary(self)
        return "\n".join(lines) + "\n"


def utc(ms: int) -> str:
    t = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc) + _dt.timedelta(milliseconds=ms)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


_TABLE = ("scheduled", "cancelled", "dispatched", "duplicated", "missing", "not_yet_due")
_HEAD = ("BUCKET", "SCHEDULED", "CANCELLED", "DISPATCHED", "DUPLICATED", "MISSING", "NOT_YET_DUE",
         "P50_MS", "P90_MS", "P99_MS", "P99.9_MS", "MAX_MS")


def _row(label: str, f: Figures) -> tuple[str, ...]:
    late = f.lateness_ms or {}
    return (label, *(str(getattr(f, name)) for name in _TABLE), *(str(late.get(n, "-")) for n in LATENESS))


def _node_table(node: str, total: Figures, buckets: dict[str, Figures]) -> list[str]:
    if not buckets:
        return [f"node {node}: no records", ""]
    rows = [_HEAD] + [_row(b, f) for b, f in sorted(buckets.items())] + [_row("node total", total)]
    return [f"node {node}"] + _aligned(rows) + [""]


def _table(title: str, head: str, figures: dict) -> list[str]:
    if not figures:
        return []
    rows = [(head,) + _HEAD[1:]] + [_row("-" if key is None else key, f) for key, f in figures.items()]
    return [f"by {title}"] + _aligned(rows) + [""]


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
            for r in rows]


def _summary(report: Report) -> list[str]:
    t = report.total
    lines = [f"total: {t.scheduled} scheduled, {t.cancelled} cancelled, {t.dispatched} dispatched "
             f"({t.duplicated} more than once), {t.missing} missing, {t.not_yet_due} not yet due"]
    if t.lateness_ms:
        lines.append("lateness (first dispatch - schedule time): "
                     + ", ".join(f"{_LATENESS_LABELS[name]} {t.lateness_ms[name]} ms" for name in LATENESS))
    if t.early:
        lines.append(f"EARLY: {t.early} messages were dispatched before their schedule time")
    if t.orphan_dispatches:
        lines.append(f"{t.orphan_dispatches} dispatch records name no readable scheduled message")
    for d in report.torn_tails:
        lines.append(f"warning: {d.error} (the records before it are counted)")
    for d in report.damage:
        lines.append(f"DAMAGED: {d.error}; the figures above leave those records out")
    if report.damage_count > len(report.damage) + len(report.torn_tails):
        lines.append(f"{report.damage_count} damaged places in all (the first {len(report.damage)} shown)")
    for level in report.truncated:
        lines.append(f"more {level} rows than shown: every one is in the summary written with --out")
    for kind, paths in report.outputs.items():
        lines.append(f"{kind} ids: {paths['parquet']} (Parquet), {paths['csv']} (CSV)")
    if report.damage:
        lines.append(f"RESULT: {len(report.damage)} damaged place(s), {t.missing} missing")
    elif t.early:
        lines.append(f"RESULT: {t.early} messages dispatched early, {t.missing} missing")
    elif t.missing:
        lines.append(f"RESULT: {t.missing} messages missing")
    else:
        lines.append("RESULT: nothing missing")
    return lines
