"""Ingest: events in (idempotency window, the trigger index, runs created),
parked ``wait_for_event`` steps resolved, direct invocations, cancellation.
"""

from __future__ import annotations

from typing import Any

from ironflow.ids import new_id
from ironflow.protocol import (
    TERMINAL_RUN_STATUSES,
    ErrorInfo,
    lookup_path,
)
from ironflow.store.base import (
    CancelOutcome,
    Conflict,
    FunctionNotFound,
    IngestResult,
    RunNotFound,
)
from ironflow.store.core import (
    INVOKED_EVENT,
    SqlStoreBase,
    Tx,
    _dec,
    _enc,
    _marks,
    _trigger_patterns,
    _triggered,
)


class IngestOps(SqlStoreBase):
    """Events in, runs created, waits resolved, invocations, cancellation."""

    def _ingest(
        self, tx: Tx, name: str, data: Any, idempotency_key: str | None, window_s: float
    ) -> IngestResult:
        if idempotency_key is not None:
            tx.advisory_lock("idem:" + idempotency_key)
            seen = tx.fetchone(
                "SELECT id, run_ids FROM events WHERE idempotency_key = ?"
                " AND received_at > ironflow_now() - ? ORDER BY received_at LIMIT 1",
                (idempotency_key, float(window_s)),
            )
            if seen is not None:
                return IngestResult(seen[0], _dec(seen[1]), True)
        event_id = new_id("evt")
        patterns = _trigger_patterns(name)
        waiting: list[tuple[Any, ...]] | None = None
        if tx.combined:
            # The triggered functions and the parked waits on this event in one
            # round trip (the waits locked as _resolve_waits would lock them).
            rows = tx.fetchall(
                "WITH w AS (SELECT run_id, step_id, wait_match, wait_match_value FROM steps"
                f" WHERE status = 'waiting' AND kind = 'wait' AND wait_event = ? {tx.lock()})"
                " SELECT 0, f.id, f.definition, NULL, NULL, NULL FROM functions f WHERE f.id IN"
                " (SELECT t.function_id FROM function_triggers t WHERE t.pattern IN"
                f" ({_marks(len(patterns))})) UNION ALL"
                " SELECT 1, run_id, run_id, step_id, wait_match, wait_match_value FROM w"
                " ORDER BY 1, 2",
                (name, *patterns),
            )
            candidates = [(row[2],) for row in rows if row[0] == 0]
            waiting = [row[2:] for row in rows if row[0] == 1]
        else:
            candidates = tx.fetchall(
                "SELECT f.definition FROM functions f WHERE f.id IN (SELECT t.function_id"
                f" FROM function_triggers t WHERE t.pattern IN ({_marks(len(patterns))}))"
                " ORDER BY f.id",
                patterns,
            )
        fds = [
            fd
            for fd in (self._fdef_or_none(text) for (text,) in candidates)
            if fd is not None and _triggered(fd, name)
        ]
        run_ids = self._create_runs_with_event(tx, fds, event_id, name, data, idempotency_key)
        resumed = self._resolve_waits(tx, event_id, name, data, waiting)
        return IngestResult(event_id, run_ids, False, resumed_run_ids=resumed)

    async def ingest_event(
        self,
        name: str,
        data: Any,
        idempotency_key: str | None,
        *,
        idempotency_window_s: float,
    ) -> IngestResult:
        return await self._transact(
            lambda tx: self._ingest(tx, name, data, idempotency_key, idempotency_window_s)
        )

    async def ingest_events(
        self,
        events: list[tuple[str, Any, str | None]],
        *,
        idempotency_window_s: float,
    ) -> list[IngestResult]:
        def work(tx: Tx) -> list[IngestResult]:
            if tx.combined and len(events) > 1 and all(key is None for _, _, key in events):
                return self._ingest_many(tx, [(name, data) for name, data, _ in events])
            return [
                self._ingest(tx, name, data, key, idempotency_window_s)
                for name, data, key in events
            ]

        return await self._transact(work)

    def _ingest_many(self, tx: Tx, events: list[tuple[str, Any]]) -> list[IngestResult]:
        """:meth:`_ingest` for several events without idempotency keys, in order,
        in two statements whatever their number (PostgreSQL): one reads the
        functions any of them triggers and the waits parked on any of their
        names (locked), one writes every event, run and queue row."""
        names = sorted({name for name, _ in events})
        patterns = sorted({pattern for name in names for pattern in _trigger_patterns(name)})
        rows = tx.fetchall(
            "WITH w AS (SELECT run_id, step_id, wait_match, wait_match_value, wait_event FROM steps"
            f" WHERE status = 'waiting' AND kind = 'wait' AND wait_event IN ({_marks(len(names))})"
            f" {tx.lock()})"
            " SELECT 0, f.id, f.definition, NULL, NULL, NULL, NULL FROM functions f WHERE f.id IN"
            " (SELECT t.function_id FROM function_triggers t WHERE t.pattern IN"
            f" ({_marks(len(patterns))})) UNION ALL"
            " SELECT 1, run_id, run_id, step_id, wait_match, wait_match_value, wait_event FROM w"
            " ORDER BY 1, 2",
            (*names, *patterns),
        )
        functions = [
            fd for fd in (self._fdef_or_none(row[2]) for row in rows if row[0] == 0) if fd is not None
        ]
        waiting: dict[str, list[tuple[Any, ...]]] = {}
        for row in rows:
            if row[0] == 1:
                waiting.setdefault(row[6], []).append(row[2:6])
        planned = [
            (new_id("evt"), name, data, None, [fd for fd in functions if _triggered(fd, name)])
            for name, data in events
        ]
        created = self._create_runs_with_events(tx, planned)
        return [
            IngestResult(
                event_id, run_ids, False,
                resumed_run_ids=self._resolve_waits(tx, event_id, name, data, waiting.get(name, [])),
            )
            for (event_id, name, data, _, _), run_ids in zip(planned, created, strict=True)
        ]

    def _resolve_waits(
        self, tx: Tx, event_id: str, name: str, data: Any,
        waiting: list[tuple[Any, ...]] | None = None,
    ) -> list[str]:
        """Complete every parked ``wait_for_event`` step this event satisfies
        (``waiting``: those steps' rows, locked, if the caller read them)."""
        if waiting is None:
            waiting = tx.fetchall(
                "SELECT run_id, step_id, wait_match, wait_match_value FROM steps"
                f" WHERE status = 'waiting' AND kind = 'wait' AND wait_event = ? {tx.lock()}",
                (name,),
            )
        if not waiting:
            return []
        event = None
        resumed: list[str] = []
        for run_id, step_id, match, match_value in waiting:
            if match is not None and lookup_path(data, match) != _dec(match_value):
                continue
            if event is None:
                row = tx.fetchone("SELECT received_at FROM events WHERE id = ?", (event_id,))
                received_at = row[0] if row else None
                event = _enc(
                    {"id": event_id, "name": name, "data": data, "received_at": received_at}
                )
            if (
                tx.execute(
                    "UPDATE steps SET status = 'completed', output = ?, wake_at = NULL"
                    " WHERE run_id = ? AND step_id = ? AND status = 'waiting'",
                    (event, run_id, step_id),
                )
                and self._resume(tx, run_id) is not None
            ):
                resumed.append(run_id)
        return resumed

    async def invoke_function(self, function_id: str, data: Any) -> str:
        def work(tx: Tx) -> str:
            row = tx.fetchone("SELECT definition FROM functions WHERE id = ?", (function_id,))
            if row is None:
                raise FunctionNotFound(f"function {function_id} is not registered")
            event_id = new_id("evt")
            fd = self._fdef_or_none(row[0])
            if fd is None:
                raise FunctionNotFound(
                    f"function {function_id} has a stored definition this version refuses;"
                    " restart its worker to register it again"
                )
            run_id = self._create_run(tx, fd, event_id, data)
            self._insert_event(tx, event_id, INVOKED_EVENT, data, None, [run_id])
            return run_id

        return await self._transact(work)

    async def cancel_run(self, run_id: str, reason: str) -> CancelOutcome:
        def work(tx: Tx) -> CancelOutcome:
            run = tx.fetchone(
                "SELECT status, current_execution_seq, parent_run_id, parent_step_id"
                f" FROM runs WHERE id = ? {tx.lock_wait()}",
                (run_id,),
            )
            if run is None:
                raise RunNotFound(f"run {run_id} not found")
            if run[0] in TERMINAL_RUN_STATUSES:
                raise Conflict(f"run {run_id} already {run[0]}")
            error = ErrorInfo(message=reason, code="CANCELLED", retryable=False)
            outcome = self._end_run(tx, run_id, "cancelled", error, run[2], run[3])
            self._audit_if_enabled(tx, "run.cancelled", run_id, {"reason": reason})
            return outcome

        return await self._transact_ending(work, lambda _: [run_id])
