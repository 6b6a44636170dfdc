"""The reconciliation report without Spark: exit status, the terminal summary, the JSON."""
from __future__ import annotations

import json

from spark.report import Damage, Figures, Report, utc

LATE = {"p50": 20, "p90": 30, "p99": 30, "p999": 30, "max": 30}
BUCKET = Figures(scheduled=4, dispatched=3, missing=1, lateness_ms=LATE)


def report(**kw) -> Report:
    fields = {"as_of": 1_763_800_612_345, "data_dirs": ("/n/a", "/n/empty"), "total": BUCKET,
              "nodes": {"/n/a": BUCKET, "/n/empty": Figures()}, "buckets": {("/n/a", "202511220826"): BUCKET}}
    return Report(**(fields | kw))


def test_as_of_is_shown_in_utc():
    assert utc(1_763_800_612_345) == "2025-11-22T08:36:52.345Z"


def test_the_exit_status_is_1_when_messages_are_missing_or_a_segment_is_damaged():
    assert report().exit_status == 1
    assert report(total=Figures(scheduled=3, dispatched=3)).exit_status == 0
    damage = Damage("/n/a/schedule_log/202511220826.log", 40, "CORRUPT", "corrupt record at offset 40")
    assert report(total=Figures(), damage=(damage,)).exit_status == 1
    torn = Damage("/n/a/dispatch_log/202511220826.log", 40, "TORN_TAIL", "torn tail at offset 40")
    assert report(total=Figures(), torn_tails=(torn,)).exit_status == 0


def test_the_summary_has_a_table_per_node_the_totals_and_the_damage():
    damage = Damage("/n/a/schedule_log/202511220826.log", 40, "CORRUPT",
                    "/n/a/schedule_log/202511220826.log: corrupt record at offset 40: crc mismatch")
    text = report(damage=(damage,)).render()
    lines = text.splitlines()
    assert lines[0] == "Reconciliation as of 2025-11-22T08:36:52.345Z (1763800612345 ms), 2 data directories"
    assert lines[2] == "node /n/a"
    assert lines[4].split() == ["202511220826", "4", "0", "3", "0", "1", "0", "20", "30", "30", "30", "30"]
    assert lines[5].split()[:3] == ["node", "total", "4"]
    assert "node /n/empty: no records" in lines
    assert "lateness (first dispatch - schedule time): P50 20 ms, P90 30 ms, P99 30 ms, P99.9 30 ms, max 30 ms" in lines
    assert f"DAMAGED: {damage.error}; the figures above leave those records out" in lines
    assert lines[-1] == "RESULT: 1 damaged place(s), 1 missing"


def test_the_json_holds_every_figure_at_every_level():
    out = json.loads(json.dumps(report().to_json()))
    assert out["as_of_utc"] == "2025-11-22T08:36:52.345Z" and out["exit_status"] == 1
    assert out["total"] == {**Figures(scheduled=4, dispatched=3, missing=1).to_json(), "lateness_ms": LATE}
    assert [n["node"] for n in out["nodes"]] == ["/n/a", "/n/empty"]
    assert out["buckets"][0]["bucket"] == "202511220826" and out["buckets"][0]["missing"] == 1
    assert out["damage"] == [] and out["outputs"] == {}


def test_an_early_dispatch_fails_the_run_and_the_breakdowns_are_shown():
    early = Figures(scheduled=1, dispatched=1, early=1, lateness_ms={**LATE, "max": -5},
                    lateness_histogram=(1,) + (0,) * 18)
    text = report(total=early, subjects={"orders.paid": early}, broker_groups={None: Figures(scheduled=2)},
                  truncated=("bucket",)).render()
    assert report(total=early).exit_status == 1
    assert "by subject" in text and "  orders.paid" in text
    assert "by broker group (of the first dispatch)" in text and "\n  -  " in text
    assert "more bucket rows than shown: every one is in the summary written with --out" in text
    assert text.splitlines()[-1] == "RESULT: 1 messages dispatched early, 0 missing"
    assert early.to_json()["lateness_histogram"][0] == {"from_ms": None, "to_ms": 0, "count": 1}
