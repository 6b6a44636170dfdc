"""Real brokers for the transport tests, one of each per test run (starting RabbitMQ takes
seconds): `rabbitmq` (bench.brokers.RabbitMqProcess) and `nats` (bench.brokers.NatsProcess, with
JetStream). A test that stops or kills one starts it again before it ends (`restarted`)."""
from __future__ import annotations

import contextlib

import pytest
import trustme

from bench.brokers import NatsProcess, RabbitMqProcess, nats_executable, rabbitmq_installed


@pytest.fixture(scope="session")
def rabbitmq(tmp_path_factory):
    if not rabbitmq_installed():
        pytest.skip("rabbitmq-server is not installed (ops/test installs it)")
    directory = tmp_path_factory.mktemp("rabbitmq")
    # An AMQPS listener too, with a certificate for 127.0.0.1 from a private CA (ca.pem beside it).
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca.cert_pem.write_to_path(directory / "ca.pem")
    cert.cert_chain_pems[0].write_to_path(directory / "server.pem")
    cert.private_key_pem.write_to_path(directory / "server.key")
    broker = RabbitMqProcess(directory, tls=(directory / "ca.pem", directory / "server.pem", directory / "server.key"))
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def nats(tmp_path_factory):
    executable = nats_executable()
    if executable is None:
        pytest.skip("nats-server is not installed (ops/test installs it)")
    broker = NatsProcess(executable, tmp_path_factory.mktemp("nats"), username="delay", password="secret")
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@contextlib.contextmanager
def restarted(broker):
    """Whatever the block does to `broker` (stop, kill), it is running again afterwards."""
    try:
        yield broker
    finally:
        if broker.process is None:
            broker.start()
