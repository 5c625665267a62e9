"""The one implementation of :class:`~ironflow.store.base.Store`, shared by both backends.

Every public method builds a synchronous ``work(tx)`` closure and hands it to
the backend's ``_transact``, which runs it as ONE transaction (SQLite: inside
the group-commit writer thread under a SAVEPOINT; PostgreSQL: on a pooled
connection in a worker thread). The SQL is written once with ``?``
placeholders; :class:`Tx` implementations translate for their driver. The
only dialect differences are fragments from :meth:`Tx.lock` (``FOR UPDATE
SKIP LOCKED`` on PostgreSQL, nothing on SQLite — its single writer already
serialises) and :meth:`Tx.advisory_lock` (PostgreSQL only).

Fencing lives in the SQL: a worker message may only change a segment when a
lease row with that ``(run_id, execution_seq, session_id, lease_token_hash)``
exists AND ``runs.current_execution_seq`` still equals that seq.
"""

from __future__ import annotations

import abc
import hashlib
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, Literal, Protocol, TypeVar

import msgspec

from ironflow.ids import new_id
from ironflow.protocol import (
    TERMINAL_RUN_STATUSES,
    ActiveJob,
    ErrorInfo,
    EventInfo,
    FunctionDef,
    InvokeYield,
    JobAssignment,
    JobLeaseStatus,
    JobNackReason,
    MemoStep,
    SleepYield,
    WaitYield,
    YieldInfo,
    job_id_for,
)
from ironflow.store.base import (
    AuditRecord,
    CancelOutcome,
    Conflict,
    Fence,
    FunctionNotFound,
    FunctionRecord,
    IngestResult,
    JobOutcome,
    LeaseRecord,
    LimitExceeded,
    Principal,
    PurgeCounts,
    QueueRecord,
    RecoveredSegment,
    Reservation,
    RunDetail,
    RunNotFound,
    RunRecord,
    SessionInfo,
    SessionNotFound,
    SessionRecord,
    StaleExecution,
    StepRecord,
    Store,
    StoreError,
)

T = TypeVar("T")


class IngestOutcome(IngestResult, frozen=True):
    """An :class:`IngestResult` that also names parked runs the event resumed
    (``wait_for_event`` matches), so the caller can kick the dispatcher."""

    resumed_run_ids: list[str] = []


class CancelResult(CancelOutcome, frozen=True):
    """A :class:`CancelOutcome` that also names a parent run resumed because its
    invoked child was cancelled."""

    kicked_run_ids: list[str] = []


# Marks a stored definition that today's bounds refuse (see SqlStore._fdef).
_INVALID_DEFINITION = "\x00invalid stored definition"
# Name of the synthetic event behind a direct invocation or a step.invoke child.
INVOKED_EVENT = "ironflow/function.invoked"
# Error code of a run that was recovered more often than the recovery ceiling allows.
RECOVERY_EXHAUSTED = "EXECUTION_RECOVERY_EXHAUSTED"
# Upper bound of leases/reservations one scanner pass fences, so one
# transaction stays short even after a mass worker death.
SCAN_BATCH = 500
# Candidate queue rows read per reservation slot wanted: concurrency limits may
# skip some rows, so read a few more than we hope to reserve.
RESERVE_OVERSCAN = 4

# Advisory lock under which one node at a time deletes history (PostgreSQL).
JANITOR_LOCK = "ironflow:janitor"
# Audit type of one history purge pass.
PURGE_AUDIT = "history.purged"

_TERMINAL_SQL = "('completed', 'failed', 'cancelled')"
_RUN_COLS = (
    "r.id, r.function_id, r.event_id, r.parent_run_id, r.status, r.attempt, r.max_attempts,"
    " r.recovery_count, r.current_execution_seq, r.output, r.error, r.created_at,"
    " r.started_at, r.ended_at, r.concurrency_key"
)
_STEP_COLS = (
    "run_id, step_id, name, kind, status, output, error, duration_ms, execution_seq,"
    " created_at, wake_at"
)
_QUEUE_COLS = (
    "run_id, function_id, execution_seq, eligible_at, reason, enqueued_at,"
    " reservation_owner, reservation_expires_at"
)
_LEASE_COLS = "run_id, function_id, execution_seq, session_id, node_id, expires_at, activated_at"
# The lease half of every fence check; params: run_id, seq, session_id, token_hash, run_id, seq.
_FENCE_SQL = (
    "run_id = ? AND execution_seq = ? AND session_id = ? AND lease_token_hash = ?"
    " AND EXISTS (SELECT 1 FROM runs WHERE id = ? AND current_execution_seq = ?)"
)

_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode
_error_decode = msgspec.json.Decoder(ErrorInfo).decode
_function_decode = msgspec.json.Decoder(FunctionDef).decode


class Tx(Protocol):
    """The tiny transaction surface the shared SQL is written against."""

    dialect: str

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement; return the affected row count."""

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None: ...

    def fetchone(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None: ...

    def fetchall(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...

    def lock(self, of: str | None = None) -> str:
        """``FOR UPDATE [OF of] SKIP LOCKED`` on PostgreSQL, ``""`` on SQLite."""

    def lock_wait(self) -> str:
        """``FOR UPDATE`` (waits for a concurrent holder) on PostgreSQL, ``""`` on SQLite."""

    def notify(self) -> None:
        """Tell every node's dispatcher, at commit, that queue rows became claimable."""

    def share_lock(self, of: str) -> str:
        """``FOR SHARE OF of`` (waits) on PostgreSQL, ``""`` on SQLite."""

    def advisory_lock(self, key: str) -> None:
        """Transaction-scoped named lock on PostgreSQL; a no-op on SQLite."""

    def try_advisory_lock(self, key: str) -> bool:
        """Take the transaction-scoped named lock if free (PostgreSQL); True on SQLite."""


# ── small helpers ──────────────────────────────────────────────────────────


def _where(filters: dict[str, Any]) -> tuple[str, list[Any]]:
    """``WHERE col = ? AND …`` for the filters that are not None (columns are ours, never input)."""
    used = {col: value for col, value in filters.items() if value is not None}
    if not used:
        return "", []
    return "WHERE " + " AND ".join(f"{col} = ?" for col in used), list(used.values())


def token_hash(token: str) -> str:
    """SHA-256 hex of a lease token or API key: the only form the database keeps."""
    return hashlib.sha256(token.encode()).hexdigest()


def _enc(value: Any) -> str:
    return _json_encode(value).decode()


def _dec(text: str | None) -> Any:
    return None if text is None else _json_decode(text)


def _dec_error(text: str | None) -> ErrorInfo | None:
    return None if text is None else _error_decode(text)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds")


def _marks(n: int) -> str:
    return ", ".join("?" * n)


def _lookup_path(data: Any, path: str) -> Any:
    """Value at dotted ``path`` in ``data`` (``event.data.``/``data.`` prefix ignored)."""
    for prefix in ("event.data.", "data."):
        if path.startswith(prefix):
            path = path[len(prefix) :]
            break
    value = data
    for part in path.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


def _concurrency_key(fd: FunctionDef, data: Any) -> str | None:
    if fd.concurrency is None or fd.concurrency.key is None:
        return None
    value = _lookup_path(data, fd.concurrency.key)
    if value is None:
        return None
    return value if isinstance(value, str) else _enc(value)


def _triggered(fd: FunctionDef, name: str) -> bool:
    for trigger in fd.triggers:
        if trigger.event == name:
            return True
        if trigger.event.endswith(".*") and name.startswith(trigger.event[:-1]):
            return True
    return False


def _trigger_patterns(name: str) -> list[str]:
    """Every trigger pattern that matches event ``name``: the name itself and
    ``prefix.*`` for each dot in it (``a.b.c`` → ``a.b.c``, ``a.*``, ``a.b.*``)."""
    return [name] + [name[: i + 1] + "*" for i, ch in enumerate(name) if ch == "."]


