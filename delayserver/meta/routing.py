"""Which broker groups serve a subject: the routing rule, shared by the meta server and the
delay servers' cache so that both answer alike.

A route maps a pattern to an ordered list of broker group names. A pattern is either an exact
subject (1 to 255 bytes of ``[A-Za-z0-9._:%|-]``) or a glob: the same characters plus ``*`` (any
run of characters, dots included: ``orders.*`` matches ``orders.eu.paid``), ``?`` (one character)
and ``[...]`` / ``[!...]`` (one character of / not of a set), matched case-sensitively.

To resolve a subject:
1. A route whose pattern is exactly the subject wins.
2. Otherwise, of the glob routes matching the subject, the most specific wins: the one with the
   most literal (non-wildcard) characters, then the longest, then the first in sorted order.
3. When no route matches, every broker group serves the subject.

The answer is the chosen broker groups that exist and are not read-only, in route order (by name
when no route matched). It can be empty: then no broker group accepts the subject for now and
its messages wait; they are never dropped.
"""
from __future__ import annotations

import fnmatch
import re
from typing import Iterable

from delayserver.meta.store import Route
from delayserver.sender.groups import BrokerGroupSpec

_PATTERN_RE = re.compile(r"[A-Za-z0-9._:%|\-*?\[\]!]{1,255}")
_WILDCARDS = frozenset("*?[]!")


def check_pattern(pattern: str) -> None:
    """Raises ValueError unless `pattern` is a route pattern as the module docstring defines."""
    if not isinstance(pattern, str) or not _PATTERN_RE.fullmatch(pattern) or len(pattern.encode()) > 255:
        raise ValueError(
            f"bad route pattern {pattern!r}: 1 to 255 characters of [A-Za-z0-9._:%|-] and the glob "
            "wildcards * ? [ ] !"
        )
    if is_glob(pattern):
        try:
            re.compile(fnmatch.translate(pattern))
        except re.error as exc:
            raise ValueError(f"bad route pattern {pattern!r}: {exc}") from None


def is_glob(pattern: str) -> bool:
    return any(c in _WILDCARDS for c in pattern)


def matching_route(subject: str, routes: Iterable[Route]) -> Route | None:
    """The route that decides where `subject` goes (rules 1 and 2), or None (rule 3)."""
    globs = []
    for route in routes:
        if route.pattern == subject:
            return route
        if is_glob(route.pattern) and fnmatch.fnmatchcase(subject, route.pattern):
            globs.append(route)
    if not globs:
        return None
    return min(globs, key=lambda r: (-_literal_count(r.pattern), -len(r.pattern), r.pattern))


def resolve(
    subject: str, routes: Iterable[Route], broker_groups: Iterable[BrokerGroupSpec]
) -> tuple[Route | None, list[BrokerGroupSpec]]:
    """The deciding route (None: no route matched) and the broker groups serving `subject`."""
    by_name = {g.name: g for g in broker_groups}
    route = matching_route(subject, routes)
    names = route.broker_groups if route is not None else sorted(by_name)
    chosen = [by_name[n] for n in names if n in by_name]
    return route, [g for g in chosen if not g.read_only]


_SET_RE = re.compile(r"\[!?\]?[^\]]*\]")


def _literal_count(pattern: str) -> int:
    # A [...] set matches one character out of several: it counts as no literal.
    return sum(c not in "*?" for c in _SET_RE.sub("", pattern))
