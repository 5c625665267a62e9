"""Run control (docs/run-control.md): resume a failed run from its failed step, resume
many, pause a run at its next step boundary and resume it.

Resuming keeps the run's id and its memoised steps before the failed one; the
failed step's row and every later one (by ``steps.seq``, the order they were
written) go, so the SDK runs them again, and the attempt budget starts again.
Pausing takes the run off the queue and away from its worker (its lease goes,
its execution_seq moves on: whatever the worker still sends is refused as
stale, so the step in flight runs again on resume — ``docs/run-control.md``).

PostgreSQL: every transition locks the run row ``FOR UPDATE`` before it reads
the status (after the run's queue row and lease, the order an activation and a
completion take them: ``ingest.py`` ``cancel_run``), so two nodes resuming the
same run at once serialise and the second sees it queued: Conflict
(``docs/isolation.md``, "Run control").
"""

from __future__ import annotations

from ironflow.store.base import Conflict, NotFound, RunNotFound
from ironflow.store.core import SqlStoreBase, Tx
from ironflow.store.records import CancelOutcome, ResumeOutcome
from ironflow.store.transitions import enqueue, take_segment, write_audit

# Most runs one bulk resume call puts back (each in its own transaction).
MAX_BULK_RESUME = 500
# The statuses a run is resumed from.
RESUMABLE = ("failed", "paused")


def _cursor(text: str | None) -> tuple[float, str]:
    """``created_at|run_id`` of the last run of the previous page (start: before all)."""
    if not text:
        return (float("-inf"), "")
    at, sep, run_id = text.partition("|")
    try:
        if not sep:
            raise ValueError(text)
        return (float(at), run_id)
    except ValueError:
        raise NotFound(f"cursor {text!r} is not one this node gave out") from None