def _run_record(row: Sequence[Any]) -> RunRecord:
    return RunRecord(
        id=row[0],
        function_id=row[1],
        event_id=row[2],
        parent_run_id=row[3],
        status=row[4],
        attempt=row[5],
        max_attempts=row[6],
        recovery_count=row[7],
        current_execution_seq=row[8],
        output=_dec(row[9]),
        error=_dec_error(row[10]),
        created_at=row[11],
        started_at=row[12],
        ended_at=row[13],
        concurrency_key=row[14],
    )


def _step_record(row: Sequence[Any]) -> StepRecord:
    return StepRecord(
        run_id=row[0],
        step_id=row[1],
        name=row[2],
        kind=row[3],
        status=row[4],
        output=_dec(row[5]),
        error=_dec_error(row[6]),
        duration_ms=row[7],
        execution_seq=row[8],
        created_at=row[9],
        wake_at=row[10],
    )


def _queue_record(row: Sequence[Any], now: float) -> QueueRecord:
    return QueueRecord(
        run_id=row[0],
        function_id=row[1],
        execution_seq=row[2],
        eligible_at=row[3],
        reason=row[4],
        enqueued_at=row[5],
        reservation_owner=row[6],
        reservation_expires_at=row[7],
        eligible_in_s=row[3] - now,
    )


def _lease_record(row: Sequence[Any], now: float) -> LeaseRecord:
    return LeaseRecord(
        run_id=row[0],
        function_id=row[1],
        execution_seq=row[2],
        session_id=row[3],
        node_id=row[4],
        expires_at=row[5],
        activated_at=row[6],
        expires_in_s=row[5] - now,
    )


# ── the shared store ─────────────────────────────────────────────────────────


