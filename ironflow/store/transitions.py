"""The shared transitions of a run, as functions of a transaction: every
operation that queues a segment, frees a credit, resumes, ends, cancels or
recovers a run calls these, whichever mechanism's module it lives in.

Each takes the caller's :class:`~ironflow.store.tx.Tx` and changes rows in it
only; the caller owns the transaction, its locks and what is announced after
commit. Lock order where it matters is written at the function (``cancel``:
queue row, lease, run — the order of an activation and a completion).

- :func:`enqueue`: a segment on the queue (one row per run, replaced);
- :func:`take_segment`: a run's lease and queue row taken away, credits freed;
- :func:`end_run`: a run ended ``failed`` or ``cancelled`` wherever it is;
- :func:`resume`: a parked run's next segment queued;
- :func:`resolve_parent`: a child's end settles its parent's invoke step;
- :func:`begin_compensation`: a run's undos queued instead of its end
  (``store/compensation.py``);
- :func:`cancel`: ``runs cancel``, a cancel-on event, a singleton's cancel;
- :func:`recover`: loop 1's recovery of lost leases, and its ceiling.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from ironflow.ids import new_id
from ironflow.protocol import (
    TERMINAL_RUN_STATUSES,
    CompensationBegin,
    CompensationCause,
    ErrorInfo,
    compensation_step_id,
    job_id_for,
)
from ironflow.store.base import Conflict, RunNotFound
from ironflow.store.records import CancelOutcome, RecoveredSegment
from ironflow.store.tx import Tx, enc

__all__ = [
    "TERMINAL_SQL", "RUN_END_FIGURES", "RECOVERY_EXHAUSTED",
    "write_audit", "audit_if_enabled", "free_credit", "enqueue", "take_segment", "fail_parked_steps",
    "end_run", "resume", "resolve_parent", "has_undos_sql", "has_undos", "begin_compensation",
    "cancel", "recover",
]

# The statuses a run never leaves, as an SQL list.
TERMINAL_SQL = "('completed', 'failed', 'cancelled')"
# What an UPDATE that ends a run returns for ironflow_run_duration_seconds: its
# function and its duration from first start (or creation) to end.
RUN_END_FIGURES = "function_id, ended_at - COALESCE(started_at, created_at)"
# Error code of a run that was recovered more often than the recovery ceiling allows.
RECOVERY_EXHAUSTED = "EXECUTION_RECOVERY_EXHAUSTED"


def write_audit(tx: Tx, kind: str, run_id: str | None, function_id: str | None, data: Any) -> None:
    """Write one audit row, whatever the function's audit toggle."""
    tx.execute(
        "INSERT INTO audit_log (id, at, type, run_id, function_id, data)"
        " VALUES (?, ironflow_now(), ?, ?, ?, ?)",
        (new_id("aud"), kind, run_id, function_id, enc(data)),
    )


def audit_if_enabled(tx: Tx, kind: str, run_id: str, data: Any) -> None:
    """Ordinary audit events: only for functions whose definition has ``audit: true``."""
    tx.execute(
        "INSERT INTO audit_log (id, at, type, run_id, function_id, data)"
        " SELECT ?, ironflow_now(), ?, r.id, r.function_id, ? FROM runs r"
        " JOIN functions f ON f.id = r.function_id WHERE r.id = ? AND f.audit = 1",
        (new_id("aud"), kind, enc(data), run_id),
    )


def free_credit(tx: Tx, session_id: str, run_id: str, seq: int, *, hold: bool = False) -> None:
    """Give segment ``(run_id, seq)``'s credit of ``session_id`` back (``hold``: kept held)."""
    tx.execute(
        "UPDATE worker_credits SET claimed_run_id = NULL, claimed_execution_seq = NULL,"
        " held = ? WHERE session_id = ? AND claimed_run_id = ? AND claimed_execution_seq = ?",
        (1 if hold else 0, session_id, run_id, seq),
    )


