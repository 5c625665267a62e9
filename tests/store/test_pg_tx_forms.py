"""The PostgreSQL store's two statement forms (ironflow/store/pg_tx.py), the
libpq fast path and psycopg's own prepared statements, give the same results:
the same rows read, the same row counts, the same rows written, the same
errors. Each form runs the same script on its own table of one database."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from ironflow.store.pg_tx import PgTx, fast_path_refusal
from ironflow.store.postgres import PostgresStore


class PsycopgTx(PgTx):
    """Every statement through psycopg's cursor (the fallback form)."""

    libpq_fast_path = False


class FastTx(PgTx):
    libpq_fast_path = True


def _script(tx: PgTx, table: str) -> list[Any]:
    """Statements of every shape the store sends, on ``table``; what each returned."""
    out: list[Any] = []
    tx.raw(f"CREATE TABLE {table} (id text PRIMARY KEY, n bigint, x double precision,"
           " flag boolean, data jsonb, note text)")
    out.append(tx.execute(
        f"INSERT INTO {table} (id, n, x, flag, data, note) VALUES (?, ?, ?, ?, ?::jsonb, ?), (?, ?, ?, ?, ?::jsonb, ?)",
        ("a", 1, 0.5, True, '{"k": 1}', None, "b", -(2**63), 1e300, False, '{"j": [1, 2]}', "what? 100%"),
    ))
    tx.executemany(f"INSERT INTO {table} (id, n, note) VALUES (?, ?, ?)", [("c", 3, "x"), ("d", 4, None)])
    # An int past int8 and a list: types only psycopg's adapters know (the cursor either way).
    out.append(tx.fetchone("SELECT ?::numeric + 1, cardinality(?::text[])", (2**70, ["p", "q"])))
    out.append(tx.fetchall(f"SELECT id, n, x, flag, data, note FROM {table} ORDER BY id"))
    # The jsonb ? operator beside a placeholder; a literal '?'; NULL and bool parameters.
    out.append(tx.fetchall(
        f"SELECT id, 'why?' FROM {table} WHERE data ? ? AND (note IS NULL OR note = ?) AND flag = ?",
        ("k", None, True),
    ))
    # Value-planned statements (a range, a LIMIT) and a prepared one, run twice each.
    for _ in range(2):
        out.append(tx.fetchall(f"SELECT id FROM {table} WHERE n >= ? ORDER BY id LIMIT ?", (2, 1)))
        out.append(tx.fetchone(f"SELECT count(*), sum(n) FROM {table} WHERE id = ANY(?)", (["c", "d"],)))
        out.append(tx.fetchone(f"SELECT note FROM {table} WHERE id = ?", ("b",)))
    out.append(tx.execute(f"UPDATE {table} SET n = n + ?, x = ? WHERE id IN (?, ?)", (10, float("inf"), "c", "d")))
    out.append(tx.execute(f"DELETE FROM {table} WHERE id = ?", ("nope",)))
    out.append(tx.fetchone(f"SELECT id FROM {table} WHERE id = ?", ("nope",)))
    out.append(tx.try_advisory_lock(f"{table}-lock"))
    tx.advisory_lock(f"{table}-other")
    tx.raw("SAVEPOINT dup")
    with pytest.raises(psycopg.errors.UniqueViolation) as refused:
        tx.execute(f"INSERT INTO {table} (id) VALUES (?)", ("a",))
    out.append((type(refused.value).__name__, refused.value.diag.constraint_name.replace(table, "T")))
    tx.raw("ROLLBACK TO SAVEPOINT dup")
    out.append(tx.fetchall(f"SELECT id, n, x FROM {table} ORDER BY id"))
    return out


@pytest.fixture
def conn(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_url, autocommit=True) as c:
        yield c


def test_the_fast_path_and_psycopgs_prepared_statements_read_and_write_the_same(
    conn: psycopg.Connection[Any],
) -> None:
    results = {}
    for name, form in (("fast", FastTx), ("psycopg", PsycopgTx)):
        tx = form(conn, {})
        tx.raw("BEGIN")
        results[name] = _script(tx, f"forms_{name}")
        tx.raw("COMMIT")
    assert results["fast"] == results["psycopg"]
    # What the script wrote, read back outside either form.
    rows = {
        name: conn.execute(f"SELECT id, n, x, flag, data, note FROM forms_{name} ORDER BY id").fetchall()
        for name in results
    }
    assert rows["fast"] == rows["psycopg"] and len(rows["fast"]) == 4


def test_the_fast_path_is_the_one_taken_with_the_installed_psycopg(
    conn: psycopg.Connection[Any],
) -> None:
    assert fast_path_refusal() is None and PgTx.libpq_fast_path
    prepared: dict[Any, bytes] = {}
    tx = PgTx(conn, prepared)
    tx.raw("BEGIN")
    tx.fetchone("SELECT ?::text", ("x",))
    tx.raw("ROLLBACK")
    assert prepared, "the fast path prepares its statements itself"
    fallback: dict[Any, bytes] = {}
    tx = PsycopgTx(conn, fallback)
    tx.raw("BEGIN")
    tx.fetchone("SELECT ?::text", ("x",))
    tx.raw("ROLLBACK")
    assert fallback == {}


def test_another_psycopg_release_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(psycopg, "__version__", "3.9.0")
    reason = fast_path_refusal()
    assert reason is not None and "psycopg 3.9.0" in reason


async def test_a_store_on_psycopgs_prepared_statements_runs_a_call(pg_url: str) -> None:
    class FallbackStore(PostgresStore):
        tx_class = PsycopgTx

    store = FallbackStore(pg_url, connections=1)
    await store.open()
    try:
        assert await store.db_now() > 0
        assert await store.list_functions() == []
    finally:
        await store.close()
