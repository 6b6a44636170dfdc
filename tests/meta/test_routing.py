"""The routing rule: exact route, most specific glob, everything when no route matches."""
from __future__ import annotations

import pytest

from delayserver.meta.routing import check_pattern, matching_route, resolve
from delayserver.meta.store import Route
from delayserver.sender.groups import BrokerGroupSpec, TransportKind

GROUPS = [
    BrokerGroupSpec("a", TransportKind.SPOOL, "x"),
    BrokerGroupSpec("b", TransportKind.REDIS, "redis://h:1"),
    BrokerGroupSpec("c", TransportKind.HTTP, "http://h/", read_only=True),
]


def names(groups):
    return [g.name for g in groups]


def test_an_exact_route_wins_over_globs():
    routes = [Route("orders.*", ("a",)), Route("orders.paid", ("b",))]
    assert matching_route("orders.paid", routes).pattern == "orders.paid"
    assert matching_route("orders.new", routes).pattern == "orders.*"


def test_the_most_specific_glob_wins():
    routes = [Route("*", ("a",)), Route("orders.*", ("b",)), Route("orders.eu.*", ("a", "b")), Route("o*", ("b",))]
    assert matching_route("orders.eu.paid", routes).pattern == "orders.eu.*"
    assert matching_route("orders.us", routes).pattern == "orders.*"
    assert matching_route("other", routes).pattern == "o*"
    assert matching_route("x", routes).pattern == "*"


def test_a_star_matches_dots_and_sets_count_as_wildcards():
    routes = [Route("or[dx]ers.*", ("a",)), Route("orders.?*", ("b",))]
    assert matching_route("orders.a.b", routes).pattern == "orders.?*"
    assert matching_route("orxers.a", routes).pattern == "or[dx]ers.*"


def test_resolve_gives_the_route_groups_in_order_without_read_only_or_unknown_ones():
    route, chosen = resolve("s", [Route("s", ("b", "zz", "c", "a"))], GROUPS)
    assert route.pattern == "s" and names(chosen) == ["b", "a"]


def test_resolve_falls_back_to_every_writable_group():
    route, chosen = resolve("nothing.routes.me", [Route("orders.*", ("b",))], GROUPS)
    assert route is None and names(chosen) == ["a", "b"]


def test_a_route_to_read_only_groups_only_resolves_to_nothing():
    assert resolve("s", [Route("s", ("c",))], GROUPS)[1] == []


@pytest.mark.parametrize("pattern,matches,misses", [
    ("orders", "orders", "orders.paid"),
    ("orders.*", "orders.eu.paid", "order.paid"),
    ("a?c", "abc", "ac"),
    ("x[!ab]y", "xcy", "xay"),
    ("q:1|2%-_", "q:1|2%-_", "q:1|2%-"),
])
def test_good_patterns_are_accepted_and_route_what_they_match(pattern, matches, misses):
    assert check_pattern(pattern) is None
    route = Route(pattern, ("a",))
    assert matching_route(matches, [route]) == route
    assert matching_route(misses, [route]) is None


@pytest.mark.parametrize("pattern", ["", "a b", "é", "x" * 256, "a/b", 7])
def test_bad_patterns(pattern):
    with pytest.raises(ValueError, match="bad route pattern"):
        check_pattern(pattern)
