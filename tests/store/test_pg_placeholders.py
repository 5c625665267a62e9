"""The ``?`` → ``$n`` / ``%s`` rewrite of the PostgreSQL backend touches only placeholders."""

from __future__ import annotations

from ironflow.store.core import Tx
from ironflow.store.pg_tx import numbered as _numbered
from ironflow.store.pg_tx import pg_sql as _pg_sql
from ironflow.store.postgres import PostgresStore


def test_placeholders_are_numbered_in_order() -> None:
    assert _numbered("SELECT a FROM t WHERE b = ? AND c IN (?, ?) LIMIT ?") == (
        b"SELECT a FROM t WHERE b = $1 AND c IN ($2, $3) LIMIT $4"
    )


def test_a_question_mark_in_a_literal_an_identifier_a_comment_or_a_dollar_body_is_left_alone() -> None:
    sql = (
        "SELECT 'what?', 'it''s ?', \"odd?col\", $$ body? $$, $f$ ? $f$ -- why?\n"
        "/* and? */ FROM t WHERE x = ?"
    )
    assert _numbered(sql).decode() == sql[: sql.rindex("?")] + "$1"


def test_the_jsonb_question_mark_operators_are_left_alone() -> None:
    assert _numbered("SELECT data ? 'k', data ?| ?, data ?& ? FROM t WHERE (data) ? ?") == (
        b"SELECT data ? 'k', data ?| $1, data ?& $2 FROM t WHERE (data) ? $3"
    )
    assert _pg_sql("SELECT '%' || ?, d ? 'k' FROM t") == "SELECT '%%' || %s, d ? 'k' FROM t"


async def test_a_statement_with_the_jsonb_operator_and_a_literal_question_mark_runs_on_postgres(
    pg_url: str,
) -> None:
    store = PostgresStore(pg_url)
    await store.open()
    try:
        def work(tx: Tx) -> tuple[object, ...] | None:
            return tx.fetchone("SELECT '{\"a\": 1}'::jsonb ? 'a', ?::text, 'what?'", ("x",))

        assert await store._transact(work) == (True, "x", "what?")
    finally:
        await store.close()
