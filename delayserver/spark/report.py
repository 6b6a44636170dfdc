"""The result of a reconciliation: figures per bucket, per node and in total; as text or JSON.

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
  P99.9 (nearest rank: the smallest lateness that many of them are within; exact up to 1/10000 of
  the rank on big buckets) and the exact max; None when nothing was dispatched.
"""
from __future__ import annotations

import datetime as _dt

import attrs

PERCENTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999))
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

    def to_json(self) -> dict:
        return attrs.asdict(self)


@attrs.frozen
class Damage:
    """A CORRUPT or TORN_TAIL row of a data source: what and where."""

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
    damage: tuple[Damage, ...] = ()
    torn_tails: tuple[Damage, ...] = ()
    #: {"missing": {"parquet": dir, "csv": dir}, "duplicated": {...}} when ids were written.
    outputs: dict[str, dict[str, str]] = attrs.field(factory=dict)

    @property
    def exit_status(self) -> int:
        """0 when nothing is missing and nothing is damaged, else 1."""
        return 1 if self.total.missing or self.damage else 0

    def to_json(self) -> dict:
        return {
            "as_of": self.as_of,
            "as_of_utc": utc(self.as_of),
            "data_dirs": list(self.data_dirs),
            "total": self.total.to_json(),
            "nodes": [{"node": node, **f.to_json()} for node, f in self.nodes.items()],
            "buckets": [{"node": node, "bucket": bucket, **f.to_json()}
                        for (node, bucket), f in self.buckets.items()],
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
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEAD))]
    table = ["  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    return [f"node {node}"] + table + [""]


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
    for kind, paths in report.outputs.items():
        lines.append(f"{kind} ids: {paths['parquet']} (Parquet), {paths['csv']} (CSV)")
    if report.damage:
        lines.append(f"RESULT: {len(report.damage)} damaged segment(s), {t.missing} missing")
    elif t.missing:
        lines.append(f"RESULT: {t.missing} messages missing")
    else:
        lines.append("RESULT: nothing missing")
    return lines
