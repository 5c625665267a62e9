"""Loop 1, the capacity scanner's SQL (crash-recovery seed): expired
reservations released, expired concurrency leases and worker sessions
recovered. A recovered segment gets a new ``execution_seq`` (fencing the old
worker), is re-queued after the recovery grace, and writes the audit pair;
past the recovery ceiling the run fails with ``EXECUTION_RECOVERY_EXHAUSTED``.
Expiry is decided by the database clock.
"""

from __future__ import annotations

from ironflow.protocol import (
    ErrorInfo,
)
from ironflow.store.core import (
    FUNCTION_TIMEOUT,
    SCAN_BATCH,
    SqlStoreBase,
    Tx,
    exhausted_runs,
    placeholders,
)
from ironflow.store.function_life import forget_sessions
from ironflow.store.records import CancelOutcome, RecoveredSegment
from ironflow.store.transitions import TERMINAL_SQL, end_run, recover, write_audit


def release_expired_reservations(tx: Tx) -> int:
    """Release the reservations past their expiry (their queue rows unreserved,
    their credits freed), at most SCAN_BATCH; how many. The capacity scanner
    runs it, and so does every dispatcher round (store/dispatch.py)."""
    rows = tx.fetchall(
        "SELECT run_id, execution_seq, reservation_owner FROM dispatch_queue"
        " WHERE reservation_owner IS NOT NULL AND reservation_expires_at <= ironflow_now()"
        f" LIMIT {SCAN_BATCH} {tx.lock()}"
    )
    if rows:
        tx.notify()
        tx.executemany(
            "UPDATE dispatch_queue SET reservation_owner = NULL,"
            " reservation_expires_at = NULL, lease_token_hash = NULL"
            " WHERE run_id = ? AND execution_seq = ?",
            [(r[0], r[1]) for r in rows],
        )
        tx.executemany(
            "UPDATE worker_credits SET claimed_run_id = NULL, claimed_execution_seq = NULL"
            " WHERE session_id = ? AND claimed_run_id = ? AND claimed_execution_seq = ?",
            [(r[2], r[0], r[1]) for r in rows],
        )
    return len(rows)


class CapacityLoop(SqlStoreBase):
    """Loop 1: expired reservations, leases and sessions; recovery and its ceiling."""

    async def expire_reservations(self) -> int:
        return await self._transact(release_expired_reservations)

    async def expire_leases(
        self, *, recovery_grace_s: float, recovery_ceiling: int
    ) -> list[RecoveredSegment]:
        def work(tx: Tx) -> list[RecoveredSegment]:
            leases = tx.fetchall(
                "SELECT run_id, execution_seq, function_id, session_id FROM concurrency_leases"
                f" WHERE expires_at <= ironflow_now() ORDER BY expires_at LIMIT {SCAN_BATCH}"
                f" {tx.lock()}"
            )
            return recover(
                tx,
                leases,
                recovery_grace_s=recovery_grace_s,
                recovery_ceiling=recovery_ceiling,
                no_grace_first=False,
            )

        return await self._transact_ending(work, exhausted_runs)

    async def expire_sessions(self) -> int:
        def work(tx: Tx) -> int:
            ids = [
                r[0]
                for r in tx.fetchall(
                    "SELECT id FROM worker_sessions WHERE expires_at <= ironflow_now()"
                    f" LIMIT {SCAN_BATCH} {tx.lock()}"
                )
            ]
            if ids:
                tx.execute(
                    f"DELETE FROM worker_credits WHERE session_id IN ({placeholders(len(ids))})", ids
                )
                forget_sessions(tx, ids, self._now(tx))  # their functions were last served now (function_life.py)
                tx.execute(f"DELETE FROM worker_sessions WHERE id IN ({placeholders(len(ids))})", ids)
            return len(ids)

        return await self._transact(work)

    async def expire_run_deadlines(self) -> list[CancelOutcome]:
        """Fail every unended run past its function's timeout (``FUNCTION_TIMEOUT``).

        Decided here, by the database clock, so it holds with no worker alive;
        the run's execution_seq moves on, so its worker's later reports are
        refused as stale.
        """

        def work(tx: Tx) -> list[CancelOutcome]:
            rows = tx.fetchall(
                "SELECT id, timeout_s, parent_run_id, parent_step_id FROM runs"
                f" WHERE deadline_at IS NOT NULL AND status NOT IN {TERMINAL_SQL}"
                f" AND deadline_at <= ironflow_now() ORDER BY deadline_at LIMIT {SCAN_BATCH}"
                f" {tx.lock()}"
            )
            out = []
            for run_id, timeout_s, parent_run_id, parent_step_id in rows:
                error = ErrorInfo(
                    message=f"run exceeded its function's timeout of {timeout_s:g} s",
                    code=FUNCTION_TIMEOUT,
                    retryable=False,
                )
                out.append(end_run(tx, run_id, "failed", error, parent_run_id, parent_step_id))
                write_audit(tx, "run.timed_out", run_id, None, {"timeout_s": timeout_s})
            return out

        return await self._transact_ending(work, lambda ended: [o.run_id for o in ended])

    async def seconds_until_next_capacity_expiry(self) -> float | None:
        def work(tx: Tx) -> float | None:
            row = tx.fetchone(
                "SELECT min(t) - ironflow_now() FROM ("
                " SELECT min(reservation_expires_at) AS t FROM dispatch_queue"
                " WHERE reservation_owner IS NOT NULL"
                " UNION ALL SELECT min(expires_at) FROM concurrency_leases"
                " UNION ALL SELECT min(expires_at) FROM worker_sessions"
                " UNION ALL SELECT min(deadline_at) FROM runs WHERE deadline_at IS NOT NULL"
                f" AND status NOT IN {TERMINAL_SQL}) u"
            )
            return None if row is None or row[0] is None else max(0.0, float(row[0]))

        return await self._transact(work)
