"""Real brokers for the transport tests, one of each per test session (starting RabbitMQ takes
seconds): `rabbitmq` (bench.brokers.RabbitMqProcess) and `nats` (bench.brokers.NatsProcess, with
JetStream). A test that stops or kills one starts it again before it ends (`restarted`)."""
from __future__ import annotations

import contextlib

import pytest

from bench.brokers import NatsProcess, RabbitMqProcess, nats_executable, rabbitmq_installed


@pytest.fixture(scope="session")
def rabbitmq(tmp_path_factory):
    if not rabbitmq_installed():
        pytest.skip("rabbitmq-server is not installed (ops/test installs it)")
    broker = RabbitMqProcess(tmp_path_factory.mktemp("rabbitmq"))
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
