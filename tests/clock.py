"""Stores whose database clock a test can move forward: ``advance_clock``.

A test switch, so it lives here and not in the engine (as ``tests/sim/bugs.py``
does for injected bugs): the production stores read the database clock as it
is. :func:`open_test_store` is :func:`ironflow.store.open_store` building
these subclasses instead.

- SQLite: the clock behind ``ironflow_now()`` is a Python function of the
  store, so the skew is an attribute added to it.
- PostgreSQL: ``ironflow_now()`` is an SQL function every node's statements
  call; advancing re-creates it with the skew as a literal (a body without a
  subquery is inlined into every statement: see ``pg_now_function`` in
  ``ironflow/store/schema.py``), so every store on the same database — every
  node of a multi-node test — sees the same advanced clock. The skew is kept
  in a table of this module's own, so two stores advancing add up.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ironflow.store import Store
from ironflow.store.core import Tx
from ironflow.store.postgres import PostgresStore
from ironflow.store.schema import pg_now_function
from ironflow.store.sqlite import SqliteStore, sqlite_path

_SKEW_TABLE = (
    "CREATE TABLE IF NOT EXISTS test_clock_skew ("
    " id INTEGER PRIMARY KEY CHECK (id = 1), skew DOUBLE PRECISION NOT NULL DEFAULT 0)"
)


class SkewedSqliteStore(SqliteStore):
    """A SQLite store whose database clock :meth:`advance_clock` moves forward."""

    _skew = 0.0

    def _db_clock(self) -> float:
        return super()._db_clock() + self._skew

    async def advance_clock(self, seconds: float) -> None:
        """Move this store's database clock forward by ``seconds``."""
        self._skew += seconds


class SkewedPostgresStore(PostgresStore):
    """A PostgreSQL store whose database clock :meth:`advance_clock` moves forward
    (for every store on the same database)."""

    async def advance_clock(self, seconds: float) -> None:
        """Move the database's clock forward by ``seconds``."""

        def work(tx: Tx) -> None:
            tx.execute(_SKEW_TABLE)
            row = tx.fetchone(
                "INSERT INTO test_clock_skew (id, skew) VALUES (1, ?)"
                " ON CONFLICT (id) DO UPDATE SET skew = test_clock_skew.skew + excluded.skew"
                " RETURNING skew",
                (float(seconds),),
            )
            assert row is not None
            tx.execute(pg_now_function(float(row[0])))

        await self._transact(work)


SkewedStore = SkewedSqliteStore | SkewedPostgresStore


def open_test_store(url: str, *, now: Callable[[], float] | None = None) -> SkewedStore:
    """:func:`ironflow.store.open_store`, with a clock a test can advance."""
    if url.startswith(("postgres://", "postgresql://")):
        return SkewedPostgresStore(url)
    path = sqlite_path(url)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return SkewedSqliteStore(path, now=now)


def skewed(store: Store) -> SkewedStore:
    """``store``, checked to be one whose clock a test can advance."""
    assert isinstance(store, SkewedSqliteStore | SkewedPostgresStore), type(store)
    return store
