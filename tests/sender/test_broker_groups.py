"""rabbitmq and nats broker groups in the node's configuration and the meta server's commands:
options checked up front, with a message naming the field."""
from __future__ import annotations

import sqlite3

import pytest

from delayserver.config import Config, ConfigError
from delayserver.message import ResultCode
from delayserver.meta.store import SqliteMetaStore
from delayserver.sender.groups import BrokerGroupSpec, TransportKind
from tests.meta.test_server import client, expect_error, meta_server


def write(tmp_path, text: str):
    path = tmp_path / "server.toml"
    path.write_text(text)
    return path


def test_config_accepts_rabbitmq_and_nats_groups(tmp_path):
    config = Config.load(write(tmp_path, '''
[[broker_group]]
name = "rabbit"
transport = "rabbitmq"
address = "amqp://delay:secret@127.0.0.1:5672/"
weight = 2
options = { exchange = "delays", routing_key = "due.{subject}", unroutable = "retry" }

[[broker_group]]
name = "jetstream"
transport = "nats"
address = "nats://127.0.0.1:4222"
options = { subject_template = "due.{subject}", timeout_ms = 2000 }
'''))
    rabbit, jetstream = config.broker_groups
    assert (rabbit.transport, rabbit.weight, rabbit.options["unroutable"]) == ("rabbitmq", 2, "retry")
    assert (jetstream.transport, jetstream.options["timeout_ms"]) == ("nats", 2000)


@pytest.mark.parametrize("transport, address, options, message", [
    ("rabbitmq", "amqp://127.0.0.1:5672/", 'unroutable = "drop"', r"broker_group\[0\]: rabbitmq transport: option 'unroutable'"),
    ("rabbitmq", "kafka://127.0.0.1:9092", "", r"broker_group\[0\]: rabbitmq transport: address"),
    ("rabbitmq", "127.0.0.1:5672", "exchnage = 'x'", r"unknown option 'exchnage'"),
    ("nats", "127.0.0.1:4222", "subject_template = '{topic}'", r"broker_group\[0\]: nats transport: option 'subject_template'"),
    ("nats", "127.0.0.1:4222", "tls_ca_file = '/nonexistent/ca.pem'", r"option 'tls_ca_file'"),
])
def test_config_names_the_bad_field(tmp_path, transport, address, options, message):
    path = write(tmp_path, f'[[broker_group]]\nname = "g"\ntransport = "{transport}"\naddress = "{address}"\n'
                           f"options = {{ {options} }}\n")
    with pytest.raises(ConfigError, match=message):
        Config.load(path)


def test_a_store_made_before_the_new_transports_takes_them_and_keeps_its_rows(tmp_path):
    path = tmp_path / "meta.sqlite3"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE broker_groups (name TEXT PRIMARY KEY, "
               "transport TEXT NOT NULL CHECK (transport IN ('spool', 'redis', 'http')), address TEXT NOT NULL, "
               "weight INTEGER NOT NULL, read_only INTEGER NOT NULL, options TEXT NOT NULL)")
    db.execute("INSERT INTO broker_groups VALUES ('r', 'redis', '127.0.0.1:6379', 2, 0, '{\"maxlen\": 5}')")
    db.commit()
    db.close()

    store = SqliteMetaStore.open(path)
    try:
        store.put_broker_group(BrokerGroupSpec("jetstream", TransportKind.NATS, "127.0.0.1:4222"))
        assert store.list_broker_groups() == [
            BrokerGroupSpec("jetstream", TransportKind.NATS, "127.0.0.1:4222"),
            BrokerGroupSpec("r", TransportKind.REDIS, "127.0.0.1:6379", 2, False, {"maxlen": 5}),
        ]
    finally:
        store.close()


@pytest.fixture
def store(tmp_path):
    store = SqliteMetaStore.open(tmp_path / "meta.sqlite3")
    yield store
    store.close()


async def test_meta_server_checks_rabbitmq_and_nats_options(store, autojump_clock):
    async with meta_server(store) as address, client(address) as c:
        reply = await c.request("add_broker_group", name="rabbit", transport="rabbitmq",
                                address="amqp://127.0.0.1:5672/", options={"exchange": "delays"})
        assert reply["broker_group"]["transport"] == "rabbitmq"
        await expect_error(
            c.request("add_broker_group", name="js", transport="nats", address="127.0.0.1:4222",
                      options={"subject_template": "{topic}"}),
            ResultCode.BAD_REQUEST, "nats transport: option 'subject_template'")
        await expect_error(
            c.request("update_broker_group", name="rabbit", options={"unroutable": "drop"}),
            ResultCode.BAD_REQUEST, "option 'unroutable' must be 'park' or 'retry'")
        [group] = (await c.request("list_broker_groups"))["broker_groups"]
        assert group["options"] == {"exchange": "delays"}
