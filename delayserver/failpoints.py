"""Failpoints: named places where a test can make the process die, switched on from the environment.

`DELAYSERVER_FAILPOINT=name` (or `name@N`, to die at the N-th hit) makes `hit(name)` kill the
process with SIGKILL at that point, so crash tests can stop it at an exact stage boundary. With the
variable unset, `hit` costs one dict lookup.
"""
from __future__ import annotations

import os
import signal

_spec = os.environ.get("DELAYSERVER_FAILPOINT", "")
_name, _, _count = _spec.partition("@")
_remaining = {_name: int(_count or 1)} if _name else {}


def hit(name: str) -> None:
    if name in _remaining:
        _remaining[name] -= 1
        if _remaining[name] <= 0:
            os.kill(os.getpid(), signal.SIGKILL)
