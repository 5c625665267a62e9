"""A segment's step results, written under its fence: one segment's or many
segments' at once (different runs), each its own outcome, in as few
statements as PostgreSQL's parameter limit allows.

The fence verdict comes from the statement that writes the rows, and the
live lease is locked ``FOR KEY SHARE`` until commit, so whatever ends the
fence waits for the write (``docs/isolation.md``, races 4 and 5).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import outcome

from ironflow.protocol import ErrorInfo
from ironflow.store.base import StaleExecution, StepNotFound
from ironflow.store.core import (
    MAX_STATEMENT_PARAMS,
    SqlStoreBase,
    Tx,
    enc,
    fence_join,
    fences_alive,
    token_hash,
)
from ironflow.store.records import Fence, StepResult
from ironflow.store.transitions import write_audit

# A step's run's function id when that function records ordinary audit
# events, else NULL: read in the statement that writes the step.
_STEP_AUDITED_FUNCTION = (
    "(SELECT f.id FROM runs r JOIN functions f ON f.id = r.function_id"
    " WHERE r.id = steps.run_id AND f.audit = 1)"
)
# The columns a step result's row is written with (step.run's kind).
STEP_INSERT = (
    "INSERT INTO steps (run_id, step_id, name, kind, status, output, error,"
    " duration_ms, execution_seq, created_at, seq)"
)
# Bind parameters of one step row in the step-result INSERT.
STEP_ROW_PARAMS = 8


def _statement_chunks(rows: list[tuple[Any, ...]], per_row: int) -> list[list[tuple[Any, ...]]]:
    """``rows`` (run id, step id first) in order, cut into statements of at most
    :data:`MAX_STATEMENT_PARAMS` parameters in which no (run, step) repeats:
    one INSERT … ON CONFLICT may not change the same row twice, so a later
    result of the same step goes in the next statement, after the first."""
    chunks: list[list[tuple[Any, ...]]] = []
    seen: set[tuple[Any, Any]] = set()
    limit = max(1, MAX_STATEMENT_PARAMS // per_row)
    for row in rows:
        key = (row[0], row[1])
        if not chunks or key in seen or len(chunks[-1]) >= limit:
            chunks.append([])
            seen = set()
        chunks[-1].append(row)
        seen.add(key)
    return chunks


# How a step result is written: a completed row is never overwritten (a
# replayed result leaves it as it was); a failed one may be retried over.
STEP_RESULT_UPSERT = (
    " ON CONFLICT (run_id, step_id) DO UPDATE SET status = excluded.status,"
    " output = excluded.output, error = excluded.error,"
    " duration_ms = excluded.duration_ms, execution_seq = excluded.execution_seq"
    " WHERE steps.status <> 'completed'"
)

# Writes the rows of live segments and says which runs were live (record_live's shape).
RecordLive = Callable[[Tx, dict[str, Fence], list[tuple[Any, ...]]], set[str]]


def step_fields(steps: list[StepResult]) -> list[tuple[Any, ...]]:
    """Each step result's row fields after its run id: id, name, status,
    output (completed only) and error as JSON, duration."""
    return [
        (
            s.step_id,
            s.name,
            s.status,
            enc(s.output) if s.status == "completed" else None,
            None if s.error is None else enc(s.error),
            float(s.duration_ms),
        )
        for s in steps
    ]


def step_rows(prepared: list[tuple[Fence, list[tuple[Any, ...]]]]) -> list[tuple[Any, ...]]:
    """The step rows of :func:`step_fields` per segment, each with its
    run id first and its order last: when their transaction ran (a chain
    runs in arrival order), then their order in this call."""
    first = time.time_ns()
    rows: list[tuple[Any, ...]] = []
    for fence, fields in prepared:
        rows += [(fence.run_id, *row, first + len(rows) + i) for i, row in enumerate(fields)]
    return rows


def record_many(
    tx: Tx, prepared: list[tuple[Fence, list[tuple[Any, ...]]]], live_rows: RecordLive
) -> list[outcome.Outcome[None]]:
    """Several segments' step fields (:func:`step_fields`; different runs),
    each under its own fence (``live_rows``: :func:`record_live`, or the seam a
    test store overrides) and with its own outcome: StaleExecution, and
    nothing of it written, for a segment whose fence is not live."""
    rows = step_rows(prepared)
    fences = {fence.run_id: fence for fence, _ in prepared}
    live = live_rows(tx, fences, rows)
    return [
        outcome.Value(None) if fence.run_id in live or not fields else outcome.Error(StaleExecution(
            f"segment {fence.run_id}/{fence.execution_seq} is not the live lease"
        ))
        for fence, fields in prepared
    ]


def record_live(
    tx: Tx, fences: dict[str, Fence], rows: list[tuple[Any, ...]]
) -> set[str]:
    """Write the rows (:func:`step_rows`) of the segments whose fence is
    live, and audit them; the runs whose fence was live.

    With data-modifying WITH (``tx.modifying_with``): every segment's rows
    in one statement per chunk, each row written only if its fence is
    live, and the verdict of each fence from that same statement (a
    verdict read by a later statement could call a written row stale:
    docs/isolation.md, race 4). The fence's lease row is locked ``FOR KEY
    SHARE`` until commit: whatever ends the fence (cancel, loop 1, the
    run's end — each deletes the lease) waits for this write to commit,
    and a write behind such an end finds the lease gone (race 5: a step
    row committed after its run's cancel). A heartbeat's UPDATE of the
    lease does not wait for it.

    Without (SQLite): the fences checked (one statement), then the live
    ones' rows written; its single writer makes the check and the write
    one step, so no later transaction comes between them."""
    if not tx.modifying_with:
        checked = fences_alive(tx, list(fences.values()))
        write_steps(tx, [row for row in rows if row[0] in checked])
        return checked
    live: set[str] = set()
    for chunk in _statement_chunks(rows, STEP_ROW_PARAMS + 4):
        in_chunk = sorted({row[0] for row in chunk})
        heads = [
            (f.run_id, f.execution_seq, f.session_id, token_hash(f.lease_token))
            for f in (fences[run_id] for run_id in in_chunk)
        ]
        out = tx.fetchall(
            "WITH f (run_id, execution_seq, session_id, digest) AS (VALUES "
            + ", ".join(["(?, ?, ?, ?)"] * len(heads))
            + "), live AS (SELECT c.run_id, c.execution_seq FROM concurrency_leases c, f"
            f" WHERE {fence_join('c', 'f')} ORDER BY c.run_id {tx.key_share_lock('c')}),"
            " v (run_id, step_id, name, status, output, error, duration_ms, seq) AS (VALUES "
            + ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?)"] * len(chunk))
            + f"), i AS ({STEP_INSERT}"
            " SELECT v.run_id, v.step_id, v.name, 'run', v.status, v.output, v.error,"
            " v.duration_ms, live.execution_seq, ironflow_now(), v.seq FROM v, live"
            " WHERE live.run_id = v.run_id"
            + STEP_RESULT_UPSERT
            + f" RETURNING run_id, step_id, status, {_STEP_AUDITED_FUNCTION} AS audited)"
            " SELECT 0, run_id, step_id, status, audited FROM i"
            " UNION ALL SELECT 1, run_id, NULL, NULL, NULL FROM live",
            (
                *(value for head in heads for value in head),
                *(value for row in chunk for value in row),
            ),
        )
        live.update(row[1] for row in out if row[0] == 1)
        audit_steps(tx, chunk, [row[1:] for row in out if row[0] == 0])
    return live


def write_steps(tx: Tx, rows: list[tuple[Any, ...]]) -> None:
    """Write step rows (:func:`step_rows`) whose segments' fences the
    caller has proven in this transaction, and audit them."""
    for chunk in _statement_chunks(rows, STEP_ROW_PARAMS):
        written = tx.fetchall(
            "WITH v (run_id, step_id, name, status, output, error, duration_ms, seq) AS (VALUES "
            + ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?)"] * len(chunk))
            + f") {STEP_INSERT}"
            " SELECT v.run_id, v.step_id, v.name, 'run', v.status, v.output, v.error,"
            " v.duration_ms, (SELECT current_execution_seq FROM runs WHERE id = v.run_id),"
            " ironflow_now(), v.seq FROM v WHERE true"
            + STEP_RESULT_UPSERT
            + f" RETURNING run_id, step_id, status, {_STEP_AUDITED_FUNCTION}",
            tuple(value for row in chunk for value in row),
        )
        audit_steps(tx, chunk, written)


def write_steps_unaudited(tx: Tx, rows: list[tuple[Any, ...]], seqs: dict[str, int]) -> None:
    """:func:`write_steps` for segments whose functions record no audit
    events and whose execution seqs the caller knows (``seqs``: run →
    seq): the same rows, no per-row reads of the run and its function."""
    for chunk in _statement_chunks(rows, STEP_ROW_PARAMS + 1):
        tx.execute(
            f"{STEP_INSERT} VALUES "
            + ", ".join(["(?, ?, ?, 'run', ?, ?, ?, ?, ?, ironflow_now(), ?)"] * len(chunk))
            + STEP_RESULT_UPSERT,
            tuple(value for row in chunk for value in (*row[:7], seqs[row[0]], row[7])),
        )


def audit_steps(
    tx: Tx, chunk: list[tuple[Any, ...]], written: list[tuple[Any, ...]]
) -> None:
    """``step.completed`` for each completed row written whose function
    audits (``written``: run, step, status, audited function). Rows not
    written are idempotent replays of completed steps."""
    names = {(row[0], row[1]): row[2] for row in chunk}
    for run_id, step_id, status, audited in written:
        if status == "completed" and audited is not None:
            write_audit(
                tx, "step.completed", run_id, audited,
                {"step_id": step_id, "name": names[(run_id, step_id)]},
            )


class StepResultOps(SqlStoreBase):
    """``record_step(s)`` and ``record_steps_many`` (see the module docstring)."""

    # How live segments' rows are written (:func:`record_live`), reached
    # through the class so a test store can plant a bug (tests/sim/bugs.py).
    _record_live = staticmethod(record_live)

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
        await self.record_steps(
            fence, [StepResult(step_id, name, status, output, error, duration_ms)]
        )

    async def step_output(self, run_id: str, step_id: str) -> str:
        def work(tx: Tx) -> str:
            row = tx.fetchone(
                "SELECT output FROM steps WHERE run_id = ? AND step_id = ? AND status = 'completed'",
                (run_id, step_id),
            )
            if row is None:
                raise StepNotFound(f"run {run_id} has no completed step {step_id!r}")
            return row[0] if row[0] is not None else "null"

        return await self._transact(work)

    def _record(self, tx: Tx, fence: Fence, fields: list[tuple[Any, ...]]) -> None:
        """Write one segment's step results under its fence (StaleExecution,
        and nothing written, if it is not live)."""
        record_many(tx, [(fence, fields)], self._record_live)[0].unwrap()

    async def record_steps(self, fence: Fence, steps: list[StepResult]) -> None:
        if not steps:
            return
        fields = step_fields(steps)
        await self._transact(lambda tx: self._record(tx, fence, fields))

    async def record_steps_many(
        self, items: Sequence[tuple[Fence, list[StepResult]]]
    ) -> list[outcome.Outcome[None]]:
        if len(items) <= 1 or len({fence.run_id for fence, _ in items}) < len(items):
            return await super().record_steps_many(items)
        prepared = [(fence, step_fields(steps)) for fence, steps in items]
        return await self._transact(lambda tx: record_many(tx, prepared, self._record_live))
