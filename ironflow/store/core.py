"""What every concern of the SQL store shares (assembled in ``sql.py``).

The transaction surface :class:`Tx` (in ``tx.py``), the column lists, the fence clause, the
row → record builders, and :class:`SqlStoreBase` (definition decoding, run
creation; the shared transitions are functions in ``transitions.py``). Every
public method builds a synchronous ``work(tx)`` closure and hands it to
the backend's ``_transact``, which runs it as ONE transaction (SQLite: inside
the group-commit writer thread under a SAVEPOINT; PostgreSQL: on a pooled
connection in a worker thread). The SQL is written once with ``?``
placeholders; :class:`Tx` implementations translate for their driver. The
only dialect differences are fragments from :meth:`Tx.lock` (``FOR UPDATE
SKIP LOCKED`` on PostgreSQL, nothing on SQLite — its single writer already
serialises), :meth:`Tx.advisory_lock` (PostgreSQL only), and, where
:attr:`Tx.modifying_with` is set (PostgreSQL), the hottest transitions (create a
run, activate a segment, complete it) written as one statement with
data-modifying ``WITH`` clauses instead of one statement per table — same rows,
same checks, one round trip — each pair of forms side by side in one function.

Fencing lives in the SQL: a worker message may only change a segment when a
lease row with that ``(run_id, execution_seq, session_id, lease_token_hash)``
exists AND ``runs.current_execution_seq`` still equals that seq.
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec

from ironflow.ids import new_id
from ironflow.protocol import (
    FunctionDef,
    LeaseRecord,
    QueueRecord,
    RunRecord,
    RunResult,
    StepRecord,
)
from ironflow.store.base import Store
from ironflow.store.filters import CompiledDefinitions
from ironflow.store.records import CancelNotice, Fence, RecoveredSegment
from ironflow.store.tx import (  # re-exported: the store modules import them from here
    Tx as Tx,
)
from ironflow.store.tx import dec as dec
from ironflow.store.tx import dec_error as dec_error
from ironflow.store.tx import enc as enc
from ironflow.store.tx import error_decode as error_decode
from ironflow.store.tx import iso_time as iso_time
from ironflow.store.tx import json_decode as json_decode
from ironflow.store.tx import json_encode as json_encode
from ironflow.store.tx import placeholders as placeholders

T = TypeVar("T")


# Marks a stored definition that today's bounds refuse (see SqlStoreBase._fdef).
_INVALID_DEFINITION = "\x00invalid stored definition"
# Name of the synthetic event behind a direct invocation or a step.invoke child.
INVOKED_EVENT = "ironflow/function.invoked"
# Error code of a run that outlived its function's timeout (from its first start).
FUNCTION_TIMEOUT = "FUNCTION_TIMEOUT"
# Upper bound of leases/reservations one scanner pass fences, so one
# transaction stays short even after a mass worker death.
SCAN_BATCH = 500
# Candidate queue rows read per reservation slot wanted: concurrency limits may
# skip some rows, so read a few more than we hope to reserve.
RESERVE_OVERSCAN = 4

# Most bind parameters one statement carries (PostgreSQL's protocol allows
# 65,535): a larger batch goes in several statements of one transaction.
MAX_STATEMENT_PARAMS = 30_000

# Advisory lock under which one node at a time deletes history (PostgreSQL).
JANITOR_LOCK = "ironflow:janitor"
# Audit type of one history purge pass.
PURGE_AUDIT = "history.purged"

RUN_COLS = (
    "r.id, r.function_id, r.event_id, r.parent_run_id, r.status, r.attempt, r.max_attempts,"
    " r.recovery_count, r.current_execution_seq, r.output, r.error, r.created_at,"
    " r.started_at, r.ended_at, r.concurrency_key"
)
STEP_COLS = (
    "run_id, step_id, name, kind, status, output, error, duration_ms, execution_seq,"
    " created_at, wake_at"
)
QUEUE_COLS = (
    "run_id, function_id, execution_seq, eligible_at, reason, enqueued_at,"
    " reservation_owner, reservation_expires_at"
)
LEASE_COLS = "run_id, function_id, execution_seq, session_id, node_id, expires_at, activated_at"
# The lease half of every fence check; params: run_id, seq, session_id, token_hash, run_id, seq.
FENCE_SQL = (
    "run_id = ? AND execution_seq = ? AND session_id = ? AND lease_token_hash = ?"
    " AND EXISTS (SELECT 1 FROM runs WHERE id = ? AND current_execution_seq = ?)"
)

# A named lock a transaction takes before its first statement: (name, exclusive).
# A shared holder waits only for an exclusive one (see :func:`lock_id`).
NamedLock = tuple[str, bool]



def fence_join(lease: str, fence: str) -> str:
    """:data:`FENCE_SQL` for many fences at once: lease rows ``lease`` (an alias
    of ``concurrency_leases``) matching the rows of ``fence`` (a VALUES alias
    with run_id, execution_seq, session_id, digest) whose run is still at that seq."""
    return (
        f"{lease}.run_id = {fence}.run_id AND {lease}.execution_seq = {fence}.execution_seq"
        f" AND {lease}.session_id = {fence}.session_id AND {lease}.lease_token_hash = {fence}.digest"
        f" AND EXISTS (SELECT 1 FROM runs WHERE id = {fence}.run_id"
        f" AND current_execution_seq = {fence}.execution_seq)"
    )


_function_decode = msgspec.json.Decoder(FunctionDef).decode


# ── small helpers ──────────────────────────────────────────────────────────


def exhausted_runs(recovered: list[RecoveredSegment]) -> list[str]:
    """The runs a recovery ended (failed at the recovery ceiling)."""
    return [seg.run_id for seg in recovered if seg.exhausted]


def _where(filters: dict[str, Any]) -> tuple[str, list[Any]]:
    """``WHERE col = ? AND …`` for the filters that are not None (columns are ours, never input)."""
    used = {col: value for col, value in filters.items() if value is not None}
    if not used:
        return "", []
    return "WHERE " + " AND ".join(f"{col} = ?" for col in used), list(used.values())


def lock_id(name: str) -> int:
    """The 64-bit advisory lock number of named lock ``name``. Computed here, not
    by ``hashtext`` in SQL, so a group can sort its locks by the very numbers
    PostgreSQL orders them by: two names that collide are one lock, taken once."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big", signed=True)


