"""The two forms of each dual path (``Tx.modifying_with``, ``Tx.round_trips``;
ironflow/store/tx.py) write the same rows: one script of emits, a reservation
round, acks, step results, completions — with and without the ack folded in —
run by PostgreSQL's one-statement forms, by PostgreSQL forced onto the
per-table forms, and by SQLite (which has only those), leaves the same tables
(ids and times aside)."""

from __future__ import annotations

from typing import Any

from ironflow.store import StepResult, Store
from ironflow.store.pg_tx import PgTx
from ironflow.store.postgres import PostgresStore
from ironflow.store.sqlite import SqliteStore
from ironflow.testing import ThrowawayPostgres
from tests.store.behaviour import LEASE, fence_of, fn, reserve, worker


class PerTableTx(PgTx):
    """PostgreSQL answering as SQLite does: no data-modifying WITH, no folded reads."""

    modifying_with = False
    round_trips = False


class PerTableStore(PostgresStore):
    tx_class = PerTableTx


STEPS = [StepResult("s1", "one", "completed", 1), StepResult("s2", "two", "failed", None)]


async def _script(store: Store) -> None:
    session = await worker(store, fn("quiet"), fn("loud", "order.created", audit=True), slots=6)
    await store.ingest_events(
        [("order.created", {"n": n}, None) for n in range(4)], idempotency_window_s=3600
    )
    await store.ingest_event("order.created", {"n": 4}, "k4", idempotency_window_s=3600)
    fences = sorted((fence_of(r) for r in await reserve(store, session, limit=6)), key=lambda f: f.run_id)
    assert len(fences) == 6  # of 10 runs: 5 events × (quiet, loud)
    acked, folded = fences[:3], fences[3:]
    await store.activate_leases(acked, lease_expiry_s=LEASE)
    await store.record_steps_many([(f, STEPS[:1]) for f in acked])
    await store.complete_jobs([(f, {"done": "a"}, STEPS[1:]) for f in acked[:2]])
    await store.complete_jobs(
        [(f, {"done": "b"}, STEPS) for f in folded],
        activate=frozenset(f.run_id for f in folded), lease_expiry_s=LEASE,
    )


async def _rows(store: Store) -> dict[str, list[tuple[Any, ...]]]:
    """Every table the script writes, without ids or times: runs by their
    event's data and function."""

    def read(tx: Any) -> dict[str, list[tuple[Any, ...]]]:
        run = "(SELECT e.data || ':' || r.function_id FROM runs r JOIN events e ON e.id = r.event_id WHERE r.id = {})"
        return {
            "runs": tx.fetchall(
                "SELECT e.data, r.function_id, r.status, r.attempt, r.current_execution_seq, r.output,"
                " r.error, r.started_at IS NULL, r.ended_at IS NULL, r.concurrency_key"
                " FROM runs r JOIN events e ON e.id = r.event_id"
            ),
            "steps": tx.fetchall(
                f"SELECT {run.format('s.run_id')}, s.step_id, s.name, s.kind, s.status, s.output,"
                " s.error, s.execution_seq FROM steps s"
            ),
            "queue": tx.fetchall(
                f"SELECT {run.format('q.run_id')}, q.execution_seq, q.reason,"
                " q.reservation_owner IS NULL FROM dispatch_queue q"
            ),
            "leases": tx.fetchall(
                f"SELECT {run.format('l.run_id')}, l.execution_seq FROM concurrency_leases l"
            ),
            "credits": tx.fetchall(
                f"SELECT c.slot, {run.format('c.claimed_run_id')}, c.claimed_execution_seq, c.held"
                " FROM worker_credits c"
            ),
            "audit": tx.fetchall(
                f"SELECT a.type, {run.format('a.run_id')}, a.function_id FROM audit_log a"
            ),
            "events": tx.fetchall("SELECT name, data, idempotency_key, run_ids = '[]' FROM events"),
        }

    tables = await store._transact(read)  # type: ignore[attr-defined]
    return {name: sorted(rows, key=repr) for name, rows in tables.items()}


async def test_one_statement_and_per_table_forms_write_the_same_rows(pg_url, tmp_path):
    # Three databases: the PostgreSQL forms each on their own, and SQLite.
    server = pg_url.rsplit("/", 1)[0]
    stores: list[Store] = [
        PostgresStore(pg_url),
        PerTableStore(ThrowawayPostgres(server).new_database()),
        SqliteStore(str(tmp_path / "ironflow.db")),
    ]
    assert PerTableTx.modifying_with is False and PgTx.modifying_with is True
    seen = []
    for store in stores:
        await store.open()
        try:
            await _script(store)
            seen.append(await _rows(store))
        finally:
            await store.close()
    one_statement, per_table, sqlite = seen
    assert one_statement["runs"] and one_statement["steps"] and one_statement["audit"]
    assert one_statement == per_table
    assert per_table == sqlite
