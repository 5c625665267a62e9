"""The waker's claims and loop 2, the stale-claim sweeper (crash-recovery
seed): elapsed sleeps and timed-out waits are claimed (``waking``, with
``pre_claim_status``) and resumed; a claim left ``waking`` past the
threshold by a dead node is restored to its ``pre_claim_status``. Loop 2's
``NOT EXISTS`` guards keep it off any run loop 1 owns (a lease or a queue
row): the two loops are disjoint by construction, not by timing.
"""

from __future__ import annotations

from ironflow.protocol import (
    ErrorInfo,
)
from ironflow.store.base import (
    Conflict,
    JobOutcome,
)
from ironflow.store.core import (
    SqlStoreBase,
    Tx,
    _enc,
)


class WakeLoop(SqlStoreBase):
    """The waker's claims and loop 2, the stale-claim sweeper."""

    async def claim_elapsed_steps(self, node_id: str, limit: int) -> list[tuple[str, str]]:
        def work(tx: Tx) -> list[tuple[str, str]]:
            due = tx.fetchall(
                "SELECT run_id, step_id FROM steps WHERE status IN ('sleeping', 'waiting')"
                " AND wake_at IS NOT NULL AND wake_at <= ironflow_now()"
                f" ORDER BY wake_at LIMIT ? {tx.lock()}",
                (limit,),
            )
            if due:
                tx.executemany(
                    "UPDATE steps SET pre_claim_status = status, status = 'waking',"
                    " claimed_by = ?, claimed_at = ironflow_now()"
                    " WHERE run_id = ? AND step_id = ? AND status IN ('sleeping', 'waiting')",
                    [(node_id, r[0], r[1]) for r in due],
                )
            return [(r[0], r[1]) for r in due]

        return await self._transact(work)

    async def resume_claimed_step(self, node_id: str, run_id: str, step_id: str) -> JobOutcome:
        def work(tx: Tx) -> JobOutcome:
            step = tx.fetchone(
                "SELECT s.kind, s.invoke_run_id, s.claimed_at, s.pre_claim_status, f.audit,"
                " ironflow_now() - s.wake_at"
                " FROM steps s JOIN runs r ON r.id = s.run_id"
                " LEFT JOIN functions f ON f.id = r.function_id"
                " WHERE s.run_id = ? AND s.step_id = ? AND s.status = 'waking' AND s.claimed_by = ?",
                (run_id, step_id, node_id),
            )
            if step is None:
                raise Conflict(f"step {run_id}/{step_id} is not claimed by node {node_id}")
            kind, child, claimed_at, pre_claim_status, audit, late = step
            if audit:
                # One record per wake, in the resume's transaction: with
                # ``step.claim.restored`` it counts each step's claims in the
                # database (a function's ordinary audit events, opt-in).
                self._audit(tx, "step.woke", run_id, None, {
                    "step_id": step_id, "node_id": node_id, "from": pre_claim_status,
                    "claimed_at": float(claimed_at),
                })
            status, error = "completed", None
            if kind == "wait":
                status = "timed_out"
            elif kind == "invoke":
                status = "failed"
                error = _enc(
                    ErrorInfo(
                        message=f"invoked run {child} did not finish before the timeout",
                        code="INVOKE_TIMEOUT",
                        retryable=False,
                    )
                )
            tx.execute(
                "UPDATE steps SET status = ?, error = ?, output = NULL, claimed_by = NULL,"
                " claimed_at = NULL, pre_claim_status = NULL WHERE run_id = ? AND step_id = ?",
                (status, error, run_id, step_id),
            )
            resumed = self._resume(tx, run_id)
            if resumed is None:
                row = tx.fetchone("SELECT status FROM runs WHERE id = ?", (run_id,))
                return JobOutcome(run_id, row[0] if row else "unknown", wake_lateness_s=late)
            return JobOutcome(run_id, "waiting", resumed[0], resumed[1], wake_lateness_s=late)

        return await self._transact(work)

    async def reset_stale_claims(self, threshold_s: float) -> int:
        def work(tx: Tx) -> int:
            stale = tx.fetchall(
                "SELECT run_id, step_id, claimed_by, claimed_at FROM steps"
                " WHERE status = 'waking' AND claimed_at <= ironflow_now() - ?"
                " AND NOT EXISTS (SELECT 1 FROM concurrency_leases l WHERE l.run_id = steps.run_id)"
                " AND NOT EXISTS (SELECT 1 FROM dispatch_queue q WHERE q.run_id = steps.run_id)"
                f" {tx.lock()}",
                (float(threshold_s),),
            )
            restored = 0
            for run_id, step_id, claimed_by, claimed_at in stale:
                # Re-checked in the UPDATE: a claimer may have resumed it since.
                n = tx.execute(
                    "UPDATE steps SET status = pre_claim_status, claimed_by = NULL,"
                    " claimed_at = NULL, pre_claim_status = NULL"
                    " WHERE run_id = ? AND step_id = ? AND status = 'waking' AND claimed_at = ?",
                    (run_id, step_id, claimed_at),
                )
                if n:
                    restored += 1
                    self._audit_if_enabled(tx, "step.claim.restored", run_id, {
                        "step_id": step_id, "claimed_by": claimed_by, "claimed_at": float(claimed_at),
                    })
            return restored

        return await self._transact(work)

    async def seconds_until_next_wake(self) -> float | None:
        def work(tx: Tx) -> float | None:
            row = tx.fetchone(
                "SELECT min(wake_at) - ironflow_now() FROM steps"
                " WHERE status IN ('sleeping', 'waiting') AND wake_at IS NOT NULL"
            )
            return None if row is None or row[0] is None else max(0.0, float(row[0]))

        return await self._transact(work)
