"""delayctl reschedule, promote (and list) against a real server process."""
from __future__ import annotations

import json

from tests.ctl.test_node_commands import delayctl, server  # noqa: F401 (the fixture)
from tests.procs import wait_for


def test_reschedule_and_promote_print_the_new_handle(server):  # noqa: F811
    address = server.address
    handle = delayctl("send", "--server", address, "--subject", "orders.expire", "--delay", "1h",
                      "--id", "order-42", "--body", "order 42").stdout.strip()
    moved = delayctl("reschedule", handle, "--delay", "2h", "--server", address).stdout.strip()
    assert moved.endswith(":order-42") and int(moved.split(":")[0]) > int(handle.split(":")[0])
    assert delayctl("status", handle, "--server", address).stdout.strip() == "cancelled"
    again = delayctl("reschedule", handle, "--at", "2027-06-01T00:00:00Z", "--server", address, check=False)
    assert again.returncode == 1 and again.stdout.strip() == "already_cancelled"
    promoted = json.loads(delayctl("promote", moved, "--server", address, "--json").stdout)
    assert promoted["outcome"] == "rescheduled"
    new = promoted["new_handle"]
    assert wait_for(lambda: delayctl("status", new, "--server", address).stdout.startswith("delivered"), 30)
    late = delayctl("promote", new, "--server", address, check=False)
    assert late.returncode == 1 and late.stdout.strip() == "already_delivered"
    bad = delayctl("reschedule", new, "--delay", "nonsense", "--server", address, check=False)
    assert bad.returncode == 1 and "--delay" in bad.stderr


def test_list_pages_by_subject_and_state(server):  # noqa: F811
    address = server.address
    handles = [delayctl("send", "--server", address, "--subject", subject, "--delay", f"{i + 1}h",
                        "--id", f"l{i}", "--body", f"body {i}").stdout.strip()
               for i, subject in enumerate(["orders.eu", "orders.us", "billing", "orders.eu"])]
    delayctl("cancel", handles[3], "--server", address)
    lines = delayctl("list", "--server", address, "--subject", "orders.*").stdout.splitlines()
    assert [line.split()[0] for line in lines] == handles[:2]
    assert lines[0].split()[1] == "pending" and lines[0].split()[3] == "orders.eu"
    first = delayctl("list", "--server", address, "--limit", "2", "--newest")
    assert [line.split()[0] for line in first.stdout.splitlines()] == [handles[2], handles[1]]
    cursor = first.stderr.strip().removeprefix("next: --cursor ")
    rest = delayctl("list", "--server", address, "--limit", "2", "--newest", "--cursor", cursor).stdout
    assert [line.split()[0] for line in rest.splitlines()] == [handles[0]]
    everything = delayctl("list", "--server", address, "--all", "--limit", "1", "--state", "pending",
                          "--state", "cancelled", "--json", "--bodies").stdout.splitlines()
    rows = [json.loads(x) for x in everything]
    assert [r["handle"] for r in rows] == handles
    assert rows[3]["state"] == "cancelled" and rows[2]["subject"] == "billing"
    bad = delayctl("list", "--server", address, "--limit", "0", check=False)
    assert bad.returncode == 1 and "BAD_REQUEST" in bad.stderr


def test_schedules_put_list_pause_resume_delete(server):  # noqa: F811
    address = server.address
    made = delayctl("schedules", "--server", address, "put", "nightly", "--subject", "reports.nightly",
                    "--rule", "0 2 * * *", "--tz", "Europe/Berlin", "--body", "run the report",
                    "--catch-up", "skip").stdout
    assert made.startswith("nightly  active  next ") and "'0 2 * * *' Europe/Berlin  -> reports.nightly" in made
    delayctl("schedules", "--server", address, "put", "tick", "--subject", "q.tick", "--rule", "@every 1h")
    rows = [json.loads(x) for x in delayctl("schedules", "--server", address, "--json").stdout.splitlines()]
    assert [r["name"] for r in rows] == ["nightly", "tick"] and rows[0]["body"] == "run the report"
    assert "paused" in delayctl("schedules", "--server", address, "pause", "tick").stdout
    assert "active" in delayctl("schedules", "--server", address, "resume", "tick").stdout
    delayctl("schedules", "--server", address, "delete", "tick")
    assert [line.split()[0] for line in delayctl("schedules", "--server", address).stdout.splitlines()] == ["nightly"]
    bad = delayctl("schedules", "--server", address, "put", "x", "--subject", "q", "--rule", "every day", check=False)
    assert bad.returncode == 1 and "BAD_REQUEST" in bad.stderr
    missing = delayctl("schedules", "--server", address, "pause", "nope", check=False)
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
