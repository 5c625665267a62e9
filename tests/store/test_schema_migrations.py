"""Numbered schema migrations (``ironflow/store/schema.py``): a new database
gets every version, a restart applies none, and a database made before the
versions table existed (``schema_before_migrations.py``) is brought forward
with its rows and ends with the schema a new database has."""

from __future__ import annotations

import sqlite3
from typing import Any

import msgspec
import psycopg
import pytest
import trio

from ironflow.protocol import FunctionDef, Trigger
from ironflow.store import open_store
from ironflow.store.schema import MIGRATIONS, latest_version, migrate
from ironflow.testing import ThrowawayPostgres
from tests.store import schema_before_migrations as before

pytestmark = pytest.mark.parametrize("backend", ["sqlite", "postgres"])


def _url(backend: str, request: pytest.FixtureRequest, tmp_path: Any, name: str = "ironflow.db") -> str:
    if backend == "postgres":
        return str(request.getfixturevalue("pg_url"))
    return f"sqlite:///{tmp_path / name}"


def _query(url: str, sql: str) -> list[tuple[Any, ...]]:
    if url.startswith("sqlite:///"):
        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            return [tuple(r) for r in conn.execute(sql)]
    with psycopg.connect(url) as conn:
        return [tuple(r) for r in conn.execute(sql)]


def _shape(url: str) -> tuple[dict[str, list[tuple[Any, ...]]], set[tuple[Any, ...]]]:
    """Every table's columns (in order, with their types) and every index."""
    if url.startswith("sqlite:///"):
        tables = [t for (t,) in _query(url, "SELECT name FROM sqlite_master WHERE type = 'table'")]
        columns = {t: [r[1:3] for r in _query(url, f"PRAGMA table_info({t})")] for t in tables}
        indexes = set(_query(url, "SELECT name, sql FROM sqlite_master WHERE type = 'index'"))
        return columns, indexes
    rows = _query(
        url,
        "SELECT table_name, column_name, data_type, column_default FROM information_schema.columns"
        " WHERE table_schema = 'public' ORDER BY table_name, ordinal_position",
    )
    by_table: dict[str, list[tuple[Any, ...]]] = {}
    for table, *column in rows:
        by_table.setdefault(table, []).append(tuple(column))
    return by_table, set(_query(url, "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'"))


def _open_and_close(url: str) -> None:
    async def go() -> None:
        store = open_store(url)
        await store.open()
        await store.close()

    trio.run(go)


def _build_before(url: str, *, columns: bool) -> None:
    if url.startswith("sqlite:///"):
        before.build_sqlite(url.removeprefix("sqlite:///"), columns=columns)
    else:
        before.build_postgres(url, columns=columns)


def test_a_new_database_gets_every_migration_and_a_restart_applies_none(backend, request, tmp_path):
    url = _url(backend, request, tmp_path)
    _open_and_close(url)
    assert _query(url, "SELECT version, name FROM schema_migrations ORDER BY version") == [
        (m.version, m.name) for m in MIGRATIONS
    ]
    shape = _shape(url)
    _open_and_close(url)
    assert _shape(url) == shape
    assert len(_query(url, "SELECT version FROM schema_migrations")) == latest_version()
    if backend == "sqlite":
        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            assert migrate(conn.cursor(), "sqlite") == []


@pytest.mark.parametrize("columns", [True, False], ids=["last-release", "first-release"])
def test_a_database_made_before_numbered_migrations_is_brought_forward_with_its_rows(
    backend, columns, request, tmp_path
):
    """``columns`` false: a database of the first release, without the added
    columns, whose waiting step has no wait key, whose function has no trigger
    row, and with the list indexes the page indexes replaced."""
    url = _url(backend, request, tmp_path)
    _build_before(url, columns=columns)
    definition = msgspec.json.encode(FunctionDef(id="f", triggers=[Trigger("order.created")])).decode()
    statements = [
        "INSERT INTO functions (id, definition, audit, version, updated_at)"
        f" VALUES ('f', '{definition}', 0, 1, 1)",
        "DELETE FROM function_triggers",
        "INSERT INTO runs (id, function_id, status, max_attempts, created_at, updated_at)"
        " VALUES ('r1', 'f', 'waiting', 3, 1, 1)",
        "INSERT INTO steps (run_id, step_id, name, kind, status, execution_seq, created_at,"
        " wait_event, wait_match, wait_match_value)"
        " VALUES ('r1', 'w', 'w', 'wait', 'waiting', 1, 1, 'order.paid', 'data.id', '\"a\"')",
    ]
    if not columns:  # and the list indexes from before the page indexes replaced them
        statements += [
            "CREATE INDEX events_received ON events (received_at)",
            "CREATE INDEX runs_status ON runs (status, created_at)",
            "CREATE INDEX runs_function ON runs (function_id, created_at)",
            "CREATE INDEX audit_run ON audit_log (run_id, at)",
            "CREATE INDEX audit_type ON audit_log (type, at)",
        ]
        if backend == "sqlite":
            statements.append("CREATE INDEX events_name_received ON events (name, received_at)")
    if url.startswith("sqlite:///"):
        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            for s in statements:
                conn.execute(s)
    else:
        with psycopg.connect(url) as conn:
            for s in statements:
                conn.execute(s)

    _open_and_close(url)

    assert [v for (v,) in _query(url, "SELECT version FROM schema_migrations ORDER BY version")] == [
        m.version for m in MIGRATIONS
    ]
    if backend == "sqlite":
        fresh = _url("sqlite", request, tmp_path, "fresh.db")
    else:
        fresh = ThrowawayPostgres(str(request.getfixturevalue("pg_server"))).new_database()
    _open_and_close(fresh)
    assert _shape(url) == _shape(fresh)
    assert _query(url, "SELECT pattern, function_id FROM function_triggers") == [("order.created", "f")]
    assert _query(url, "SELECT wait_event, wait_match FROM wait_paths") == [("order.paid", "data.id")]
    assert _query(url, "SELECT wait_key FROM steps") == [("order.paid\x1fdata.id\x1f\"a\"",)]
    assert _query(url, "SELECT id, status FROM runs") == [("r1", "waiting")]

    async def ingest() -> list[str]:
        store = open_store(url)
        await store.open()
        try:
            result = await store.ingest_event("order.created", {}, None, idempotency_window_s=60)
            return [(await store.get_run_record(r)).function_id for r in result.run_ids]
        finally:
            await store.close()

    assert trio.run(ingest) == ["f"]


def test_nodes_starting_at_once_apply_each_migration_once(backend, request, tmp_path):
    url = _url(backend, request, tmp_path)

    async def start_together() -> None:
        stores = [open_store(url) for _ in range(3)]
        async with trio.open_nursery() as nursery:
            for s in stores:
                nursery.start_soon(s.open)
        for s in stores:
            await s.close()

    trio.run(start_together)
    assert _query(url, "SELECT version FROM schema_migrations ORDER BY version") == [
        (m.version,) for m in MIGRATIONS
    ]
