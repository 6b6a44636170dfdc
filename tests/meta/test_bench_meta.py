"""`ops/bench meta` runs whole at a tiny size over both stores; figures are not checked, only
that it measures heartbeats and prints them."""
from __future__ import annotations

import pytest

from bench.meta import main


@pytest.mark.parametrize("store, servers", [("sqlite", 1), ("postgres", 2)])
def test_the_meta_benchmark_measures_heartbeats(store, servers, request, capsys):
    url = "sqlite" if store == "sqlite" else request.getfixturevalue("postgres_url")
    main(["--store", url, "--servers", str(servers), "--nodes", "6", "--groups", "2", "--seconds", "1"])
    out = capsys.readouterr().out
    assert f"meta servers: {servers}, nodes: 6 in 2 groups" in out
    rate = float(out.split("heartbeats/s: ")[1].split()[0].replace(",", ""))
    assert rate > 0 and "p99" in out
