"""The waker's claims and loop 2, the stale-claim sweeper (crash-recovery
seed): elapsed sleeps and timed-out waits are claimed (``waking``, with
``pre_claim_status``) and resumed; a claim left ``waking`` past the
threshold by a dead node is restored to its ``pre_claim_status``. Loop 2's
``NOT EXISTS`` guards keep it off any run loop 1 owns (a lease or a queue
row): the two loops are disjoint by construction, not by timing.
"""

from __future__ import annotations

from ironflow.ids import new_id
from ironflow.protocol import (
    ErrorInfo,
)
from ironflow.store.core import (
    SqlStoreBase,
    Tx,
    enc,
    placeholders,
)
from ironflow.store.records import WakeOutcome
from ironflow.store.transitions import TERMINAL_SQL, audit_if_enabled


def _pairs(n: int) -> str:
    """``(?, ?), …`` n times: the rows of a ``(run_id, step_id) IN (VALUES …)``."""
    return ", ".join(["(?, ?)"] * n)


def _invoke_timeout(child_run_id: str | None) -> str:
    """The stored error of an invoke step whose child did not finish in time."""
    return enc(
        ErrorInfo(
            message=f"invoked run {child_run_id} did not finish before the timeout",
            code="INVOKE_TIMEOUT",
            retryable=False,
        )
    )


