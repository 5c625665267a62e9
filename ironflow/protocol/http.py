"""The HTTP contract: request and response bodies of every ``/v1`` endpoint and
the records the API returns (runs, steps, leases, sessions, queue, audit).

The store builds these records, the API encodes them, and the CLI and the SDK
client decode them into the same types.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from ironflow.protocol.bounds import MAX_DURATION_S, Name, ShortText
from ironflow.protocol.flow import FlowNote
from ironflow.protocol.worker import (
    ErrorInfo,
    FunctionDef,
    JobAssignment,
    RunStatus,
    Shutdown,
    StepKind,
)

# Header carrying a pull session's secret on every call after registration.
SESSION_SECRET_HEADER = "Ironflow-Session-Secret"

# ── HTTP bodies ─────────────────────────────────────────────────────────────


# A W3C trace context ``traceparent`` (version 00): the producer's span.
Traceparent = Annotated[str, Meta(pattern=r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")]


class EmitRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: Name
    data: Any = {}
    idempotency_key: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    # The producer's trace: the run's spans join it (also the ``traceparent`` header).
    traceparent: Traceparent | None = None


class EmitResponse(msgspec.Struct, frozen=True):
    event_id: str
    run_ids: list[str]
    duplicate: bool = False
    # Functions the event would have started but that are paused (docs/schedules.md).
    paused_function_ids: list[str] = []
    # Ingest-side flow control (protocol/flow.py): the functions this event
    # started no run of, the debounced runs it moved, the batches it joined.
    # New optional fields: an older client reads the answer it always did.
    skipped: list[FlowNote] = []
    debounced: list[FlowNote] = []
    batched: list[FlowNote] = []


# One batch is one transaction; this bounds how long it holds the writer.
MAX_BATCH_EVENTS = 1000


class EmitBatchRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Body of ``POST /v1/events/batch``: persisted in one transaction, all or none."""

    events: Annotated[list[EmitRequest], Meta(min_length=1, max_length=MAX_BATCH_EVENTS)]


class EmitBatchResponse(msgspec.Struct, frozen=True):
    events: list[EmitResponse]


class InvokeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    data: Any = {}


class CancelRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    reason: ShortText = "cancelled by user"


FinishedRunStatus = Literal["completed", "failed", "cancelled"]


class PurgeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Body of ``POST /v1/runs/purge`` (platform only): delete finished history now."""

    # Runs that ended strictly longer ago than this go; positive, so that
    # "0" can never mean "everything".
    older_than_s: Annotated[float, Meta(gt=0, le=100 * MAX_DURATION_S)]
    # Only runs in these finished statuses (default: all three).
    statuses: Annotated[list[FinishedRunStatus], Meta(max_length=3)] | None = None


class PurgeResponse(msgspec.Struct, frozen=True):
    """Rows one purge deleted, by kind."""

    runs: int
    steps: int
    audit: int
    events: int
    older_than_s: float


class PullPollRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Body of ``POST /v1/worker/sessions/{session_id}/poll``."""

    wait_s: Annotated[float, Meta(ge=0, le=3600)] = 20.0
    max_jobs: Annotated[int, Meta(ge=1, le=1000)] = 1
    # The pull form of ``Register.delayed_start``: this worker honours
    # ``JobAssignment.start_delay_ms`` (without it, no job comes before its start).
    delayed_start: bool = False


class PullPollResponse(msgspec.Struct, frozen=True):
    """Jobs for a pull worker; ``shutdown`` set when the node drains (the
    pull form of the streaming ``Shutdown``: drain within its deadline)."""

    jobs: list[JobAssignment]
    shutdown: Shutdown | None = None


class FencedResponse(msgspec.Struct, frozen=True):
    """Answer to a pull worker's fenced call (ack, step, result, nack)."""

    ok: bool = True


class ApiError(msgspec.Struct, frozen=True):
    code: str
    message: str


class KeyCreateRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    platform: bool = False
    role: Annotated[str, Meta(min_length=1, max_length=64)] = "admin"


class KeyCreateResponse(msgspec.Struct, frozen=True):
    id: str
    key: str
    kind: str
    role: str


class ChaosCrashRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``POST /v1/chaos/crash`` (a node started with ``--chaos`` only): the
    supervised actor to crash, as ``GET /v1/chaos/actors`` names it."""

    actor: Annotated[str, Meta(min_length=1, max_length=64)]


class ActorRecord(msgspec.Struct, frozen=True):
    """A supervised actor and how often its supervisor restarted it."""

    name: str
    restarts: int


class ActorList(msgspec.Struct, frozen=True):
    actors: list[ActorRecord]


# ── records the API returns (built by the store) ─────────────────────────────

# A step's life: run steps end completed/failed; durable steps park as
# sleeping/waiting, are claimed as waking, and a wait that ran out is timed_out.
StepStatus = Literal["running", "completed", "failed", "sleeping", "waiting", "waking", "timed_out"]
# Why a segment is in the dispatch queue.
QueueReason = Literal["new", "resume", "retry", "recovery", "nack"]
SessionMode = Literal["stream", "pull"]


class RunRecord(msgspec.Struct, frozen=True):
    id: str
    function_id: str
    event_id: str | None
    parent_run_id: str | None
    status: RunStatus
    attempt: int
    max_attempts: int
    recovery_count: int
    current_execution_seq: int
    output: Any
    error: ErrorInfo | None
    created_at: float
    started_at: float | None
    ended_at: float | None
    concurrency_key: str | None = None
    # Fields a list left out (``["output", "error.traceback"]``): a list route
    # carries no payloads unless asked (``?include=data``); the run's own GET
    # always has them.
    omitted: list[str] = []


class StepRecord(msgspec.Struct, frozen=True):
    run_id: str
    step_id: str
    name: str
    kind: StepKind
    status: StepStatus
    output: Any
    error: ErrorInfo | None
    duration_ms: float | None
    execution_seq: int
    created_at: float
    wake_at: float | None = None


class QueueRecord(msgspec.Struct, frozen=True):
    run_id: str
    function_id: str
    execution_seq: int
    eligible_at: float
    reason: QueueReason
    enqueued_at: float
    reservation_owner: str | None
    reservation_expires_at: float | None
    # Seconds until eligible by the database clock (negative: eligible now).
    eligible_in_s: float = 0.0


class LeaseRecord(msgspec.Struct, frozen=True):
    run_id: str
    function_id: str
    execution_seq: int
    session_id: str
    node_id: str
    expires_at: float
    activated_at: float
    expires_in_s: float = 0.0
    # Expired by the database clock, not yet reaped by loop 1 (listed only with all=true).
    expired: bool = False


class SessionRecord(msgspec.Struct, frozen=True):
    session_id: str
    worker_id: str
    node_id: str
    mode: SessionMode
    max_concurrent_jobs: int
    draining: bool
    expires_at: float
    created_at: float
    credits_claimed: int
    credits_held: int
    function_ids: list[str]


class RunDetail(msgspec.Struct, frozen=True):
    run: RunRecord
    steps: list[StepRecord]
    queue: QueueRecord | None
    lease: LeaseRecord | None
    # Human reason the run is waiting, e.g. "recovery grace until <ts>"; None otherwise.
    waiting_reason: str | None
    db_now: float


class AuditRecord(msgspec.Struct, frozen=True):
    id: str
    at: float
    type: str
    run_id: str | None
    function_id: str | None
    data: Any
    # ``["data"]`` in a list that left it out (``?include=data`` keeps it).
    omitted: list[str] = []


class FunctionSchedule(msgspec.Struct, frozen=True):
    """One cron trigger of a function, its next fire time (epoch seconds) and
    what its last tick did (docs/schedules.md)."""

    cron: str
    timezone: str
    catchup: str
    next_at: float
    # The latest tick considered (None: none yet) and, when it started no run,
    # why: NO_LIVE_WORKER (no worker within limits.function_live_s), PAUSED, or
    # MISSED (no node was up, and the catch-up policy fired none); None: it fired.
    last_tick_at: float | None = None
    skip_reason: str | None = None
    # Ticks skipped in a row since the last one that started a run.
    skipped_ticks: int = 0
    # The first tick skipped for want of a live worker: a returning worker's
    # catch-up looks back to it.
    skipped_since: float | None = None


class FunctionRecord(msgspec.Struct, frozen=True):
    id: str
    definition: FunctionDef
    version: int
    updated_at: float
    # When a worker last served it: registered it, or its session ended (None:
    # before this was recorded).
    last_seen_at: float | None = None
    # A worker serves it, or did within the node's ``limits.function_live_s``:
    # a cron function not live starts no runs (docs/schedules.md).
    live: bool = True
    # ── cron triggers and pause (docs/schedules.md) ──
    # When it was paused (None: not paused): no run starts from events or ticks.
    paused_at: float | None = None
    schedules: list[FunctionSchedule] = []
    # When an operator deleted it (None: not deleted): no new runs; listed
    # only with ``all=true``; a worker registering it restores it.
    deleted_at: float | None = None


# ── response envelopes (one struct per endpoint answer) ─────────────────────


class Health(msgspec.Struct, frozen=True):
    """``/healthz`` and ``/readyz``: ``ok`` / ``ready`` / ``starting`` / ``draining`` /
    ``store_unavailable`` (with the ``cause``: the database's own words)."""

    status: str
    node_id: str | None = None
    cause: str | None = None


class RunList(msgspec.Struct, frozen=True):
    """``GET /v1/runs``: one page, newest first; ``next_cursor`` (None: the
    last page) is the ``?cursor=`` of the next."""

    runs: list[RunRecord]
    next_cursor: str | None = None


class CancelResponse(msgspec.Struct, frozen=True):
    """``compensating``: the run has undos (``step.compensate``); it is queued
    to run them (``status`` its status now) and ends ``cancelled`` after."""

    run_id: str
    status: RunStatus = "cancelled"
    compensating: bool = False


class FunctionList(msgspec.Struct, frozen=True):
    functions: list[FunctionRecord]


class ResumeFunctionRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Body of ``POST /v1/functions/{id}/resume``: ``catchup`` starts a run for
    the latest tick skipped while paused (none by default)."""

    catchup: bool = False


class DeleteFunctionResponse(msgspec.Struct, frozen=True):
    """Answer of ``DELETE /v1/functions/{id}``; ``changed`` is False when it
    was deleted already."""

    function_id: str
    deleted: bool
    changed: bool


class PauseResponse(msgspec.Struct, frozen=True):
    """Answer of ``POST /v1/functions/{id}/pause`` and ``/resume``."""

    function_id: str
    paused: bool
    # False when the function already was in that state (nothing changed).
    changed: bool
    # resume with catchup: the run started for the latest skipped tick.
    catchup_run_id: str | None = None


class InvokeResponse(msgspec.Struct, frozen=True):
    run_id: str


class AuditList(msgspec.Struct, frozen=True):
    """``GET /v1/audit``: one page, oldest first; ``next_cursor`` (None: the
    last page) is the ``?cursor=`` of the next."""

    events: list[AuditRecord]
    next_cursor: str | None = None


class LeaseList(msgspec.Struct, frozen=True):
    leases: list[LeaseRecord]


class SessionList(msgspec.Struct, frozen=True):
    sessions: list[SessionRecord]


class QueueList(msgspec.Struct, frozen=True):
    queue: list[QueueRecord]


class RunResult(msgspec.Struct, frozen=True):
    """``GET /v1/runs/{id}/result``: the run's outcome once it ended (200), or
    its status so far (202) when it had not ended within ``wait_s``."""

    run_id: str
    status: RunStatus
    ended: bool
    output: Any = None
    error: ErrorInfo | None = None


# ── events and re-runs (read by the dashboard and the CLI) ──────────────────


class FilterNote(msgspec.Struct, frozen=True):
    """A function an event triggers but did not start (docs/triggers.md): its
    filter was false (``error`` False), or a filter or key could not be
    evaluated on the event (``error`` True); ``reason`` says which and why,
    ``code`` names a refusal by a limit (``EXPRESSION_BUDGET_EXCEEDED``)."""

    function_id: str
    reason: str
    error: bool = False
    code: str | None = None


class EventRecord(msgspec.Struct, frozen=True):
    """A stored event and the runs it started (or an invocation's run)."""

    id: str
    name: str
    data: Any
    received_at: float
    run_ids: list[str]
    idempotency_key: str | None = None
    # Trigger filters and cancel-on (docs/triggers.md): the functions it did
    # not start and why, and the runs it cancelled.
    filtered: list[FilterNote] = []
    cancelled_run_ids: list[str] = []
    # What flow control did with it, per function (protocol/flow.py).
    flow: list[FlowNote] = []
    # ``["data"]`` in a list that left it out (``?include=data`` keeps it);
    # ``GET /v1/events/{id}`` always has it.
    omitted: list[str] = []


class EventList(msgspec.Struct, frozen=True):
    """``GET /v1/events``: one page, newest first; ``next_cursor`` (None: the
    last page) is the ``?cursor=`` of the next."""

    events: list[EventRecord]
    next_cursor: str | None = None


class RerunResponse(msgspec.Struct, frozen=True):
    """``POST /v1/runs/{run_id}/rerun``: a new run of the same function with the same event."""

    run_id: str
    rerun_of: str
    event_id: str


class RunBucket(msgspec.Struct, frozen=True):
    """Runs created in the bucket starting at ``start`` (epoch s) now in ``status``."""

    start: float
    status: RunStatus
    count: int


class FunctionRunCount(msgspec.Struct, frozen=True):
    """Runs of ``function_id`` created in the window now in ``status``."""

    function_id: str
    status: RunStatus
    count: int


class RunStats(msgspec.Struct, frozen=True):
    """``GET /v1/stats/runs``: runs created in the last ``window_s`` by status,
    per ``bucket_s`` bucket and per function (the dashboard's chart and rates)."""

    window_s: int
    bucket_s: int
    since: float
    db_now: float
    buckets: list[RunBucket]
    functions: list[FunctionRunCount]
