"""History retention: purge finished runs (with their steps and audit
rows), audit rows of no run, and events past the idempotency window, in
short batches.
"""

from __future__ import annotations

from ironflow.protocol import (
    TERMINAL_RUN_STATUSES,
)
from ironflow.store.base import StoreError
from ironflow.store.core import (
    JANITOR_LOCK,
    PURGE_AUDIT,
    SqlStoreBase,
    Tx,
    placeholders,
)
from ironflow.store.records import PurgeCounts
from ironflow.store.transitions import TERMINAL_SQL, write_audit


class RetentionOps(SqlStoreBase):
    """History retention: finished runs, run-less audit rows and old events, in short batches."""

    async def purge_history(
        self,
        *,
        older_than_s: float,
        idempotency_window_s: float,
        statuses: frozenset[str] = TERMINAL_RUN_STATUSES,
        batch: int,
        wait_for_lock: bool = False,
    ) -> PurgeCounts:
        wanted = sorted(statuses & TERMINAL_RUN_STATUSES)
        if not wanted:
            raise StoreError(f"only finished runs can be purged, not {sorted(statuses)}")

        def work(tx: Tx) -> PurgeCounts:
            if wait_for_lock:
                tx.advisory_lock(JANITOR_LOCK)
            elif not tx.try_advisory_lock(JANITOR_LOCK):
                return PurgeCounts(locked_out=True)
            run_ids = [
                row[0]
                for row in tx.fetchall(
                    # The first status test is the guard (never a run that has
                    # not ended) and matches the runs_ended index; `<` keeps a
                    # run exactly at the boundary. A child goes only once its
                    # parent is gone, so no kept run loses a child.
                    "SELECT r.id FROM runs r"
                    f" WHERE r.status IN {TERMINAL_SQL} AND r.status IN ({placeholders(len(wanted))})"
                    " AND r.ended_at < ironflow_now() - ?"
                    " AND NOT EXISTS (SELECT 1 FROM runs p WHERE p.id = r.parent_run_id)"
                    " AND NOT EXISTS (SELECT 1 FROM concurrency_leases l WHERE l.run_id = r.id)"
                    " AND NOT EXISTS (SELECT 1 FROM dispatch_queue q WHERE q.run_id = r.id)"
                    f" ORDER BY r.ended_at LIMIT ? {tx.lock('r')}",
                    (*wanted, float(older_than_s), batch),
                )
            ]
            steps = audit = runs = 0
            if run_ids:
                marks = placeholders(len(run_ids))
                steps = tx.execute(f"DELETE FROM steps WHERE run_id IN ({marks})", run_ids)
                audit = tx.execute(f"DELETE FROM audit_log WHERE run_id IN ({marks})", run_ids)
                # Cancel-on subscriptions no event came to clean up (cancel_on.py).
                tx.execute(f"DELETE FROM cancel_subscriptions WHERE run_id IN ({marks})", run_ids)
                tx.execute(f"DELETE FROM batch_events WHERE run_id IN ({marks})", run_ids)  # store/flow.py
                runs = tx.execute(f"DELETE FROM runs WHERE id IN ({marks})", run_ids)
            # After the runs: an event only they referenced can go in this batch.
            events = tx.execute(
                "DELETE FROM events WHERE id IN (SELECT e.id FROM events e"
                " WHERE e.received_at < ironflow_now() - ?"
                " AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.event_id = e.id)"
                # An event of a batch run that is kept (store/flow.py).
                " AND NOT EXISTS (SELECT 1 FROM batch_events b WHERE b.event_id = e.id)"
                f" ORDER BY e.received_at LIMIT ? {tx.lock()})",
                (float(idempotency_window_s), batch),
            )
            loose = 0
            if len(wanted) == len(TERMINAL_RUN_STATUSES):
                # Audit rows of no run (node drains, janitor passes…) go by age
                # alone, and only in a purge of every finished status: one
                # limited to some statuses is about those runs. `run_id IS
                # NULL` is the guard and the audit_run_page index's prefix.
                loose = tx.execute(
                    "DELETE FROM audit_log WHERE id IN (SELECT a.id FROM audit_log a"
                    " WHERE a.run_id IS NULL AND a.at < ironflow_now() - ?"
                    f" ORDER BY a.at LIMIT ? {tx.lock()})",
                    (float(older_than_s), batch),
                )
            return PurgeCounts(
                runs=runs, steps=steps, audit=audit + loose, events=events,
                more=batch in (len(run_ids), events, loose),
            )

        return await self._transact(work)

    async def oldest_finished_run_age(self) -> float | None:
        def work(tx: Tx) -> float | None:
            row = tx.fetchone(
                f"SELECT ironflow_now() - min(ended_at) FROM runs WHERE status IN {TERMINAL_SQL}"
            )
            return None if row is None or row[0] is None else float(row[0])

        return await self._transact(work)

    async def record_purge(self, counts: PurgeCounts, *, by: str, older_than_s: float) -> None:
        data = {
            "runs": counts.runs,
            "steps": counts.steps,
            "audit": counts.audit,
            "events": counts.events,
            "older_than_s": older_than_s,
            "by": by,
        }
        await self._transact(lambda tx: write_audit(tx, PURGE_AUDIT, None, None, data))
