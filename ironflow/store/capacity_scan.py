"""Loop 1, the capacity scanner's SQL (crash-recovery seed): expired
reservations released, expired concurrency leases and worker sessions
recovered. A recovered segment gets a new ``execution_seq`` (fencing the old
worker), is re-queued after the recovery grace, and writes the audit pair;
past the recovery ceiling the run fails with ``EXECUTION_RECOVERY_EXHAUSTED``.
Expiry is decided by the database clock.
"""

from __future__ import annotations

from typing import Any

from ironflow.protocol import (
    ErrorInfo,
)
from ironflow.store.base import (
    CancelOutcome,
    RecoveredSegment,
)
from ironflow.store.core import (
    _TERMINAL_SQL,
    FUNCTION_TIMEOUT,
    RECOVERY_EXHAUSTED,
    SCAN_BATCH,
    SqlStoreBase,
    Tx,
    _enc,
    _exhausted,
    _marks,
)
from ironflow.store.function_life import forget_sessions


class CapacityLoop(SqlStoreBase):
    """Loop 1: expired reservations, leases and sessions; recovery and its ceiling."""

    def _recover(
        self,
        tx: Tx,
        leases: list[tuple[Any, ...]],
        *,
        recovery_grace_s: float,
        recovery_ceiling: int,
        no_grace_first: bool,
    ) -> list[RecoveredSegment]:
        """Fence and requeue (or fail at the ceiling) each lease row
        ``(run_id, execution_seq, function_id, session_id)``."""
        out: list[RecoveredSegment] = []
        for run_id, seq, function_id, session_id in leases:
            if not tx.execute(
                "DELETE FROM concurrency_leases WHERE run_id = ? AND execution_seq = ?",
                (run_id, seq),
            ):
                continue
            self._free_credit(tx, session_id, run_id, seq)
            row = tx.fetchone(
                "UPDATE runs SET current_execution_seq = current_execution_seq + 1,"
                " recovery_count = recovery_count + 1, status = 'waiting',"
                " updated_at = ironflow_now()"
                f" WHERE id = ? AND current_execution_seq = ? AND status NOT IN {_TERMINAL_SQL}"
                " RETURNING current_execution_seq, recovery_count, concurrency_key,"
                " parent_run_id, parent_step_id",
                (run_id, seq),
            )
            if row is None:
                continue
            new_seq, count, ckey, parent_run_id, parent_step_id = row
            # The ceiling permits `recovery_ceiling` recoveries; a lease loss past
            # it is not one of them, so the count (run and audit alike) stays there.
            exhausted = count > recovery_ceiling
            if exhausted:
                count -= 1
            self._audit(
                tx,
                "capacity.lease.expired",
                run_id,
                function_id,
                {
                    "execution_seq": seq,
                    "session_id": session_id,
                    "recovery_count": count,
                    "ceiling_reached": exhausted,
                },
            )
            if exhausted:
                error = ErrorInfo(
                    message=f"segment lost its lease after {count} consecutive recoveries;"
                    f" recovery ceiling is {recovery_ceiling}",
                    code=RECOVERY_EXHAUSTED,
                    retryable=False,
                )
                ended = tx.fetchone(
                    "UPDATE runs SET status = 'failed', error = ?, recovery_count = ?,"
                    " ended_at = ironflow_now(), updated_at = ironflow_now() WHERE id = ?"
                    " RETURNING ended_at - COALESCE(started_at, created_at)",
                    (_enc(error), count, run_id),
                )
                self._audit_if_enabled(tx, "run.failed", run_id, {"error": error})
                self._resolve_parent(tx, parent_run_id, parent_step_id, run_id, error=error)
                out.append(
                    RecoveredSegment(
                        run_id, function_id, seq, None, session_id, count, None, True,
                        duration_s=ended[0] if ended else None,
                    )
                )
                continue
            grace = 0.0 if (no_grace_first and count == 1) else recovery_grace_s
            eligible_at = self._enqueue(tx, run_id, new_seq, function_id, ckey, grace, "recovery")
            self._audit(
                tx,
                "capacity.segment.recovered",
                run_id,
                function_id,
                {
                    "old_execution_seq": seq,
                    "new_execution_seq": new_seq,
                    "session_id": session_id,
                    "recovery_count": count,
                    "eligible_at": eligible_at,
                },
            )
            out.append(
                RecoveredSegment(
                    run_id, function_id, seq, new_seq, session_id, count, eligible_at, False
                )
            )
        return out

    def _expire_reservations(self, tx: Tx) -> int:
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

    async def expire_reservations(self) -> int:
        return await self._transact(self._expire_reservations)

    async def expire_leases(
        self, *, recovery_grace_s: float, recovery_ceiling: int
    ) -> list[RecoveredSegment]:
        def work(tx: Tx) -> list[RecoveredSegment]:
            leases = tx.fetchall(
                "SELECT run_id, execution_seq, function_id, session_id FROM concurrency_leases"
                f" WHERE expires_at <= ironflow_now() ORDER BY expires_at LIMIT {SCAN_BATCH}"
                f" {tx.lock()}"
            )
            return self._recover(
                tx,
                leases,
                recovery_grace_s=recovery_grace_s,
                recovery_ceiling=recovery_ceiling,
                no_grace_first=False,
            )

        return await self._transact_ending(work, _exhausted)

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
                    f"DELETE FROM worker_credits WHERE session_id IN ({_marks(len(ids))})", ids
                )
                forget_sessions(tx, ids, self._now(tx))  # their functions were last served now (function_life.py)
                tx.execute(f"DELETE FROM worker_sessions WHERE id IN ({_marks(len(ids))})", ids)
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
                f" WHERE deadline_at IS NOT NULL AND status NOT IN {_TERMINAL_SQL}"
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
                out.append(self._end_run(tx, run_id, "failed", error, parent_run_id, parent_step_id))
                self._audit(tx, "run.timed_out", run_id, None, {"timeout_s": timeout_s})
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
                f" AND status NOT IN {_TERMINAL_SQL}) u"
            )
            return None if row is None or row[0] is None else max(0.0, float(row[0]))

        return await self._transact(work)