def enqueue(
    tx: Tx,
    run_id: str,
    seq: int,
    function_id: str,
    concurrency_key: str | None,
    delay_s: float,
    reason: str,
) -> float:
    """Put segment ``(run_id, seq)`` on the queue (replacing any older row of
    the run), eligible ``delay_s`` from now; its ``eligible_at``. Kicks the
    dispatchers at commit."""
    tx.notify()
    row = tx.fetchone(
        "INSERT INTO dispatch_queue (run_id, execution_seq, function_id, concurrency_key,"
        " eligible_at, reason, enqueued_at) VALUES (?, ?, ?, ?, ironflow_now() + ?, ?,"
        " ironflow_now()) ON CONFLICT (run_id) DO UPDATE SET"
        " execution_seq = excluded.execution_seq, eligible_at = excluded.eligible_at,"
        " reason = excluded.reason, enqueued_at = excluded.enqueued_at,"
        " reservation_owner = NULL, reservation_expires_at = NULL, lease_token_hash = NULL"
        " RETURNING eligible_at",
        (run_id, seq, function_id, concurrency_key, float(delay_s), reason),
    )
    assert row is not None
    return float(row[0])


def take_segment(tx: Tx, run_id: str) -> tuple[str | None, str | None, str | None]:
    """Take run ``run_id``'s lease and queue row away, their credits freed:
    ``(session_id, node_id, job_id)`` of whoever held it (Nones if nobody),
    so the caller can send ``Cancel``. Used by :func:`end_run` and a pause
    (run_control.py)."""
    session_id = node_id = job_id = None
    lease = tx.fetchone(
        "DELETE FROM concurrency_leases WHERE run_id = ?"
        " RETURNING session_id, node_id, execution_seq",
        (run_id,),
    )
    if lease is not None:
        session_id, node_id = lease[0], lease[1]
        job_id = job_id_for(run_id, lease[2])
        free_credit(tx, lease[0], run_id, lease[2])
    queued = tx.fetchone(
        "DELETE FROM dispatch_queue WHERE run_id = ? RETURNING reservation_owner, execution_seq",
        (run_id,),
    )
    if queued is not None and queued[0] is not None:
        free_credit(tx, queued[0], run_id, queued[1])
        if session_id is None:
            session_id = queued[0]
            job_id = job_id_for(run_id, queued[1])
            owner = tx.fetchone("SELECT node_id FROM worker_sessions WHERE id = ?", (session_id,))
            node_id = owner[0] if owner else None
    return session_id, node_id, job_id


def fail_parked_steps(tx: Tx, run_id: str) -> None:
    """Fail the run's parked steps (sleeps, waits, invokes; claimed or not):
    no wake or event resumes a run that ended or began compensating."""
    tx.execute(
        "UPDATE steps SET status = 'failed', wake_at = NULL, claimed_by = NULL,"
        " claimed_at = NULL, pre_claim_status = NULL"
        " WHERE run_id = ? AND status IN ('sleeping', 'waiting', 'waking')",
        (run_id,),
    )


def end_run(
    tx: Tx,
    run_id: str,
    status: Literal["cancelled", "failed"],
    error: ErrorInfo,
    parent_run_id: str | None,
    parent_step_id: str | None,
    taken: tuple[str | None, str | None, str | None] | None = None,
) -> CancelOutcome:
    """End a run that has not ended, wherever it is: its lease and queue row
    go (their credits freed; ``taken``: :func:`take_segment`'s answer when
    the caller took them already), its execution_seq moves on (so whatever
    its worker still sends is refused), parked steps fail, a waiting parent
    resumes. Returns who was executing it, so the caller can tell them."""
    session_id, node_id, job_id = take_segment(tx, run_id) if taken is None else taken
    ended = tx.fetchone(
        "UPDATE runs SET status = ?, error = ?, current_execution_seq = current_execution_seq + 1,"
        f" ended_at = ironflow_now(), updated_at = ironflow_now() WHERE id = ? RETURNING {RUN_END_FIGURES}",
        (status, enc(error), run_id),
    )
    fail_parked_steps(tx, run_id)
    kicked = resolve_parent(tx, parent_run_id, parent_step_id, run_id, error=error)
    return CancelOutcome(
        run_id, session_id, node_id, job_id, kicked_run_ids=kicked,
        function_id=ended[0] if ended else None, duration_s=ended[1] if ended else None,
    )


