"""Ingest: events in (idempotency window, the trigger index, runs created),
parked ``wait_for_event`` steps resolved, direct invocations, cancellation.
"""

from __future__ import annotations

from typing import Any

from ironflow.ids import new_id
from ironflow.protocol import (
    TERMINAL_RUN_STATUSES,
    ErrorInfo,
    FunctionDef,
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
    NamedLock,
    Tx,
    _dec,
    _marks,
    _trigger_patterns,
    _triggered,
)
from ironflow.store.waits import WaitOps, ingest_locks


class IngestOps(WaitOps):
    """Events in, runs created, waits resolved, invocations, cancellation."""

    def _ingest(
        self, tx: Tx, name: str, data: Any, idempotency_key: str | None, window_s: float
    ) -> IngestResult:
        """One event in, under :meth:`_ingest_locks` (taken by the transaction)."""
        if idempotency_key is not None:
            seen = tx.fetchone(
                "SELECT id, run_ids FROM events WHERE idempotency_key = ?"
                " AND received_at > ironflow_now() - ? ORDER BY received_at LIMIT 1",
                (idempotency_key, float(window_s)),
            )
            if seen is not None:
                return IngestResult(seen[0], _dec(seen[1]), True)
        event_id = new_id("evt")
        fds, paths, paused = self._triggered_and_waited(tx, [name])
        run_ids = self._create_runs_with_event(
            tx, [fd for fd in fds if _triggered(fd, name) and fd.id not in paused], event_id, name, data,
            idempotency_key,
        )
        resumed = self._resolve_waits(tx, [(event_id, name, data)], paths)[0]
        return IngestResult(
            event_id, run_ids, False, resumed_run_ids=resumed,
            paused_function_ids=[fd.id for fd in fds if fd.id in paused and _triggered(fd, name)],
        )

    def _triggered_and_waited(
        self, tx: Tx, names: list[str]
    ) -> tuple[list[FunctionDef], dict[str, list[str]], set[str]]:
        """The functions any of ``names`` may trigger, the match paths waited
        on per name (waits.py), and which of those functions are paused
        (ironflow/store/cron.py): on PostgreSQL in one round trip."""
        names = sorted(set(names))
        patterns = sorted({pattern for name in names for pattern in _trigger_patterns(name)})
        # The third column says whether the function is paused (ironflow/store/cron.py).
        functions_sql = (
            "SELECT 0, f.definition, CASE WHEN f.paused_at IS NULL THEN NULL ELSE 'paused' END"
            " FROM functions f WHERE f.id IN (SELECT t.function_id"
            f" FROM function_triggers t WHERE t.pattern IN ({_marks(len(patterns))}))"
        )
        if tx.combined:
            rows = tx.fetchall(
                f"{functions_sql} UNION ALL SELECT 1, w.wait_event, w.wait_match FROM"
                f" ({self._wait_paths_sql(len(names))}) w ORDER BY 1, 2, 3",
                (*patterns, *names),
            )
        else:
            rows = tx.fetchall(functions_sql + " ORDER BY 2", patterns) + [
                (1, *row) for row in tx.fetchall(self._wait_paths_sql(len(names)), names)
            ]
        fds: list[FunctionDef] = []
        paused: set[str] = set()
        for row in rows:
            fd = self._fdef_or_none(row[1]) if row[0] == 0 else None
            if fd is not None:
                fds.append(fd)
                if row[2] is not None:
                    paused.add(fd.id)
        fds.sort(key=lambda fd: fd.id)
        paths: dict[str, list[str]] = {}
        for kind, event, path in rows:
            if kind == 1:
                paths.setdefault(event, []).append(path)
        return fds, paths, paused

    @staticmethod
    def _ingest_locks(events: list[tuple[str, Any, str | None]]) -> list[NamedLock]:
        """What an ingest of ``events`` locks before its first statement: each
        name shared against a park of a wait on it (waits.py), each idempotency
        key exclusive (two emits with one key: one records it, the other finds it)."""
        return [
            *ingest_locks(name for name, _, _ in events),
            *(("idem:" + key, True) for key in sorted({k for _, _, k in events if k is not None})),
        ]

    async def ingest_event(
        self,
        name: str,
        data: Any,
        idempotency_key: str | None,
        *,
        idempotency_window_s: float,
    ) -> IngestResult:
        return await self._transact(
            lambda tx: self._ingest(tx, name, data, idempotency_key, idempotency_window_s),
            self._ingest_locks([(name, data, idempotency_key)]),
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

        return await self._transact(work, self._ingest_locks(events))

    def _ingest_many(self, tx: Tx, events: list[tuple[str, Any]]) -> list[IngestResult]:
        """:meth:`_ingest` for several events without idempotency keys, in order,
        in two statements whatever their number when nothing waits on their
        names (PostgreSQL): one reads the functions any of them triggers and the
        match paths waited on their names, one writes every event, run and
        queue row; waits they satisfy are then resolved together (waits.py)."""
        functions, paths, paused = self._triggered_and_waited(tx, [name for name, _ in events])
        planned = [
            (new_id("evt"), name, data, None,
             [fd for fd in functions if _triggered(fd, name) and fd.id not in paused])
            for name, data in events
        ]
        created = self._create_runs_with_events(tx, planned)
        resumed = self._resolve_waits(
            tx, [(event_id, name, data) for event_id, name, data, _, _ in planned], paths
        )
        return [
            IngestResult(
                event_id, run_ids, False, resumed_run_ids=resumed_ids,
                paused_function_ids=[fd.id for fd in functions if fd.id in paused and _triggered(fd, name)],
            )
            for (event_id, name, _, _, _), run_ids, resumed_ids in zip(planned, created, resumed, strict=True)
        ]

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
            # The run's queue row and lease first, then the run: the order in
            # which an activation (queue row, lease, run) and a completion
            # (lease, run) take them, so a cancel racing either waits for it
            # rather than deadlocking with it; a step write holding the lease
            # (FOR KEY SHARE) commits before the cancel, never after it.
            tx.fetchone(f"SELECT 1 FROM dispatch_queue WHERE run_id = ? {tx.lock_wait()}", (run_id,))
            tx.fetchone(f"SELECT 1 FROM concurrency_leases WHERE run_id = ? {tx.lock_wait()}", (run_id,))
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
