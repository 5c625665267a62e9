"""Worker sessions and the functions they register: register (with the
trigger index and the node's limits), a pull session's ownership check, the
function list, and a session's close (its leases recovered as loop 1 would).
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

from ironflow.ids import new_id
from ironflow.protocol import (
    FunctionDef,
    FunctionRecord,
)
from ironflow.store.base import LimitExceeded
from ironflow.store.cancel_on import register_cancel_paths
from ironflow.store.core import (
    SqlStoreBase,
    Tx,
    dec,
    enc,
    exhausted_runs,
    placeholders,
    token_hash,
)
from ironflow.store.cron import read_schedules, sync_schedules
from ironflow.store.function_life import (
    LIVE_SQL,
    add_session,
    forget_sessions,
    live_params,
    lock_registered,
    rewind_skipped,
)
from ironflow.store.records import RecoveredSegment, SessionInfo
from ironflow.store.transitions import recover, write_audit


def _has_cron(fd: FunctionDef) -> bool:
    return any(t.cron is not None for t in fd.triggers)


class SessionOps(SqlStoreBase):
    """Worker sessions and their functions (see the module docstring)."""

    async def register_worker(
        self,
        *,
        node_id: str,
        worker_id: str,
        mode: Literal["stream", "pull"],
        max_concurrent_jobs: int,
        functions: list[FunctionDef],
        session_expiry_s: float,
        hostname: str = "",
        max_functions_per_trigger: int | None = None,
    ) -> SessionInfo:
        function_ids = [fd.id for fd in functions]
        secret = secrets.token_urlsafe(32) if mode == "pull" else None

        def work(tx: Tx) -> SessionInfo:
            deleted = lock_registered(tx, function_ids)  # function_life.py: a delete takes turns
            for fd in functions:
                self._upsert_function(tx, fd, max_functions_per_trigger)
            if function_ids:
                tx.execute(
                    "UPDATE functions SET last_seen_at = ironflow_now()"
                    f" WHERE id IN ({placeholders(len(function_ids))})",
                    function_ids,
                )
            session_id = new_id("ses")
            tx.execute(
                "INSERT INTO worker_sessions (id, worker_id, node_id, mode, max_concurrent_jobs,"
                " draining, function_ids, hostname, created_at, expires_at, secret_hash)"
                " VALUES (?, ?, ?, ?, ?, 0, ?, ?, ironflow_now(), ironflow_now() + ?, ?)",
                (
                    session_id,
                    worker_id,
                    node_id,
                    mode,
                    max_concurrent_jobs,
                    enc(function_ids),
                    hostname,
                    float(session_expiry_s),
                    None if secret is None else token_hash(secret),
                ),
            )
            tx.executemany(
                "INSERT INTO worker_credits (session_id, slot, held) VALUES (?, ?, 0)",
                [(session_id, slot) for slot in range(max_concurrent_jobs)],
            )
            # The functions are live again (function_life.py): their skipped
            # schedules catch up, a deleted one is restored.
            add_session(tx, session_id, function_ids)
            rewind_skipped(tx, [fd.id for fd in functions if _has_cron(fd)], self._now(tx))
            for fid in sorted(deleted):
                write_audit(tx, "function.restored", None, fid, {
                    "worker_id": worker_id, "session_id": session_id, "node_id": node_id,
                })
            return SessionInfo(
                session_id, worker_id, node_id, mode, max_concurrent_jobs, function_ids, secret
            )

        info = await self._transact(work)
        if any(_has_cron(fd) for fd in functions):
            for listener in self._schedule_listeners:  # ironflow/store/cron.py
                listener()
        return info

    def _upsert_function(self, tx: Tx, fd: FunctionDef, max_per_trigger: int | None) -> None:
        """Store ``fd``; when its definition changed, or it was deleted (and is
        restored: function_life.py), rewrite its trigger index rows and schedules."""
        changed = tx.fetchone(
            "INSERT INTO functions (id, definition, audit, version, updated_at)"
            " VALUES (?, ?, ?, 1, ironflow_now()) ON CONFLICT (id) DO UPDATE SET"
            " definition = excluded.definition, audit = excluded.audit,"
            " version = functions.version"
            " + CASE WHEN functions.definition <> excluded.definition THEN 1 ELSE 0 END,"
            " updated_at = excluded.updated_at, deleted_at = NULL"
            " WHERE functions.definition <> excluded.definition OR functions.deleted_at IS NOT NULL"
            " RETURNING id",
            (fd.id, enc(fd), 1 if fd.audit else 0),
        )
        if changed is None:
            return
        sync_schedules(tx, fd, self._now(tx))  # its cron triggers (ironflow/store/cron.py)
        register_cancel_paths(tx, fd)  # cancel on an event (cancel_on.py)
        patterns = sorted({t.event for t in fd.triggers if t.event is not None})
        if patterns and max_per_trigger is not None:
            crowded = tx.fetchone(
                "SELECT pattern, count(*) FROM function_triggers"
                f" WHERE pattern IN ({placeholders(len(patterns))}) AND function_id <> ?"
                " GROUP BY pattern HAVING count(*) >= ? LIMIT 1",
                [*patterns, fd.id, max_per_trigger],
            )
            if crowded is not None:
                raise LimitExceeded(
                    f"function {fd.id}: event pattern {crowded[0]!r} already triggers"
                    f" {crowded[1]} functions (limit {max_per_trigger})"
                )
        tx.execute("DELETE FROM function_triggers WHERE function_id = ?", (fd.id,))
        tx.executemany(
            "INSERT INTO function_triggers (pattern, function_id) VALUES (?, ?)",
            [(pattern, fd.id) for pattern in patterns],
        )

    async def pull_session(self, session_id: str, secret: str) -> SessionInfo | None:
        def work(tx: Tx) -> SessionInfo | None:
            row = tx.fetchone(
                "SELECT worker_id, node_id, max_concurrent_jobs, function_ids FROM worker_sessions"
                " WHERE id = ? AND mode = 'pull' AND secret_hash = ?"
                " AND expires_at > ironflow_now()",
                (session_id, token_hash(secret)),
            )
            if row is None:
                return None
            return SessionInfo(session_id, row[0], row[1], "pull", row[2], dec(row[3]))

        return await self._transact(work)

    async def list_functions(self, *, live_within_s: float | None = None) -> list[FunctionRecord]:
        def work(tx: Tx) -> list[FunctionRecord]:
            records = []
            schedules = read_schedules(tx)  # ironflow/store/cron.py
            live_sql, params = ("1", ()) if live_within_s is None else (
                LIVE_SQL, live_params(self._now(tx), live_within_s)
            )
            for fid, text, version, updated_at, seen, paused_at, deleted_at, live in tx.fetchall(
                "SELECT f.id, f.definition, f.version, f.updated_at, f.last_seen_at, f.paused_at,"
                f" f.deleted_at, {live_sql} FROM functions f ORDER BY f.id",
                params,
            ):
                fd = self._fdef_or_none(text)
                if fd is None:
                    continue  # stored by an older version under looser rules
                records.append(FunctionRecord(
                    fid, fd, version, updated_at, seen, bool(live), paused_at, schedules.get(fid, []),
                    deleted_at,
                ))
            return records

        return await self._transact(work)

    async def record_node_drain(self, kind: str, data: Any, *, run_id: str | None = None) -> None:
        def work(tx: Tx) -> None:
            function_id = None
            if run_id is not None:
                row = tx.fetchone("SELECT function_id FROM runs WHERE id = ?", (run_id,))
                function_id = row[0] if row is not None else None
            write_audit(tx, kind, run_id, function_id, data)

        await self._transact(work)

    async def close_session(
        self,
        session_id: str,
        *,
        recover_leases: bool,
        recovery_grace_s: float,
        recovery_ceiling: int,
    ) -> list[RecoveredSegment]:
        def work(tx: Tx) -> list[RecoveredSegment]:
            tx.notify()  # its reservations become claimable by any node
            tx.execute(
                "UPDATE dispatch_queue SET reservation_owner = NULL,"
                " reservation_expires_at = NULL, lease_token_hash = NULL"
                " WHERE reservation_owner = ?",
                (session_id,),
            )
            recovered: list[RecoveredSegment] = []
            if recover_leases:
                leases = tx.fetchall(
                    "SELECT run_id, execution_seq, function_id, session_id"
                    f" FROM concurrency_leases WHERE session_id = ? {tx.lock_wait()}",
                    (session_id,),
                )
                recovered = recover(
                    tx,
                    leases,
                    recovery_grace_s=recovery_grace_s,
                    recovery_ceiling=recovery_ceiling,
                    no_grace_first=True,
                )
            tx.execute("DELETE FROM worker_credits WHERE session_id = ?", (session_id,))
            forget_sessions(tx, [session_id], self._now(tx))  # its functions were last served now (function_life.py)
            tx.execute("DELETE FROM worker_sessions WHERE id = ?", (session_id,))
            return recovered

        return await self._transact_ending(work, exhausted_runs)