class SqlStore(Store):
    """Every Store method, written once. Backends supply ``_transact`` and lifecycle."""

    def __init__(self) -> None:
        # Decoded FunctionDefs keyed by their stored JSON text (decode once per version).
        self._defs: dict[str, FunctionDef] = {}

    @abc.abstractmethod
    async def _transact(self, work: Callable[[Tx], T]) -> T:
        """Run ``work(tx)`` as one transaction and return its result (or raise)."""

    # helpers used inside transactions -------------------------------------------

    def _fdef(self, text: str) -> FunctionDef:
        """The stored definition ``text``, decoded once per version.

        A definition that today's bounds refuse was stored by an older version
        under looser rules; its runs still execute, with the default retry
        policy and no concurrency limit, rather than failing every call that
        reads it (an emit, a reservation, a retry)."""
        fd = self._defs.get(text)
        if fd is None:
            if len(self._defs) > 4096:
                self._defs.clear()
            try:
                fd = _function_decode(text)
            except msgspec.ValidationError:
                raw = _json_decode(text)
                fid = raw.get("id") if isinstance(raw, dict) else None
                fd = FunctionDef(id=str(fid or "?"), name=_INVALID_DEFINITION)
            self._defs[text] = fd
        return fd

    def _fdef_or_none(self, text: str) -> FunctionDef | None:
        """Like :meth:`_fdef`, but a definition today's rules refuse is None: an
        emit never starts new runs of it (its worker must register it again)."""
        fd = self._fdef(text)
        return None if fd.name == _INVALID_DEFINITION else fd

    @staticmethod
    def _now(tx: Tx) -> float:
        row = tx.fetchone("SELECT ironflow_now()")
        assert row is not None
        return float(row[0])

    @staticmethod
    def _audit(tx: Tx, kind: str, run_id: str | None, function_id: str | None, data: Any) -> None:
        tx.execute(
            "INSERT INTO audit_log (id, at, type, run_id, function_id, data)"
            " VALUES (?, ironflow_now(), ?, ?, ?, ?)",
            (new_id("aud"), kind, run_id, function_id, _enc(data)),
        )

    @staticmethod
    def _audit_if_enabled(tx: Tx, kind: str, run_id: str, data: Any) -> None:
        """Ordinary audit events: only for functions whose definition has ``audit: true``."""
        tx.execute(
            "INSERT INTO audit_log (id, at, type, run_id, function_id, data)"
            " SELECT ?, ironflow_now(), ?, r.id, r.function_id, ? FROM runs r"
            " JOIN functions f ON f.id = r.function_id WHERE r.id = ? AND f.audit = 1",
            (new_id("aud"), kind, _enc(data), run_id),
        )

    @staticmethod
    def _free_credit(tx: Tx, session_id: str, run_id: str, seq: int, *, hold: bool = False) -> None:
        tx.execute(
            "UPDATE worker_credits SET claimed_run_id = NULL, claimed_execution_seq = NULL,"
            " held = ? WHERE session_id = ? AND claimed_run_id = ? AND claimed_execution_seq = ?",
            (1 if hold else 0, session_id, run_id, seq),
        )

    @staticmethod
    def _enqueue(
        tx: Tx,
        run_id: str,
        seq: int,
        function_id: str,
        concurrency_key: str | None,
        delay_s: float,
        reason: str,
    ) -> float:
        """Put segment ``(run_id, seq)`` on the queue (replacing any older row of the run)."""
        tx.notify()
        row = tx.fetchone(
            "INSERT INTO dispatch_queue (run_id, execution_seq, function_id, concurrency_key,"
            " eligible_at, reason, enqueued_at) VALUES (?, ?, ?, ?, ironflow_now() + ?, ?,"
            " ironflow_now()) ON CONFLICT (run_id) DO UPDATE SET"
            " execution_seq = excluded.execution_seq, eligible_at = excluded.eligible_at,"
            " reason = excluded.reason, enqueued_at = excluded.enqueued_at,"
            " reservation_owner = NULL, reservation_expires_at = NULL, lease_token_hash = NULL"
            " RETURNING eligible_at",
            (run_id, seq, function_id, concurrency_key, float(delay_s), reason),
        )
        assert row is not None
        return float(row[0])

    def _create_run(
        self,
        tx: Tx,
        fd: FunctionDef,
        event_id: str,
        data: Any,
        *,
        parent_run_id: str | None = None,
        parent_step_id: str | None = None,
    ) -> str:
        run_id = new_id("run")
        ckey = _concurrency_key(fd, data)
        tx.execute(
            "INSERT INTO runs (id, function_id, event_id, parent_run_id, parent_step_id, status,"
            " attempt, max_attempts, recovery_count, current_execution_seq, concurrency_key,"
            " created_at, updated_at) VALUES (?, ?, ?, ?, ?, 'waiting_for_capacity', 1, ?, 0, 1,"
            " ?, ironflow_now(), ironflow_now())",
            (
                run_id,
                fd.id,
                event_id,
                parent_run_id,
                parent_step_id,
                max(1, fd.retries.max_attempts),
                ckey,
            ),
        )
        self._enqueue(tx, run_id, 1, fd.id, ckey, 0.0, "new")
        return run_id

    def _insert_event(self, tx: Tx, name: str, data: Any, key: str | None = None) -> str:
        event_id = new_id("evt")
        tx.execute(
            "INSERT INTO events (id, name, data, idempotency_key, received_at)"
            " VALUES (?, ?, ?, ?, ironflow_now())",
            (event_id, name, _enc(data), key),
        )
        return event_id

    def _resume(self, tx: Tx, run_id: str) -> tuple[int, float] | None:
        """Queue a parked run's next segment now (reason 'resume'); None if not resumable."""
        row = tx.fetchone(
            "UPDATE runs SET current_execution_seq = current_execution_seq + 1,"
            " status = 'waiting', updated_at = ironflow_now()"
            f" WHERE id = ? AND status NOT IN {_TERMINAL_SQL}"
            " AND NOT EXISTS (SELECT 1 FROM concurrency_leases l WHERE l.run_id = runs.id)"
            " AND NOT EXISTS (SELECT 1 FROM dispatch_queue q WHERE q.run_id = runs.id)"
            " RETURNING current_execution_seq, function_id, concurrency_key",
            (run_id,),
        )
        if row is None:
            return None
        eligible_at = self._enqueue(tx, run_id, row[0], row[1], row[2], 0.0, "resume")
        return row[0], eligible_at

    def _resolve_parent(
        self,
        tx: Tx,
        parent_run_id: str | None,
        parent_step_id: str | None,
        child_id: str,
        *,
        output: Any = None,
        error: ErrorInfo | None = None,
    ) -> list[str]:
        """A child run ended: settle the parent's invoke step and resume the parent."""
        if parent_run_id is None or parent_step_id is None:
            return []
        if error is None:
            n = tx.execute(
                "UPDATE steps SET status = 'completed', output = ?, wake_at = NULL"
                " WHERE run_id = ? AND step_id = ? AND kind = 'invoke' AND status = 'waiting'"
                " AND invoke_run_id = ?",
                (_enc(output), parent_run_id, parent_step_id, child_id),
            )
        else:
            failure = ErrorInfo(
                message=f"invoked run {child_id} failed: {error.message}",
                code="INVOKE_FAILED",
                retryable=False,
            )
            n = tx.execute(
                "UPDATE steps SET status = 'failed', error = ?, wake_at = NULL"
                " WHERE run_id = ? AND step_id = ? AND kind = 'invoke' AND status = 'waiting'"
                " AND invoke_run_id = ?",
                (_enc(failure), parent_run_id, parent_step_id, child_id),
            )
        if n and self._resume(tx, parent_run_id) is not None:
            return [parent_run_id]
        return []

    def _fence_alive(self, tx: Tx, fence: Fence) -> bool:
        return (
            tx.fetchone(
                f"SELECT 1 FROM concurrency_leases WHERE {_FENCE_SQL}",
                self._fence_params(fence),
            )
            is not None
        )

    @staticmethod
    def _fence_params(fence: Fence) -> tuple[Any, ...]:
        return (
            fence.run_id,
            fence.execution_seq,
            fence.session_id,
            token_hash(fence.lease_token),
            fence.run_id,
            fence.execution_seq,
        )

    def _take_lease(self, tx: Tx, fence: Fence) -> tuple[str, str | None]:
        """Delete the fenced lease and free its credit; StaleExecution if it is not live."""
        row = tx.fetchone(
            f"DELETE FROM concurrency_leases WHERE {_FENCE_SQL} RETURNING function_id, node_id",
            self._fence_params(fence),
        )
        if row is None:
            raise StaleExecution(
                f"segment {fence.run_id}/{fence.execution_seq} is not the live lease"
            )
        self._free_credit(tx, fence.session_id, fence.run_id, fence.execution_seq)
        return row[0], row[1]

    def _recover(
        self,
        tx: Tx,
        leases: list[tuple[Any, ...]],
        *,
        recovery_grace_s: float,
        recovery_ceiling: int,
        no_grace_first: bool,
    ) -> list[RecoveredSegment]:
        """Fence and requeue (or fail at the ceiling) each lease row
        ``(run_id, execution_seq, function_id, session_id)``."""
        out: list[RecoveredSegment] = []
        for run_id, seq, function_id, session_id in leases:
            if not tx.execute(
                "DELETE FROM concurrency_leases WHERE run_id = ? AND execution_seq = ?",
                (run_id, seq),
            ):
                continue
            self._free_credit(tx, session_id, run_id, seq)
            row = tx.fetchone(
                "UPDATE runs SET current_execution_seq = current_execution_seq + 1,"
                " recovery_count = recovery_count + 1, status = 'waiting',"
                " updated_at = ironflow_now()"
                f" WHERE id = ? AND current_execution_seq = ? AND status NOT IN {_TERMINAL_SQL}"
                " RETURNING current_execution_seq, recovery_count, concurrency_key,"
                " parent_run_id, parent_step_id",
                (run_id, seq),
            )
            if row is None:
                continue
            new_seq, count, ckey, parent_run_id, parent_step_id = row
            self._audit(
                tx,
                "capacity.lease.expired",
                run_id,
                function_id,
                {"execution_seq": seq, "session_id": session_id, "recovery_count": count},
            )
            if count > recovery_ceiling:
                # The ceiling permits `recovery_ceiling` recoveries; this lease
                # loss is not one of them, so the count stays at the ceiling.
                count -= 1
                error = ErrorInfo(
                    message=f"segment lost its lease after {count} consecutive recoveries;"
                    f" recovery ceiling is {recovery_ceiling}",
                    code=RECOVERY_EXHAUSTED,
                    retryable=False,
                )
                tx.execute(
                    "UPDATE runs SET status = 'failed', error = ?, recovery_count = ?,"
                    " ended_at = ironflow_now(), updated_at = ironflow_now() WHERE id = ?",
                    (_enc(error), count, run_id),
                )
                self._audit_if_enabled(tx, "run.failed", run_id, {"error": error})
                self._resolve_parent(tx, parent_run_id, parent_step_id, run_id, error=error)
                out.append(
                    RecoveredSegment(run_id, function_id, seq, None, session_id, count, None, True)
                )
                continue
            grace = 0.0 if (no_grace_first and count == 1) else recovery_grace_s
            eligible_at = self._enqueue(tx, run_id, new_seq, function_id, ckey, grace, "recovery")
            self._audit(
                tx,
                "capacity.segment.recovered",
                run_id,
                function_id,
                {
                    "old_execution_seq": seq,
                    "new_execution_seq": new_seq,
                    "session_id": session_id,
                    "recovery_count": count,
                    "eligible_at": eligible_at,
                },
            )
            out.append(
                RecoveredSegment(
                    run_id, function_id, seq, new_seq, session_id, count, eligible_at, False
                )
            )
        return out

    # lifecycle ------------------------------------------------------------------

    async def db_now(self) -> float:
        return await self._transact(self._now)

    # nodes ----------------------------------------------------------------------

    async def register_node(self, node_id: str) -> None:
        def work(tx: Tx) -> None:
            tx.execute(
                "INSERT INTO nodes (id, started_at, heartbeat_at)"
                " VALUES (?, ironflow_now(), ironflow_now()) ON CONFLICT (id) DO UPDATE SET"
                " started_at = excluded.started_at, heartbeat_at = excluded.heartbeat_at",
                (node_id,),
            )

        await self._transact(work)

    async def node_heartbeat(self, node_id: str) -> None:
        def work(tx: Tx) -> None:
            if not tx.execute(
                "UPDATE nodes SET heartbeat_at = ironflow_now() WHERE id = ?", (node_id,)
            ):
                tx.execute(
                    "INSERT INTO nodes (id, started_at, heartbeat_at)"
                    " VALUES (?, ironflow_now(), ironflow_now())",
                    (node_id,),
                )

        await self._transact(work)

    # functions, workers, sessions -------------------------------------------------

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
            for fd in functions:
                self._upsert_function(tx, fd, max_functions_per_trigger)
            if function_ids:
                tx.execute(
                    "UPDATE functions SET last_seen_at = ironflow_now()"
                    f" WHERE id IN ({_marks(len(function_ids))})",
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
                    _enc(function_ids),
                    hostname,
                    float(session_expiry_s),
                    None if secret is None else token_hash(secret),
                ),
            )
            tx.executemany(
                "INSERT INTO worker_credits (session_id, slot, held) VALUES (?, ?, 0)",
                [(session_id, slot) for slot in range(max_concurrent_jobs)],
            )
            return SessionInfo(
                session_id, worker_id, node_id, mode, max_concurrent_jobs, function_ids, secret
            )

        return await self._transact(work)

    def _upsert_function(self, tx: Tx, fd: FunctionDef, max_per_trigger: int | None) -> None:
        """Store ``fd``; when its definition changed, rewrite its trigger index rows."""
        changed = tx.fetchone(
            "INSERT INTO functions (id, definition, audit, version, updated_at)"
            " VALUES (?, ?, ?, 1, ironflow_now()) ON CONFLICT (id) DO UPDATE SET"
            " definition = excluded.definition, audit = excluded.audit,"
            " version = functions.version + 1, updated_at = excluded.updated_at"
            " WHERE functions.definition <> excluded.definition RETURNING id",
            (fd.id, _enc(fd), 1 if fd.audit else 0),
        )
        if changed is None:
            return
        patterns = sorted({t.event for t in fd.triggers})
        if patterns and max_per_trigger is not None:
            crowded = tx.fetchone(
                "SELECT pattern, count(*) FROM function_triggers"
                f" WHERE pattern IN ({_marks(len(patterns))}) AND function_id <> ?"
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
            return SessionInfo(session_id, row[0], row[1], "pull", row[2], _dec(row[3]))

        return await self._transact(work)

    async def list_functions(self, *, live_within_s: float | None = None) -> list[FunctionRecord]:
        def work(tx: Tx) -> list[FunctionRecord]:
            now = self._now(tx)
            records = []
            for fid, text, version, updated_at, seen in tx.fetchall(
                "SELECT id, definition, version, updated_at, last_seen_at FROM functions"
                " ORDER BY id"
            ):
                fd = self._fdef_or_none(text)
                if fd is None:
                    continue  # stored by an older version under looser rules
                last = seen if seen is not None else updated_at
                live = live_within_s is None or last > now - live_within_s
                records.append(FunctionRecord(fid, fd, version, updated_at, seen, live))
            return records

        return await self._transact(work)

    async def heartbeat(
        self,
        session_id: str,
        jobs: list[ActiveJob] | None,
        *,
        session_expiry_s: float,
        lease_expiry_s: float,
    ) -> list[JobLeaseStatus]:
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
                    " WHERE session_id = ? AND expires_at > ironflow_now()",
                    (float(lease_expiry_s), session_id),
                )
                return []
            out: list[JobLeaseStatus] = []
            for job in jobs:
                digest = token_hash(job.lease_token)
                state: Literal["REFRESHED", "STALE", "UNKNOWN"]
                if tx.execute(
                    "UPDATE concurrency_leases SET expires_at = ironflow_now() + ?"
                    f" WHERE {_FENCE_SQL} AND expires_at > ironflow_now()",
                    (
                        float(lease_expiry_s),
                        job.run_id,
                        job.execution_seq,
                        session_id,
                        digest,
                        job.run_id,
                        job.execution_seq,
                    ),
                ):
                    state = "REFRESHED"
                elif tx.fetchone(
                    # Assigned but not yet activated: the reservation is still ours.
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
            if len(jobs) < row[0]:
                tx.execute(
                    "UPDATE worker_credits SET held = 0 WHERE session_id = ? AND held = 1",
                    (session_id,),
                )
            return out

        return await self._transact(work)

    async def mark_session_draining(self, session_id: str) -> None:
        def work(tx: Tx) -> None:
            tx.execute("UPDATE worker_sessions SET draining = 1 WHERE id = ?", (session_id,))

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
                recovered = self._recover(
                    tx,
                    leases,
                    recovery_grace_s=recovery_grace_s,
                    recovery_ceiling=recovery_ceiling,
                    no_grace_first=True,
                )
            tx.execute("DELETE FROM worker_credits WHERE session_id = ?", (session_id,))
            tx.execute("DELETE FROM worker_sessions WHERE id = ?", (session_id,))
            return recovered

        return await self._transact(work)

    # events and runs ----------------------------------------------------------------

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
        event_id = self._insert_event(tx, name, data, idempotency_key)
        patterns = _trigger_patterns(name)
        candidates = tx.fetchall(
            "SELECT f.definition FROM functions f WHERE f.id IN (SELECT t.function_id"
            f" FROM function_triggers t WHERE t.pattern IN ({_marks(len(patterns))}))"
            " ORDER BY f.id",
            patterns,
        )
        run_ids = [
            self._create_run(tx, fd, event_id, data)
            for fd in (self._fdef_or_none(text) for (text,) in candidates)
            if fd is not None and _triggered(fd, name)
        ]
        if run_ids:
            tx.execute("UPDATE events SET run_ids = ? WHERE id = ?", (_enc(run_ids), event_id))
        resumed = self._resolve_waits(tx, event_id, name, data)
        return IngestOutcome(event_id, run_ids, False, resumed_run_ids=resumed)

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
        return await self._transact(
            lambda tx: [
                self._ingest(tx, name, data, key, idempotency_window_s)
                for name, data, key in events
            ]
        )

    def _resolve_waits(self, tx: Tx, event_id: str, name: str, data: Any) -> list[str]:
        """Complete every parked ``wait_for_event`` step this event satisfies."""
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
            if match is not None and _lookup_path(data, match) != _dec(match_value):
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
            event_id = self._insert_event(tx, INVOKED_EVENT, data)
            fd = self._fdef_or_none(row[0])
            if fd is None:
                raise FunctionNotFound(
                    f"function {function_id} has a stored definition this version refuses;"
                    " restart its worker to register it again"
                )
            run_id = self._create_run(tx, fd, event_id, data)
            tx.execute("UPDATE events SET run_ids = ? WHERE id = ?", (_enc([run_id]), event_id))
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
            session_id = node_id = job_id = None
            lease = tx.fetchone(
                "DELETE FROM concurrency_leases WHERE run_id = ?"
                " RETURNING session_id, node_id, execution_seq",
                (run_id,),
            )
            if lease is not None:
                session_id, node_id = lease[0], lease[1]
                job_id = job_id_for(run_id, lease[2])
                self._free_credit(tx, lease[0], run_id, lease[2])
            queued = tx.fetchone(
                "DELETE FROM dispatch_queue WHERE run_id = ?"
                " RETURNING reservation_owner, execution_seq",
                (run_id,),
            )
            if queued is not None and queued[0] is not None:
                self._free_credit(tx, queued[0], run_id, queued[1])
                if session_id is None:
                    session_id = queued[0]
                    job_id = job_id_for(run_id, queued[1])
                    owner = tx.fetchone(
                        "SELECT node_id FROM worker_sessions WHERE id = ?", (session_id,)
                    )
                    node_id = owner[0] if owner else None
            error = ErrorInfo(message=reason, code="CANCELLED", retryable=False)
            tx.execute(
                "UPDATE runs SET status = 'cancelled', error = ?,"
                " current_execution_seq = current_execution_seq + 1,"
                " ended_at = ironflow_now(), updated_at = ironflow_now() WHERE id = ?",
                (_enc(error), run_id),
            )
            tx.execute(
                "UPDATE steps SET status = 'failed', wake_at = NULL, claimed_by = NULL,"
                " claimed_at = NULL, pre_claim_status = NULL"
                " WHERE run_id = ? AND status IN ('sleeping', 'waiting', 'waking')",
                (run_id,),
            )
            self._audit_if_enabled(tx, "run.cancelled", run_id, {"reason": reason})
            kicked = self._resolve_parent(tx, run[2], run[3], run_id, error=error)
            return CancelResult(run_id, session_id, node_id, job_id, kicked_run_ids=kicked)

        return await self._transact(work)

    # dispatch ---------------------------------------------------------------------------

    async def reserve_segments(
        self,
        node_id: str,
        offers: dict[str, frozenset[str]],
        limit: int,
        *,
        reservation_expiry_s: float,
    ) -> list[Reservation]:
        function_ids = sorted(set().union(*offers.values())) if offers else []
        session_ids = sorted(offers)
        if limit <= 0 or not function_ids:
            return []

        def work(tx: Tx) -> list[Reservation]:
            self._expire_reservations(tx)
            credits = tx.fetchall(
                "SELECT c.session_id, c.slot FROM worker_credits c"
                " JOIN worker_sessions s ON s.id = c.session_id"
                f" WHERE c.session_id IN ({_marks(len(session_ids))}) AND s.draining = 0"
                " AND s.expires_at > ironflow_now() AND c.claimed_run_id IS NULL AND c.held = 0"
                # The session rows are share-locked (waiting, not skipping): a
                # DRAINING nack committing meanwhile would otherwise requeue its
                # run into this very transaction's later read, for a session
                # this read still saw as not draining.
                f" ORDER BY c.session_id, c.slot {tx.lock('c')} {tx.share_lock('s')}",
                session_ids,
            )
            if not credits:
                return []
            free: dict[str, list[int]] = {}
            for sid, slot in credits:
                free.setdefault(sid, []).append(slot)
            candidates = tx.fetchall(
                "SELECT q.run_id, q.execution_seq, q.function_id, q.concurrency_key,"
                " f.definition FROM dispatch_queue q JOIN functions f ON f.id = q.function_id"
                " WHERE q.reservation_owner IS NULL AND q.eligible_at <= ironflow_now()"
                f" AND q.function_id IN ({_marks(len(function_ids))})"
                f" ORDER BY q.eligible_at, q.enqueued_at LIMIT ? {tx.lock('q')}",
                [*function_ids, min(limit, len(credits)) * RESERVE_OVERSCAN],
            )
            if not candidates:
                return []
            usage = self._concurrency_usage(tx, candidates)
            chosen: list[tuple[str, int, str, str]] = []  # run_id, seq, session, token
            credit_rows: list[tuple[Any, ...]] = []
            for run_id, seq, function_id, ckey, definition in candidates:
                if len(chosen) >= limit:
                    break
                fd = self._fdef(definition)
                bucket = None
                if fd.concurrency is not None:
                    bucket = (function_id, ckey if fd.concurrency.key is not None else None)
                    if usage.get(bucket, 0) >= fd.concurrency.limit:
                        continue
                # The offering session with the most free credits spreads the load.
                best = max(
                    (s for s, ids in offers.items() if function_id in ids and free.get(s)),
                    key=lambda s: len(free[s]),
                    default=None,
                )
                if best is None:
                    continue
                slot = free[best].pop()
                if bucket is not None:
                    usage[bucket] = usage.get(bucket, 0) + 1
                token = secrets.token_hex(16)
                chosen.append((run_id, seq, best, token))
                credit_rows.append((run_id, seq, best, slot))
            if not chosen:
                return []
            tx.executemany(
                "UPDATE dispatch_queue SET reservation_owner = ?,"
                " reservation_expires_at = ironflow_now() + ?, lease_token_hash = ?"
                " WHERE run_id = ? AND execution_seq = ?",
                [
                    (sid, float(reservation_expiry_s), token_hash(tok), rid, seq)
                    for rid, seq, sid, tok in chosen
                ],
            )
            tx.executemany(
                "UPDATE worker_credits SET claimed_run_id = ?, claimed_execution_seq = ?"
                " WHERE session_id = ? AND slot = ?",
                credit_rows,
            )
            return self._assignments(tx, chosen)

        return await self._transact(work)

    def _concurrency_usage(
        self, tx: Tx, candidates: list[tuple[Any, ...]]
    ) -> dict[tuple[str, str | None], int]:
        """Live leases + live reservations per concurrency bucket of limited functions."""
        limited: dict[str, FunctionDef] = {}
        for _, _, function_id, _, definition in candidates:
            fd = self._fdef(definition)
            if fd.concurrency is not None:
                limited[function_id] = fd
        if not limited:
            return {}
        ids = sorted(limited)
        for function_id in ids:
            # Two nodes must not both see the same free bucket: serialise per function.
            tx.advisory_lock("conc:" + function_id)
        rows = tx.fetchall(
            "SELECT function_id, concurrency_key, count(*) FROM ("
            " SELECT function_id, concurrency_key FROM concurrency_leases"
            f" WHERE function_id IN ({_marks(len(ids))})"
            " UNION ALL SELECT function_id, concurrency_key FROM dispatch_queue"
            " WHERE reservation_owner IS NOT NULL AND reservation_expires_at > ironflow_now()"
            f" AND function_id IN ({_marks(len(ids))})"
            ") u GROUP BY function_id, concurrency_key",
            [*ids, *ids],
        )
        usage: dict[tuple[str, str | None], int] = {}
        for function_id, ckey, n in rows:
            conc = limited[function_id].concurrency
            assert conc is not None
            bucket = (function_id, ckey if conc.key is not None else None)
            usage[bucket] = usage.get(bucket, 0) + int(n)
        return usage

    def _assignments(self, tx: Tx, chosen: list[tuple[str, int, str, str]]) -> list[Reservation]:
        run_ids = [c[0] for c in chosen]
        marks = _marks(len(run_ids))
        runs = {
            row[0]: row
            for row in tx.fetchall(
                "SELECT r.id, r.function_id, r.attempt, r.max_attempts, e.id, e.name, e.data,"
                " e.received_at, e.idempotency_key FROM runs r LEFT JOIN events e"
                f" ON e.id = r.event_id WHERE r.id IN ({marks})",
                run_ids,
            )
        }
        memo: dict[str, list[MemoStep]] = {rid: [] for rid in run_ids}
        for run_id, step_id, name, kind, status, output, error in tx.fetchall(
            "SELECT run_id, step_id, name, kind, status, output, error FROM steps"
            f" WHERE run_id IN ({marks}) AND status IN ('completed', 'failed', 'timed_out')"
            " ORDER BY run_id, seq",
            run_ids,
        ):
            memo[run_id].append(
                MemoStep(step_id, name, kind, status, _dec(output), _dec_error(error))
            )
        out = []
        for run_id, seq, session_id, token in chosen:
            r = runs[run_id]
            event = EventInfo(
                id=r[4] or "",
                name=r[5] or "",
                data=_dec(r[6]),
                received_at=r[7] or 0.0,
                idempotency_key=r[8],
            )
            out.append(
                Reservation(
                    session_id,
                    JobAssignment(
                        job_id=job_id_for(run_id, seq),
                        run_id=run_id,
                        function_id=r[1],
                        event=event,
                        attempt=r[2],
                        max_attempts=r[3],
                        completed_steps=memo[run_id],
                        execution_seq=seq,
                        lease_token=token,
                    ),
                )
            )
        return out

    async def release_reservation(self, session_id: str, run_id: str, execution_seq: int) -> None:
        def work(tx: Tx) -> None:
            tx.notify()
            if tx.execute(
                "UPDATE dispatch_queue SET reservation_owner = NULL,"
                " reservation_expires_at = NULL, lease_token_hash = NULL"
                " WHERE run_id = ? AND execution_seq = ? AND reservation_owner = ?",
                (run_id, execution_seq, session_id),
            ):
                self._free_credit(tx, session_id, run_id, execution_seq)

        await self._transact(work)

    async def seconds_until_next_eligible(self) -> float | None:
        def work(tx: Tx) -> float | None:
            row = tx.fetchone(
                "SELECT min(eligible_at) - ironflow_now() FROM dispatch_queue"
                " WHERE reservation_owner IS NULL"
            )
            return None if row is None or row[0] is None else max(0.0, float(row[0]))

        return await self._transact(work)

    # execution (fenced) -----------------------------------------------------------------

    async def activate_lease(self, fence: Fence, *, lease_expiry_s: float) -> RunRecord:
        digest = token_hash(fence.lease_token)

        def work(tx: Tx) -> RunRecord:
            row = tx.fetchone(
                "DELETE FROM dispatch_queue WHERE run_id = ? AND execution_seq = ?"
                " AND reservation_owner = ? AND lease_token_hash = ? AND EXISTS ("
                " SELECT 1 FROM runs WHERE id = ? AND current_execution_seq = ?"
                f" AND status NOT IN {_TERMINAL_SQL})"
                " RETURNING function_id, concurrency_key",
                (
                    fence.run_id,
                    fence.execution_seq,
                    fence.session_id,
                    digest,
                    fence.run_id,
                    fence.execution_seq,
                ),
            )
            if row is None:
                if self._fence_alive(tx, fence):  # a repeated JobAck: already active
                    run = tx.fetchone(
                        f"SELECT {_RUN_COLS} FROM runs r WHERE r.id = ?", (fence.run_id,)
                    )
                    assert run is not None
                    return _run_record(run)
                raise StaleExecution(
                    f"segment {fence.run_id}/{fence.execution_seq} is not reserved for this"
                    " session with this lease token"
                )
            if not tx.execute(
                "INSERT INTO concurrency_leases (run_id, execution_seq, function_id,"
                " concurrency_key, session_id, node_id, lease_token_hash, expires_at,"
                " activated_at) SELECT ?, ?, ?, ?, s.id, s.node_id, ?, ironflow_now() + ?,"
                " ironflow_now() FROM worker_sessions s WHERE s.id = ?",
                (
                    fence.run_id,
                    fence.execution_seq,
                    row[0],
                    row[1],
                    digest,
                    float(lease_expiry_s),
                    fence.session_id,
                ),
            ):
                raise StaleExecution(f"worker session {fence.session_id} is gone")
            run = tx.fetchone(
                "UPDATE runs SET status = 'running', started_at = coalesce(started_at,"
                " ironflow_now()), updated_at = ironflow_now() WHERE id = ? RETURNING"
                + _RUN_COLS.replace("r.", " "),
                (fence.run_id,),
            )
            assert run is not None
            self._audit_if_enabled(
                tx, "run.started", fence.run_id, {"execution_seq": fence.execution_seq}
            )
            return _run_record(run)

        return await self._transact(work)

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
            written = tx.execute(
                "INSERT INTO steps (run_id, step_id, name, kind, status, output, error,"
                " duration_ms, execution_seq, created_at, seq)"
                " SELECT ?, ?, ?, 'run', ?, ?, ?, ?, ?, ironflow_now(), ?"
                f" WHERE EXISTS (SELECT 1 FROM concurrency_leases WHERE {_FENCE_SQL})"
                " ON CONFLICT (run_id, step_id) DO UPDATE SET status = excluded.status,"
                " output = excluded.output, error = excluded.error,"
                " duration_ms = excluded.duration_ms, execution_seq = excluded.execution_seq"
                " WHERE steps.status <> 'completed'",
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
                    *self._fence_params(fence),
                ),
            )
            if not written:
                if not self._fence_alive(tx, fence):
                    raise StaleExecution(
                        f"segment {fence.run_id}/{fence.execution_seq} is not the live lease"
                    )
                return  # idempotent replay of a completed step
            if status == "completed":
                self._audit_if_enabled(
                    tx, "step.completed", fence.run_id, {"step_id": step_id, "name": name}
                )

        await self._transact(work)

    async def complete_job(self, fence: Fence, output: Any) -> JobOutcome:
        def work(tx: Tx) -> JobOutcome:
            self._take_lease(tx, fence)
            row = tx.fetchone(
                "UPDATE runs SET status = 'completed', output = ?, ended_at = ironflow_now(),"
                " updated_at = ironflow_now() WHERE id = ?"
                " RETURNING parent_run_id, parent_step_id",
                (_enc(output), fence.run_id),
            )
            assert row is not None
            self._audit_if_enabled(tx, "run.completed", fence.run_id, {})
            kicked = self._resolve_parent(tx, row[0], row[1], fence.run_id, output=output)
            return JobOutcome(fence.run_id, "completed", kicked_run_ids=kicked)

        return await self._transact(work)

    async def fail_job(self, fence: Fence, error: ErrorInfo) -> JobOutcome:
        def work(tx: Tx) -> JobOutcome:
            self._take_lease(tx, fence)
            run = tx.fetchone(
                "SELECT r.attempt, r.max_attempts, r.concurrency_key, r.parent_run_id,"
                " r.parent_step_id, f.definition FROM runs r"
                " JOIN functions f ON f.id = r.function_id WHERE r.id = ?",
                (fence.run_id,),
            )
            assert run is not None
            attempt, max_attempts, ckey, parent_run_id, parent_step_id, definition = run
            fd = self._fdef(definition)
            if error.retryable and attempt < max_attempts:
                row = tx.fetchone(
                    "UPDATE runs SET attempt = attempt + 1, status = 'waiting',"
                    " current_execution_seq = current_execution_seq + 1, error = ?,"
                    " updated_at = ironflow_now() WHERE id = ?"
                    " RETURNING current_execution_seq, attempt",
                    (_enc(error), fence.run_id),
                )
                assert row is not None
                eligible_at = self._enqueue(
                    tx, fence.run_id, row[0], fd.id, ckey, fd.retries.delay_after(attempt), "retry"
                )
                return JobOutcome(fence.run_id, "waiting", row[0], eligible_at, row[1])
            tx.execute(
                "UPDATE runs SET status = 'failed', error = ?, ended_at = ironflow_now(),"
                " updated_at = ironflow_now() WHERE id = ?",
                (_enc(error), fence.run_id),
            )
            self._audit_if_enabled(tx, "run.failed", fence.run_id, {"error": error})
            kicked = self._resolve_parent(
                tx, parent_run_id, parent_step_id, fence.run_id, error=error
            )
            return JobOutcome(fence.run_id, "failed", attempt=attempt, kicked_run_ids=kicked)

        return await self._transact(work)

    async def yield_job(
        self, fence: Fence, *, step_id: str, name: str, info: YieldInfo
    ) -> JobOutcome:
        def work(tx: Tx) -> JobOutcome:
            self._take_lease(tx, fence)
            tx.execute(
                "UPDATE runs SET status = 'waiting', recovery_count = 0,"
                " updated_at = ironflow_now() WHERE id = ?",
                (fence.run_id,),
            )
            wait_event = match = match_value = invoke_run_id = None
            kicked: list[str] = []
            wake_at: float | None
            if isinstance(info, SleepYield):
                kind, status, wake_at = "sleep", "sleeping", info.until
            elif isinstance(info, WaitYield):
                kind, status, wake_at = "wait", "waiting", info.timeout_at
                wait_event, match, match_value = info.event, info.match, _enc(info.match_value)
            else:
                assert isinstance(info, InvokeYield)
                kind, status, wake_at = "invoke", "waiting", info.timeout_at
                row = tx.fetchone(
                    "SELECT definition FROM functions WHERE id = ?", (info.function_id,)
                )
                if row is None:
                    error = ErrorInfo(
                        message=f"function {info.function_id} is not registered",
                        code=FunctionNotFound.code,
                        retryable=False,
                    )
                    self._park_step(
                        tx, fence, step_id, name, kind, "failed", None, error=_enc(error)
                    )
                    resumed = self._resume(tx, fence.run_id)
                    assert resumed is not None
                    return JobOutcome(fence.run_id, "waiting", resumed[0], resumed[1])
                event_id = self._insert_event(tx, INVOKED_EVENT, info.input)
                invoke_run_id = self._create_run(
                    tx,
                    self._fdef(row[0]),
                    event_id,
                    info.input,
                    parent_run_id=fence.run_id,
                    parent_step_id=step_id,
                )
                tx.execute(
                    "UPDATE events SET run_ids = ? WHERE id = ?", (_enc([invoke_run_id]), event_id)
                )
                kicked.append(invoke_run_id)
            self._park_step(
                tx,
                fence,
                step_id,
                name,
                kind,
                status,
                wake_at,
                wait_event=wait_event,
                match=match,
                match_value=match_value,
                invoke_run_id=invoke_run_id,
            )
            return JobOutcome(fence.run_id, "waiting", kicked_run_ids=kicked)

        return await self._transact(work)

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
        wait_event: str | None = None,
        match: str | None = None,
        match_value: str | None = None,
        invoke_run_id: str | None = None,
    ) -> None:
        tx.execute(
            "INSERT INTO steps (run_id, step_id, name, kind, status, error, execution_seq,"
            " created_at, seq, wake_at, wait_event, wait_match, wait_match_value, invoke_run_id)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ironflow_now(), ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (run_id, step_id) DO UPDATE SET kind = excluded.kind,"
            " status = excluded.status, error = excluded.error,"
            " execution_seq = excluded.execution_seq, wake_at = excluded.wake_at,"
            " wait_event = excluded.wait_event, wait_match = excluded.wait_match,"
            " wait_match_value = excluded.wait_match_value,"
            " invoke_run_id = excluded.invoke_run_id, claimed_by = NULL, claimed_at = NULL,"
            " pre_claim_status = NULL WHERE steps.status <> 'completed'",
            (
                fence.run_id,
                step_id,
                name,
                kind,
                status,
                error,
                fence.execution_seq,
                time.time_ns(),
                wake_at,
                wait_event,
                match,
                match_value,
                invoke_run_id,
            ),
        )

    async def nack_job(self, fence: Fence, reason: JobNackReason) -> JobOutcome:
        digest = token_hash(fence.lease_token)

        def work(tx: Tx) -> JobOutcome:
            lease = tx.fetchone(
                f"DELETE FROM concurrency_leases WHERE {_FENCE_SQL} RETURNING run_id",
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
            self._free_credit(
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
            eligible_at = self._enqueue(tx, fence.run_id, row[0], row[1], row[2], 0.0, "nack")
            return JobOutcome(fence.run_id, "waiting", row[0], eligible_at, row[3])

        return await self._transact(work)

    # loop 1: capacity scanner -------------------------------------------------------------

    def _expire_reservations(self, tx: Tx) -> int:
        rows = tx.fetchall(
            "SELECT run_id, execution_seq, reservation_owner FROM dispatch_queue"
            " WHERE reservation_owner IS NOT NULL AND reservation_expires_at <= ironflow_now()"
            f" LIMIT {SCAN_BATCH} {tx.lock()}"
        )
        if rows:
            tx.notify()
            tx.executemany(
                "UPDATE dispatch_queue SET reservation_owner = NULL,"
                " reservation_expires_at = NULL, lease_token_hash = NULL"
                " WHERE run_id = ? AND execution_seq = ?",
                [(r[0], r[1]) for r in rows],
            )
            tx.executemany(
                "UPDATE worker_credits SET claimed_run_id = NULL, claimed_execution_seq = NULL"
                " WHERE session_id = ? AND claimed_run_id = ? AND claimed_execution_seq = ?",
                [(r[2], r[0], r[1]) for r in rows],
            )
        return len(rows)

    async def expire_reservations(self) -> int:
        return await self._transact(self._expire_reservations)

    async def expire_leases(
        self, *, recovery_grace_s: float, recovery_ceiling: int
    ) -> list[RecoveredSegment]:
        def work(tx: Tx) -> list[RecoveredSegment]:
            leases = tx.fetchall(
                "SELECT run_id, execution_seq, function_id, session_id FROM concurrency_leases"
                f" WHERE expires_at <= ironflow_now() ORDER BY expires_at LIMIT {SCAN_BATCH}"
                f" {tx.lock()}"
            )
            return self._recover(
                tx,
                leases,
                recovery_grace_s=recovery_grace_s,
                recovery_ceiling=recovery_ceiling,
                no_grace_first=False,
            )

        return await self._transact(work)

    async def expire_sessions(self) -> int:
        def work(tx: Tx) -> int:
            ids = [
                r[0]
                for r in tx.fetchall(
                    "SELECT id FROM worker_sessions WHERE expires_at <= ironflow_now()"
                    f" LIMIT {SCAN_BATCH} {tx.lock()}"
                )
            ]
            if ids:
                tx.execute(
                    f"DELETE FROM worker_credits WHERE session_id IN ({_marks(len(ids))})", ids
                )
                tx.execute(f"DELETE FROM worker_sessions WHERE id IN ({_marks(len(ids))})", ids)
            return len(ids)

        return await self._transact(work)

    async def seconds_until_next_capacity_expiry(self) -> float | None:
        def work(tx: Tx) -> float | None:
            row = tx.fetchone(
                "SELECT min(t) - ironflow_now() FROM ("
                " SELECT min(reservation_expires_at) AS t FROM dispatch_queue"
                " WHERE reservation_owner IS NOT NULL"
                " UNION ALL SELECT min(expires_at) FROM concurrency_leases"
                " UNION ALL SELECT min(expires_at) FROM worker_sessions) u"
            )
            return None if row is None or row[0] is None else max(0.0, float(row[0]))

        return await self._transact(work)

    # loop 2 and the waker -----------------------------------------------------------------

    async def claim_elapsed_steps(self, node_id: str, limit: int) -> list[tuple[str, str]]:
        def work(tx: Tx) -> list[tuple[str, str]]:
            due = tx.fetchall(
                "SELECT run_id, step_id FROM steps WHERE status IN ('sleeping', 'waiting')"
                " AND wake_at IS NOT NULL AND wake_at <= ironflow_now()"
                f" ORDER BY wake_at LIMIT ? {tx.lock()}",
                (limit,),
            )
            if due:
                tx.executemany(
                    "UPDATE steps SET pre_claim_status = status, status = 'waking',"
                    " claimed_by = ?, claimed_at = ironflow_now()"
                    " WHERE run_id = ? AND step_id = ? AND status IN ('sleeping', 'waiting')",
                    [(node_id, r[0], r[1]) for r in due],
                )
            return [(r[0], r[1]) for r in due]

        return await self._transact(work)

    async def resume_claimed_step(self, node_id: str, run_id: str, step_id: str) -> JobOutcome:
        def work(tx: Tx) -> JobOutcome:
            step = tx.fetchone(
                "SELECT kind, invoke_run_id FROM steps WHERE run_id = ? AND step_id = ?"
                " AND status = 'waking' AND claimed_by = ?",
                (run_id, step_id, node_id),
            )
            if step is None:
                raise Conflict(f"step {run_id}/{step_id} is not claimed by node {node_id}")
            kind, child = step
            status, error = "completed", None
            if kind == "wait":
                status = "timed_out"
            elif kind == "invoke":
                status = "failed"
                error = _enc(
                    ErrorInfo(
                        message=f"invoked run {child} did not finish before the timeout",
                        code="INVOKE_TIMEOUT",
                        retryable=False,
                    )
                )
            tx.execute(
                "UPDATE steps SET status = ?, error = ?, output = NULL, claimed_by = NULL,"
                " claimed_at = NULL, pre_claim_status = NULL WHERE run_id = ? AND step_id = ?",
                (status, error, run_id, step_id),
            )
            resumed = self._resume(tx, run_id)
            if resumed is None:
                row = tx.fetchone("SELECT status FROM runs WHERE id = ?", (run_id,))
                return JobOutcome(run_id, row[0] if row else "unknown")
            return JobOutcome(run_id, "waiting", resumed[0], resumed[1])

        return await self._transact(work)

    async def reset_stale_claims(self, threshold_s: float) -> int:
        def work(tx: Tx) -> int:
            return tx.execute(
                "UPDATE steps SET status = pre_claim_status, claimed_by = NULL,"
                " claimed_at = NULL, pre_claim_status = NULL"
                " WHERE status = 'waking' AND claimed_at <= ironflow_now() - ?"
                " AND NOT EXISTS (SELECT 1 FROM concurrency_leases l WHERE l.run_id = steps.run_id)"
                " AND NOT EXISTS (SELECT 1 FROM dispatch_queue q WHERE q.run_id = steps.run_id)",
                (float(threshold_s),),
            )

        return await self._transact(work)

    async def seconds_until_next_wake(self) -> float | None:
        def work(tx: Tx) -> float | None:
            row = tx.fetchone(
                "SELECT min(wake_at) - ironflow_now() FROM steps"
                " WHERE status IN ('sleeping', 'waiting') AND wake_at IS NOT NULL"
            )
            return None if row is None or row[0] is None else max(0.0, float(row[0]))

        return await self._transact(work)

    # reads ----------------------------------------------------------------------------------

    async def get_run(self, run_id: str) -> RunDetail:
        def work(tx: Tx) -> RunDetail:
            now = self._now(tx)
            row = tx.fetchone(f"SELECT {_RUN_COLS} FROM runs r WHERE r.id = ?", (run_id,))
            if row is None:
                raise RunNotFound(f"run {run_id} not found")
            run = _run_record(row)
            step_rows = tx.fetchall(
                f"SELECT {_STEP_COLS}, wait_event, invoke_run_id FROM steps WHERE run_id = ?"
                " ORDER BY seq",
                (run_id,),
            )
            q = tx.fetchone(f"SELECT {_QUEUE_COLS} FROM dispatch_queue WHERE run_id = ?", (run_id,))
            lease = tx.fetchone(
                f"SELECT {_LEASE_COLS} FROM concurrency_leases WHERE run_id = ?", (run_id,)
            )
            queue = None if q is None else _queue_record(q, now)
            reason = None
            if queue is not None:
                if queue.reason == "recovery" and queue.eligible_at > now:
                    reason = f"recovery grace until {_iso(queue.eligible_at)}"
                elif queue.reason == "retry" and queue.eligible_at > now:
                    reason = f"retry delay until {_iso(queue.eligible_at)}"
                elif queue.reason == "nack":
                    reason = "requeued after nack"
                else:
                    reason = "waiting for capacity"
            elif lease is None and run.status not in TERMINAL_RUN_STATUSES:
                for s in step_rows:
                    kind, status, wake_at, wait_event, child = s[3], s[4], s[10], s[11], s[12]
                    if status == "sleeping":
                        reason = f"sleeping until {_iso(wake_at)}"
                    elif status == "waiting" and kind == "wait":
                        reason = f"waiting for event {wait_event}" + (
                            f" until {_iso(wake_at)}" if wake_at is not None else ""
                        )
                    elif status == "waiting" and kind == "invoke":
                        reason = f"waiting for invoked run {child}"
                    elif status == "waking":
                        reason = "waking"
            return RunDetail(
                run=run,
                steps=[_step_record(s) for s in step_rows],
                queue=queue,
                lease=None if lease is None else _lease_record(lease, now),
                waiting_reason=reason,
                db_now=now,
            )

        return await self._transact(work)

    async def list_runs(
        self, *, status: str | None = None, function_id: str | None = None, limit: int = 50
    ) -> list[RunRecord]:
        def work(tx: Tx) -> list[RunRecord]:
            clause, params = _where({"r.status": status, "r.function_id": function_id})
            rows = tx.fetchall(
                f"SELECT {_RUN_COLS} FROM runs r {clause} ORDER BY r.created_at DESC, r.id DESC"
                " LIMIT ?",
                [*params, limit],
            )
            return [_run_record(r) for r in rows]

        return await self._transact(work)

    async def list_leases(self) -> list[LeaseRecord]:
        def work(tx: Tx) -> list[LeaseRecord]:
            now = self._now(tx)
            rows = tx.fetchall(f"SELECT {_LEASE_COLS} FROM concurrency_leases ORDER BY expires_at")
            return [_lease_record(r, now) for r in rows]

        return await self._transact(work)

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
                    _dec(r[10]),
                )
                for r in rows
            ]

        return await self._transact(work)

    async def list_queue(self) -> list[QueueRecord]:
        def work(tx: Tx) -> list[QueueRecord]:
            now = self._now(tx)
            rows = tx.fetchall(
                f"SELECT {_QUEUE_COLS} FROM dispatch_queue ORDER BY eligible_at, enqueued_at"
            )
            return [_queue_record(r, now) for r in rows]

        return await self._transact(work)

    async def list_audit(
        self, *, run_id: str | None = None, type: str | None = None, limit: int = 100
    ) -> list[AuditRecord]:
        def work(tx: Tx) -> list[AuditRecord]:
            clause, params = _where({"run_id": run_id, "type": type})
            rows = tx.fetchall(
                f"SELECT id, at, type, run_id, function_id, data FROM audit_log {clause}"
                " ORDER BY at, id LIMIT ?",
                [*params, limit],
            )
            return [AuditRecord(r[0], r[1], r[2], r[3], r[4], _dec(r[5])) for r in rows]

        return await self._transact(work)

    # history retention ------------------------------------------------------------------------

    async def purge_history(
        self,
        *,
        older_than_s: float,
        idempotency_window_s: float,
        statuses: frozenset[str] = TERMINAL_RUN_STATUSES,
        batch: int,
        wait_for_lock: bool = False,
    ) -> PurgeCounts:
        wanted = sorted(statuses & TERMINAL_RUN_STATUSES)
        if not wanted:
            raise StoreError(f"only finished runs can be purged, not {sorted(statuses)}")

        def work(tx: Tx) -> PurgeCounts:
            if wait_for_lock:
                tx.advisory_lock(JANITOR_LOCK)
            elif not tx.try_advisory_lock(JANITOR_LOCK):
                return PurgeCounts(locked_out=True)
            run_ids = [
                row[0]
                for row in tx.fetchall(
                    # The first status test is the guard (never a run that has
                    # not ended) and matches the runs_ended index; `<` keeps a
                    # run exactly at the boundary. A child goes only once its
                    # parent is gone, so no kept run loses a child.
                    "SELECT r.id FROM runs r"
                    f" WHERE r.status IN {_TERMINAL_SQL} AND r.status IN ({_marks(len(wanted))})"
                    " AND r.ended_at < ironflow_now() - ?"
                    " AND NOT EXISTS (SELECT 1 FROM runs p WHERE p.id = r.parent_run_id)"
                    " AND NOT EXISTS (SELECT 1 FROM concurrency_leases l WHERE l.run_id = r.id)"
                    " AND NOT EXISTS (SELECT 1 FROM dispatch_queue q WHERE q.run_id = r.id)"
                    f" ORDER BY r.ended_at LIMIT ? {tx.lock('r')}",
                    (*wanted, float(older_than_s), batch),
                )
            ]
            steps = audit = runs = 0
            if run_ids:
                marks = _marks(len(run_ids))
                steps = tx.execute(f"DELETE FROM steps WHERE run_id IN ({marks})", run_ids)
                audit = tx.execute(f"DELETE FROM audit_log WHERE run_id IN ({marks})", run_ids)
                runs = tx.execute(f"DELETE FROM runs WHERE id IN ({marks})", run_ids)
            # After the runs: an event only they referenced can go in this batch.
            events = tx.execute(
                "DELETE FROM events WHERE id IN (SELECT e.id FROM events e"
                " WHERE e.received_at < ironflow_now() - ?"
                " AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.event_id = e.id)"
                f" ORDER BY e.received_at LIMIT ? {tx.lock()})",
                (float(idempotency_window_s), batch),
            )
            return PurgeCounts(runs=runs, steps=steps, audit=audit, events=events)

        return await self._transact(work)

    async def oldest_finished_run_age(self) -> float | None:
        def work(tx: Tx) -> float | None:
            row = tx.fetchone(
                f"SELECT ironflow_now() - min(ended_at) FROM runs WHERE status IN {_TERMINAL_SQL}"
            )
            return None if row is None or row[0] is None else float(row[0])

        return await self._transact(work)

    async def record_purge(self, counts: PurgeCounts, *, by: str, older_than_s: float) -> None:
        data = {
            "runs": counts.runs,
            "steps": counts.steps,
            "audit": counts.audit,
            "events": counts.events,
            "older_than_s": older_than_s,
            "by": by,
        }
        await self._transact(lambda tx: self._audit(tx, PURGE_AUDIT, None, None, data))

    # keys -------------------------------------------------------------------------------------

    async def create_api_key(
        self, kind: Literal["org", "platform"], role: str = "admin", key: str | None = None
    ) -> tuple[str, str]:
        if kind not in ("org", "platform"):
            raise StoreError(f"unknown key kind {kind!r}")
        secret = key or ("ifkey_" if kind == "org" else "ifplatform_") + secrets.token_hex(16)
        key_id = new_id("key")

        def work(tx: Tx) -> None:
            tx.execute(
                "INSERT INTO api_keys (id, kind, role, key_hash, created_at)"
                " VALUES (?, ?, ?, ?, ironflow_now())",
                (key_id, kind, role, token_hash(secret)),
            )

        await self._transact(work)
        return key_id, secret

    async def authenticate(self, key: str) -> Principal | None:
        def work(tx: Tx) -> Principal | None:
            row = tx.fetchone(
                "SELECT id, kind, role FROM api_keys WHERE key_hash = ?", (token_hash(key),)
            )
            return None if row is None else Principal(row[0], row[1], row[2])

        return await self._transact(work)