def resume(tx: Tx, run_id: str) -> tuple[int, float] | None:
    """Queue a parked run's next segment now (reason 'resume'): its
    ``(execution_seq, eligible_at)``, None if not resumable. The segment may
    start at once: an earlier sleep's ``start_at`` is cleared."""
    row = tx.fetchone(
        "UPDATE runs SET current_execution_seq = current_execution_seq + 1,"
        " status = 'waiting', start_at = NULL, updated_at = ironflow_now()"
        f" WHERE id = ? AND status NOT IN {TERMINAL_SQL}"
        " AND status <> 'paused'"  # a paused run waits for resume_run (run_control.py)
        " AND NOT EXISTS (SELECT 1 FROM concurrency_leases l WHERE l.run_id = runs.id)"
        " AND NOT EXISTS (SELECT 1 FROM dispatch_queue q WHERE q.run_id = runs.id)"
        " RETURNING current_execution_seq, function_id, concurrency_key",
        (run_id,),
    )
    if row is None:
        return None
    eligible_at = enqueue(tx, run_id, row[0], row[1], row[2], 0.0, "resume")
    return row[0], eligible_at


def resolve_parent(
    tx: Tx,
    parent_run_id: str | None,
    parent_step_id: str | None,
    child_id: str,
    *,
    output: Any = None,
    error: ErrorInfo | None = None,
) -> list[str]:
    """A child run ended: settle the parent's invoke step and resume the
    parent; the parent's id in a list if it was resumed."""
    if parent_run_id is None or parent_step_id is None:
        return []
    if error is None:
        n = tx.execute(
            "UPDATE steps SET status = 'completed', output = ?, wake_at = NULL"
            " WHERE run_id = ? AND step_id = ? AND kind = 'invoke' AND status = 'waiting'"
            " AND invoke_run_id = ?",
            (enc(output), parent_run_id, parent_step_id, child_id),
        )
    else:
        failure = ErrorInfo(
            message=f"invoked run {child_id} failed: {error.message}",
            code="INVOKE_FAILED",
            retryable=False,
        )
        n = tx.execute(
            "UPDATE steps SET status = 'failed', error = ?, wake_at = NULL"
            " WHERE run_id = ? AND step_id = ? AND kind = 'invoke' AND status = 'waiting'"
            " AND invoke_run_id = ?",
            (enc(failure), parent_run_id, parent_step_id, child_id),
        )
    if n and resume(tx, parent_run_id) is not None:
        return [parent_run_id]
    return []


def has_undos_sql(run: str) -> str:
    """An SQL condition: run ``run`` (a column or ``?``) recorded
    ``compensate:registered``; its one parameter is
    ``compensation_step_id(run_id, "registered")``. Read it after the run's
    lease went in this transaction (``store/compensation.py``: locks)."""
    return f"EXISTS (SELECT 1 FROM steps s WHERE s.run_id = {run} AND s.step_id = ?)"


def has_undos(tx: Tx, run_id: str) -> bool:
    """Whether the run recorded ``compensate:registered`` (:func:`has_undos_sql`)."""
    row = tx.fetchone(
        f"SELECT {has_undos_sql('?')}", (run_id, compensation_step_id(run_id, "registered"))
    )
    return row is not None and bool(row[0])


def begin_compensation(tx: Tx, run_id: str, cause: CompensationCause, error: ErrorInfo) -> tuple[int, float]:
    """Begin the run's compensation (its lease and queue row already taken
    by the caller; ``store/compensation.py``): ``(execution_seq,
    eligible_at)`` of its compensation segment, queued now."""
    row = tx.fetchone(
        # recovery_count starts again, as after a yield: the undos get the
        # recovery ceiling's whole budget.
        "UPDATE runs SET status = 'waiting', compensation = ?, error = ?, start_at = NULL,"
        " recovery_count = 0, current_execution_seq = current_execution_seq + 1,"
        " updated_at = ironflow_now()"
        " WHERE id = ? RETURNING current_execution_seq, function_id, concurrency_key",
        (cause, enc(error), run_id),
    )
    assert row is not None
    seq, function_id, ckey = row
    tx.execute(
        "INSERT INTO steps (run_id, step_id, name, kind, status, output, execution_seq,"
        " created_at, seq) VALUES (?, ?, 'compensate:begin', 'run', 'completed', ?, ?,"
        " ironflow_now(), ?) ON CONFLICT (run_id, step_id) DO UPDATE SET"
        " status = 'completed', output = excluded.output, execution_seq = excluded.execution_seq",
        (
            run_id, compensation_step_id(run_id, "begin"), enc(CompensationBegin(cause, error)),
            seq, time.time_ns(),
        ),
    )
    fail_parked_steps(tx, run_id)
    eligible_at = enqueue(tx, run_id, seq, function_id, ckey, 0.0, "compensate")
    # Always recorded, whatever the function's audit toggle: the undos
    # change the world outside, and the run's story must say why they ran.
    write_audit(tx, "run.compensating", run_id, function_id, {"cause": cause, "error": error.code})
    return seq, eligible_at


