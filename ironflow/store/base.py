"""The store interface: every read and write of engine state.

One interface, two backends (``sqlite.py``, ``postgres.py``) sharing the SQL in
``core.py`` and the modules ``sql.py`` assembles; the records it takes and
returns are in ``records.py``, what a cancelled call does is stated once, on
:class:`Store`. Each public method is ONE transaction; its guards (fencing,
``NOT EXISTS``, ``SKIP LOCKED``) are visible in its SQL. Expiry is decided by
the database clock (the SQL function ``ironflow_now()``, epoch seconds), never
by a node's wall clock. Timestamps in records are epoch seconds (float).

Nothing outside ``ironflow/store`` writes SQL.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

import outcome
import trio

from ironflow.protocol import (
    TERMINAL_RUN_STATUSES,
    ActiveJob,
    AuditList,
    AuditRecord,
    DebounceRecord,
    ErrorInfo,
    EventList,
    EventRecord,
    FunctionDef,
    FunctionRecord,
    JobLeaseStatus,
    JobNackReason,
    LeaseRecord,
    QueueRecord,
    RunDetail,
    RunList,
    RunRecord,
    RunResult,
    RunStats,
    SessionRecord,
    YieldInfo,
)
from ironflow.store.availability import Availability
from ironflow.store.errors import (  # noqa: F401  (re-exported: the store's errors)
    CommitOutcomeUnknown,
    Conflict,
    FunctionNotFound,
    InvalidCursor,
    KeyEvaluationFailed,
    LimitExceeded,
    NotFound,
    RunNotFound,
    SessionNotFound,
    StaleExecution,
    StepNotFound,
    StorageFull,
    StoreError,
    StoreReadOnly,
    StoreTimeout,
    StoreUnavailable,
)
from ironflow.store.records import (  # noqa: F401  (re-exported: the records the interface names)
    CancelNotice,
    CancelOutcome,
    CapacityGauges,
    CronFired,
    Fence,
    IngestResult,
    JobOutcome,
    PageRequest,
    Principal,
    PurgeCounts,
    RecoveredSegment,
    Reservation,
    Reservations,
    ResumeOutcome,
    SessionInfo,
    StepResult,
    WakeOutcome,
)

# The records the store returns are the HTTP contract's (ironflow.protocol.http);
# ``ironflow.store`` re-exports them for the store's callers.

class Store(abc.ABC):
    """Engine state. Async methods are safe to call from many Trio tasks at once.

    **Cancellation.** Each call is one transaction, and a cancelled caller
    never leaves it half done nor drops a result that committed:

    - SQLite (``sqlite.py``): once a call is queued to the writer thread it
      runs to its commit or rollback; the caller waits shielded, gets its
      result, and the cancellation is delivered at its next checkpoint. A
      read beside the writer likewise runs to its end (an uncancellable
      thread call).
    - PostgreSQL (``postgres.py``): a call still waiting in the queue when
      its caller is cancelled is withdrawn (no actor will run it) and
      ``trio.Cancelled`` propagates at once. Once an actor took it, it runs to
      its commit or rollback and the caller waits shielded for the result, as
      on SQLite. A call made under ``ANSWER_WHEN_DOWN`` (``availability.py``)
      is not shielded: a cancel, or the store marked down, ends its wait
      though an actor may still commit it.
    - Calls chained into one transaction (``chain.in_order``) wait shielded
      once queued, on both backends.

    So a caller cancelled mid-call must assume the call may have committed;
    only a PostgreSQL call withdrawn before any actor took it surely did not.
    """

    # Whether the database answers (``ironflow/store/availability.py``); each
    # backend makes its own and marks it down when a call meets an outage.
    availability: Availability

    # Whether several nodes may share this database (PostgreSQL) or one node
    # owns it (SQLite): a node-wide record nobody else reads is then not kept
    # fresh, so an idle node writes nothing.
    shared_by_nodes: bool = False
    # Most characters of step outputs a later segment's assignment carries
    # inline (the rest are fetched by step id: :meth:`step_output`); the node
    # sets it from ``limits.memo_inline_bytes``.
    memo_inline_bytes: int = 1024 * 1024
    # Whether a session's job acks of different runs are better applied as
    # one call (:meth:`activate_leases`: PostgreSQL, where each call is
    # round trips through a database thread) than as concurrent calls of their
    # own (SQLite, whose writer groups concurrent calls anyway: there a
    # group only serialised a session's acks, measured in docs/benchmarks.md).
    group_acks: bool = False

    async def in_order(
        self, calls: Sequence[Callable[[], Awaitable[Any]]]
    ) -> list[outcome.Outcome[Any]]:
        """Run store calls (zero-argument callables calling this store's methods)
        in this order and return each one's outcome. A backend may commit them
        together (see ``ironflow/store/chain.py``): each is still its own unit
        of work, and a later call sees what the earlier ones wrote."""
        results: list[outcome.Outcome[Any]] = []
        for call in calls:
            try:
                results.append(outcome.Value(await call()))
            except Exception as exc:
                results.append(outcome.Error(exc))
        return results

    # lifecycle ------------------------------------------------------------

    @abc.abstractmethod
    async def open(self) -> None:
        """Connect, create the schema if missing, start backend threads."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Finish in-flight work and release connections/threads."""

    def abandon_calls(self) -> None:
        """The node stops while the database does not answer: a call the
        database took is no longer awaited to its commit or rollback once its
        caller is cancelled (its outcome stays unknown; the database ends the
        transaction when the connection goes). A no-op where calls are
        in-process (SQLite)."""
        return None

    @abc.abstractmethod
    async def db_now(self) -> float:
        """The database clock, epoch seconds."""

    # listeners (called in Trio after a commit) ------------------------------

    @abc.abstractmethod
    def on_runs_ended(self, listener: Callable[[list[str]], None]) -> None:
        """Call ``listener(run_ids)`` (in Trio, after commit) whenever a call on this
        store object ended runs: completed, failed, cancelled, timed out, or
        failed at the recovery ceiling. Runs ended by another node are not
        announced here; waiters re-read the store as a backstop."""

    @abc.abstractmethod
    def on_run_results(self, listener: Callable[[list[RunResult]], None]) -> None:
        """Call ``listener(results)`` (in Trio, after commit, before the
        :meth:`on_runs_ended` listeners hear the same runs) whenever a call on
        this store object completed runs, each with its result as that commit
        wrote it: a result wait answers from it instead of reading the run
        back. Other run ends are announced by id only."""

    @abc.abstractmethod
    def on_wake_scheduled(self, listener: Callable[[float], None]) -> Callable[[], None]:
        """Call ``listener(wake_at)`` (in Trio, after commit) whenever a call on this
        store object parked a step with a wake time, so the waker can wake for
        it rather than at its next interval tick. Returns the call that
        unregisters it (a restarted waker registers again)."""

    @abc.abstractmethod
    def on_jobs_cancelled(self, listener: Callable[[list[CancelNotice]], None]) -> None:
        """Call ``listener(notices)`` on every node, after commit, for the jobs
        of runs an event cancelled (cancel_on) while a worker held them: the
        node serving the session tells its worker (ironflow/store/cancel_on.py)."""

    # ingest-side flow control (ironflow/store/flow.py) -----------------------

    @abc.abstractmethod
    async def list_debounces(
        self, *, function_id: str | None = None, limit: int = 100
    ) -> list[DebounceRecord]:
        """Pending debounces (not yet dispatched), soonest first."""

    # outages (ironflow/store/outage.py) ---------------------------------------

    @abc.abstractmethod
    async def probe(self, *, write: bool, direct: bool = False) -> None:
        """Reach the database; ``write``: prove it can also grow and commit;
        ``direct``: not queued behind this node's other calls (PostgreSQL: on
        a connection of its own), so that it answers while they wait on
        locks. A write probe is always direct. Raises StoreUnavailable (or
        StorageFull) if it cannot."""

    @abc.abstractmethod
    async def give_back_blind_time(self, node_id: str, blind_s: float) -> int:
        """Push out the expiry of every node's leases, reservations and worker
        sessions that were live ``blind_s`` ago, by the part of those
        ``blind_s`` seconds no give-back covered yet (``node_id`` could not
        reach the database that long: nobody could heartbeat them, and no other
        node's scanner may expire them for it). Audited; returns how many
        leases it extended."""

    # nodes ----------------------------------------------------------------

    @abc.abstractmethod
    async def register_node(self, node_id: str) -> None:
        """Upsert the ``nodes`` row (started_at, heartbeat_at = now)."""

    @abc.abstractmethod
    async def node_heartbeat(self, node_id: str) -> None: ...

    # functions, workers, sessions -------------------------------------------

    @abc.abstractmethod
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
        """Upsert every function definition (version +1 when it changed) and its
        trigger index rows, create a worker session expiring at now +
        ``session_expiry_s`` and one credit row per slot (``max_concurrent_jobs``).
        A pull session gets a fresh secret, returned once and stored hashed.

        Raises:
          LimitExceeded: a trigger pattern would be shared by more than
            ``max_functions_per_trigger`` functions (nothing is written).
        """

    @abc.abstractmethod
    async def pull_session(self, session_id: str, secret: str) -> SessionInfo | None:
        """The live *pull* session ``session_id`` if ``secret`` is its secret, else None.

        A streaming session, an expired one and a wrong secret all answer None:
        the caller cannot tell them apart (no oracle)."""

    @abc.abstractmethod
    async def list_functions(self, *, live_within_s: float | None = None) -> list[FunctionRecord]:
        """Every stored function, deleted ones too (``deleted_at``); ``live``
        says whether a worker serves it or did within ``live_within_s``
        seconds (ironflow/store/function_life.py; always True when None)."""

    @abc.abstractmethod
    async def delete_function(self, function_id: str, *, by: str) -> bool:
        """No new run from its events or ticks (nor invoke, step.invoke,
        rerun); runs in flight finish; its definition is kept. Audited; False
        if deleted already; FunctionNotFound if never stored. A worker
        registering it restores it (ironflow/store/function_life.py)."""

    @abc.abstractmethod
    async def close_session(
        self,
        session_id: str,
        *,
        recover_leases: bool,
        recovery_grace_s: float,
        recovery_ceiling: int,
    ) -> list[RecoveredSegment]:
        """A worker went away (socket closed). Release its reservations (queue
        rows become claimable again), delete the session and its credits.

        With ``recover_leases`` (fast loss detection, beyond the seed): every
        lease the session holds is fenced and recovered at once, exactly as the
        scanner does on expiry (audit pair, recovery_count +1, ceiling), except
        that a run's FIRST recovery is requeued with eligible_at = now (no
        grace); a run that already has recoveries gets ``recovery_grace_s``.
        """

    @abc.abstractmethod
    async def record_node_drain(self, kind: str, data: Any, *, run_id: str | None = None) -> None:
        """Audit one step of a node's drain (``node.drain.*``: started, completed,
        deadline_reached, and recovered for each segment recovered at the deadline)."""

    # events and runs --------------------------------------------------------

    @abc.abstractmethod
    async def ingest_event(
        self,
        name: str,
        data: Any,
        idempotency_key: str | None,
        *,
        idempotency_window_s: float,
    ) -> IngestResult:
        """Persist the event and create one run (+ queue row, reason 'new',
        status 'waiting_for_capacity') per function whose trigger matches (exact
        name or ``prefix.*``), in one transaction. A key seen within the window
        returns the first event's id and run ids and creates nothing."""

    @abc.abstractmethod
    async def ingest_events(
        self,
        events: list[tuple[str, Any, str | None]],
        *,
        idempotency_window_s: float,
    ) -> list[IngestResult]:
        """:meth:`ingest_event` for each ``(name, data, idempotency_key)``, all in
        ONE transaction (all persisted, or none)."""

    @abc.abstractmethod
    async def ingest_traced_events(
        self,
        events: list[tuple[str, Any, str | None, str | None]],
        *,
        idempotency_window_s: float,
    ) -> list[IngestResult]:
        """:meth:`ingest_events` of ``(name, data, idempotency_key, traceparent)``:
        each new event also records its W3C ``traceparent`` (None: none), which
        every assignment of its runs carries (ironflow/store/ingest.py)."""

    @abc.abstractmethod
    async def invoke_function(self, function_id: str, data: Any) -> str:
        """Start a run of ``function_id`` directly (synthetic event
        ``ironflow/function.invoked``). Raises FunctionNotFound."""

    @abc.abstractmethod
    async def cancel_run(self, run_id: str, reason: str) -> CancelOutcome:
        """Run → 'cancelled'; delete its queue row and lease, free the credit,
        bump current_execution_seq so later messages from the segment are
        refused. A run with undos (``step.compensate``) is not ended: its
        compensation segment is queued instead (``compensating`` in the
        answer; store/compensation.py). Raises RunNotFound; Conflict if the run
        already ended or is compensating."""

    # run control (ironflow/store/run_control.py) ---------------------

    @abc.abstractmethod
    async def resume_run(self, run_id: str, from_step: str | None = None) -> ResumeOutcome:
        """Put a failed (or paused) run back on the queue under the same id. A
        failed run: its failed step's row and every later step row go (or from
        the first step named ``from_step`` on), earlier memoised steps stay, the
        attempt budget starts again. Raises RunNotFound; NotFound for an unknown
        ``from_step``; Conflict when the run is neither failed nor paused."""

    @abc.abstractmethod
    async def resume_failed_runs(
        self, *, function_id: str | None, since_s: float, limit: int, cursor: str | None
    ) -> tuple[list[ResumeOutcome], str | None]:
        """:meth:`resume_run` for up to ``limit`` runs that failed in the last
        ``since_s`` seconds (each its own transaction), oldest first after
        ``cursor``; the resumed runs and the cursor of the next page (None at the end)."""

    @abc.abstractmethod
    async def pause_run(self, run_id: str) -> CancelOutcome:
        """Run → 'paused': its queue row and lease go (credits freed), its
        execution_seq moves on so its worker's next write is refused. Raises
        RunNotFound; Conflict when the run ended or is already paused."""

    # dispatch -----------------------------------------------------------------

    @abc.abstractmethod
    async def reserve_segments(
        self,
        node_id: str,
        offers: dict[str, frozenset[str]],
        limit: int,
        *,
        reservation_expiry_s: float,
    ) -> Reservations:
        """Admit runnable segments to free credits of the offered sessions.

        ``offers`` maps session_id → function ids that session can run. In one
        transaction: take queue rows with eligible_at ≤ now and no live
        reservation (``FOR UPDATE SKIP LOCKED`` on PostgreSQL), oldest first;
        respect each function's concurrency limit (global or per key: leases
        + reservations still on their rows, an expired one too until it is
        cleared: a JobAck may be activating it); claim one free, not-held credit of a
        non-draining session for each; stamp the row with reservation_owner,
        reservation_expires_at and sha256 of a fresh lease token; build the
        JobAssignment (event, attempt, memoised steps, execution_seq, token).
        Fewer than ``limit`` made: the same transaction reads when the next
        row becomes eligible (:class:`Reservations`).
        """

    @abc.abstractmethod
    async def ingest_and_reserve(
        self,
        events: list[tuple[str, Any, str | None]],
        *,
        idempotency_window_s: float,
        offers: dict[str, frozenset[str]],
        limit: int,
        reservation_expiry_s: float,
    ) -> tuple[list[IngestResult], Reservations]:
        """:meth:`ingest_events`, then, in the same transaction when the events
        queued a run, one :meth:`reserve_segments` round for ``offers`` (in
        dispatch order: older rows first); both answers. The round's
        ``next_eligible`` is not read."""

    @abc.abstractmethod
    async def release_reservation(self, session_id: str, run_id: str, execution_seq: int) -> None:
        """An assignment could not be delivered: unreserve the row, free the credit."""

    @abc.abstractmethod
    async def seconds_until_next_eligible(self) -> float | None:
        """Seconds (DB clock) until the soonest unreserved queue row that is not
        eligible yet becomes eligible; 0 if every unreserved row is eligible
        now (they wait for a credit or a concurrency slot: a kick); None if
        no row is unreserved."""

    @abc.abstractmethod
    async def watch_kicks(
        self,
        on_kick: Callable[[], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Until cancelled, call ``on_kick`` whenever ANOTHER node (or this one)
        committed work that became claimable (PostgreSQL ``LISTEN/NOTIFY``; a
        no-op on SQLite, which has one node)."""

    # execution (fenced) -------------------------------------------------------

    @abc.abstractmethod
    async def activate_lease(self, fence: Fence, *, lease_expiry_s: float) -> RunRecord:
        """THE FENCING CHOKEPOINT. Turn the session's reservation of
        ``(run_id, execution_seq)`` into a concurrency lease (token hash must
        match, seq must be the run's current one, run not terminal): delete the
        queue row, insert the lease expiring at now + ``lease_expiry_s``, run →
        'running'. Raises StaleExecution otherwise."""

    async def activate_leases(
        self,
        fences: Sequence[Fence],
        *,
        lease_expiry_s: float,
        synchronous_commit: bool = True,
    ) -> list[outcome.Outcome[RunRecord]]:
        """:meth:`activate_lease` for several segments (the acks of a burst of
        assignments), each its own outcome in ``fences``' order: one refused
        ack (StaleExecution) never undoes another (a backend may activate them
        all in one statement). At most one fence per run.

        ``synchronous_commit=False``: the commit need not wait for its WAL
        flush (PostgreSQL), for a caller that tells nobody the activations
        happened — see :meth:`ironflow.store.fence.FenceOps.activate_leases`
        for why losing them in a database crash is safe."""
        results: list[outcome.Outcome[RunRecord]] = []
        for fence in fences:
            try:
                results.append(
                    outcome.Value(await self.activate_lease(fence, lease_expiry_s=lease_expiry_s))
                )
            except StaleExecution as exc:
                results.append(outcome.Error(exc))
        return results

    @abc.abstractmethod
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
        """Persist a step result under the live lease (idempotent per step_id;
        a completed row is never overwritten). Raises StaleExecution."""

    async def record_steps(self, fence: Fence, steps: list[StepResult]) -> None:
        """:meth:`record_step` for several results under one fence, in order:
        all recorded, or StaleExecution and none (a backend may write them in
        one statement)."""
        for s in steps:
            await self.record_step(
                fence, step_id=s.step_id, name=s.name, status=s.status, output=s.output,
                error=s.error, duration_ms=s.duration_ms,
            )

    async def record_steps_many(
        self, items: Sequence[tuple[Fence, list[StepResult]]]
    ) -> list[outcome.Outcome[None]]:
        """:meth:`record_steps` for several segments (different runs), each its
        own outcome in ``items``' order: one refused (StaleExecution) never
        undoes another (a backend may write them all in one statement). At
        most one item per run."""
        results: list[outcome.Outcome[None]] = []
        for fence, steps in items:
            try:
                await self.record_steps(fence, steps)
                results.append(outcome.Value(None))
            except StaleExecution as exc:
                results.append(outcome.Error(exc))
        return results

    @abc.abstractmethod
    async def heartbeat(
        self,
        session_id: str,
        jobs: list[ActiveJob] | None,
        *,
        session_expiry_s: float,
        lease_expiry_s: float,
    ) -> list[JobLeaseStatus]:
        """Push the session's expiry and refresh leases.

        With ``jobs``: refresh only the leases matching each job's
        ``(run_id, execution_seq, sha256(lease_token), session)``; answer
        REFRESHED for those, STALE for a known run whose lease is gone or
        superseded, UNKNOWN for a run the engine has no record of. Held-back
        credits (AT_CAPACITY) are released when the list shows free slots.
        With ``jobs=None`` (compatibility fallback): refresh every lease of the
        session and answer an empty list.

        Raises SessionNotFound if the session expired or was closed.
        """

    @abc.abstractmethod
    async def complete_job(self, fence: Fence, output: Any) -> JobOutcome:
        """Run → 'completed'; delete the lease; free the credit. StaleExecution."""

    async def complete_jobs(
        self,
        items: Sequence[tuple[Fence, Any, list[StepResult]]],
        *,
        activate: frozenset[str] = frozenset(),
        lease_expiry_s: float = 0.0,
    ) -> list[outcome.Outcome[JobOutcome]]:
        """:meth:`complete_job` for several segments (different runs), each its
        own outcome in ``items``' order, as :meth:`record_steps_many`. An
        item is (fence, output, step results): the segment's last step
        results, which a worker sends together with the job's result, are
        recorded first (:meth:`record_steps`), in the same transaction.
        The segments of runs in ``activate`` are activated first (their
        JobAck came with the result; :meth:`activate_leases` with
        ``lease_expiry_s``): an ack refused refuses its item."""
        results: list[outcome.Outcome[JobOutcome]] = []
        for fence, output, steps in items:
            try:
                if fence.run_id in activate:
                    await self.activate_lease(fence, lease_expiry_s=lease_expiry_s)
                if steps:
                    await self.record_steps(fence, steps)
                results.append(outcome.Value(await self.complete_job(fence, output)))
            except StaleExecution as exc:
                results.append(outcome.Error(exc))
        return results

    @abc.abstractmethod
    async def complete_jobs_and_reserve(
        self,
        items: Sequence[tuple[Fence, Any, list[StepResult]]],
        *,
        offers: dict[str, frozenset[str]],
        limit: int,
        reservation_expiry_s: float,
        activate: frozenset[str] = frozenset(),
        lease_expiry_s: float = 0.0,
    ) -> tuple[list[outcome.Outcome[JobOutcome]], Reservations]:
        """:meth:`complete_jobs` (``activate``, ``lease_expiry_s`` as there),
        then, in the same transaction when one of
        them freed a credit, one :meth:`reserve_segments` round for
        ``offers`` (the freed credits among them): both answers. The round's
        ``next_eligible`` is not read."""

    @abc.abstractmethod
    async def fail_job(self, fence: Fence, error: ErrorInfo) -> JobOutcome:
        """Retryable with attempts left: attempt +1, new seq queued at now +
        backoff (reason 'retry'), run 'waiting'. Otherwise run 'failed' with the
        error — unless the run has undos (``step.compensate``): then its
        compensation segment is queued (reason 'compensate', ``compensating``
        in the outcome), and that segment's own JobFailed ends the run
        'failed' or 'cancelled' with the original error (store/compensation.py).
        Lease deleted, credit freed either way. StaleExecution."""

    @abc.abstractmethod
    async def yield_job(self, fence: Fence, *, step_id: str, name: str, info: YieldInfo) -> JobOutcome:
        """Park the run on a sleep / wait / invoke step: step row 'sleeping' or
        'waiting', run 'waiting', recovery_count reset to 0, lease deleted,
        credit freed. StaleExecution."""

    @abc.abstractmethod
    async def nack_job(self, fence: Fence, reason: JobNackReason) -> JobOutcome:
        """The worker refused the assignment: the reservation (or lease) is
        released, run → 'waiting', next seq queued at once (no grace), attempt
        and recovery_count unchanged. DRAINING marks the session draining;
        AT_CAPACITY holds that session's credit back until a heartbeat shows
        space. StaleExecution."""

    # loop 1: capacity scanner --------------------------------------------------

    @abc.abstractmethod
    async def expire_reservations(self) -> int:
        """Unreserve queue rows whose reservation expired; free their credits."""

    @abc.abstractmethod
    async def expire_leases(
        self, *, recovery_grace_s: float, recovery_ceiling: int
    ) -> list[RecoveredSegment]:
        """Fence every expired lease: bump the run's seq, delete the lease, free
        the credit, recovery_count +1, run 'running' → 'waiting', queue the new
        seq at now + grace (reason 'recovery') and audit
        ``capacity.lease.expired`` + ``capacity.segment.recovered`` (always).
        A run whose recovery_count would exceed the ceiling fails with
        EXECUTION_RECOVERY_EXHAUSTED instead."""

    @abc.abstractmethod
    async def expire_sessions(self) -> int:
        """Delete expired sessions, cascading to credits. Leases stay (they
        expire on their own clock)."""

    @abc.abstractmethod
    async def expire_run_deadlines(self) -> list[CancelOutcome]:
        """Fail every unended run past its function's timeout (``FUNCTION_TIMEOUT``),
        counted from its first start by the database clock."""

    @abc.abstractmethod
    async def seconds_until_next_capacity_expiry(self) -> float | None:
        """Earliest of reservation / lease / session expiry, seconds from now (DB clock)."""

    # loop 2 and the waker -------------------------------------------------------

    @abc.abstractmethod
    async def claim_elapsed_steps(
        self, node_id: str, limit: int, *, lookahead_s: float = 0.0
    ) -> list[tuple[str, str]]:
        """Claim up to ``limit`` steps, earliest wake time first: sleeps whose
        wake_at is at most ``lookahead_s`` ahead of now, and waits/invokes whose
        timeout passed (never ahead: an event or the child may still come).
        Status → 'waking', claimed_by/claimed_at set, pre_claim_status kept
        (SKIP LOCKED). Returns (run_id, step_id) pairs."""

    @abc.abstractmethod
    async def resume_claimed_steps(
        self, node_id: str, steps: list[tuple[str, str]]
    ) -> WakeOutcome:
        """Finish a batch of claims in one transaction: a sleep → 'completed'; a
        timed-out wait → 'timed_out' (output None); a timed-out invoke →
        'failed' (InvokeError); the claim cleared. Each resumable run's next
        seq is queued at once (reason 'resume') with ``runs.start_at`` = the
        step's wake_at, which every dispatch of that segment honours (a sleep
        claimed ahead is held until then). A step no longer claimed by
        ``node_id`` is skipped and reported in ``lost``."""

    @abc.abstractmethod
    async def reset_stale_claims(self, threshold_s: float) -> int:
        """Restore 'waking' steps claimed longer than ``threshold_s`` ago whose
        run holds NEITHER a lease NOR a queue row to pre_claim_status."""

    @abc.abstractmethod
    async def seconds_until_next_wake(self, lookahead_s: float = 0.0) -> float | None:
        """Seconds (DB clock) until :meth:`claim_elapsed_steps` with this
        ``lookahead_s`` would find a step; 0 if one is claimable now; None if
        no step is parked with a wake time."""

    # reads ----------------------------------------------------------------------

    @abc.abstractmethod
    async def get_run(self, run_id: str) -> RunDetail:
        """Run, its steps (oldest first), queue row, lease and waiting reason. RunNotFound."""

    @abc.abstractmethod
    async def step_output(self, run_id: str, step_id: str) -> str:
        """A completed step's output, its stored JSON text (what a worker reads
        when an assignment left it out). StepNotFound if there is none."""

    @abc.abstractmethod
    async def list_runs(
        self, *, status: str | None = None, function_id: str | None = None, limit: int = 50
    ) -> list[RunRecord]:
        """The newest ``limit`` runs with their outputs (:meth:`runs_page`'s first page)."""

    @abc.abstractmethod
    async def runs_page(
        self, page: PageRequest, *, status: str | None = None, function_id: str | None = None
    ) -> RunList:
        """One page of runs, newest first (store/pages.py). InvalidCursor."""

    @abc.abstractmethod
    async def get_run_record(self, run_id: str) -> RunRecord:
        """The run alone (no steps): what a result wait re-reads. RunNotFound if unknown."""

    @abc.abstractmethod
    async def list_leases(self, *, include_expired: bool = False) -> list[LeaseRecord]:
        """Active (unexpired) concurrency leases; with ``include_expired`` also
        those expired by the database clock that loop 1 has not reaped yet."""

    @abc.abstractmethod
    async def list_sessions(self) -> list[SessionRecord]: ...

    @abc.abstractmethod
    async def list_queue(self) -> list[QueueRecord]: ...

    @abc.abstractmethod
    async def list_audit(
        self, *, run_id: str | None = None, type: str | None = None, limit: int = 100
    ) -> list[AuditRecord]:
        """The oldest ``limit`` audit records with their data (:meth:`audit_page`'s first page)."""

    @abc.abstractmethod
    async def audit_page(
        self, page: PageRequest, *, run_id: str | None = None, type: str | None = None
    ) -> AuditList:
        """One page of the audit trail, oldest first (store/pages.py). InvalidCursor."""

    @abc.abstractmethod
    async def run_stats(self, *, window_s: int, bucket_s: int) -> RunStats:
        """Runs created in the last ``window_s`` by status, per ``bucket_s`` and per function."""

    @abc.abstractmethod
    async def capacity_gauges(self) -> CapacityGauges:
        """Queue depth by state, active leases and live sessions by mode, in one read."""

    @abc.abstractmethod
    async def list_events(self, *, name: str | None = None, limit: int = 50) -> list[EventRecord]:
        """Stored events, newest first, each with the runs it started (:meth:`events_page`'s first page)."""

    @abc.abstractmethod
    async def events_page(self, page: PageRequest, *, name: str | None = None) -> EventList:
        """One page of stored events, newest first (store/pages.py). InvalidCursor."""

    @abc.abstractmethod
    async def get_event(self, event_id: str) -> EventRecord:
        """One stored event. NotFound."""

    @abc.abstractmethod
    async def rerun(self, run_id: str) -> tuple[str, str]:
        """A new run of ``run_id``'s function with its event: (new run id, event id).
        RunNotFound when the run, its event or its function is gone."""

    # history retention --------------------------------------------------------------

    @abc.abstractmethod
    async def purge_history(
        self,
        *,
        older_than_s: float,
        idempotency_window_s: float,
        statuses: frozenset[str] = TERMINAL_RUN_STATUSES,
        batch: int,
        wait_for_lock: bool = False,
    ) -> PurgeCounts:
        """Delete ONE batch of history in one short transaction; return the counts.

        Up to ``batch`` runs whose status is terminal (and in ``statuses``),
        that ended strictly more than ``older_than_s`` ago by the database
        clock, whose parent run no longer exists (a child goes after its
        parent, never while the parent is kept), and that hold no lease and no
        queue row — with their steps and audit rows. Then up to ``batch``
        events received more than ``idempotency_window_s`` ago that no
        remaining run references. Then, when ``statuses`` is every finished
        status, up to ``batch`` audit rows of no run (node drains, purges…)
        written more than ``older_than_s`` ago. ``more`` says whether any of
        the three hit ``batch``.

        PostgreSQL: the batch runs under a transaction-level advisory lock, so
        one node purges at a time. With ``wait_for_lock`` False a node that
        finds it taken deletes nothing and answers ``locked_out=True``; with
        True it waits for the other node's batch to commit.
        """

    @abc.abstractmethod
    async def reclaim_space(self, max_pages: int) -> int:
        """Give up to ``max_pages`` free database pages back to the file system
        (SQLite ``PRAGMA incremental_vacuum``); return the pages released.
        PostgreSQL returns 0: its autovacuum reclaims deleted rows."""

    @abc.abstractmethod
    async def oldest_finished_run_age(self) -> float | None:
        """Seconds (database clock) since the oldest stored finished run ended;
        None when no finished run is stored."""

    @abc.abstractmethod
    async def record_purge(self, counts: PurgeCounts, *, by: str, older_than_s: float) -> None:
        """Audit one purge pass (type ``history.purged``) with its counts and who ran it."""

    # keys -------------------------------------------------------------------------

    @abc.abstractmethod
    async def create_api_key(
        self, kind: Literal["org", "platform"], role: str = "admin", key: str | None = None
    ) -> tuple[str, str]:
        """Mint a key (``ifkey_``/``ifplatform_`` + 32 hex; or store ``key`` as
        given), store only its SHA-256. Returns (key_id, key)."""

    @abc.abstractmethod
    async def authenticate(self, key: str) -> Principal | None: ...

    # cron triggers, function pause and resume (ironflow/store/cron.py) ---

    @abc.abstractmethod
    async def fire_due_ticks(
        self, node_id: str, *, limit: int, missed_after_s: float, live_within_s: float
    ) -> list[CronFired]:
        """Fire up to ``limit`` schedules due by the database clock, in one
        transaction: each tick that starts a run is claimed (once per function
        and scheduled time) with its run; ticks older than ``missed_after_s``
        follow the catch-up policy; a function no worker served within
        ``live_within_s`` starts none (its ticks recorded as skipped,
        NO_LIVE_WORKER); every next tick moves past now."""

    @abc.abstractmethod
    def on_schedules_changed(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener()`` after a registration that may have changed schedules; returns the unregister."""

    @abc.abstractmethod
    async def seconds_until_next_tick(self) -> float | None:
        """Seconds from the database clock to the earliest tick (None: no schedule)."""

    @abc.abstractmethod
    async def pause_function(self, function_id: str, *, by: str) -> bool:
        """No run starts from its events or ticks; audited; False if paused already."""

    @abc.abstractmethod
    async def resume_function(
        self, function_id: str, *, catchup: bool, by: str, node_id: str
    ) -> tuple[bool, str | None]:
        """(whether it was paused, the run started for the latest tick skipped
        while paused when ``catchup``). Audited. Both raise FunctionNotFound."""
