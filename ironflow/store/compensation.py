"""Compensation (``step.compensate``, docs/compensation.md): the engine's part.

A run's undos are functions in its worker's memory, registered again by every
replay of its handler; what the engine keeps is whether there are any. The
SDK records one step row under the fence at the run's first
``step.compensate``, ``compensate:registered``
(:func:`~ironflow.protocol.compensation_step_id`): a run without it costs
nothing more anywhere.

Compensation **begins** in the transaction that would otherwise end the run
(``transitions.begin_compensation``):

* ``fail_job`` (fence.py) of the run's final failure — a non-retryable error,
  or a failure of its last attempt;
* ``cancel`` (transitions.py): ``runs cancel``, a cancel-on event, a
  singleton's ``mode="cancel"``.

A run timeout and the recovery ceiling are not among them: they end the run
at once (a run past its deadline would be stopped again mid-undo).

Beginning writes the ``compensate:begin`` step (its output a
``CompensationBegin``: the cause and the original error), sets
``runs.compensation`` to the cause and ``runs.error`` to the original error,
moves the run's execution_seq on (whatever its old segment still sends is
refused as stale), fails its parked steps (no wake or event resumes it) and
queues a segment with reason ``compensate``. That segment is dispatched and
fenced like any other; the begin row in its assignment's memo tells the SDK to
compensate: replay the handler on memoised results only, run the undos not yet
recorded newest-first, report ``JobFailed``. A kill -9 meanwhile is loop 1's
ordinary recovery: the next segment replays again and runs only the undos not
yet recorded.

That segment's ``JobFailed`` **ends** the run
(:func:`end_compensation`): ``failed`` or ``cancelled`` by
the cause, with ``runs.error`` as it was set at the beginning, never retried;
``run.compensated`` is audited with the undos' counts.

Locks (PostgreSQL, READ COMMITTED; docs/isolation.md): the SDK writes the
registration under the fence, holding the live lease ``FOR KEY SHARE``
(steps.py). Both beginnings read it only after that lease is gone from their
own transaction (``fail_job`` deleted it; a cancel locked it ``FOR UPDATE``
and deleted it), by a statement begun after: a registration committed first
is seen, one behind finds no lease and is refused. Nothing else writes it.
"""

from __future__ import annotations

from ironflow.protocol import (
    CompensationCause,
    compensation_id_prefix,
    compensation_step_id,
)
from ironflow.store.core import Tx, dec_error
from ironflow.store.records import JobOutcome
from ironflow.store.transitions import RUN_END_FIGURES, resolve_parent, write_audit


def end_compensation(
    tx: Tx, run_id: str, cause: CompensationCause, stored_error: str,
    parent: tuple[str | None, str | None], *, attempt: int, audit: bool,
) -> JobOutcome:
    """End a run whose compensation segment reported ``JobFailed`` (its
    lease already taken): ``failed`` or ``cancelled`` by ``cause``, with the
    original error as stored when it began (``stored_error``); ``parent``:
    its parent run and invoke step, if any."""
    status = "cancelled" if cause == "cancel" else "failed"
    ended = tx.fetchone(
        "UPDATE runs SET status = ?, ended_at = ironflow_now(), updated_at = ironflow_now()"
        f" WHERE id = ? RETURNING {RUN_END_FIGURES}",
        (status, run_id),
    )
    assert ended is not None
    prefix = compensation_id_prefix(run_id)
    counts = dict(
        tx.fetchall(
            "SELECT status, count(*) FROM steps WHERE run_id = ? AND substr(step_id, 1, CAST(? AS INTEGER)) = ?"
            " AND step_id NOT IN (?, ?) GROUP BY status",
            (
                run_id, len(prefix), prefix, compensation_step_id(run_id, "registered"),
                compensation_step_id(run_id, "begin"),
            ),
        )
    )
    error = dec_error(stored_error)
    assert error is not None  # set when the compensation began
    write_audit(
        tx, "run.compensated", run_id, ended[0],
        {
            "cause": cause,
            "undos_completed": counts.get("completed", 0),
            "undos_failed": counts.get("failed", 0),
            "error": error.code,
        },
    )
    if audit and status == "failed":
        write_audit(tx, "run.failed", run_id, ended[0], {"error": error})
    kicked = resolve_parent(tx, parent[0], parent[1], run_id, error=error)
    return JobOutcome(
        run_id, status, attempt=attempt, kicked_run_ids=kicked, function_id=ended[0], duration_s=ended[1]
    )
