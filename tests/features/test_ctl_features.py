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
