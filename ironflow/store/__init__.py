"""Engine state: one interface (:mod:`ironflow.store.base`), its records
(:mod:`ironflow.store.records`), two backends."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ironflow.config import Timings
from ironflow.protocol import AuditRecord as AuditRecord
from ironflow.protocol import FunctionRecord as FunctionRecord
from ironflow.protocol import LeaseRecord as LeaseRecord
from ironflow.protocol import QueueRecord as QueueRecord
from ironflow.protocol import RunDetail as RunDetail
from ironflow.protocol import RunRecord as RunRecord
from ironflow.protocol import SessionRecord as SessionRecord
from ironflow.protocol import StepRecord as StepRecord
from ironflow.store.base import *  # noqa: F403
from ironflow.store.base import Store
from ironflow.store.records import *  # noqa: F403


def open_store(
    url: str,
    *,
    now: Callable[[], float] | None = None,
    sqlite_auto_vacuum: bool = False,
    timings: Timings | None = None,
) -> Store:
    """Build (not yet open) the backend ``url`` names.

    ``postgres://`` / ``postgresql://`` → :class:`~ironflow.store.postgres.PostgresStore`;
    anything else is a SQLite path or ``sqlite:///path`` (parent directories are
    created). ``now`` drives the SQLite clock in tests; PostgreSQL uses its own.
    ``sqlite_auto_vacuum`` makes a NEW SQLite file shrink when history is purged
    (see :class:`~ironflow.store.sqlite.SqliteStore`). ``timings``: the
    node's, whose ``pg_*`` bound every PostgreSQL wait (defaults if None).
    Call ``await store.open()`` before use and ``await store.close()`` after.
    """
    if url.startswith(("postgres://", "postgresql://")):
        from ironflow.store.postgres import PostgresStore

        return PostgresStore(url, timings=timings)
    from ironflow.store.sqlite import SqliteStore, sqlite_path

    path = sqlite_path(url)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return SqliteStore(path, now=now, auto_vacuum=sqlite_auto_vacuum)
