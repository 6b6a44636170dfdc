"""Configuration: defaults, units, TOML, and refusal naming the option."""
from __future__ import annotations

import subprocess
import sys

import pytest

from delayserver.config import Config, ConfigError, parse_delay_levels, parse_duration, parse_size


def test_defaults_are_the_documented_ones():
    c = Config()
    assert c.listen == ("127.0.0.1", 20801) and c.flush == "sync"
    assert c.max_message_bytes == 4 << 20 and c.max_delay_ms == 2 * 365 * 86_400_000
    assert c.segment_scale_ms == 3_600_000 and c.effective_load_ahead_ms == 1_800_000
    assert c.delay_levels[:4] == (1000, 5000, 10_000, 30_000) and len(c.delay_levels) == 18
    assert [g.transport for g in c.broker_groups] == ["spool"]


@pytest.mark.parametrize("text,ms", [("250ms", 250), ("30s", 30_000), ("5m", 300_000), ("2h", 7_200_000),
                                     ("1d", 86_400_000), ("2y", 2 * 365 * 86_400_000), (15, 15), ("0", 0), (0, 0)])
def test_durations(text, ms):
    assert parse_duration(text) == ms


def test_a_dedupe_window_of_zero_turns_dedupe_off_as_a_string_too():
    assert Config.from_dict({"dedupe_window": "0"}).dedupe_window_ms == 0
    with pytest.raises(ConfigError, match="expected a duration"):
        parse_duration("5")  # any other number needs its unit


@pytest.mark.parametrize("text,size", [("4KiB", 4096), ("64MiB", 64 << 20), (512, 512), ("1GB", 10**9)])
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("raw,option", [
    ({"flush": "sometimes"}, "flush"),
    ({"max_delay": "forever"}, "max_delay"),
    ({"segment_scale": "90m"}, "segment_scale"),
    ({"segment_scale": "90s"}, "segment_scale"),
    ({"wheel_slots": 1000}, "wheel_slots"),
    ({"listen": "nowhere:port"}, "listen"),
    ({"max_message_bytes": "-1"}, "max_message_bytes"),
    ({"delay_levels": "1s soon"}, "delay_levels"),
    ({"colour": "blue"}, "colour"),
    ({"read_ahead": "0"}, "read_ahead"),
    ({"read_ahead": "soon"}, "read_ahead"),
    ({"read_ahead_ms": -5}, "read_ahead_ms"),
    ({"read_ahead_bytes": "-1"}, "read_ahead_bytes"),
    ({"read_ahead_bytes": "lots"}, "read_ahead_bytes"),
    ({"broker_group": [{"name": "a", "transport": "kafka"}]}, "broker_group[0].transport"),
    ({"broker_group": [{"name": "a"}, {"name": "a"}]}, "broker_group[1].name"),
    ({"broker_group": [{"name": "r", "transport": "redis"}]}, "broker_group[0].address"),
    ({"broker_group": [{"name": "a", "weight": 0}]}, "broker_group[0].weight"),
])
def test_invalid_options_are_refused_naming_the_option(raw, option):
    with pytest.raises(ConfigError) as err:
        Config.from_dict(raw)
    assert str(err.value).startswith(option)


def test_read_ahead_defaults_and_units():
    c = Config()
    assert (c.read_ahead_ms, c.read_ahead_bytes) == (1000, 64 << 20)
    c = Config.from_dict({"read_ahead": "5s", "read_ahead_bytes": "16MiB"})
    assert (c.read_ahead_ms, c.read_ahead_bytes) == (5000, 16 << 20)
    c = Config.from_dict({"read_ahead_ms": 250, "read_ahead_bytes": 0})
    assert (c.read_ahead_ms, c.read_ahead_bytes) == (250, 0)


def test_toml_file_and_command_line_overrides(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('data_dir = "/srv/delay"\nflush = "async"\nsegment_scale = "10m"\n'
                    'delay_levels = "1s 2s"\n[[broker_group]]\nname = "r"\ntransport = "redis"\n'
                    'address = "127.0.0.1:6379"\nweight = 2\nsubjects = ["a.b"]\n')
    c = Config.load(path, listen="0.0.0.0:9000", flush=None)
    assert str(c.data_dir) == "/srv/delay" and c.flush == "async" and c.listen == ("0.0.0.0", 9000)
    assert c.segment_scale_ms == 600_000 and c.delay_levels == (1000, 2000)
    (g,) = c.broker_groups
    assert (g.name, g.transport, g.weight, g.subjects) == ("r", "redis", 2, ("a.b",))


def test_bad_toml_is_refused():
    with pytest.raises(ConfigError, match="--config"):
        Config.load("/nonexistent/node.toml")


def test_delay_levels_must_be_durations():
    assert parse_delay_levels("1s 1m 1h") == (1000, 60_000, 3_600_000)


def test_the_server_refuses_to_start_on_invalid_configuration(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('flush = "never"\n')
    proc = subprocess.run([sys.executable, "-m", "delayserver", "serve", "--config", str(path),
                           "--data-dir", str(tmp_path / "d")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "flush" in proc.stderr and "invalid configuration" in proc.stderr


def test_replication_options():
    c = Config.from_dict({"replication": "sync", "sync_timeout_ms": "2s", "min_insync_replicas": 2,
                          "max_slave_lag": "64MiB"})
    assert (c.replication, c.sync_timeout_ms, c.min_insync_replicas, c.max_slave_lag) == ("sync", 2000, 2, 64 << 20)
    assert Config().replication == "async"
    for raw, match in [({"replication": "semi"}, "replication: expected 'async' or 'sync'"),
                       ({"sync_timeout_ms": 0}, "sync_timeout_ms: must be more than 0"),
                       ({"min_insync_replicas": 0}, "min_insync_replicas: expected a positive integer"),
                       ({"max_slave_lag": "lots"}, "max_slave_lag")]:
        with pytest.raises(ConfigError, match=match):
            Config.from_dict(raw)