def token_hash(token: str) -> str:
    """SHA-256 hex of a lease token or API key: the only form the database keeps."""
    return hashlib.sha256(token.encode()).hexdigest()


def triggered(fd: FunctionDef, name: str) -> bool:
    for trigger in fd.triggers:
        if trigger.event is None:  # a cron trigger (ironflow/store/cron.py)
            continue
        if trigger.event == name:
            return True
        if trigger.event.endswith(".*") and name.startswith(trigger.event[:-1]):
            return True
    return False


def trigger_patterns(name: str) -> list[str]:
    """Every trigger pattern that matches event ``name``: the name itself and
    ``prefix.*`` for each dot in it (``a.b.c`` → ``a.b.c``, ``a.*``, ``a.b.*``)."""
    return [name] + [name[: i + 1] + "*" for i, ch in enumerate(name) if ch == "."]


def run_record(row: Sequence[Any]) -> RunRecord:
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
        output=dec(row[9]),
        error=dec_error(row[10]),
        created_at=row[11],
        started_at=row[12],
        ended_at=row[13],
        concurrency_key=row[14],
    )


def step_record(row: Sequence[Any]) -> StepRecord:
    return StepRecord(
        run_id=row[0],
        step_id=row[1],
        name=row[2],
        kind=row[3],
        status=row[4],
        output=dec(row[5]),
        error=dec_error(row[6]),
        duration_ms=row[7],
        execution_seq=row[8],
        created_at=row[9],
        wake_at=row[10],
    )


def queue_record(row: Sequence[Any], now: float) -> QueueRecord:
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


def lease_record(row: Sequence[Any], now: float) -> LeaseRecord:
    return LeaseRecord(
        run_id=row[0],
        function_id=row[1],
        execution_seq=row[2],
        session_id=row[3],
        node_id=row[4],
        expires_at=row[5],
        activated_at=row[6],
        expires_in_s=row[5] - now,
        expired=row[5] <= now,
    )


class NewRun(msgspec.Struct, frozen=True):
    """A run an ingest creates: of ``fd``, under ``run_id`` (chosen before
    flow control's row names it, store/flow.py), its first segment held
    ``delay_s`` with queue reason ``reason`` (a debounce or batch), ``batch``
    if it is a batch run (its first event is batch event 0). A held run is
    not among the event's ``run_ids``: its flow note names it."""

    fd: FunctionDef
    run_id: str
    delay_s: float = 0.0
    reason: str = "new"
    batch: bool = False