def cancel(tx: Tx, run_id: str, error: ErrorInfo, audit_data: dict[str, Any]) -> CancelOutcome:
    """End run ``run_id`` ``cancelled`` with ``error``, auditing
    ``run.cancelled`` with ``audit_data``; a run with undos
    (``step.compensate``) is not ended but begins compensating, to end
    ``cancelled`` once its undos ran (``compensating`` in the outcome).

    Raises:
      RunNotFound: no such run.
      Conflict: it already ended, or it is compensating.
    """
    # The run's queue row and lease first, then the run: the order in
    # which an activation (queue row, lease, run) and a completion
    # (lease, run) take them, so a cancel racing either waits for it
    # rather than deadlocking with it; a step write holding the lease
    # (FOR KEY SHARE) commits before the cancel, never after it.
    tx.fetchone(f"SELECT 1 FROM dispatch_queue WHERE run_id = ? {tx.lock_wait()}", (run_id,))
    tx.fetchone(f"SELECT 1 FROM concurrency_leases WHERE run_id = ? {tx.lock_wait()}", (run_id,))
    run = tx.fetchone(
        "SELECT status, current_execution_seq, parent_run_id, parent_step_id, compensation"
        f" FROM runs WHERE id = ? {tx.lock_wait()}",
        (run_id,),
    )
    if run is None:
        raise RunNotFound(f"run {run_id} not found")
    if run[0] in TERMINAL_RUN_STATUSES:
        raise Conflict(f"run {run_id} already {run[0]}")
    if run[4] is not None:
        raise Conflict(
            f"run {run_id} is compensating (its undos run after its {run[4]});"
            " it ends when they have"
        )
    taken = take_segment(tx, run_id)
    # After the lease went: a registration committed before is seen, one
    # behind is refused by the fence (store/compensation.py: locks).
    if has_undos(tx, run_id):
        begin_compensation(tx, run_id, "cancel", error)
        audit_if_enabled(tx, "run.cancelled", run_id, {**audit_data, "compensating": True})
        return CancelOutcome(run_id, *taken, compensating=True)
    outcome = end_run(tx, run_id, "cancelled", error, run[2], run[3], taken)
    audit_if_enabled(tx, "run.cancelled", run_id, audit_data)
    return outcome


def recover(
    tx: Tx,
    leases: list[tuple[Any, ...]],
    *,
    recovery_grace_s: float,
    recovery_ceiling: int,
    no_grace_first: bool,
) -> list[RecoveredSegment]:
    """Loop 1's recovery (crash-recovery seed): fence and requeue each lost
    lease row ``(run_id, execution_seq, function_id, session_id)`` after
    ``recovery_grace_s`` (none for a first loss when ``no_grace_first``: a
    socket closed without a drain), or fail its run past
    ``recovery_ceiling``; one ``RecoveredSegment`` per row recovered."""
    out: list[RecoveredSegment] = []
    for run_id, seq, function_id, session_id in leases:
        if not tx.execute(
            "DELETE FROM concurrency_leases WHERE run_id = ? AND execution_seq = ?",
            (run_id, seq),
        ):
            continue
        free_credit(tx, session_id, run_id, seq)
        row = tx.fetchone(
            "UPDATE runs SET current_execution_seq = current_execution_seq + 1,"
            " recovery_count = recovery_count + 1, status = 'waiting',"
            " updated_at = ironflow_now()"
            f" WHERE id = ? AND current_execution_seq = ? AND status NOT IN {TERMINAL_SQL}"
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
        write_audit(
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
                (enc(error), count, run_id),
            )
            audit_if_enabled(tx, "run.failed", run_id, {"error": error})
            resolve_parent(tx, parent_run_id, parent_step_id, run_id, error=error)
            out.append(
                RecoveredSegment(
                    run_id, function_id, seq, None, session_id, count, None, True,
                    duration_s=ended[0] if ended else None,
                )
            )
            continue
        grace = 0.0 if (no_grace_first and count == 1) else recovery_grace_s
        eligible_at = enqueue(tx, run_id, new_seq, function_id, ckey, grace, "recovery")
        write_audit(
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
