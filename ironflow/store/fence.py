"""The fence and a segment's life: activate its lease (JobAck), complete /
fail / yield / nack it, and heartbeat its lease (its step results:
``steps.py``; a parked wait: ``waits.py``).

This is the fencing chokepoint: a worker message may change a segment only
when a lease row with ``(run_id, execution_seq, session_id,
lease_token_hash)`` exists AND ``runs.current_execution_seq`` still equals
that seq (``FENCE_SQL``; parameters in :meth:`FenceOps._fence_params`'s
order). A stale worker's write is refused with ``StaleExecution``, never
applied.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import outcome

from ironflow.ids import new_id
from ironflow.protocol import (
    ActiveJob,
    ErrorInfo,
    InvokeYield,
    JobLeaseStatus,
    JobNackReason,
    RunRecord,
    RunResult,
    SleepYield,
    WaitYield,
    YieldInfo,
    compensation_step_id,
)
from ironflow.store.base import (
    FunctionNotFound,
    KeyEvaluationFailed,
    SessionNotFound,
    StaleExecution,
)
from ironflow.store.compensation import end_compensation
from ironflow.store.core import (
    FENCE_SQL,
    INVOKED_EVENT,
    MAX_STATEMENT_PARAMS,
    RUN_COLS,
    SqlStoreBase,
    Tx,
    enc,
    fence_join,
    run_record,
    token_hash,
)
from ironflow.store.creation import create_run
from ironflow.store.records import Fence, JobOutcome, StepResult
from ironflow.store.steps import (
    STEP_INSERT,
    STEP_RESULT_UPSERT,
    STEP_ROW_PARAMS,
    record_live,
    record_many,
    step_fields,
    step_rows,
    write_steps,
    write_steps_unaudited,
)
from ironflow.store.transitions import (
    RUN_END_FIGURES,
    TERMINAL_SQL,
    audit_if_enabled,
    begin_compensation,
    enqueue,
    free_credit,
    has_undos_sql,
    resolve_parent,
    resume,
    write_audit,
)
from ironflow.store.waits import park_locks, park_wait

# Whether the run's function records ordinary audit events, read in the same
# statement that changes the run or its step: a hot-path transition costs no
# separate audit statement when auditing is off (the common case).
_AUDIT_FLAG = "(SELECT f.audit FROM functions f WHERE f.id = function_id)"
# Leases renewed per statement by a heartbeat (4 parameters each): far under
# both backends' parameter limits and above any worker's slots.
HEARTBEAT_JOBS_PER_STATEMENT = 500
# What a run's completion sets (its output is set beside this).
_ENDED = "status = 'completed', ended_at = ironflow_now(), updated_at = ironflow_now()"
# A run whose segment begins and ends in one transaction: what its activation
# would have set (the start, the function's timeout from the first start),
# then what its completion sets.
_BEGUN_AND_ENDED = (
    "started_at = coalesce(started_at, ironflow_now()),"
    f" deadline_at = coalesce(deadline_at, ironflow_now() + timeout_s), {_ENDED}"
)


class FenceOps(SqlStoreBase):
    """The fence and a segment's life (see the module docstring)."""

    # A job's last step results are written as steps.py's StepResultOps
    # writes any (the same seam: a test store overrides it on the store).
    _record_live = staticmethod(record_live)

    def _take_lease(self, tx: Tx, fence: Fence) -> tuple[float, str | None]:
        """Delete the fenced lease and free its credit; return when the segment
        began (its reservation, or its activation for a lease an older version
        wrote) and the snapshot of its reservation (PostgreSQL; waits.py).
        StaleExecution if it is not live."""
        row = tx.fetchone(
            f"DELETE FROM concurrency_leases WHERE {FENCE_SQL}"
            " RETURNING coalesce(began_at, activated_at), began_snapshot",
            self._fence_params(fence),
        )
        if row is None:
            raise StaleExecution(
                f"segment {fence.run_id}/{fence.execution_seq} is not the live lease"
            )
        free_credit(tx, fence.session_id, fence.run_id, fence.execution_seq)
        return float(row[0]), row[1]

    async def activate_lease(self, fence: Fence, *, lease_expiry_s: float) -> RunRecord:
        # One ack is a burst of one; refused, it raises inside its transaction.
        return await self._transact(
            lambda tx: self._activate(tx, [fence], lease_expiry_s)[0].unwrap()
        )

    async def activate_leases(
        self,
        fences: Sequence[Fence],
        *,
        lease_expiry_s: float,
        synchronous_commit: bool = True,
    ) -> list[outcome.Outcome[RunRecord]]:
        """Activate several runs' segments in one transaction (one statement on
        PostgreSQL), each its own outcome.

        ``synchronous_commit=False`` lets the commit return before its WAL is
        flushed (PostgreSQL's ``SET LOCAL synchronous_commit TO off``; the WAL
        writer flushes it within ~3 × ``wal_writer_delay``, and any later
        synchronous commit flushes it first). The streaming session passes it
        for its acks: it tells the worker nothing when an activation commits
        (the SDK started the handler when its JobAck went on the wire). Why a
        PostgreSQL crash that loses such a commit breaks no promise (the long
        form: docs/isolation.md, "Commits that do not wait for their WAL
        flush"):

        - It is lost only together with every commit after it that was not
          flushed either: a commit that read the lease (a step result, the
          job's result, a cancel, another node's scan) comes later in the WAL
          and, being synchronous, flushed this one before it was reported.
        - What is left is what the ack found: the reservation (synchronous,
          flushed before the assignment was sent), the queue row, the credit;
          no lease, the run as it was. The worker's next fenced write finds
          no lease and is refused as stale; its heartbeat says REFRESHED while
          the reservation lasts and STALE once the scanner has freed it. The
          run is then dispatched again — the outcome of a JobAck that arrives
          after its reservation expired.
        - Fencing holds: activation hands out no number. The execution_seq is
          the queue row's (changed only by recovery, nack, retry or resume,
          all synchronous) and a new reservation draws a new lease token
          (128 random bits), so the old worker's token matches no lease and no
          reservation and every write it makes is refused.
        - Nothing recorded twice (the lost segment recorded nothing), nothing
          lost (ingest, reservation, step results and run ends are all
          synchronous). The cost: a handler acked in the last moments before
          a PostgreSQL crash runs again once its reservation expires (not
          counted as a recovery), as after a node crash; its timeout and
          ``started_at`` count from the start that was kept.

        A group commit that holds any other call waits for its flush."""
        if len({f.run_id for f in fences}) < len(fences):
            # The same run twice (a repeated JobAck in one burst): one after another.
            return [
                (await self.activate_leases(
                    [fence], lease_expiry_s=lease_expiry_s, synchronous_commit=synchronous_commit
                ))[0]
                for fence in fences
            ]
        if not fences:
            return []
        return await self._transact(
            lambda tx: self._activate(tx, fences, lease_expiry_s),
            synchronous_commit=synchronous_commit,
        )

    def _activate(
        self, tx: Tx, fences: Sequence[Fence], lease_expiry_s: float
    ) -> list[outcome.Outcome[RunRecord]]:
        """Activate segments of different runs: the queue row out, the lease in,
        the run running, each its own outcome (StaleExecution, nothing written,
        for an ack no live reservation of a live session proves)."""
        rows = [(f.run_id, f.execution_seq, f.session_id, token_hash(f.lease_token)) for f in fences]
        values = ", ".join(["(?, ?, ?, ?)"] * len(rows))
        flat = [value for row in rows for value in row]

        def one_statement(tx: Tx) -> list[tuple[Any, ...]]:
            """Every reservation's queue row out, its lease in, its run running:
            one statement. The queue row goes only with its session's row in
            the same statement's view: an ack from a session removed since its
            reservation deletes nothing (docs/isolation.md, race 1: the queue row went,
            no lease came, and the run was stranded). A session removed while
            this runs first frees its reservations (``close_session`` updates
            the queue rows, which this DELETE then waits for and re-checks), or
            expires (``expire_sessions``) and the lease written here expires
            with it: never a run with neither."""
            return tx.fetchall(
                f"WITH v (run_id, execution_seq, session_id, digest) AS (VALUES {values}),"
                + _taken_reservations(
                    "d.run_id, d.execution_seq, d.function_id, d.concurrency_key, v.session_id,"
                    " s.node_id, v.digest, d.reserved_at, d.reservation_snapshot"
                )
                + ","
                " l AS (INSERT INTO concurrency_leases (run_id, execution_seq, function_id,"
                " concurrency_key, session_id, node_id, lease_token_hash, expires_at,"
                " activated_at, began_at, began_snapshot) SELECT q.run_id, q.execution_seq,"
                " q.function_id, q.concurrency_key, q.session_id, q.node_id, q.digest,"
                " ironflow_now() + ?, ironflow_now(), q.reserved_at, q.reservation_snapshot"
                " FROM q RETURNING run_id)"
                " UPDATE runs r SET status = 'running', started_at = coalesce(r.started_at,"
                " ironflow_now()), deadline_at = coalesce(r.deadline_at, ironflow_now() + r.timeout_s),"
                f" updated_at = ironflow_now() FROM l WHERE r.id = l.run_id RETURNING {RUN_COLS},"
                f" {_AUDIT_FLAG}",
                (*flat, float(lease_expiry_s)),
            )

        def statement_per_table(tx: Tx) -> list[tuple[Any, ...]]:
            """The same in three statements (SQLite has no data-modifying WITH;
            the session check is in the DELETE's own WHERE, and its single
            writer makes the three one step). ``run_id IN`` beside the row-value list keeps SQLite on the primary
            key (a row-value list of several rows alone makes it scan)."""
            taken = tx.fetchall(
                _take_reservations_per_table(
                    len(rows),
                    "run_id, execution_seq, function_id, concurrency_key, reservation_owner,"
                    " lease_token_hash, reserved_at,"
                    " (SELECT node_id FROM worker_sessions WHERE id = dispatch_queue.reservation_owner)",
                ),
                (*(row[0] for row in rows), *flat),
            )
            if not taken:
                return []
            tx.execute(
                "INSERT INTO concurrency_leases (run_id, execution_seq, function_id,"
                " concurrency_key, session_id, node_id, lease_token_hash, expires_at,"
                " activated_at, began_at) VALUES "
                + ", ".join(["(?, ?, ?, ?, ?, ?, ?, ironflow_now() + ?, ironflow_now(), ?)"] * len(taken)),
                tuple(
                    value
                    for run_id, seq, function_id, key, session_id, digest, reserved_at, node_id in taken
                    for value in (
                        run_id, seq, function_id, key, session_id, node_id, digest,
                        float(lease_expiry_s), reserved_at,
                    )
                ),
            )
            return tx.fetchall(
                # The function's timeout runs from the first start (deadline_at).
                "UPDATE runs SET status = 'running', started_at = coalesce(started_at,"
                " ironflow_now()), deadline_at = coalesce(deadline_at, ironflow_now() + timeout_s),"
                " updated_at = ironflow_now() WHERE id IN ("
                + ", ".join("?" * len(taken)) + ") RETURNING"
                + RUN_COLS.replace("r.", " ")
                + f", {_AUDIT_FLAG}",
                tuple(row[0] for row in taken),
            )

        def work(tx: Tx) -> list[outcome.Outcome[RunRecord]]:
            started = {
                row[0]: row
                for row in (one_statement(tx) if tx.modifying_with else statement_per_table(tx))
            }
            results: list[outcome.Outcome[RunRecord]] = []
            for fence in fences:
                run = started.get(fence.run_id)
                if run is not None:
                    record = run_record(run)
                    if run[-1]:
                        write_audit(
                            tx, "run.started", fence.run_id, record.function_id,
                            {"execution_seq": fence.execution_seq},
                        )
                    results.append(outcome.Value(record))
                elif self._fence_alive(tx, fence):  # a repeated JobAck: already active
                    again = tx.fetchone(f"SELECT {RUN_COLS} FROM runs r WHERE r.id = ?", (fence.run_id,))
                    assert again is not None
                    results.append(outcome.Value(run_record(again)))
                else:
                    results.append(
                        outcome.Error(
                            StaleExecution(
                                f"segment {fence.run_id}/{fence.execution_seq} is not reserved for"
                                " this session with this lease token, or the session is gone"
                            )
                        )
                    )
            return results

        return work(tx)

    def _complete(self, tx: Tx, fence: Fence, output: Any) -> JobOutcome:
        """Complete one segment's run (StaleExecution, nothing written, if its
        fence is not live)."""
        done = self._complete_many(tx, [(fence, output)]).get(fence.run_id)
        if done is None:
            raise StaleExecution(
                f"segment {fence.run_id}/{fence.execution_seq} is not the live lease"
            )
        return done

    def _completed(self, tx: Tx, fence: Fence, output: Any, row: tuple[Any, ...]) -> JobOutcome:
        """After the run's UPDATE: ``row`` = parent run, parent step, function,
        duration, audit flag."""
        if row[4]:
            write_audit(tx, "run.completed", fence.run_id, row[2], {})
        kicked = resolve_parent(tx, row[0], row[1], fence.run_id, output=output)
        return JobOutcome(
            fence.run_id, "completed", kicked_run_ids=kicked, function_id=row[2], duration_s=row[3]
        )

    async def complete_job(self, fence: Fence, output: Any) -> JobOutcome:
        return await self._transact_ending(
            lambda tx: self._complete(tx, fence, output),
            lambda _: [fence.run_id],
            results=lambda _: [RunResult(fence.run_id, "completed", True, output)],
        )

    async def complete_jobs(
        self,
        items: Sequence[tuple[Fence, Any, list[StepResult]]],
        *,
        activate: frozenset[str] = frozenset(),
        lease_expiry_s: float = 0.0,
    ) -> list[outcome.Outcome[JobOutcome]]:
        if not distinct_runs(items):
            return await super().complete_jobs(items, activate=activate, lease_expiry_s=lease_expiry_s)
        # Even one item takes the path below: its steps and its completion in
        # one transaction (the interface's form would commit each).
        return await self._transact_ending(
            self._completing(items, activate),
            completed_ids,
            results=completed_results(items),
        )

    def _completing(
        self,
        items: Sequence[tuple[Fence, Any, list[StepResult]]],
        activate: frozenset[str] = frozenset(),
    ) -> Callable[[Tx], list[outcome.Outcome[JobOutcome]]]:
        """The work of :meth:`complete_jobs` (different runs) in one
        transaction. A segment of ``activate`` (its JobAck came with its
        result) begins and ends here (:meth:`_begin_and_complete`: its
        reservation is its fence, no lease is written); the others' last step
        results are written under their leases, then they complete."""
        prepared = [(fence, step_fields(steps)) for fence, _, steps in items]

        def work(tx: Tx) -> list[outcome.Outcome[JobOutcome]]:
            refused: dict[str, outcome.Outcome[Any]] = {}
            ended: dict[str, JobOutcome] = {}
            if activate:
                ended = self._begin_and_complete(
                    tx, [item for item in zip(prepared, items, strict=True) if item[0][0].run_id in activate]
                )
                for fence, _ in prepared:
                    # Not begun here: an ack repeated after its lease was
                    # activated goes on under that lease; any other is stale.
                    if fence.run_id in activate and fence.run_id not in ended and not self._fence_alive(tx, fence):
                        refused[fence.run_id] = outcome.Error(StaleExecution(
                            f"segment {fence.run_id}/{fence.execution_seq} is not reserved for"
                            " this session with this lease token, or the session is gone"
                        ))
            todo = [(fence, fields) for fence, fields in prepared if fence.run_id not in refused | ended.keys()]
            # Each leased segment's last step results first (under their fences).
            recorded = dict(refused)
            recorded.update(zip(
                (fence.run_id for fence, _ in todo),
                record_many(tx, todo, self._record_live)
                if any(fields for _, fields in todo)
                else [outcome.Value(None) for _ in todo],
                strict=True,
            ))
            live = [
                (fence, output)
                for fence, output, _ in items
                if isinstance(recorded.get(fence.run_id), outcome.Value)
            ]
            completed = self._complete_many(tx, live)
            completed.update(ended)
            results: list[outcome.Outcome[JobOutcome]] = []
            for fence, _, _ in items:
                steps_done = recorded.get(fence.run_id)
                if isinstance(steps_done, outcome.Error):
                    results.append(outcome.Error(steps_done.error))
                    continue
                one = completed.get(fence.run_id)
                results.append(
                    outcome.Value(one) if one is not None else outcome.Error(StaleExecution(
                        f"segment {fence.run_id}/{fence.execution_seq} is not the live lease"
                    ))
                )
            return results

        return work

    def _begin_and_complete(
        self,
        tx: Tx,
        items: list[tuple[tuple[Fence, list[tuple[Any, ...]]], tuple[Fence, Any, list[StepResult]]]],
    ) -> dict[str, JobOutcome]:
        """Segments whose JobAck, step results and job result are applied
        together (different runs; ``items``: the step fields, the item): each
        live reservation's queue row out (the activation's fence: the same
        session, seq and token, the session still there, the run at that seq
        and not ended), its credit freed and its run completed, with no lease
        written and deleted between (docs/design.md, "A segment that begins
        and ends in one transaction"); then each one's ``run.started`` audit,
        its step results (proven live by that DELETE, whose row lock holds
        off every other end of the reservation until commit) and its end.
        The outcome of each begun segment; the others are left as they were."""
        if not items:
            return {}
        rows = [
            (f.run_id, f.execution_seq, f.session_id, token_hash(f.lease_token), enc(output))
            for (f, _), (_, output, _) in items
        ]
        steps = step_rows([prepared for prepared, _ in items])
        # With data-modifying WITH the unaudited runs' steps go in the same
        # statement when they fit one (no step twice: an upsert changes a row once).
        folded = tx.modifying_with and _one_statement(steps, len(rows) * 5 + len(steps) * STEP_ROW_PARAMS)
        begun = {row[0]: row[1:] for row in self._begin_ended(tx, rows, steps if folded else [])}
        fences = [(fence, fields) for (fence, fields), _ in items if fence.run_id in begun]
        for fence, _ in fences:
            if begun[fence.run_id][4]:
                write_audit(
                    tx, "run.started", fence.run_id, begun[fence.run_id][2],
                    {"execution_seq": fence.execution_seq},
                )
        audited = [row for row in steps if row[0] in begun and begun[row[0]][4]]
        if folded or audited:
            write_steps(tx, audited if folded else [row for row in steps if row[0] in begun])
        else:  # nothing to audit, every seq known
            write_steps_unaudited(
                tx, [row for row in steps if row[0] in begun], {fence.run_id: fence.execution_seq for fence, _ in fences}
            )
        return {
            fence.run_id: self._completed(tx, fence, output, begun[fence.run_id])
            for _, (fence, output, _) in items
            if fence.run_id in begun
        }

    @staticmethod
    def _begin_ended(
        tx: Tx, rows: list[tuple[Any, ...]], steps: list[tuple[Any, ...]]
    ) -> list[tuple[Any, ...]]:
        """:meth:`_begin_and_complete`'s writes over ``rows`` (run, seq,
        session, digest, output): the activation's DELETE (:meth:`_activate`,
        same conditions and lock order: the queue row, then the run row), the
        credit freed, the run completed with its start figures. Per run: its
        id, parent run, parent step, function, duration, audit flag.

        With data-modifying WITH (``tx.modifying_with``), one statement, which
        also writes ``steps`` (:meth:`_step_rows`) of the runs it began whose
        functions record no audit events, under the seq the DELETE proved
        (after the run rows, as a step written alone would be). Without (SQLite;
        ``steps`` then empty), one statement per table, its single writer
        making them one step."""
        if not tx.modifying_with:
            taken = tx.fetchall(
                _take_reservations_per_table(len(rows), "run_id, execution_seq, reservation_owner"),
                (*(row[0] for row in rows), *(value for row in rows for value in row[:4])),
            )
            return FenceOps._end_taken_per_table(tx, rows, taken, _BEGUN_AND_ENDED)
        written = (
            ", sv (run_id, step_id, name, status, output, error, duration_ms, seq) AS (VALUES "
            + ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?)"] * len(steps))
            + f"), i AS ({STEP_INSERT} SELECT sv.run_id, sv.step_id, sv.name,"
            " 'run', sv.status, sv.output, sv.error, sv.duration_ms, q.execution_seq,"
            " ironflow_now(), sv.seq FROM sv JOIN q ON q.run_id = sv.run_id"
            " JOIN r ON r.id = sv.run_id WHERE coalesce(r.audited, 0) = 0"
            f"{STEP_RESULT_UPSERT})"
        ) if steps else ""
        return tx.fetchall(
            "WITH v (run_id, execution_seq, session_id, digest, output) AS (VALUES "
            + ", ".join(["(?, ?, ?, ?, ?)"] * len(rows))
            + "), "
            + _taken_reservations("d.run_id, d.execution_seq, v.session_id, v.output")
            + ","
            " k AS (UPDATE worker_credits w SET claimed_run_id = NULL,"
            " claimed_execution_seq = NULL, held = 0 FROM q WHERE w.session_id = q.session_id"
            " AND w.claimed_run_id = q.run_id AND w.claimed_execution_seq = q.execution_seq),"
            f" r AS (UPDATE runs SET {_BEGUN_AND_ENDED}, output = q.output FROM q WHERE runs.id = q.run_id"
            f" RETURNING runs.id, parent_run_id, parent_step_id, {RUN_END_FIGURES}, {_AUDIT_FLAG} AS audited)"
            f"{written} SELECT * FROM r",
            (*(value for row in rows for value in row), *(value for row in steps for value in row)),
        )

    @staticmethod
    def _complete_rows(tx: Tx, rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """:meth:`_complete_many`'s rows (run, seq, session, digest, output):
        the fenced leases out (the fence verdict), their credits freed, their
        runs completed. Per run completed: its id, parent run, parent step,
        function, duration, audit flag.

        With data-modifying WITH (``tx.modifying_with``), one statement.
        Without (SQLite), one statement per table: ``run_id IN`` beside each
        row-value list keeps SQLite on the primary key (a row-value list of
        several rows alone makes it scan the table)."""
        if tx.modifying_with:
            return tx.fetchall(
                "WITH v (run_id, execution_seq, session_id, digest, output) AS (VALUES "
                + ", ".join(["(?, ?, ?, ?, ?)"] * len(rows))
                + f"), l AS (DELETE FROM concurrency_leases c USING v WHERE {fence_join('c', 'v')}"
                " RETURNING c.run_id, c.execution_seq, c.session_id, v.output),"
                " k AS (UPDATE worker_credits w SET claimed_run_id = NULL,"
                " claimed_execution_seq = NULL, held = 0 FROM l WHERE w.session_id = l.session_id"
                " AND w.claimed_run_id = l.run_id AND w.claimed_execution_seq = l.execution_seq)"
                f" UPDATE runs SET {_ENDED}, output = l.output FROM l"
                f" WHERE runs.id = l.run_id RETURNING runs.id, parent_run_id, parent_step_id,"
                f" {RUN_END_FIGURES}, {_AUDIT_FLAG}",
                tuple(value for row in rows for value in row),
            )
        runs = ", ".join("?" * len(rows))
        run_ids = [row[0] for row in rows]
        taken = tx.fetchall(
            f"DELETE FROM concurrency_leases WHERE run_id IN ({runs}) AND (run_id, execution_seq,"
            " session_id, lease_token_hash) IN (VALUES "
            + ", ".join(["(?, ?, ?, ?)"] * len(rows))
            + ") AND EXISTS (SELECT 1 FROM runs WHERE id = concurrency_leases.run_id"
            " AND current_execution_seq = concurrency_leases.execution_seq)"
            " RETURNING run_id, execution_seq, session_id",
            (*run_ids, *(value for row in rows for value in row[:4])),
        )
        return FenceOps._end_taken_per_table(tx, rows, taken, _ENDED)

    @staticmethod
    def _end_taken_per_table(
        tx: Tx, rows: list[tuple[Any, ...]], taken: list[tuple[Any, ...]], ends: str
    ) -> list[tuple[Any, ...]]:
        """SQLite: the segments ``taken`` (run, seq, session: their fence
        proven by the caller's DELETE) have their credits freed and their runs
        set by ``ends``, each with its output from ``rows`` (run, …, output
        fifth). Per run: its id, parent run, parent step, function, duration,
        audit flag."""
        if not taken:
            return []
        live = ", ".join("?" * len(taken))
        tx.execute(
            "UPDATE worker_credits SET claimed_run_id = NULL, claimed_execution_seq = NULL,"
            f" held = 0 WHERE claimed_run_id IN ({live}) AND (session_id, claimed_run_id,"
            " claimed_execution_seq) IN (VALUES " + ", ".join(["(?, ?, ?)"] * len(taken)) + ")",
            (*(row[0] for row in taken), *(v for run_id, seq, session in taken for v in (session, run_id, seq))),
        )
        outputs = {row[0]: row[4] for row in rows}
        return tx.fetchall(
            "WITH v (run_id, output) AS (VALUES " + ", ".join(["(?, ?)"] * len(taken)) + ")"
            f" UPDATE runs SET {ends}, output = v.output FROM v WHERE runs.id = v.run_id"
            f" RETURNING id, parent_run_id, parent_step_id, {RUN_END_FIGURES}, {_AUDIT_FLAG}",
            tuple(v for row in taken for v in (row[0], outputs[row[0]])),
        )

    def _complete_many(self, tx: Tx, items: list[tuple[Fence, Any]]) -> dict[str, JobOutcome]:
        """Every lease out, its credit freed, its run completed (different
        runs): PostgreSQL in one statement, SQLite in one statement per table
        (its single writer makes them one step). The outcome of each run whose
        fence was live; the others are left as they were."""
        if not items:
            return {}
        rows = [
            (f.run_id, f.execution_seq, f.session_id, token_hash(f.lease_token), enc(output))
            for f, output in items
        ]
        ended = self._complete_rows(tx, rows)
        by_run = {row[0]: row[1:] for row in ended}
        return {
            fence.run_id: self._completed(tx, fence, output, by_run[fence.run_id])
            for fence, output in items
            if fence.run_id in by_run
        }

    async def fail_job(self, fence: Fence, error: ErrorInfo) -> JobOutcome:
        def work(tx: Tx) -> JobOutcome:
            self._take_lease(tx, fence)
            # Whether the run has undos is read here, after its lease went
            # (store/compensation.py: locks), in the statement that reads the run.
            run = tx.fetchone(
                "SELECT r.attempt, r.max_attempts, r.concurrency_key, r.parent_run_id,"
                " r.parent_step_id, f.definition, f.audit, r.compensation, r.error,"
                f" {has_undos_sql('r.id')}"
                " FROM runs r JOIN functions f ON f.id = r.function_id WHERE r.id = ?",
                (compensation_step_id(fence.run_id, "registered"), fence.run_id),
            )
            assert run is not None
            attempt, max_attempts, ckey, parent_run_id, parent_step_id, definition, audit = run[:7]
            compensation, stored_error, has_undos = run[7:]
            if compensation is not None:  # the compensation segment's end
                return end_compensation(
                    tx, fence.run_id, compensation, stored_error, (parent_run_id, parent_step_id),
                    attempt=attempt, audit=bool(audit),
                )
            fd = self._fdef(definition)
            if error.retryable and attempt < max_attempts:
                row = tx.fetchone(
                    "UPDATE runs SET attempt = attempt + 1, status = 'waiting',"
                    " current_execution_seq = current_execution_seq + 1, error = ?,"
                    " updated_at = ironflow_now() WHERE id = ?"
                    " RETURNING current_execution_seq, attempt",
                    (enc(error), fence.run_id),
                )
                assert row is not None
                eligible_at = enqueue(
                    tx, fence.run_id, row[0], fd.id, ckey, fd.retries.delay_after(attempt), "retry"
                )
                audit_if_enabled(
                    tx,
                    "run.attempt.failed",
                    fence.run_id,
                    {"attempt": attempt, "next_attempt": row[1], "error": error.code},
                )
                return JobOutcome(fence.run_id, "waiting", row[0], eligible_at, row[1])
            if has_undos:  # the run's final failure: its undos run first
                seq, eligible_at = begin_compensation(tx, fence.run_id, "failure", error)
                return JobOutcome(fence.run_id, "waiting", seq, eligible_at, attempt, compensating=True)
            ended = tx.fetchone(
                "UPDATE runs SET status = 'failed', error = ?, ended_at = ironflow_now(),"
                f" updated_at = ironflow_now() WHERE id = ? RETURNING {RUN_END_FIGURES}",
                (enc(error), fence.run_id),
            )
            assert ended is not None
            if audit:
                write_audit(tx, "run.failed", fence.run_id, ended[0], {"error": error})
            kicked = resolve_parent(
                tx, parent_run_id, parent_step_id, fence.run_id, error=error
            )
            return JobOutcome(
                fence.run_id, "failed", attempt=attempt, kicked_run_ids=kicked,
                function_id=ended[0], duration_s=ended[1],
            )

        return await self._transact_ending(
            work, lambda outcome: [fence.run_id] if outcome.status in ("failed", "cancelled") else []
        )

    async def yield_job(
        self, fence: Fence, *, step_id: str, name: str, info: YieldInfo
    ) -> JobOutcome:
        def work(tx: Tx) -> JobOutcome:
            began_at, began_snapshot = self._take_lease(tx, fence)
            tx.execute(
                "UPDATE runs SET status = 'waiting', recovery_count = 0,"
                " updated_at = ironflow_now() WHERE id = ?",
                (fence.run_id,),
            )
            invoke_run_id = None
            kicked: list[str] = []
            wake_at: float | None
            if isinstance(info, WaitYield):
                if park_wait(
                    tx, fence, step_id, name, info,
                    began_at=began_at, began_snapshot=began_snapshot,
                ):
                    resumed = resume(tx, fence.run_id)
                    if resumed is not None:
                        return JobOutcome(fence.run_id, "waiting", resumed[0], resumed[1])
                return JobOutcome(fence.run_id, "waiting")
            if isinstance(info, SleepYield):
                kind, status, wake_at = "sleep", "sleeping", info.until
            else:
                assert isinstance(info, InvokeYield)
                kind, status, wake_at = "invoke", "waiting", info.timeout_at
                # A deleted function starts no child (ironflow/store/function_life.py).
                row = tx.fetchone(
                    "SELECT definition FROM functions WHERE id = ? AND deleted_at IS NULL",
                    (info.function_id,),
                )
                if row is None:
                    error = ErrorInfo(
                        message=f"function {info.function_id} is not registered (or was deleted)",
                        code=FunctionNotFound.code,
                        retryable=False,
                    )
                    self._park_step(
                        tx, fence, step_id, name, kind, "failed", None, error=enc(error)
                    )
                    resumed = resume(tx, fence.run_id)
                    assert resumed is not None
                    return JobOutcome(fence.run_id, "waiting", resumed[0], resumed[1])
                event_id = new_id("evt")
                try:
                    invoke_run_id = create_run(
                        tx,
                        self.definitions,
                        self._fdef(row[0]),
                        event_id,
                        info.input,
                        parent_run_id=fence.run_id,
                        parent_step_id=step_id,
                    )
                except KeyEvaluationFailed as exc:
                    # The child's key expression fails on this input (docs/triggers.md):
                    # no child; the invoke step fails, not retried.
                    error = ErrorInfo(message=str(exc), code=exc.code, retryable=False)
                    self._park_step(
                        tx, fence, step_id, name, kind, "failed", None, error=enc(error)
                    )
                    resumed = resume(tx, fence.run_id)
                    assert resumed is not None
                    return JobOutcome(fence.run_id, "waiting", resumed[0], resumed[1])
                self._insert_event(tx, event_id, INVOKED_EVENT, info.input, None, [invoke_run_id])
                kicked.append(invoke_run_id)
            if not self._park_step(
                tx, fence, step_id, name, kind, status, wake_at, invoke_run_id=invoke_run_id
            ):
                # The step settled after this segment read it (a replay of a
                # parked step the waker completed meanwhile): nothing to wait
                # for, so the run goes on rather than waiting on nothing.
                resumed = resume(tx, fence.run_id)
                if resumed is not None:
                    return JobOutcome(fence.run_id, "waiting", resumed[0], resumed[1], kicked_run_ids=kicked)
            return JobOutcome(fence.run_id, "waiting", kicked_run_ids=kicked)

        outcome = await self._transact(
            work, park_locks(info.event) if isinstance(info, WaitYield) else ()
        )
        self._announce_wake(info.until if isinstance(info, SleepYield) else info.timeout_at)
        return outcome

    @staticmethod
    def _park_step(
        tx: Tx,
        fence: Fence,
        step_id: str,
        name: str,
        kind: str,
        status: str,
        wake_at: float | None,
        *,
        error: str | None = None,
        invoke_run_id: str | None = None,
    ) -> bool:
        """Park a sleep or an invoke (a wait: ``waits.py``); False when the step
        was already completed (its row is left as it is)."""
        return 0 < tx.execute(
            "INSERT INTO steps (run_id, step_id, name, kind, status, error, execution_seq,"
            " created_at, seq, wake_at, invoke_run_id)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ironflow_now(), ?, ?, ?)"
            " ON CONFLICT (run_id, step_id) DO UPDATE SET kind = excluded.kind,"
            " status = excluded.status, error = excluded.error,"
            " execution_seq = excluded.execution_seq, wake_at = excluded.wake_at,"
            " wait_event = NULL, wait_match = NULL, wait_match_value = NULL, wait_key = NULL,"
            " invoke_run_id = excluded.invoke_run_id, claimed_by = NULL, claimed_at = NULL,"
            " pre_claim_status = NULL WHERE steps.status <> 'completed'",
            (
                fence.run_id, step_id, name, kind, status, error, fence.execution_seq,
                time.time_ns(), wake_at, invoke_run_id,
            ),
        )

    async def nack_job(self, fence: Fence, reason: JobNackReason) -> JobOutcome:
        digest = token_hash(fence.lease_token)

        def work(tx: Tx) -> JobOutcome:
            lease = tx.fetchone(
                f"DELETE FROM concurrency_leases WHERE {FENCE_SQL} RETURNING run_id",
                self._fence_params(fence),
            )
            if (
                lease is None
                and tx.fetchone(
                    # Normally a nack comes before activation: the live reservation proves the fence.
                    "SELECT 1 FROM dispatch_queue q JOIN runs r ON r.id = q.run_id"
                    " WHERE q.run_id = ? AND q.execution_seq = ? AND q.reservation_owner = ?"
                    " AND q.lease_token_hash = ? AND r.current_execution_seq = q.execution_seq",
                    (fence.run_id, fence.execution_seq, fence.session_id, digest),
                )
                is None
            ):
                raise StaleExecution(
                    f"segment {fence.run_id}/{fence.execution_seq} is neither reserved nor"
                    " leased with this token"
                )
            free_credit(
                tx,
                fence.session_id,
                fence.run_id,
                fence.execution_seq,
                hold=reason == "AT_CAPACITY",
            )
            if reason == "DRAINING":
                tx.execute(
                    "UPDATE worker_sessions SET draining = 1 WHERE id = ?", (fence.session_id,)
                )
            row = tx.fetchone(
                "UPDATE runs SET current_execution_seq = current_execution_seq + 1,"
                " status = 'waiting', updated_at = ironflow_now() WHERE id = ?"
                " RETURNING current_execution_seq, function_id, concurrency_key, attempt",
                (fence.run_id,),
            )
            assert row is not None
            eligible_at = enqueue(tx, fence.run_id, row[0], row[1], row[2], 0.0, "nack")
            # Always recorded, whatever the function's audit toggle, like every
            # capacity.* event: a run's story includes the assignments refused.
            write_audit(
                tx,
                "capacity.job.nacked",
                fence.run_id,
                row[1],
                {
                    "reason": reason,
                    "execution_seq": fence.execution_seq,
                    "next_execution_seq": row[0],
                    "session_id": fence.session_id,
                },
            )
            return JobOutcome(fence.run_id, "waiting", row[0], eligible_at, row[3])

        return await self._transact(work)

    @staticmethod
    def _release_held(tx: Tx, session_id: str, free_slots: int) -> None:
        """Give back up to ``free_slots`` credits held back after AT_CAPACITY
        nacks; a credit another transaction has locked is left for the next
        heartbeat (see :meth:`heartbeat`)."""
        if free_slots <= 0:
            return
        tx.execute(
            "UPDATE worker_credits SET held = 0 WHERE session_id = ? AND slot IN ("
            " SELECT slot FROM worker_credits WHERE session_id = ? AND held = 1"
            f" ORDER BY slot LIMIT ? {tx.lock()})",
            (session_id, session_id, free_slots),
        )

    async def heartbeat(
        self,
        session_id: str,
        jobs: list[ActiveJob] | None,
        *,
        session_expiry_s: float,
        lease_expiry_s: float,
    ) -> list[JobLeaseStatus]:
        """Renew a worker session and its jobs' leases; each job's state.

        PostgreSQL: after its session row, a heartbeat never waits for a row
        lock. Its leases and held credits are many rows of one session, and
        other transactions lock some of them in their own order (a group
        commit's job results delete leases in the order the calls came, a
        ``_complete_many`` in its join's): a heartbeat that waited for one
        while holding others would deadlock with them. So it skips a lease
        another transaction has locked (``renew_lock``: a job result, a
        cancel or a fence deleting it; a step write's ``FOR KEY SHARE`` is not
        in the way) and reports it REFRESHED when it is still live by the
        committed state: it is exactly as live as it was a moment before, and
        the next heartbeat, one ``heartbeat_interval_s`` later and far inside
        ``lease_expiry_s``, renews it if it is still there."""

        def work(tx: Tx) -> list[JobLeaseStatus]:
            row = tx.fetchone(
                "UPDATE worker_sessions SET expires_at = ironflow_now() + ?"
                " WHERE id = ? AND expires_at > ironflow_now() RETURNING max_concurrent_jobs",
                (float(session_expiry_s), session_id),
            )
            if row is None:
                raise SessionNotFound(f"worker session {session_id} expired or was closed")
            if jobs is None:
                # An expired lease is not revived, even before the scanner
                # reaps it: expiry is decided by the database clock, once.
                tx.execute(
                    "UPDATE concurrency_leases SET expires_at = ironflow_now() + ?"
                    " WHERE run_id IN (SELECT c.run_id FROM concurrency_leases c"
                    f" WHERE c.session_id = ? AND c.expires_at > ironflow_now() {tx.renew_lock('c')})",
                    (float(lease_expiry_s), session_id),
                )
                # No job list, no count of free slots: an older worker that
                # heartbeats is taken at its word and gets its held slots back.
                self._release_held(tx, session_id, row[0])
                return []
            refreshed = self._renew_leases(tx, session_id, jobs, lease_expiry_s)
            out: list[JobLeaseStatus] = []
            for job in jobs:
                digest = token_hash(job.lease_token)
                state: Literal["REFRESHED", "STALE", "UNKNOWN"]
                if job.run_id in refreshed or tx.fetchone(
                    # Live but locked by another transaction (skipped above),
                    # or assigned but not yet activated: the reservation is still ours.
                    f"SELECT 1 FROM concurrency_leases WHERE {FENCE_SQL}"
                    " AND expires_at > ironflow_now()",
                    (job.run_id, job.execution_seq, session_id, digest, job.run_id, job.execution_seq),
                ) or tx.fetchone(
                    "SELECT 1 FROM dispatch_queue WHERE run_id = ? AND execution_seq = ?"
                    " AND reservation_owner = ? AND lease_token_hash = ?",
                    (job.run_id, job.execution_seq, session_id, digest),
                ):
                    state = "REFRESHED"
                elif tx.fetchone("SELECT 1 FROM runs WHERE id = ?", (job.run_id,)):
                    state = "STALE"
                else:
                    state = "UNKNOWN"
                out.append(JobLeaseStatus(job.job_id, job.run_id, job.execution_seq, state))
            # k free slots on the worker release at most k held credits.
            self._release_held(tx, session_id, row[0] - len(jobs))
            return out

        return await self._transact(work)

    @staticmethod
    def _renew_leases(
        tx: Tx, session_id: str, jobs: list[ActiveJob], lease_expiry_s: float
    ) -> set[str]:
        """Extend the live, unlocked leases of ``jobs`` (one statement per
        chunk); the run ids renewed."""
        renewed: set[str] = set()
        for first in range(0, len(jobs), HEARTBEAT_JOBS_PER_STATEMENT):
            chunk = jobs[first:first + HEARTBEAT_JOBS_PER_STATEMENT]
            renewed.update(row[0] for row in tx.fetchall(
                "WITH f (run_id, execution_seq, session_id, digest) AS (VALUES "
                + ", ".join(["(?, ?, ?, ?)"] * len(chunk))
                + ") UPDATE concurrency_leases SET expires_at = ironflow_now() + ?"
                " WHERE run_id IN (SELECT c.run_id FROM concurrency_leases c, f"
                f" WHERE {fence_join('c', 'f')} AND c.expires_at > ironflow_now()"
                f" {tx.renew_lock('c')}) RETURNING run_id",
                (
                    *(v for job in chunk
                      for v in (job.run_id, job.execution_seq, session_id, token_hash(job.lease_token))),
                    float(lease_expiry_s),
                ),
            ))
        return renewed


def _taken_reservations(returning: str) -> str:
    """PostgreSQL: the CTE ``q`` deleting the queue row of each live
    reservation in ``v`` (run_id, execution_seq, session_id, digest, …):
    reserved for that session, with that token, the session's row still
    there (the join: an ack from a session removed since its reservation
    takes nothing, docs/isolation.md, race 1), the run at that seq and not ended.
    The fence of an activation and of a segment begun and ended at once."""
    return (
        "q AS (DELETE FROM dispatch_queue d USING v JOIN worker_sessions s"
        " ON s.id = v.session_id WHERE d.run_id = v.run_id"
        " AND d.execution_seq = v.execution_seq AND d.reservation_owner = v.session_id"
        " AND d.lease_token_hash = v.digest AND EXISTS (SELECT 1 FROM runs"
        " WHERE id = v.run_id AND current_execution_seq = v.execution_seq"
        f" AND status NOT IN {TERMINAL_SQL}) RETURNING {returning})"
    )


def _take_reservations_per_table(n: int, returning: str) -> str:
    """SQLite: :func:`_taken_reservations` as a statement over ``n``
    reservations (parameters: the n run ids, then run, seq, session, digest
    of each). ``run_id IN`` beside the row-value list keeps SQLite on the
    primary key (a row-value list of several rows alone makes it scan)."""
    return (
        "DELETE FROM dispatch_queue WHERE run_id IN (" + ", ".join("?" * n) + ")"
        " AND (run_id, execution_seq, reservation_owner, lease_token_hash) IN (VALUES "
        + ", ".join(["(?, ?, ?, ?)"] * n) + ")"
        " AND EXISTS (SELECT 1 FROM runs WHERE id = dispatch_queue.run_id"
        " AND current_execution_seq = dispatch_queue.execution_seq"
        f" AND status NOT IN {TERMINAL_SQL})"
        # A gone session's acks are refused: its queue rows stay.
        " AND EXISTS (SELECT 1 FROM worker_sessions WHERE id = dispatch_queue.reservation_owner)"
        f" RETURNING {returning}"
    )


def _one_statement(steps: list[tuple[Any, ...]], params: int) -> bool:
    """Whether step rows (run and step id first) can go in one upsert of
    ``params`` parameters: within the limit, and no (run, step) twice."""
    return params <= MAX_STATEMENT_PARAMS and len({(row[0], row[1]) for row in steps}) == len(steps)


def distinct_runs(items: Sequence[tuple[Fence, Any, list[StepResult]]]) -> bool:
    """Whether ``items`` are of different runs (a completion group's one
    transaction needs it; a repeated result goes one by one)."""
    return len({fence.run_id for fence, _, _ in items}) == len(items)


def completed_ids(results: list[outcome.Outcome[JobOutcome]]) -> list[str]:
    """The runs a :meth:`FenceOps.complete_jobs` transaction ended."""
    return [r.value.run_id for r in results if isinstance(r, outcome.Value)]


def completed_results(
    items: Sequence[tuple[Fence, Any, list[StepResult]]],
) -> Callable[[list[outcome.Outcome[JobOutcome]]], list[RunResult]]:
    """The results of the runs a completion transaction of ``items`` ended
    (their outputs are the items'): a result wait is answered from them."""
    outputs = {fence.run_id: output for fence, output, _ in items}
    return lambda results: [
        RunResult(r.value.run_id, "completed", True, outputs[r.value.run_id])
        for r in results
        if isinstance(r, outcome.Value)
    ]
