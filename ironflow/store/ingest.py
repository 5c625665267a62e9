"""Ingest: events in (idempotency window, the trigger index, runs created),
parked ``wait_for_event`` steps resolved, direct invocations, cancellation.
"""

from __future__ import annotations

from typing import Any

from ironflow.ids import new_id
from ironflow.protocol import (
    FunctionDef,
)
from ironflow.store.base import (
    CancelOutcome,
    FunctionNotFound,
    IngestResult,
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
from ironflow.store.flow import FlowOps, has_flow
from ironflow.store.waits import WaitOps, ingest_locks


class IngestOps(WaitOps, FlowOps):
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
        fds, paths = self._triggered_and_waited(tx, [name])
        return self._ingest_new(tx, name, data, idempotency_key, fds, paths)

    def _ingest_new(
        self, tx: Tx, name: str, data: Any, idempotency_key: str | None,
        functions: list[FunctionDef], paths: dict[str, list[str]],
    ) -> IngestResult:
        """A new event in, given the functions its name (or its group's names)
        may trigger and the match paths waited on (:meth:`_triggered_and_waited`)."""
        event_id = new_id("evt")
        fds = [fd for fd in functions if _triggered(fd, name)]
        # Ingest-side flow control (store/flow.py) decides for the functions declaring it.
        flow = self._flow(tx, fds, event_id, name, data) if any(has_flow(fd) for fd in fds) else None
        run_ids = self._create_runs_with_event(
            tx, fds if flow is None else flow.plain, event_id, name, data, idempotency_key
        )
        if flow is not None and flow.singletons:
            self._singletons_started(tx, flow, run_ids)
        if flow is not None and (flow.run_ids or flow.notes):
            run_ids = [*run_ids, *flow.run_ids]
            self._record_flow(tx, event_id, run_ids, flow)
        resumed = self._resolve_waits(tx, [(event_id, name, data)], paths)[0]
        if flow is None:
            return IngestResult(event_id, run_ids, False, resumed_run_ids=resumed)
        return IngestResult(
            event_id, run_ids, False, resumed_run_ids=resumed, flow=flow.notes, cancelled=flow.cancelled
        )

    def _triggered_and_waited(
        self, tx: Tx, names: list[str]
    ) -> tuple[list[FunctionDef], dict[str, list[str]]]:
        """The functions any of ``names`` may trigger, and the match paths waited
        on per name (waits.py): on PostgreSQL in one round trip."""
        names = sorted(set(names))
        patterns = sorted({pattern for name in names for pattern in _trigger_patterns(name)})
        functions_sql = (
            "SELECT 0, f.definition, NULL FROM functions f WHERE f.id IN (SELECT t.function_id"
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
        fds = [
            fd for fd in (self._fdef_or_none(row[1]) for row in rows if row[0] == 0) if fd is not None
        ]
        fds.sort(key=lambda fd: fd.id)
        paths: dict[str, list[str]] = {}
        for kind, event, path in rows:
            if kind == 1:
                paths.setdefault(event, []).append(path)
        return fds, paths

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
        result = await self._transact(
            lambda tx: self._ingest(tx, name, data, idempotency_key, idempotency_window_s),
            self._ingest_locks([(name, data, idempotency_key)]),
        )
        self._announce_cancelled([result])
        return result

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

        results = await self._transact(work, self._ingest_locks(events))
        self._announce_cancelled(results)
        return results

    def _announce_cancelled(self, results: list[IngestResult]) -> None:
        """This node's listeners hear of the singleton runs an ingest cancelled
        (other nodes by the transaction's ``runs_ended``: store/flow.py)."""
        self._announce_ended([c.run_id for r in results for c in r.cancelled])

    def _ingest_many(self, tx: Tx, events: list[tuple[str, Any]]) -> list[IngestResult]:
        """:meth:`_ingest` for several events without idempotency keys, in order,
        in two statements whatever their number when nothing waits on their
        names (PostgreSQL): one reads the functions any of them triggers and the
        match paths waited on their names, one writes every event, run and
        queue row; waits they satisfy are then resolved together (waits.py)."""
        functions, paths = self._triggered_and_waited(tx, [name for name, _ in events])
        if any(has_flow(fd) for fd in functions):
            # Flow control decides event by event, in order (store/flow.py).
            return [self._ingest_new(tx, name, data, None, functions, paths) for name, data in events]
        planned = [
            (new_id("evt"), name, data, None, [fd for fd in functions if _triggered(fd, name)])
            for name, data in events
        ]
        created = self._create_runs_with_events(tx, planned)
        resumed = self._resolve_waits(
            tx, [(event_id, name, data) for event_id, name, data, _, _ in planned], paths
        )
        return [
            IngestResult(event_id, run_ids, False, resumed_run_ids=resumed_ids)
            for (event_id, _, _, _, _), run_ids, resumed_ids in zip(planned, created, resumed, strict=True)
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
            return self._cancel(tx, run_id, reason)  # store/flow.py: shared with a singleton's cancel

        return await self._transact_ending(work, lambda _: [run_id])