class RunControlOps(SqlStoreBase):
    """Resume a failed or paused run; resume many; pause a run."""

    @staticmethod
    def _lock_run(tx: Tx, run_id: str) -> tuple[str, str, str | None, str | None] | None:
        """Lock the run's queue row, lease and run row (PostgreSQL: FOR UPDATE, in
        that order, as ``cancel_run`` does); (status, function_id,
        concurrency_key, compensation)."""
        tx.fetchone(f"SELECT 1 FROM dispatch_queue WHERE run_id = ? {tx.lock_wait()}", (run_id,))
        tx.fetchone(f"SELECT 1 FROM concurrency_leases WHERE run_id = ? {tx.lock_wait()}", (run_id,))
        row = tx.fetchone(
            "SELECT status, function_id, concurrency_key, compensation FROM runs"
            f" WHERE id = ? {tx.lock_wait()}",
            (run_id,),
        )
        return None if row is None else (row[0], row[1], row[2], row[3])

    def _resume_locked(self, tx: Tx, run_id: str, from_step: str | None) -> ResumeOutcome:
        run = self._lock_run(tx, run_id)
        if run is None:
            raise RunNotFound(f"run {run_id} not found")
        status, function_id, ckey, compensation = run
        if status not in RESUMABLE:
            raise Conflict(f"run {run_id} is {status}: only a failed or paused run resumes")
        if status == "failed" and compensation is not None:
            # Its memoised steps say "charged", its undos "refunded": a resume
            # would carry on from steps they undid. (A paused compensating run
            # resumes its compensation.)
            raise Conflict(
                f"run {run_id} was compensated (its undos ran): resuming it would continue"
                " past the steps they undid; start a new run instead"
            )
        cut: tuple[int, str] | None = None
        if from_step is not None:
            row = tx.fetchone(
                "SELECT seq, name FROM steps WHERE run_id = ? AND (name = ? OR step_id = ?)"
                " ORDER BY seq LIMIT 1",
                (run_id, from_step, from_step),
            )
            if row is None:
                raise NotFound(f"run {run_id} has no step {from_step!r}")
            cut = (row[0], row[1])
        elif status == "failed":
            # The latest failed step: the one that failed the run (an earlier
            # failure the handler caught stays memoised).
            row = tx.fetchone(
                "SELECT seq, name FROM steps WHERE run_id = ? AND status = 'failed'"
                " ORDER BY seq DESC LIMIT 1",
                (run_id,),
            )
            cut = None if row is None else (row[0], row[1])
        deleted = 0
        if cut is not None:
            deleted = tx.execute("DELETE FROM steps WHERE run_id = ? AND seq >= ?", (run_id, cut[0]))
        # A failed run starts a fresh attempt budget and a fresh function
        # timeout; a paused one keeps its attempt and its deadline.
        fresh = (
            " attempt = 1, error = NULL, output = NULL, ended_at = NULL, recovery_count = 0,"
            " deadline_at = NULL," if status == "failed" else ""
        )
        step_name = None if cut is None else cut[1]
        audit = {"from_status": status, "from_step": step_name, "steps_deleted": deleted}
        # A step still parked (a sleep not ended, a wait not answered): the run
        # goes back to waiting on it, not on the queue. Queued, its replay would
        # park the step again with a wake time counted from now, or find it
        # settled meanwhile and leave the run waiting on nothing. The parked
        # rows are locked (after the run row): an event or a child's end
        # settles a step under its row lock and then resumes the run, so one in
        # flight either committed first (the step is settled: queued below) or
        # waits for ours and then resumes a run it sees 'waiting'. A step the
        # waker has claimed ('waking') is settled by a transaction that decided
        # about the run before it, so such a run is queued below instead, held
        # until the sleep's wake time (``docs/isolation.md``, "Run control").
        parked = [r[0] for r in tx.fetchall(
            "SELECT status FROM steps WHERE run_id = ? AND status IN ('sleeping', 'waiting', 'waking')"
            f" ORDER BY step_id {tx.lock_wait()}",
            (run_id,),
        )]
        if parked and "waking" not in parked:
            row = tx.fetchone(
                f"UPDATE runs SET{fresh} status = 'waiting', start_at = NULL,"
                " updated_at = ironflow_now() WHERE id = ? RETURNING current_execution_seq",
                (run_id,),
            )
            assert row is not None
            write_audit(tx, "run.resumed", run_id, function_id, {**audit, "parked": True})
            return ResumeOutcome(run_id, function_id, row[0], status, step_name, deleted, "waiting")
        # A sleep the waker settled while the run was paused, or is settling
        # now (claimed up to the lookahead early), still holds the run back.
        held = (
            "(SELECT max(s.wake_at) FROM steps s WHERE s.run_id = runs.id AND s.kind = 'sleep'"
            " AND s.status IN ('completed', 'waking') AND s.wake_at > ironflow_now())"
        )
        start_at = held if status == "failed" else f"COALESCE(start_at, {held})"
        row = tx.fetchone(
            f"UPDATE runs SET{fresh} status = 'waiting_for_capacity', start_at = {start_at},"
            " current_execution_seq = current_execution_seq + 1, updated_at = ironflow_now()"
            " WHERE id = ? RETURNING current_execution_seq",
            (run_id,),
        )
        assert row is not None
        enqueue(tx, run_id, row[0], function_id, ckey, 0.0, "resume")
        write_audit(tx, "run.resumed", run_id, function_id, audit)
        return ResumeOutcome(run_id, function_id, row[0], status, step_name, deleted)

    async def resume_run(self, run_id: str, from_step: str | None = None) -> ResumeOutcome:
        return await self._transact(lambda tx: self._resume_locked(tx, run_id, from_step))

    async def resume_failed_runs(
        self, *, function_id: str | None, since_s: float, limit: int, cursor: str | None
    ) -> tuple[list[ResumeOutcome], str | None]:
        limit = max(1, min(int(limit), MAX_BULK_RESUME))
        after_at, after_id = _cursor(cursor)

        def page(tx: Tx) -> list[tuple[str, float]]:
            # runs_status_page (status, created_at, id): one range of the index, paged.
            of_function = "" if function_id is None else " AND function_id = ?"
            rows = tx.fetchall(
                f"SELECT id, created_at FROM runs WHERE status = 'failed'{of_function}"
                " AND ended_at >= ironflow_now() - ?"
                " AND (created_at > ? OR (created_at = ? AND id > ?))"
                " ORDER BY created_at, id LIMIT ?",
                (
                    *(() if function_id is None else (function_id,)),
                    float(since_s), after_at, after_at, after_id, limit,
                ),
            )
            return [(r[0], float(r[1])) for r in rows]

        candidates = await self._read(page)
        resumed: list[ResumeOutcome] = []
        for run_id, _ in candidates:
            try:
                resumed.append(await self.resume_run(run_id))
            except (Conflict, RunNotFound):
                pass  # resumed, or purged, by someone else since the page was read
        next_cursor = None
        if len(candidates) == limit:
            at, run_id = candidates[-1][1], candidates[-1][0]
            next_cursor = f"{at!r}|{run_id}"
        return resumed, next_cursor

    async def pause_run(self, run_id: str) -> CancelOutcome:
        def work(tx: Tx) -> CancelOutcome:
            run = self._lock_run(tx, run_id)
            if run is None:
                raise RunNotFound(f"run {run_id} not found")
            status, function_id, _, _ = run
            if status in ("completed", "failed", "cancelled", "paused"):
                raise Conflict(f"run {run_id} is {status}: only a run that has not ended pauses")
            session_id, node_id, job_id = take_segment(tx, run_id)
            # Parked steps (sleeps, waits) stay parked: their wake or event
            # settles them while paused, and ``transitions.resume`` leaves a paused run be.
            tx.execute(
                "UPDATE runs SET status = 'paused', current_execution_seq = current_execution_seq + 1,"
                " updated_at = ironflow_now() WHERE id = ?",
                (run_id,),
            )
            write_audit(tx, "run.paused", run_id, function_id, {"from_status": status})
            return CancelOutcome(run_id, session_id, node_id, job_id, function_id=function_id)

        return await self._transact(work)
