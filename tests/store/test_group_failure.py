"""A group commit that fails as a whole (the connection or the COMMIT broke):
every caller of the group hears the error itself, not only the first one."""

from __future__ import annotations

import sqlite3
from typing import Any

import psycopg
import pytest

from ironflow.store.postgres import _Actor, _Request
from ironflow.store.sqlite import SqliteStore, _Inline, _SqliteTx


def test_sqlite_every_caller_of_a_failed_group_hears_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(SqliteStore, "_run_group", staticmethod(broken))
    conn = sqlite3.connect(":memory:", isolation_level=None)
    got: list[Any] = []
    SqliteStore._commit_group(
        conn, _SqliteTx(conn), [(lambda tx: 1, _Inline, got.append), (lambda tx: 2, _Inline, got.append)]
    )
    assert len(got) == 2
    for result in got:
        with pytest.raises(sqlite3.OperationalError, match="disk I/O error"):
            result.unwrap()


def test_postgres_every_caller_of_a_failed_group_hears_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(self: _Actor) -> Any:
        raise psycopg.OperationalError("connection refused")

    monkeypatch.setattr(_Actor, "_connect", refused)
    actor = _Actor(None, "test")  # type: ignore[arg-type]  # the store is only asked for its URL
    got: list[Any] = []
    retry = actor._run_group(
        [_Request(lambda tx: 1, _Inline, got.append), _Request(lambda tx: 2, _Inline, got.append)]  # type: ignore[arg-type]
    )
    assert retry == [] and len(got) == 2
    for result in got:
        with pytest.raises(psycopg.OperationalError, match="connection refused"):
            result.unwrap()
