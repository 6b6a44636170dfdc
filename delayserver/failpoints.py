"""Failpoints: named places where a test can make the process die or an I/O call fail, switched on
from the environment.

Kill points: `DELAYSERVER_FAILPOINT=name` (or `name@N`, to die at the N-th hit) makes `hit(name)`
kill the process with SIGKILL at that point, so crash tests can stop it at an exact stage boundary.

I/O faults: `DELAYSERVER_IO_FAULT=OP:LOG:ERRNO[@N][+]`, several separated by commas, makes the
N-th (default: first) `OP` on a file of `LOG` fail with `ERRNO`, once, or with `+` at every
later hit too (for good); entries are checked in order, and each counts the hits that reach it
(one that fires ends the check). OP is `write`, `fsync`, `rename` or `dirfsync` (the fsync of a
directory); LOG names the directory the file lives in (`message_log`, `schedule_log`,
`dispatch_log`, `checkpoint`, `spool`, `parked`), or `roll` (the fsync that seals a message_log
segment), or `*` for any; ERRNO is `EIO` or `ENOSPC` (any name of the errno module). For example::

    DELAYSERVER_IO_FAULT=fsync:message_log:EIO@3      the third message_log fsync fails, once
    DELAYSERVER_IO_FAULT=write:dispatch_log:ENOSPC+   every dispatch_log write fails

Each fault that fires is reported on stderr as one line
``failpoint fired: OP LOG ERRNO PATH at TIME_NS`` (wall clock), so a test can tell what was
acknowledged before it and what after. With both variables unset, a check costs one dict lookup.
"""
from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path

import attrs

OPS = ("write", "fsync", "rename", "dirfsync")

_spec = os.environ.get("DELAYSERVER_FAILPOINT", "")
_name, _, _count = _spec.partition("@")
_remaining = {_name: int(_count or 1)} if _name else {}


def hit(name: str) -> None:
    if name in _remaining:
        _remaining[name] -= 1
        if _remaining[name] <= 0:
            os.kill(os.getpid(), signal.SIGKILL)


@attrs.define
class IOFault:
    op: str
    log: str
    errno: int
    at: int = 1  # the hit that fails first
    forever: bool = False
    hits: int = 0

    def matches(self, op: str, path, site: str | None = None) -> bool:
        if op != self.op:
            return False
        if self.log == "*" or self.log == site:
            return True
        parts = Path(path).parts
        return self.log in parts[-3:]

    def check(self) -> bool:
        """Count a matching hit; True when this one fails."""
        self.hits += 1
        return self.hits == self.at or (self.forever and self.hits > self.at)


def parse_io_faults(spec: str) -> list[IOFault]:
    """Parse DELAYSERVER_IO_FAULT (see the module docstring); ValueError names a bad entry."""
    faults = []
    for entry in filter(None, (s.strip() for s in spec.split(","))):
        forever = entry.endswith("+")
        body = entry.rstrip("+")
        body, _, at = body.partition("@")
        try:
            op, log, name = body.split(":")
            code = getattr(errno, name)
            at_n = int(at or 1)
        except (ValueError, AttributeError):
            raise ValueError(f"bad DELAYSERVER_IO_FAULT entry {entry!r}: want OP:LOG:ERRNO[@N][+]") from None
        if op not in OPS or not isinstance(code, int) or at_n < 1:
            raise ValueError(f"bad DELAYSERVER_IO_FAULT entry {entry!r}: OP is one of {', '.join(OPS)}, N >= 1")
        faults.append(IOFault(op, log, code, at_n, forever))
    return faults


_io_faults = parse_io_faults(os.environ.get("DELAYSERVER_IO_FAULT", ""))


def set_io_faults(spec: str) -> None:
    """Replace the I/O faults (in-process tests; a server process reads the environment)."""
    global _io_faults
    _io_faults = parse_io_faults(spec)


def io(op: str, path, site: str | None = None) -> None:
    """Raise the OSError an armed I/O fault calls for at this `op` on `path` (at `site`, a name
    for one call site); else nothing."""
    if not _io_faults:
        return
    for fault in _io_faults:
        if fault.matches(op, path, site) and fault.check():
            name = errno.errorcode.get(fault.errno, str(fault.errno))
            print(f"failpoint fired: {op} {fault.log} {name} {path} at {time.time_ns()}", file=sys.stderr, flush=True)
            raise OSError(fault.errno, f"{os.strerror(fault.errno)} (failpoint)", str(path))