class WakeLoop(SqlStoreBase):
    """The waker's claims and loop 2, the stale-claim sweeper."""

    async def claim_elapsed_steps(
        self, node_id: str, limit: int, *, lookahead_s: float = 0.0
    ) -> list[tuple[str, str]]:
        def work(tx: Tx) -> list[tuple[str, str]]:
            # A sleep is claimable ``lookahead_s`` ahead of its wake time (its
            # run is held until then); a wait or invoke only once its timeout
            # passed. One range of the steps_wake index, filtered, locked
            # (SKIP LOCKED: another node's claim in progress is left to it)
            # and claimed in one statement.
            due = tx.fetchall(
                "UPDATE steps SET pre_claim_status = status, status = 'waking',"
                " claimed_by = ?, claimed_at = ironflow_now()"
                " WHERE (run_id, step_id) IN (SELECT run_id, step_id FROM steps"
                " WHERE status IN ('sleeping', 'waiting')"
                " AND wake_at IS NOT NULL AND wake_at <= ironflow_now() + ?"
                " AND (kind = 'sleep' OR wake_at <= ironflow_now())"
                f" ORDER BY wake_at LIMIT ? {tx.lock()})"
                " AND status IN ('sleeping', 'waiting') RETURNING run_id, step_id, wake_at",
                (node_id, float(max(lookahead_s, 0.0)), limit),
            )
            return [(r[0], r[1]) for r in sorted(due, key=lambda r: r[2])]

        return await self._transact(work)

    async def resume_claimed_steps(
        self, node_id: str, steps: list[tuple[str, str]]
    ) -> WakeOutcome:
        pairs = _pairs(len(steps))
        flat = [value for pair in steps for value in pair]

        def work(tx: Tx) -> WakeOutcome:
            if not steps:
                return WakeOutcome([], [])
            # Still ours: a cancel (or loop 2) since the claim took it away.
            mine = tx.fetchall(
                "SELECT s.run_id, s.step_id, s.kind, s.invoke_run_id, s.claimed_at,"
                " s.pre_claim_status, f.audit"
                " FROM steps s JOIN runs r ON r.id = s.run_id"
                " LEFT JOIN functions f ON f.id = r.function_id"
                f" WHERE (s.run_id, s.step_id) IN (VALUES {pairs})"
                " AND s.status = 'waking' AND s.claimed_by = ?",
                [*flat, node_id],
            )
            kept = {(row[0], row[1]) for row in mine}
            lost = [pair for pair in steps if pair not in kept]
            if not mine:
                return WakeOutcome([], lost)
            run_marks = placeholders(len(mine))
            run_ids = [row[0] for row in mine]
            # Runs first, while their steps are still claimed: the next segment
            # may start at the step's wake time, not before (runs.start_at).
            resumed = tx.fetchall(
                "UPDATE runs SET current_execution_seq = current_execution_seq + 1,"
                " status = 'waiting', updated_at = ironflow_now(),"
                " start_at = (SELECT max(s.wake_at) FROM steps s WHERE s.run_id = runs.id"
                " AND s.status = 'waking' AND s.claimed_by = ?)"
                f" WHERE id IN ({run_marks}) AND status NOT IN {TERMINAL_SQL}"
                " AND status <> 'paused'"  # resume_run puts it back (run_control.py)
                " AND NOT EXISTS (SELECT 1 FROM concurrency_leases l WHERE l.run_id = runs.id)"
                " AND NOT EXISTS (SELECT 1 FROM dispatch_queue q WHERE q.run_id = runs.id)"
                " RETURNING id",
                [node_id, *run_ids],
            )
            # Every claimed step ends, resumable run or not: a sleep completes,
            # a wait times out, an invoke fails (its error named below).
            tx.execute(
                "UPDATE steps SET status = CASE kind WHEN 'sleep' THEN 'completed'"
                " WHEN 'wait' THEN 'timed_out' ELSE 'failed' END,"
                " error = NULL, output = NULL, claimed_by = NULL, claimed_at = NULL,"
                " pre_claim_status = NULL"
                f" WHERE (run_id, step_id) IN (VALUES {_pairs(len(mine))})"
                " AND status = 'waking' AND claimed_by = ?",
                [*(v for row in mine for v in row[:2]), node_id],
            )
            invokes = [row for row in mine if row[2] == "invoke"]
            if invokes:
                tx.executemany(
                    "UPDATE steps SET error = ? WHERE run_id = ? AND step_id = ?",
                    [(_invoke_timeout(row[3]), row[0], row[1]) for row in invokes],
                )
            audited = [row for row in mine if row[6]]
            if audited:
                # One record per wake, in the resume's transaction: with
                # ``step.claim.restored`` it counts each step's claims in the
                # database (a function's ordinary audit events, opt-in).
                tx.executemany(
                    "INSERT INTO audit_log (id, at, type, run_id, function_id, data)"
                    " VALUES (?, ironflow_now(), 'step.woke', ?, NULL, ?)",
                    [
                        (new_id("aud"), row[0], enc({
                            "step_id": row[1], "node_id": node_id, "from": row[5],
                            "claimed_at": float(row[4]),
                        }))
                        for row in audited
                    ],
                )
            resumed_ids = [row[0] for row in resumed]
            if resumed_ids:
                tx.notify()
                tx.execute(
                    "INSERT INTO dispatch_queue (run_id, execution_seq, function_id,"
                    " concurrency_key, eligible_at, reason, enqueued_at)"
                    " SELECT id, current_execution_seq, function_id, concurrency_key,"
                    " ironflow_now(), 'resume', ironflow_now() FROM runs"
                    f" WHERE id IN ({placeholders(len(resumed_ids))})"
                    " ON CONFLICT (run_id) DO UPDATE SET"
                    " execution_seq = excluded.execution_seq, eligible_at = excluded.eligible_at,"
                    " reason = excluded.reason, enqueued_at = excluded.enqueued_at,"
                    " reservation_owner = NULL, reservation_expires_at = NULL,"
                    " lease_token_hash = NULL",
                    resumed_ids,
                )
            return WakeOutcome(resumed_ids, lost)

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
                    audit_if_enabled(tx, "step.claim.restored", run_id, {
                        "step_id": step_id, "claimed_by": claimed_by, "claimed_at": float(claimed_at),
                    })
            return restored

        return await self._transact(work)

    async def seconds_until_next_wake(self, lookahead_s: float = 0.0) -> float | None:
        def work(tx: Tx) -> float | None:
            # Each kind's earliest from its own index, one entry read: a sleep
            # is claimable ``lookahead_s`` early (steps_sleep_wake), a wait or
            # invoke at its timeout (steps_wait_wake, whose predicate is
            # spelled out so SQLite uses it).
            row = tx.fetchone(
                "SELECT (SELECT min(wake_at) FROM steps WHERE status = 'sleeping') - ?,"
                " (SELECT min(wake_at) FROM steps WHERE status = 'waiting'"
                " AND wake_at IS NOT NULL), ironflow_now()",
                (float(max(lookahead_s, 0.0)),),
            )
            assert row is not None
            times = [float(t) for t in row[:2] if t is not None]
            return None if not times else max(0.0, min(times) - float(row[2]))

        return await self._transact(work)
