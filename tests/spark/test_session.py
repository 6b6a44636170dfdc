"""spark/session.py's bookkeeping of the code it ships, with stand-ins for a session and its context
(only `addPyFile` and `stop` are called; the real sessions are in test_reconcile.py)."""
from __future__ import annotations

from pathlib import Path

from spark import session


class _Context:
    def __init__(self) -> None:
        self.added: list[str] = []

    def addPyFile(self, path: str) -> None:
        self.added.append(path)


class _Session:
    def __init__(self) -> None:
        self.sparkContext = _Context()
        self.stopped = 0

    def stop(self) -> None:
        self.stopped += 1


def test_the_code_is_shipped_once_per_context():
    spark = _Session()
    first = session.ship(spark)
    assert session.ship(spark) == first
    assert spark.sparkContext.added == [first] and Path(first).is_file()
    session.stop(spark)


def test_a_context_with_the_id_of_a_stopped_one_gets_the_code_shipped_again():
    """A context started after another stopped may get its id (the same object stands for both
    here): it is shipped the code all the same."""
    spark = _Session()
    first = session.ship(spark)
    session.stop(spark)
    second = session.ship(spark)
    assert spark.stopped == 1
    assert spark.sparkContext.added == [first, second] and Path(second).is_file()
    session.stop(spark)
