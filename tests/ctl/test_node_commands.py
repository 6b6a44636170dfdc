"""delayctl against a running server, as subprocesses: send, status, cancel, tail, parked, redrive."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.procs import ServerProcess, wait_for


def delayctl(*args, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "delayserver.ctl", *map(str, args)],
                          capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"delayctl {args} exited {proc.returncode}: {proc.stderr}")
    return proc


@pytest.fixture
def server(tmp_path):
    proc = ServerProcess(tmp_path / "data").start()
    yield proc
    proc.kill()


def test_send_status_cancel_and_tail(server, tmp_path):
    handle = delayctl("send", "--server", server.address, "--subject", "orders.expire", "--delay", "1h",
                      "--body", "order 42", "--header", "tenant=acme").stdout.strip()
    assert delayctl("status", handle, "--server", server.address).stdout.strip() == "pending"
    assert delayctl("cancel", handle, "--server", server.address).stdout.strip() == "cancelled"
    status = json.loads(delayctl("status", handle, "--server", server.address, "--json").stdout)
    assert status["state"] == "cancelled"

    body = tmp_path / "body.bin"
    body.write_bytes(b"\x00\x01binary")
    now = delayctl("send", "--server", server.address, "--subject", "orders.expire", "--at", "2020-01-01T00:00:00Z",
                   "--id", "order-43", "--body-file", body).stdout.strip()
    assert now.endswith(":order-43")
    assert wait_for(lambda: delayctl("status", now, "--server", server.address).stdout.startswith("delivered"), 10)
    assert delayctl("cancel", now, "--server", server.address, check=False).stdout.strip() == "already_delivered"
    lines = [json.loads(x) for x in delayctl("tail", server.data_dir, "--subject", "orders.expire", "--json").stdout.splitlines()]
    assert [x["id"] for x in lines] == ["order-43"]
    assert lines[0]["lateness_ms"] >= 0 and lines[0]["attempt"] == 1
    assert delayctl("tail", server.data_dir).stdout.split() == ["orders.expire"]


def test_bad_input_gets_a_clear_error_and_exit_1(server):
    bad = delayctl("send", "--server", server.address, "--subject", "no spaces", "--delay", "1s", "--body", "x",
                   check=False)
    assert bad.returncode == 1 and "BAD_SUBJECT" in bad.stderr
    far = delayctl("send", "--server", server.address, "--subject", "a", "--delay", "3y", "--body", "x", check=False)
    assert far.returncode == 1 and "BAD_SCHEDULE_TIME" in far.stderr
    handle = delayctl("status", "not-a-handle", "--server", server.address, check=False)
    assert handle.returncode == 1 and "bad handle" in handle.stderr
    usage = delayctl("send", "--subject", "a", "--body", "x", check=False)
    assert usage.returncode == 2


def test_parked_messages_are_listed_and_redrive_delivers_them(tmp_path, webhook_server):
    config = tmp_path / "node.toml"
    config.write_text(f'[[broker_group]]\nname = "hook"\ntransport = "http"\naddress = "{webhook_server.url}"\n')
    webhook_server.respond(404, body={"error": "no such queue"})
    proc = ServerProcess(tmp_path / "data", args=["--config", str(config)]).start()
    try:
        handle = delayctl("send", "--server", proc.address, "--subject", "late.q", "--delay", "0s",
                          "--body", "park me").stdout.strip()
        listed = wait_for(lambda: delayctl("parked", proc.data_dir, "--json").stdout.strip(), 10)
        parked = json.loads(listed)
        assert parked["handle"] == handle and "404" in parked["reason"]
        webhook_server.respond(200)
        assert "redrove 1" in delayctl("redrive", proc.data_dir, "--server", proc.address).stdout
        delivered = wait_for(lambda: [m for b in webhook_server.batches for m in b["messages"]
                                      if m["headers"].get("redriven-from") == handle], 10)
        assert delivered and delivered[0]["id"] == handle.split(":", 1)[1]
        assert delayctl("parked", proc.data_dir).stdout.strip() == ""
        assert "nothing to redrive" in delayctl("redrive", proc.data_dir, "--server", proc.address).stdout
    finally:
        proc.kill()


def test_a_body_no_node_takes_is_refused_with_message_too_large_before_sending(server, tmp_path):
    body = tmp_path / "big.bin"
    body.write_bytes(b"x" * (10 << 20))
    result = delayctl("send", "--server", server.address, "--subject", "orders.big", "--delay", "1s",
                      "--body-file", body, check=False)
    assert result.returncode == 1
    assert result.stderr.startswith("error: MESSAGE_TOO_LARGE:") and "Traceback" not in result.stderr


def test_a_server_address_that_is_not_host_port_is_a_usage_error(tmp_path):
    result = delayctl("send", "--server", "127.0.0.1:notaport", "--subject", "s", "--delay", "1s", "--body", "x",
                      check=False)
    assert result.returncode == 2 and "--server" in result.stderr and "Traceback" not in result.stderr
