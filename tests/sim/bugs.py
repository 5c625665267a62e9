"""Known bugs the simulator must find (``run_seed(seed, bug=NAME)``): test-only
store subclasses, so the engine carries no switch for them.

- ``record_step_unfenced``: ``record_step`` without the fence check — a
  worker whose lease was recovered can still write its step results.
- ``nack_spends_attempt``: a JobNack also bumps the run's attempt, as if the
  refused assignment had been tried.
- ``held_start_dropped``: an assignment loses its start delay, so a sleep the
  waker resumed ahead of its time (look-ahead) starts at once.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec

from ironflow.protocol import ErrorInfo, JobNackReason
from ironflow.store import Fence, JobOutcome, Reservation, Store
from ironflow.store.core import Tx, _enc
from ironflow.store.fence import _STEP_RESULT_UPSERT
from ironflow.store.sqlite import SqliteStore
from tests.sim.pg import SimPostgresStore


class UnfencedRecordStep(SqliteStore):
    async def record_step(
        self,
        fence: Fence,
        *,
        step_id: str,
        name: str,
        status: Literal["completed", "failed"],
        output: Any = None,
        error: ErrorInfo | None = None,
        duration_ms: float = 0.0,
    ) -> None:
        out_text = _enc(output) if status == "completed" else None
        err_text = None if error is None else _enc(error)

        def work(tx: Tx) -> None:
            # The real statement, minus its `WHERE EXISTS (… the fence …)`.
            written = tx.execute(
                "INSERT INTO steps (run_id, step_id, name, kind, status, output, error,"
                " duration_ms, execution_seq, created_at, seq)"
                " VALUES (?, ?, ?, 'run', ?, ?, ?, ?, ?, ironflow_now(), ?)"
                + _STEP_RESULT_UPSERT,
                (
                    fence.run_id,
                    step_id,
                    name,
                    status,
                    out_text,
                    err_text,
                    float(duration_ms),
                    fence.execution_seq,
                    time.time_ns(),
                ),
            )
            if written and status == "completed":
                self._audit_if_enabled(
                    tx, "step.completed", fence.run_id, {"step_id": step_id, "name": name}
                )

        await self._transact(work)


    # The interface's one-by-one form: the session's grouped step results
    # reach the unfenced record_step above too.
    record_steps = Store.record_steps
    record_steps_many = Store.record_steps_many


class NackSpendsAttempt(SqliteStore):
    async def nack_job(self, fence: Fence, reason: JobNackReason) -> JobOutcome:
        outcome = await super().nack_job(fence, reason)

        def work(tx: Tx) -> None:
            tx.execute("UPDATE runs SET attempt = attempt + 1 WHERE id = ?", (fence.run_id,))

        await self._transact(work)
        return outcome


class HeldStartDropped(SqliteStore):
    async def reserve_segments(self, *args: Any, **kwargs: Any) -> list[Reservation]:
        return [
            msgspec.structs.replace(
                r, assignment=msgspec.structs.replace(r.assignment, start_delay_ms=0, db_now=None)
            )
            for r in await super().reserve_segments(*args, **kwargs)
        ]


BUGS: dict[str, type[SqliteStore]] = {
    "record_step_unfenced": UnfencedRecordStep,
    "nack_spends_attempt": NackSpendsAttempt,
    "held_start_dropped": HeldStartDropped,
}


def store_class(bug: str | None) -> type[SqliteStore]:
    if bug is None:
        return SqliteStore
    return BUGS[bug]


# The PostgreSQL mode's known bugs (tests/sim/pg.py): subclasses of its store.
PG_BUGS: dict[str, type[SimPostgresStore]] = {}


def pg_store_class(bug: str | None) -> type[SimPostgresStore]:
    if bug is None:
        return SimPostgresStore
    return PG_BUGS[bug]
