"""Ingest: events in (idempotency window, the trigger index, trigger filters,
cancel-on, runs created; with a trace's ``traceparent`` if they carry one),
parked ``wait_for_event`` steps resolved, direct invocations, cancellation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ironflow.ids import new_id
from ironflow.protocol import (
    ErrorInfo,
    FunctionDef,
)
from ironflow.store.base import FunctionNotFound
from ironflow.store.cancel_on import (
    cancel_on_events,
    cancel_paths_sql,
    cancel_reason,
    subscribe_cancels,
)
from ironflow.store.core import (
    INVOKED_EVENT,
    MAX_STATEMENT_PARAMS,
    NamedLock,
    NewRun,
    SqlStoreBase,
    Tx,
    dec,
    enc,
    new_run,
    placeholders,
    trigger_patterns,
    triggered,
)
from ironflow.store.creation import create_run
from ironflow.store.filters import notes_text
from ironflow.store.flow import FlowGroup, FlowResult, IngestFlow, has_flow
from ironflow.store.records import CancelNotice, CancelOutcome, IngestResult
from ironflow.store.transitions import cancel
from ironflow.store.waits import ingest_locks, resolve_waits, wait_paths_sql

R = TypeVar("R")



def _cancelled_ids(results: list[IngestResult]) -> list[str]:
    """The runs these ingests ended by cancelling them (a compensating one has
    not ended: store/compensation.py)."""
    return [o.run_id for r in results for o in r.cancelled if not o.compensating]


class IngestOps(SqlStoreBase):
    """Events in, runs created, waits resolved, invocations, cancellation."""

    # The waits an ingest resolves (waits.py) and its flow decisions
    # (flow.py), reached through the class so a test subclass can plant a
    # bug (tests/sim/bugs.py), as ``flow_plan_class``.
    _resolve_waits = staticmethod(resolve_waits)
    ingest_flow_class: type[IngestFlow] = IngestFlow

    def __init__(self) -> None:
        super().__init__()
        self._ingest_flow = self.ingest_flow_class(self.definitions)

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
                return IngestResult(seen[0], dec(seen[1]), True)
        fds, paths, cancel_paths, paused = self._triggered_and_waited(tx, [name])
        return self._ingest_new(tx, name, data, idempotency_key, fds, paths, cancel_paths, paused)

    def _ingest_new(
        self, tx: Tx, name: str, data: Any, idempotency_key: str | None,
        functions: list[FunctionDef], paths: dict[str, list[str]],
        cancel_paths: dict[str, list[str]], paused: set[str],
    ) -> IngestResult:
        """A new event in, given the functions its name (or its group's names)
        may trigger, the match paths waited on, the cancel-on paths and the
        paused functions (:meth:`_triggered_and_waited`)."""
        event_id = new_id("evt")
        # Cancel first: the event never cancels a run it starts (cancel_on.py).
        cancelled = cancel_on_events(tx, [(event_id, name, data)], cancel_paths)[0]
        # A paused function starts nothing; the answer names it (ironflow/store/cron.py).
        live = [fd for fd in functions if fd.id not in paused and triggered(fd, name)]
        # Trigger filters and key expressions (filters.py), then ingest-side flow
        # control (store/flow.py) for the functions declaring it.
        fds, filtered = self.definitions.judge(live, event_id, name, data)
        flow = self._ingest_flow.flow(tx, fds, event_id, name, data) if any(has_flow(fd) for fd in fds) else None
        note = notes_text(filtered, [o.run_id for o in cancelled])
        flow_json = None if flow is None else flow.flow_json()
        run_ids = self._create_runs_with_event(
            tx, fds if flow is None else flow.runs, event_id, name, data, idempotency_key,
            None if note is None else {event_id: note}, None if flow_json is None else {event_id: flow_json},
        )
        resumed = self._resolve_waits(tx, [(event_id, name, data)], paths)[0]
        if flow is not None:
            cancelled = [*cancelled, *flow.cancelled]
        return IngestResult(
            event_id, run_ids, False,
            resumed_run_ids=[*resumed, *(r for o in cancelled for r in o.kicked_run_ids)],
            cancelled=cancelled,
            paused_function_ids=[fd.id for fd in functions if fd.id in paused and triggered(fd, name)],
            flow=[] if flow is None else flow.notes,
        )

    def _create_runs_with_event(
        self, tx: Tx, runs: Sequence[FunctionDef | NewRun], event_id: str, name: str, data: Any,
        key: str | None, notes: dict[str, str] | None = None, flows: dict[str, str] | None = None,
    ) -> list[str]:
        """Create ``runs`` (a definition: a plain new run) for event
        ``event_id`` and record the event with their ids: one event's
        :meth:`_create_runs_with_events`. ``notes``: event id → its
        ``events.notes`` (filters.py); ``flows``: → its ``events.flow`` (flow.py)."""
        return self._create_runs_with_events(tx, [(event_id, name, data, key, list(runs))], notes, flows)[0]

    def _create_runs_with_events(
        self, tx: Tx, events: Sequence[tuple[str, str, Any, str | None, list[FunctionDef | NewRun]]],
        notes: dict[str, str] | None = None, flows: dict[str, str] | None = None,
    ) -> list[list[str]]:
        """Create the runs of several events (``(event_id, name, data, key,
        runs)`` each; a definition: a plain new run) and record each event with
        its run ids, in one statement per table (SQLite; PostgreSQL: the three
        in one statement) unless that would carry more than
        :data:`MAX_STATEMENT_PARAMS` parameters (then halves, in order); each
        event's run ids. The runs are written under pre-made event ids (no
        foreign key ties them), so each event is written once, with its runs."""
        params = sum(7 + 12 * len(runs) for *_, runs in events)
        if params > MAX_STATEMENT_PARAMS and len(events) > 1:
            half = len(events) // 2
            return [
                *self._create_runs_with_events(tx, events[:half], notes, flows),
                *self._create_runs_with_events(tx, events[half:], notes, flows),
            ]
        event_rows: list[Any] = []
        run_rows: list[Any] = []
        queue_rows: list[Any] = []
        all_run_ids: list[list[str]] = []
        subscribing: list[tuple[str, FunctionDef, Any]] = []
        prioritised: list[tuple[str, float]] = []
        batched: list[tuple[str, str]] = []
        for event_id, name, data, key, runs in events:
            run_ids: list[str] = []
            for planned in runs:
                new = planned if isinstance(planned, NewRun) else new_run(planned)
                fd, run_id, ckey = new.fd, new.run_id, self.definitions.run_key(new.fd, name, data, event_id)
                if new.reason == "new":
                    run_ids.append(run_id)
                run_rows += [
                    run_id, fd.id, event_id, max(1, fd.retries.max_attempts), ckey, fd.timeout_s,
                    1 if new.batch else None,
                ]
                queue_rows += [run_id, fd.id, ckey, new.delay_s, new.reason]
                if new.batch:
                    batched.append((run_id, event_id))
                if fd.cancel_on:
                    subscribing.append((run_id, fd, data))
                if fd.priority is not None:  # flow control : store/dispatch_flow.py
                    from ironflow.store.dispatch_flow import priority_of

                    prioritised.append((run_id, priority_of(fd, name, data)))
            event_rows += [
                event_id, name, enc(data), key, enc(run_ids), (notes or {}).get(event_id),
                (flows or {}).get(event_id),
            ]
            all_run_ids.append(run_ids)
        runs_n = len(run_rows) // 7
        events_sql = (
            "INSERT INTO events (id, name, data, idempotency_key, received_at, run_ids, notes, flow, xid)"
            " VALUES " + ", ".join([f"(?, ?, ?, ?, ironflow_now(), ?, ?, ?, {tx.xid_sql})"] * len(events))
        )
        if not runs_n:
            tx.execute(events_sql, event_rows)
            return all_run_ids
        tx.notify()
        runs_sql = (
            "INSERT INTO runs (id, function_id, event_id, status, attempt, max_attempts,"
            " recovery_count, current_execution_seq, concurrency_key, timeout_s, batch_size,"
            " created_at, updated_at) VALUES "
            + ", ".join(["(?, ?, ?, 'waiting_for_capacity', 1, ?, 0, 1, ?, ?, ?, ironflow_now(),"
                         " ironflow_now())"] * runs_n)
        )
        queue_sql = (
            "INSERT INTO dispatch_queue (run_id, execution_seq, function_id, concurrency_key,"
            " eligible_at, reason, enqueued_at) VALUES "
            + ", ".join(["(?, 1, ?, ?, ironflow_now() + ?, ?, ironflow_now())"] * runs_n)
        )
        if tx.modifying_with:
            tx.execute(
                f"WITH e AS ({events_sql}), r AS ({runs_sql}) {queue_sql}",
                (*event_rows, *run_rows, *queue_rows),
            )
        else:
            tx.execute(events_sql, event_rows)
            tx.execute(runs_sql, run_rows)
            tx.execute(queue_sql, queue_rows)
        subscribe_cancels(tx, subscribing)
        self._first_batch_events(tx, batched)
        if prioritised:
            from ironflow.store.dispatch_flow import set_priorities

            set_priorities(tx, prioritised)
        return all_run_ids

    @staticmethod
    def _first_batch_events(tx: Tx, runs: list[tuple[str, str]]) -> None:
        """New batch runs ``(run_id, event_id)``: their first event is batch event 0."""
        if runs:
            tx.execute(
                "INSERT INTO batch_events (run_id, position, event_id) VALUES "
                + ", ".join(["(?, 0, ?)"] * len(runs)),
                [p for row in runs for p in row],
            )

    def _triggered_and_waited(
        self, tx: Tx, names: list[str]
    ) -> tuple[list[FunctionDef], dict[str, list[str]], dict[str, list[str]], set[str]]:
        """The functions any of ``names`` may trigger, the match paths waited
        on per name (waits.py), those cancel-on entries name per name
        (cancel_on.py), and which of the functions are paused
        (ironflow/store/cron.py): one statement."""
        names = sorted(set(names))
        patterns = sorted({pattern for name in names for pattern in trigger_patterns(name)})
        # The third column says whether the function is paused (ironflow/store/cron.py).
        functions_sql = (
            "SELECT 0, f.definition, CASE WHEN f.paused_at IS NULL THEN NULL ELSE 'paused' END"
            " FROM functions f WHERE f.id IN (SELECT t.function_id"
            f" FROM function_triggers t WHERE t.pattern IN ({placeholders(len(patterns))}))"
        )
        rows = tx.fetchall(
            f"{functions_sql} UNION ALL SELECT 1, w.wait_event, w.wait_match FROM"
            f" ({wait_paths_sql(len(names))}) w UNION ALL SELECT 2, c.event_name,"
            f" c.match_path FROM ({cancel_paths_sql(len(names))}) c ORDER BY 1, 2, 3",
            (*patterns, *names, *names),
        )
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
        cancel_paths: dict[str, list[str]] = {}
        for kind, event, path in rows:
            if kind == 1:
                paths.setdefault(event, []).append(path)
            elif kind == 2:
                cancel_paths.setdefault(event, []).append(path)
        return fds, paths, cancel_paths, paused

    async def _transact_ingest(
        self, work: Callable[[Tx], R], results: Callable[[R], list[IngestResult]], locks: list[NamedLock]
    ) -> R:
        """Run an ingest: the runs it cancelled are announced as ended and
        (SQLite; PostgreSQL notified every node at commit) the jobs it took from
        workers are announced after commit (cancel_on.py)."""
        result = await self._transact_ending(work, lambda r: _cancelled_ids(results(r)), locks)
        if not self._notifies_cancels:
            self._announce_cancels([
                CancelNotice(o.run_id, o.session_id, o.job_id, cancel_reason(r.event_id))
                for r in results(result) for o in r.cancelled
                if o.session_id is not None and o.job_id is not None
            ])
        return result

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
        return await self._transact_ingest(
            lambda tx: self._ingest(tx, name, data, idempotency_key, idempotency_window_s),
            lambda result: [result],
            self._ingest_locks([(name, data, idempotency_key)]),
        )

    async def ingest_events(
        self,
        events: list[tuple[str, Any, str | None]],
        *,
        idempotency_window_s: float,
    ) -> list[IngestResult]:
        return await self._transact_ingest(
            lambda tx: self._ingest_group(tx, events, idempotency_window_s),
            lambda results: results,
            self._ingest_locks(events),
        )

    async def ingest_traced_events(
        self,
        events: list[tuple[str, Any, str | None, str | None]],
        *,
        idempotency_window_s: float,
    ) -> list[IngestResult]:
        """:meth:`ingest_events` for events that carry a W3C ``traceparent``
        (ironflow/tracing.py): the same transaction, plus one UPDATE recording
        it on each new event (a duplicate keeps the one it was first stored
        with); every assignment of its runs then carries it (dispatch.py reads
        ``events.traceparent``). Only an emit that has a trace pays the UPDATE."""
        plain = [(name, data, key) for name, data, key, _ in events]

        def work(tx: Tx) -> list[IngestResult]:
            results = self._ingest_group(tx, plain, idempotency_window_s)
            for result, (_, _, _, traceparent) in zip(results, events, strict=True):
                if traceparent is not None and not result.duplicate:
                    tx.execute(
                        "UPDATE events SET traceparent = ? WHERE id = ?",
                        (traceparent, result.event_id),
                    )
            return results

        return await self._transact_ingest(work, lambda results: results, self._ingest_locks(plain))

    def _ingest_group(
        self, tx: Tx, events: list[tuple[str, Any, str | None]], idempotency_window_s: float
    ) -> list[IngestResult]:
        """:meth:`ingest_events`' work in ``tx``."""
        if len(events) > 1 and all(key is None for _, _, key in events):
            return self._ingest_many(tx, [(name, data) for name, data, _ in events])
        return [self._ingest(tx, name, data, key, idempotency_window_s) for name, data, key in events]

    def _ingest_many(self, tx: Tx, events: list[tuple[str, Any]]) -> list[IngestResult]:
        """:meth:`_ingest` for several events without idempotency keys, in order,
        in a fixed number of statements whatever their number when nothing
        waits on their names: one reads the functions any of them triggers and
        the match paths waited on their names, then every event, run and queue
        row is written (PostgreSQL: one statement; SQLite: one per table);
        waits they satisfy are then resolved together (waits.py)."""
        functions, paths, cancel_paths, paused = self._triggered_and_waited(tx, [name for name, _ in events])
        if cancel_paths:
            # One by one, in order: a run one of them starts may be cancelled by
            # a later one (cancel_on.py).
            return [
                self._ingest_new(tx, name, data, None, functions, paths, cancel_paths, paused)
                for name, data in events
            ]
        live = [fd for fd in functions if fd.id not in paused]  # a paused function starts nothing
        planned: list[tuple[str, str, Any, str | None, list[FunctionDef | NewRun]]] = []
        flows: list[FlowResult | None] = []
        notes: dict[str, str] = {}
        flow_notes: dict[str, str] = {}
        created: list[list[str]] = []

        def create_planned() -> None:
            # The runs planned so far, with their events, in one statement.
            created.extend(self._create_runs_with_events(tx, planned[len(created):], notes, flow_notes))

        # Flow control decides on a key by reading its runs (store/flow.py):
        # those an earlier event of the group planned must exist first.
        group = FlowGroup(create_planned)
        judged = []
        for name, data in events:
            event_id = new_id("evt")
            starting, filtered = self.definitions.judge(live, event_id, name, data)
            note = notes_text(filtered, [])
            if note is not None:
                notes[event_id] = note
            judged.append((event_id, name, data, starting))
        self._ingest_flow.claim_keys(tx, group, judged)
        for event_id, name, data, starting in judged:
            flow = (
                self._ingest_flow.flow(tx, starting, event_id, name, data, group)
                if any(has_flow(fd) for fd in starting) else None
            )
            flows.append(flow)
            if flow is not None and flow.notes:
                flow_notes[event_id] = enc(flow.notes)
            planned.append((event_id, name, data, None, [*(starting if flow is None else flow.runs)]))
        create_planned()
        resumed = self._resolve_waits(
            tx, [(event_id, name, data) for event_id, name, data, _, _ in planned], paths
        )
        return [
            IngestResult(
                event_id, run_ids, False,
                resumed_run_ids=[*resumed_ids, *(r for o in cancelled for r in o.kicked_run_ids)],
                cancelled=cancelled,
                paused_function_ids=[fd.id for fd in functions if fd.id in paused and triggered(fd, name)],
                flow=[] if flow is None else flow.notes,
            )
            for (event_id, name, _, _, _), run_ids, resumed_ids, flow, cancelled in zip(
                planned, created, resumed, flows, [[] if f is None else f.cancelled for f in flows], strict=True
            )
        ]

    async def invoke_function(self, function_id: str, data: Any) -> str:
        def work(tx: Tx) -> str:
            row = tx.fetchone(
                "SELECT definition, deleted_at FROM functions WHERE id = ?", (function_id,)
            )
            if row is None:
                raise FunctionNotFound(f"function {function_id} is not registered")
            if row[1] is not None:  # ironflow/store/function_life.py
                raise FunctionNotFound(
                    f"function {function_id} was deleted; a worker registering it restores it"
                )
            event_id = new_id("evt")
            fd = self._fdef_or_none(row[0])
            if fd is None:
                raise FunctionNotFound(
                    f"function {function_id} has a stored definition this version refuses;"
                    " restart its worker to register it again"
                )
            run_id = create_run(tx, self.definitions, fd, event_id, data)
            self._insert_event(tx, event_id, INVOKED_EVENT, data, None, [run_id])
            return run_id

        return await self._transact(work)

    async def cancel_run(self, run_id: str, reason: str) -> CancelOutcome:
        def work(tx: Tx) -> CancelOutcome:
            error = ErrorInfo(message=reason, code="CANCELLED", retryable=False)
            return cancel(tx, run_id, error, {"reason": reason})

        return await self._transact_ending(work, lambda o: [] if o.compensating else [run_id])
