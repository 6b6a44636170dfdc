"""Fixtures of the meta tests: a real PostgreSQL server (one per test session, a database per
test), and `any_store`, each test once over SQLite and once over PostgreSQL."""
from __future__ import annotations

import itertools

import pytest

from delayserver.meta.store import SqliteMetaStore
from tests.meta.postgres import PostgresServer, bindir

_databases = itertools.count(1)


@pytest.fixture(scope="session")
def postgres_server():
    if bindir() is None:
        pytest.skip("PostgreSQL is not installed (ops/test installs Debian's postgresql)")
    server = PostgresServer.create()
    server.start()
    try:
        yield server
    finally:
        server.remove()


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """The URL of a new, empty database on the shared server."""
    return postgres_server.create_database(f"meta_{next(_databases)}")


@pytest.fixture
def own_postgres():
    """A PostgreSQL server of this test alone (to stop, kill and restart)."""
    if bindir() is None:
        pytest.skip("PostgreSQL is not installed (ops/test installs Debian's postgresql)")
    server = PostgresServer.create()
    server.start()
    try:
        yield server
    finally:
        server.remove()


@pytest.fixture(params=["sqlite", "postgresql"])
def open_store(request, tmp_path):
    """A function opening a store of the parametrized kind: several calls share one database
    (PostgreSQL) or reopen one file (SQLite, after the previous store is closed)."""
    opened = []
    if request.param == "sqlite":
        def opener():
            store = SqliteMetaStore.open(tmp_path / "meta.sqlite3")
            opened.append(store)
            return store
    else:
        from delayserver.meta.pgstore import PostgresMetaStore

        url = request.getfixturevalue("postgres_url")

        def opener():
            store = PostgresMetaStore.open(url)
            opened.append(store)
            return store
    opener.kind = request.param
    yield opener
    for store in opened:
        store.close()


@pytest.fixture
def any_store(open_store):
    return open_store()