def new_run(fd: FunctionDef) -> NewRun:
    """A plain new run of ``fd``: due now, reason ``new``."""
    return NewRun(fd, new_id("run"))


# ── the shared store ─────────────────────────────────────────────────────────


def fences_alive(tx: Tx, fences: Sequence[Fence]) -> set[str]:
    """The runs of ``fences`` (different runs) whose fence is the live
    lease (:func:`fence_join`): one statement. It locks nothing: right for
    SQLite's single writer; on PostgreSQL a verdict that must still hold
    at commit needs a lock (``steps.record_live``)."""
    if not fences:
        return set()
    return {
        row[0]
        for row in tx.fetchall(
            "WITH f (run_id, execution_seq, session_id, digest) AS (VALUES "
            + ", ".join(["(?, ?, ?, ?)"] * len(fences))
            + f") SELECT c.run_id FROM f CROSS JOIN concurrency_leases c WHERE {fence_join('c', 'f')}",
            tuple(
                v for fence in fences
                for v in (fence.run_id, fence.execution_seq, fence.session_id, token_hash(fence.lease_token))
            ),
        )
    }


class SqlStoreBase(Store):
    """The machinery every concern shares: the transaction hook, definition
    decoding, run creation, the fence check (the transitions they share are
    functions in ``transitions.py``). Backends supply ``_transact`` and lifecycle."""

    def __init__(self) -> None:
        # Decoded FunctionDefs keyed by their stored JSON text (decode once per version).
        self._defs: dict[str, FunctionDef] = {}
        # Their compilations: filters, keys (ironflow/store/filters.py).
        self.definitions = CompiledDefinitions()
        # Called (in Trio, after commit) with the ids of runs this node ended.
        self._run_end_listeners: list[Callable[[list[str]], None]] = []
        # Called (in Trio, after commit, before the above) with the results of
        # runs this node completed: what a result wait answers.
        self._run_result_listeners: list[Callable[[list[RunResult]], None]] = []
        # Called (in Trio, after commit) with the wake time of a step just parked.
        self._wake_listeners: list[Callable[[float], None]] = []
        # Called (in Trio, after commit) when a registration may have changed
        # cron schedules (ironflow/store/cron.py): the scheduler re-reads.
        self._schedule_listeners: list[Callable[[], None]] = []
        # Called (in Trio, after commit) with the jobs a cancel took from
        # workers (ironflow/store/cancel_on.py): their sessions send Cancel.
        self._cancel_listeners: list[Callable[[list[CancelNotice]], None]] = []

    def _fence_alive(self, tx: Tx, fence: Fence) -> bool:
        """Whether ``fence`` is the live lease (:data:`FENCE_SQL`)."""
        return (
            tx.fetchone(
                f"SELECT 1 FROM concurrency_leases WHERE {FENCE_SQL}",
                self._fence_params(fence),
            )
            is not None
        )

    @staticmethod
    def _fence_params(fence: Fence) -> tuple[Any, ...]:
        """The parameters of :data:`FENCE_SQL` for ``fence``, in its order."""
        return (
            fence.run_id,
            fence.execution_seq,
            fence.session_id,
            token_hash(fence.lease_token),
            fence.run_id,
            fence.execution_seq,
        )

    @abc.abstractmethod
    async def _transact(
        self,
        work: Callable[[Tx], T],
        locks: Sequence[NamedLock] = (),
        *,
        synchronous_commit: bool = True,
    ) -> T:
        """Run ``work(tx)`` as one transaction and return its result (or raise).

        ``locks``: named locks the transaction takes before its first statement
        (PostgreSQL: transaction-scoped advisory locks, shared or exclusive; SQLite's
        single writer needs none). A group commit takes the union of its calls'
        locks at its BEGIN, sorted by :func:`lock_id`, the strongest mode of each:
        one global order, so two groups can never deadlock on them.

        ``synchronous_commit=False`` (PostgreSQL): the call's commit need not
        wait for its WAL flush — only for a call whose loss in a database crash
        costs nothing the product promises (the argument for each such call is
        in docs/isolation.md, "Commits that do not wait for their WAL flush").
        A group commit waits unless every call in it said False. SQLite ignores
        it (its writer's commits are the same either way)."""

    async def _read(self, work: Callable[[Tx], T]) -> T:
        """Run read-only ``work(tx)`` and return its result. A backend may serve it
        off the write path (SQLite: a pool of read connections); by default it is
        a transaction like any other, except that it writes nothing, so its
        commit has nothing to flush: it does not keep the rest of its group
        commit waiting for a flush either (``synchronous_commit=False``)."""
        return await self._transact(work, synchronous_commit=False)

    def on_runs_ended(self, listener: Callable[[list[str]], None]) -> None:
        """Call ``listener(run_ids)`` after each commit that ended runs (completed,
        failed, cancelled, timed out, exhausted) through this store object."""
        self._run_end_listeners.append(listener)

    def on_run_results(self, listener: Callable[[list[RunResult]], None]) -> None:
        """Call ``listener(results)`` after each commit that completed runs through
        this store object, with each run's result as that commit wrote it
        (before the :meth:`on_runs_ended` listeners hear their ids)."""
        self._run_result_listeners.append(listener)

    def on_wake_scheduled(self, listener: Callable[[float], None]) -> Callable[[], None]:
        """Call ``listener(wake_at)`` after each commit that parked a step with a
        wake time (a sleep, a wait's or an invoke's timeout) through this store.
        Returns the call that unregisters it."""
        self._wake_listeners.append(listener)

        def unregister() -> None:
            if listener in self._wake_listeners:
                self._wake_listeners.remove(listener)

        return unregister

    # PostgreSQL sets it: cancel notices travel by NOTIFY, to every node (as
    # its Tx's ``notifies_nodes`` says), this one included, so nothing is
    # announced after commit (postgres.py's listener announces them).
    _notifies_cancels = False

    def on_jobs_cancelled(self, listener: Callable[[list[CancelNotice]], None]) -> None:
        self._cancel_listeners.append(listener)

    def _announce_cancels(self, notices: list[CancelNotice]) -> None:
        if notices:
            for listener in self._cancel_listeners:
                listener(notices)

    def _announce_wake(self, wake_at: float | None) -> None:
        if wake_at is not None:
            for listener in self._wake_listeners:
                listener(wake_at)

    async def _transact_ending(
        self,
        work: Callable[[Tx], T],
        ended: Callable[[T], list[str]],
        locks: Sequence[NamedLock] = (),
        results: Callable[[T], list[RunResult]] | None = None,
    ) -> T:
        """:meth:`_transact` for work that may end runs (``ended`` picks their ids
        from its result): the transaction tells the other nodes
        (:meth:`Tx.runs_ended`, a NOTIFY on PostgreSQL) and, after the commit,
        this node's listeners hear them. ``results`` picks the results of the
        runs whose outcome the work knows in full (a completion's output): a
        result wait is answered from them, without reading the run back."""

        def announcing(tx: Tx) -> T:
            result = work(tx)
            run_ids = ended(result)
            if run_ids:
                tx.runs_ended(run_ids)
            return result

        result = await self._transact(announcing, locks)
        if results is not None and self._run_result_listeners:
            known = results(result)
            if known:
                for listener in self._run_result_listeners:
                    listener(known)
        self._announce_ended(ended(result))
        return result

    def _announce_ended(self, run_ids: list[str]) -> None:
        if run_ids:
            for listener in self._run_end_listeners:
                listener(run_ids)

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
                raw = json_decode(text)
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
    def _insert_event(
        tx: Tx, event_id: str, name: str, data: Any, key: str | None, run_ids: list[str],
        notes: str | None = None, flow: str | None = None,
    ) -> None:
        """Record an event with the runs it started (and ``notes``: filters.py;
        ``flow``: what flow control did, flow.py). Callers create the runs
        first under a pre-made ``event_id`` (no foreign key ties them), so the
        event is written once rather than inserted and then updated."""
        tx.execute(
            "INSERT INTO events (id, name, data, idempotency_key, received_at, run_ids, notes, flow, xid)"
            f" VALUES (?, ?, ?, ?, ironflow_now(), ?, ?, ?, {tx.xid_sql})",
            (event_id, name, enc(data), key, enc(run_ids), notes, flow),
        )

    async def db_now(self) -> float:
        return await self._transact(self._now)

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


