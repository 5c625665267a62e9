"""The records the store takes and returns beside the protocol's: the fence a
worker message proves, the outcomes of its transitions, the counts behind its
gauges. Plain frozen ``msgspec`` structs, no behaviour; the interface that
takes and returns them is :class:`ironflow.store.base.Store`. ``ironflow.store``
re-exports every one of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import msgspec

from ironflow.protocol import ErrorInfo, FlowNote, JobAssignment, RunStatus

__all__ = [
    "PageRequest",
    "Fence",
    "StepResult",
    "Reservation",
    "Reservations",
    "RecoveredSegment",
    "JobOutcome",
    "WakeOutcome",
    "CapacityGauges",
    "CancelOutcome",
    "CancelNotice",
    "ResumeOutcome",
    "IngestResult",
    "CronFired",
    "SessionInfo",
    "PurgeCounts",
    "Principal",
]


class PageRequest(msgspec.Struct, frozen=True):
    """Which page of a list to read (ironflow/store/pages.py).

    ``limit``: rows at most; ``cursor``: the ``next_cursor`` of the page
    before (None: the first page); ``include_data``: payloads (event data,
    run outputs, audit data) in the records, or left out and named in each
    record's ``omitted``; ``max_bytes``: the JSON of the page's records at
    most (None: no byte cap, for the store's own callers).
    """

    limit: int = 50
    cursor: str | None = None
    include_data: bool = False
    max_bytes: int | None = None


class Fence(msgspec.Struct, frozen=True):
    """What a mutating worker message proves: it holds this segment's lease."""

    session_id: str
    run_id: str
    execution_seq: int
    lease_token: str


class StepResult(msgspec.Struct, frozen=True):
    """One ``step.run`` result to record (see :meth:`Store.record_steps`)."""

    step_id: str
    name: str
    status: Literal["completed", "failed"]
    output: Any = None
    error: ErrorInfo | None = None
    duration_ms: float = 0.0


class Reservation(msgspec.Struct, frozen=True):
    """A queued segment admitted to one session's free credit (not yet executing)."""

    session_id: str
    assignment: JobAssignment
    # Set for the segment the waker queued when a step woke: the database
    # clock now minus the step's wake time (negative when it is reserved ahead
    # of it, to be held until then), for the wake-lateness metric.
    wake_lateness_s: float | None = None
    # The run's step outputs so far (characters of their JSON), counted by
    # the session against ``limits.max_run_state_bytes``.
    state_bytes: int = 0


class Reservations(list[Reservation]):
    """What :meth:`Store.reserve_segments` returns: its reservations, in order.

    When the transaction made fewer than it was asked for (the queue ran dry
    for the offers), ``next_eligible`` also holds what
    :meth:`Store.seconds_until_next_eligible` answers just after its commit,
    read by the same transaction (``next_eligible_known``): the dispatcher,
    going idle, need not ask in a transaction of its own."""

    def __init__(
        self, reservations: Iterable[Reservation] = (), *, next_eligible: float | None = None,
        known: bool = False,
    ) -> None:
        super().__init__(reservations)
        self.next_eligible = next_eligible
        self.next_eligible_known = known


class RecoveredSegment(msgspec.Struct, frozen=True):
    """A lease that was fenced and re-enqueued (or whose run hit the ceiling)."""

    run_id: str
    function_id: str
    old_execution_seq: int
    new_execution_seq: int | None  # None when the run failed with EXECUTION_RECOVERY_EXHAUSTED
    session_id: str | None
    recovery_count: int
    eligible_at: float | None
    exhausted: bool
    # Set when the run failed here (exhausted): for the run-duration metric.
    duration_s: float | None = None


class JobOutcome(msgspec.Struct, frozen=True):
    """What a terminal or yielding worker message did to the run."""

    run_id: str
    status: str  # the run's status afterwards
    # Set when the run was requeued (retry, nack, woken yield) — for kicks/logging.
    next_execution_seq: int | None = None
    eligible_at: float | None = None
    attempt: int | None = None
    # Runs made runnable as a side effect (e.g. a parent resumed by a finished invoke).
    kicked_run_ids: list[str] = []
    # Set when the run ended here (completed or failed): for the run-duration metric.
    function_id: str | None = None
    duration_s: float | None = None
    # The run's final failure began its compensation (store/compensation.py):
    # its compensation segment is queued (next_execution_seq, eligible_at).
    compensating: bool = False


class WakeOutcome(msgspec.Struct, frozen=True):
    """What :meth:`Store.resume_claimed_steps` did with one batch of claims."""

    # Runs whose next segment was queued.
    resumed: list[str]
    # Claims taken away since they were made (the run was cancelled, or loop 2
    # restored the step): nothing of ours to resume; skipped, not an error.
    lost: list[tuple[str, str]]


class CapacityGauges(msgspec.Struct, frozen=True):
    """Counts behind the capacity gauges of ``/metrics`` (cluster-wide)."""

    runnable: int
    in_grace: int
    delayed: int
    leases: int
    sessions_by_mode: dict[str, int]


class CancelOutcome(msgspec.Struct, frozen=True):
    run_id: str
    # Who was executing it, so the node can send Cancel (None if nobody was).
    session_id: str | None
    node_id: str | None
    job_id: str | None
    # A parent run resumed because its invoked child was cancelled (the caller kicks).
    kicked_run_ids: list[str] = []
    # The ended run's function and duration: for the run-duration metric.
    function_id: str | None = None
    duration_s: float | None = None
    # The run has undos (step.compensate): it did not end, its compensation
    # segment is queued; it ends 'cancelled' once they ran (store/compensation.py).
    compensating: bool = False


class CancelNotice(msgspec.Struct, frozen=True):
    """A job whose run was cancelled while a worker held it: the node serving
    that session sends it ``Cancel`` (Store.on_jobs_cancelled)."""

    run_id: str
    session_id: str
    job_id: str
    reason: str


class ResumeOutcome(msgspec.Struct, frozen=True):
    """A run put back on the queue by :meth:`Store.resume_run`."""

    run_id: str
    function_id: str
    # The segment now queued (the run's new current_execution_seq).
    execution_seq: int
    # The status the run was resumed from ('failed' or 'paused').
    resumed_from: str
    # The first step that runs again (its name), None when no step row went.
    from_step: str | None = None
    # Step rows deleted so they run again (the failed one and every later one).
    steps_deleted: int = 0
    # 'waiting_for_capacity' (queued), or 'waiting': back on a step still
    # parked (a sleep not ended, a wait not answered), resumed when it settles.
    status: RunStatus = "waiting_for_capacity"


class IngestResult(msgspec.Struct, frozen=True):
    event_id: str
    run_ids: list[str]
    duplicate: bool
    # Parked runs whose wait_for_event this event matched (the caller kicks).
    resumed_run_ids: list[str] = []
    # Paused functions the event would have started (ironflow/store/cron.py).
    paused_function_ids: list[str] = []
    # Runs this event cancelled: by cancel_on (docs/triggers.md) or by a
    # singleton's mode="cancel" (store/flow.py); the caller tells their workers.
    cancelled: list[CancelOutcome] = []
    # Ingest-side flow control (store/flow.py): what it did per function.
    flow: list[FlowNote] = []


class CronFired(msgspec.Struct, frozen=True):
    """A tick claimed and its run started (ironflow/store/cron.py)."""

    function_id: str
    scheduled_at: float
    run_id: str


class SessionInfo(msgspec.Struct, frozen=True):
    session_id: str
    worker_id: str
    node_id: str
    mode: Literal["stream", "pull"]
    max_concurrent_jobs: int
    function_ids: list[str]
    # Pull sessions only: the secret every later call must present (kept hashed).
    secret: str | None = None


class PurgeCounts(msgspec.Struct, frozen=True):
    """Rows deleted by history retention, by kind.

    ``locked_out`` is True when another node held the janitor lock
    (PostgreSQL), so this node deleted nothing on purpose. ``more`` is True
    when a batch limit was reached, so another batch may find more.
    """

    runs: int = 0
    steps: int = 0
    audit: int = 0  # the deleted runs' audit rows and audit rows of no run
    events: int = 0
    locked_out: bool = False
    more: bool = False

    @property
    def total(self) -> int:
        return self.runs + self.steps + self.audit + self.events

    def plus(self, other: PurgeCounts) -> PurgeCounts:
        """The sum of two counts (``locked_out`` and ``more`` from ``other``, the later batch)."""
        return PurgeCounts(
            self.runs + other.runs,
            self.steps + other.steps,
            self.audit + other.audit,
            self.events + other.events,
            other.locked_out,
            other.more,
        )


class Principal(msgspec.Struct, frozen=True):
    """Who an API key authenticates as (:meth:`Store.authenticate`)."""

    key_id: str
    kind: Literal["org", "platform"]
    role: str
