"""Reads for the API and the CLI: a run's detail (with why it waits), and
the lists of runs, leases, sessions, the queue and the audit trail.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ironflow.protocol import (
    TERMINAL_RUN_STATUSES,
    AuditList,
    AuditRecord,
    LeaseRecord,
    QueueRecord,
    RunDetail,
    RunList,
    RunRecord,
    SessionRecord,
)
from ironflow.store.base import RunNotFound
from ironflow.store.core import (
    LEASE_COLS,
    QUEUE_COLS,
    RUN_COLS,
    STEP_COLS,
    SqlStoreBase,
    Tx,
    dec,
    iso_time,
    lease_record,
    queue_record,
    run_record,
    step_record,
)
from ironflow.store.dispatch_flow import waiting_reason
from ironflow.store.pages import Keyset, PageQuery, read_page
from ironflow.store.records import PageRequest

# Runs newest first, by creation (indexes runs_page, runs_status_page, runs_function_page).
RUNS_ORDER = Keyset("runs", "r.created_at", "r.id", descending=True)
# The audit trail oldest first, as it happened (audit_page, audit_run_page, audit_type_page).
AUDIT_ORDER = Keyset("audit", "at", "id", descending=False)
_AUDIT_COLS = "id, at, type, run_id, function_id, data"


def _run_key(run: RunRecord) -> tuple[float, str]:
    return run.created_at, run.id


def _listed_run(row: tuple[Any, ...]) -> RunRecord:
    """A run as a list shows it without ``?include=data``: row[9] says whether
    it has an output (left out); the error without its traceback."""
    run = run_record((*row[:9], None, *row[10:]))
    omitted = ["output"] if row[9] else []
    error = run.error
    if error is not None and error.traceback is not None:
        error = msgspec.structs.replace(error, traceback=None)
        omitted.append("error.traceback")
    return msgspec.structs.replace(run, error=error, omitted=omitted) if omitted else run


def _audit_record(row: tuple[Any, ...]) -> AuditRecord:
    return AuditRecord(row[0], row[1], row[2], row[3], row[4], dec(row[5]))


def _listed_audit(row: tuple[Any, ...]) -> AuditRecord:
    return AuditRecord(row[0], row[1], row[2], row[3], row[4], None, omitted=["data"])


class ReadOps(SqlStoreBase):
    """Reads for the API and the CLI."""

    async def get_run(self, run_id: str) -> RunDetail:
        def work(tx: Tx) -> RunDetail:
            now = self._now(tx)
            row = tx.fetchone(f"SELECT {RUN_COLS} FROM runs r WHERE r.id = ?", (run_id,))
            if row is None:
                raise RunNotFound(f"run {run_id} not found")
            run = run_record(row)
            step_rows = tx.fetchall(
                f"SELECT {STEP_COLS}, wait_event, invoke_run_id FROM steps WHERE run_id = ?"
                " ORDER BY seq",
                (run_id,),
            )
            q = tx.fetchone(f"SELECT {QUEUE_COLS} FROM dispatch_queue WHERE run_id = ?", (run_id,))
            lease = tx.fetchone(
                f"SELECT {LEASE_COLS} FROM concurrency_leases WHERE run_id = ?", (run_id,)
            )
            queue = None if q is None else queue_record(q, now)
            reason = None
            if queue is not None:
                if queue.reason == "recovery" and queue.eligible_at > now:
                    reason = f"recovery grace until {iso_time(queue.eligible_at)}"
                elif queue.reason == "retry" and queue.eligible_at > now:
                    reason = f"retry delay until {iso_time(queue.eligible_at)}"
                elif queue.reason == "debounce" and queue.eligible_at > now:  # store/flow.py
                    reason = f"debounced until {iso_time(queue.eligible_at)}"
                elif queue.reason == "batch" and queue.eligible_at > now:
                    reason = f"batch filling until {iso_time(queue.eligible_at)}"
                elif queue.reason == "nack":
                    reason = "requeued after nack"
                else:
                    reason = "waiting for capacity"
                # Flow control : a throttle's start time, a full concurrency key.
                fdef = tx.fetchone("SELECT definition FROM functions WHERE id = ?", (run.function_id,))
                fd = self._fdef_or_none(fdef[0]) if fdef else None
                if fd is not None and queue.reservation_owner is None:
                    flow = waiting_reason(
                        tx, fd, run_id, run.concurrency_key, queue.eligible_at, queue.reason, now
                    )
                    reason = flow or reason
            elif lease is None and run.status not in TERMINAL_RUN_STATUSES:
                for s in step_rows:
                    kind, status, wake_at, wait_event, child = s[3], s[4], s[10], s[11], s[12]
                    if status == "sleeping":
                        reason = f"sleeping until {iso_time(wake_at)}"
                    elif status == "waiting" and kind == "wait":
                        reason = f"waiting for event {wait_event}" + (
                            f" until {iso_time(wake_at)}" if wake_at is not None else ""
                        )
                    elif status == "waiting" and kind == "invoke":
                        reason = f"waiting for invoked run {child}"
                    elif status == "waking":
                        reason = "waking"
            return RunDetail(
                run=run,
                steps=[step_record(s) for s in step_rows],
                queue=queue,
                lease=None if lease is None else lease_record(lease, now),
                waiting_reason=reason,
                db_now=now,
            )

        return await self._read(work)

    async def list_runs(
        self, *, status: str | None = None, function_id: str | None = None, limit: int = 50
    ) -> list[RunRecord]:
        page = PageRequest(limit=limit, include_data=True)
        return (await self.runs_page(page, status=status, function_id=function_id)).runs

    async def runs_page(
        self, page: PageRequest, *, status: str | None = None, function_id: str | None = None
    ) -> RunList:
        query = PageQuery(
            RUNS_ORDER,
            RUN_COLS if page.include_data else RUN_COLS.replace("r.output", "r.output IS NOT NULL"),
            "runs r",
            {"r.status": status, "r.function_id": function_id},
            ("r.output", "r.error") if page.include_data else ("r.error",),
            run_record if page.include_data else _listed_run,
            _run_key,
        )
        runs, cursor = await self._read(lambda tx: read_page(tx, query, page))
        return RunList(runs, cursor)

    async def get_run_record(self, run_id: str) -> RunRecord:
        def work(tx: Tx) -> RunRecord:
            row = tx.fetchone(f"SELECT {RUN_COLS} FROM runs r WHERE r.id = ?", (run_id,))
            if row is None:
                raise RunNotFound(f"run {run_id} not found")
            return run_record(row)

        return await self._read(work)

    async def list_leases(self, *, include_expired: bool = False) -> list[LeaseRecord]:
        def work(tx: Tx) -> list[LeaseRecord]:
            now = self._now(tx)
            # Expired by the database clock but not yet reaped by loop 1: not
            # active (a heartbeat can no longer revive them), shown only on request.
            only_active = "" if include_expired else " WHERE expires_at > ?"
            rows = tx.fetchall(
                f"SELECT {LEASE_COLS} FROM concurrency_leases{only_active} ORDER BY expires_at",
                () if include_expired else (now,),
            )
            return [lease_record(r, now) for r in rows]

        return await self._read(work)

    async def list_sessions(self) -> list[SessionRecord]:
        def work(tx: Tx) -> list[SessionRecord]:
            rows = tx.fetchall(
                "SELECT s.id, s.worker_id, s.node_id, s.mode, s.max_concurrent_jobs, s.draining,"
                " s.expires_at, s.created_at,"
                " (SELECT count(*) FROM worker_credits c WHERE c.session_id = s.id"
                "  AND c.claimed_run_id IS NOT NULL),"
                " (SELECT count(*) FROM worker_credits c WHERE c.session_id = s.id AND c.held = 1),"
                " s.function_ids FROM worker_sessions s ORDER BY s.created_at"
            )
            return [
                SessionRecord(
                    r[0],
                    r[1],
                    r[2],
                    r[3],
                    r[4],
                    bool(r[5]),
                    r[6],
                    r[7],
                    int(r[8]),
                    int(r[9]),
                    dec(r[10]),
                )
                for r in rows
            ]

        return await self._read(work)

    async def list_queue(self) -> list[QueueRecord]:
        def work(tx: Tx) -> list[QueueRecord]:
            now = self._now(tx)
            rows = tx.fetchall(
                f"SELECT {QUEUE_COLS} FROM dispatch_queue ORDER BY eligible_at, enqueued_at"
            )
            return [queue_record(r, now) for r in rows]

        return await self._read(work)

    async def list_audit(
        self, *, run_id: str | None = None, type: str | None = None, limit: int = 100
    ) -> list[AuditRecord]:
        page = PageRequest(limit=limit, include_data=True)
        return (await self.audit_page(page, run_id=run_id, type=type)).events

    async def audit_page(
        self, page: PageRequest, *, run_id: str | None = None, type: str | None = None
    ) -> AuditList:
        query = PageQuery(
            AUDIT_ORDER,
            _AUDIT_COLS if page.include_data else _AUDIT_COLS.replace("data", "NULL"),
            "audit_log",
            {"run_id": run_id, "type": type},
            ("data",) if page.include_data else (),
            _audit_record if page.include_data else _listed_audit,
            lambda record: (record.at, record.id),
        )
        events, cursor = await self._read(lambda tx: read_page(tx, query, page))
        return AuditList(events, cursor)
