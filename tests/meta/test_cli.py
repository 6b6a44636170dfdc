"""`delayserver meta` with a PostgreSQL store, its refusals at start, the node's meta options, and
`delayctl meta` over a list of meta servers with the cluster secret."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from delayserver.config import Config, ConfigError
from tests.meta.procs import SharedMetaProcess

SECRET = "s3cret-of-the-cluster"


def meta_cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "delayserver", "meta", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def delayctl(meta: str, *args, secret: str | None = SECRET) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DELAYSERVER_CLUSTER_SECRET"}
    if secret is not None:
        env["DELAYSERVER_CLUSTER_SECRET"] = secret
    return subprocess.run([sys.executable, "-m", "delayserver.ctl", "meta", "--meta", meta, *args],
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("args, message", [
    ([], "give --data-dir"),
    (["--data-dir", "x", "--store", "postgresql://h/db"], "give --data-dir"),
    (["--store", "mysql://h/db"], "want a postgresql:// URL"),
    (["--data-dir", "x", "--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
])
def test_bad_arguments_exit_2_saying_why(args, message):
    proc = meta_cli(*args)
    assert proc.returncode == 2 and message in proc.stderr


def test_an_unreachable_database_or_an_empty_secret_file_exits_1(tmp_path, unused_port):
    proc = meta_cli("--store", f"postgresql://postgres@127.0.0.1:{unused_port}/meta", "--listen", "127.0.0.1:0")
    assert proc.returncode == 1 and "cannot connect to the meta store database" in proc.stderr
    (tmp_path / "secret").write_text("")
    proc = meta_cli("--data-dir", str(tmp_path / "m"), "--cluster-secret-file", str(tmp_path / "secret"))
    assert proc.returncode == 1 and "is empty" in proc.stderr


def test_two_meta_servers_share_a_postgres_store_and_delayctl_uses_either(tmp_path, postgres_url, unused_port):
    (tmp_path / "secret").write_text(SECRET + "\n")
    args = ["--store", postgres_url, "--cluster-secret-file", str(tmp_path / "secret")]
    one = SharedMetaProcess("one", tmp_path, args).start()
    two = SharedMetaProcess("two", tmp_path, args).start()
    try:
        assert "no cluster secret" not in one.log()
        added = delayctl(one.address, "broker-group", "add", "local", "--transport", "spool", "--address", "x")
        assert added.returncode == 0, added.stderr
        # Written through one, read through the other; a dead one first in the list is passed over.
        listing = delayctl(f"127.0.0.1:{unused_port},{two.address}", "broker-groups", "--json")
        assert listing.returncode == 0, listing.stderr
        assert [json.loads(line)["name"] for line in listing.stdout.splitlines()] == ["local"]
        refused = delayctl(two.address, "route", "add", "*", "local", secret=None)
        assert refused.returncode == 1 and "cluster secret" in refused.stderr
        wrong = delayctl(two.address, "routes", secret="guess")
        assert wrong.returncode == 1 and "wrong cluster secret" in wrong.stderr
        empty = delayctl(two.address, "epochs", "nogroup", "--json")
        assert empty.returncode == 0 and empty.stdout == ""
    finally:
        one.kill()
        two.kill()


def test_a_meta_server_without_a_secret_says_it_is_open(tmp_path):
    meta = SharedMetaProcess("open", tmp_path, ["--data-dir", str(tmp_path / "m")], {"DELAYSERVER_CLUSTER_SECRET": ""})
    meta.start()
    try:
        assert "no cluster secret: anyone who reaches this port" in meta.log()
    finally:
        meta.kill()


def test_node_options_for_the_meta_tier(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    config = Config.from_dict({"meta": "10.0.0.1:20800, 10.0.0.2:20800", "cluster_secret": "c",
                               "meta_tls_ca": str(ca)})
    assert (config.meta, config.cluster_secret, config.meta_tls_ca) == ("10.0.0.1:20800, 10.0.0.2:20800", "c", str(ca))
    with pytest.raises(ConfigError, match="meta"):
        Config.from_dict({"meta": "10.0.0.1:20800,nope:port"})
    with pytest.raises(ConfigError, match="meta_tls_ca: no such file"):
        Config.from_dict({"meta_tls_ca": str(tmp_path / "missing.pem")})
    with pytest.raises(ConfigError, match="cluster_secret: expected a string"):
        Config.from_dict({"cluster_secret": 5})
