"""Wall-clock steps of an hour, back and forward, on the real process under libfaketime.

The server runs with libfaketime preloaded (Debian's `faketime`, installed by ops/test): its wall
clock is the real one plus an offset read from a file the test rewrites; its monotonic clock is
left alone (FAKETIME_DONT_FAKE_MONOTONIC). Schedule times follow the wall clock; every interval
(retry back-off, circuit breakers, checkpoints, leases) the monotonic one. So:

- a step back of an hour delivers nothing early (what was due in a minute is now due in an hour
  and a minute), while retries go on and breakers close as soon as the broker answers again;
- a step forward of an hour delivers what became due, nothing before its time.
"""
from __future__ import annotations

import base64
import glob
import time

import pytest

from delayserver.client import Message, Producer
from delayserver.message import MessageState
from tests.procs import ServerProcess, spooled, wait_for

pytestmark = pytest.mark.slow


def libfaketime() -> str:
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1"))
    assert found, "libfaketime is missing: ops/test installs Debian's faketime package"
    return found[0]


def step(rc, offset_s: int) -> None:
    rc.write_text(f"{offset_s:+d}\n")
    time.sleep(1.5)  # libfaketime rereads the file at most once a second


def test_clock_steps_of_an_hour_deliver_nothing_early_and_never_freeze_retries(tmp_path, webhook_server, monkeypatch):
    failing = {"on": True}
    monkeypatch.setattr(type(webhook_server), "answer",
                        lambda self, batch: (503, b"") if failing["on"] else (200, b""))
    rc = tmp_path / "faketime.rc"
    rc.write_text("+0\n")
    config = tmp_path / "node.toml"
    config.write_text(
        "segment_scale = \"1m\"\ncheckpoint_interval_ms = 200\n"
        f"[[broker_group]]\nname = \"hook\"\ntransport = \"http\"\naddress = \"{webhook_server.url}\"\n"
        "subjects = [\"retry.q\"]\n"
        "[[broker_group]]\nname = \"spool\"\ntransport = \"spool\"\nsubjects = [\"soon.q\"]\n")
    proc = ServerProcess(tmp_path / "data", args=["--config", str(config)], env={
        "LD_PRELOAD": libfaketime(), "FAKETIME_TIMESTAMP_FILE": str(rc), "FAKETIME_CACHE_DURATION": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1"})
    proc.start(timeout=120)
    try:
        with Producer(proc.address, timeout=60) as prod:
            retrying = prod.send_many([Message("retry.q", b"r%d" % i, delay=0) for i in range(20)])
            sent_at = time.monotonic()
            soon = prod.send_many([Message("soon.q", b"s%d" % i, delay=20_000 + 1000 * i) for i in range(20)])
            # Retries going on: the broker fails every batch, the breaker opens.
            assert wait_for(lambda: len(webhook_server.batches) >= 3, 60)

            step(rc, -3600)  # the server's wall clock goes back an hour
            seen = len(webhook_server.batches)
            # Retries keep coming (back-off and breaker on the monotonic clock, at most 30 s apart).
            assert wait_for(lambda: len(webhook_server.batches) > seen, 90), "retries froze after the step back"
            failing["on"] = False
            assert wait_for(lambda: all(prod.status(h).state == MessageState.DELIVERED for h in retrying), 90), \
                "the breaker stayed open after the step back"
            # The soon.q messages were due 20-39 s after sending; on the server's clock they are
            # now an hour away: nothing of them may go out, past the last one's time and 5 s more.
            time.sleep(max(0.0, sent_at + 39 + 5 - time.monotonic()))
            assert spooled(proc.data_dir) == [], "delivered early after the clock stepped back"
            assert all(prod.status(h).state == MessageState.PENDING for h in soon)

            step(rc, +3600)  # now an hour ahead of the real time: every soon.q message is due
            assert wait_for(lambda: len(spooled(proc.data_dir)) == len(soon), 60)
        delivered = spooled(proc.data_dir)
        assert sorted(m.message_id for _, _, m in delivered) == sorted(h.message_id for h in soon)
        assert all(t >= m.schedule_time for t, _, m in delivered), "delivered before its time"
        delivered_retry = {m["id"] for b in webhook_server.batches for m in b["messages"]}
        assert {h.message_id for h in retrying} <= delivered_retry
        assert all(base64.b64decode(m["body"]).startswith(b"r") for b in webhook_server.batches for m in b["messages"])
    finally:
        proc.kill()
