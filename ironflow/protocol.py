"""Wire types shared by the engine node and the worker SDK.

Every message that crosses a process boundary is a frozen ``msgspec.Struct``.
Worker ↔ engine frames are tagged unions (the ``type`` field names the
message) so a frame is decoded with one typed decoder and bad input fails at
the edge with a clear ``msgspec.ValidationError``.

This module imports nothing of ours: the SDK, the API, the actors and the
store all depend on it, never the other way round.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

# Hard ceiling for one websocket frame or HTTP JSON body. Large enough for a
# JobAssignment carrying a few hundred memoised steps, small enough that a
# runaway payload cannot balloon the node's memory.
MAX_FRAME_BYTES = 4 * 1024 * 1024

SDK_VERSION = "0.1.0"

JobNackReason = Literal["DRAINING", "AT_CAPACITY"]
LeaseState = Literal["REFRESHED", "STALE", "UNKNOWN"]
StepKind = Literal["run", "sleep", "wait", "invoke"]
RunStatus = Literal[
    "waiting_for_capacity", "running", "waiting", "completed", "failed", "cancelled"
]
TERMINAL_RUN_STATUSES: frozenset[str] = frozenset({"completed", "failed", "cancelled"})


# ── function definitions (registered by workers) ───────────────────────────


class Trigger(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An event trigger: an exact name (``order.created``) or ``prefix.*``."""

    event: str


class RetryPolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a retryable failure is retried. ``max_attempts`` counts all attempts."""

    max_attempts: int = 3
    initial_delay_s: float = 1.0
    backoff_factor: float = 2.0
    max_delay_s: float = 300.0

    def delay_after(self, attempt: int) -> float:
        """Seconds to wait before attempt ``attempt + 1`` after attempt ``attempt`` failed."""
        return float(
            min(self.initial_delay_s * self.backoff_factor ** max(attempt - 1, 0), self.max_delay_s)
        )


class Concurrency(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """At most ``limit`` segments execute at once, per value of ``key`` if given.

    ``key`` is a dotted path into the event data (``customer.id``); a leading
    ``event.data.`` or ``data.`` is accepted and ignored.
    """

    limit: int
    key: str | None = None


class FunctionDef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A function's full definition, as a worker registers it on connect."""

    id: str
    triggers: list[Trigger] = []
    retries: RetryPolicy = RetryPolicy()
    concurrency: Concurrency | None = None
    timeout_s: float | None = None
    audit: bool = False
    name: str | None = None


# ── pieces carried inside messages ──────────────────────────────────────────


class ErrorInfo(msgspec.Struct, frozen=True):
    """A handler or step error as the worker reports it."""

    message: str
    code: str = "ERROR"
    traceback: str | None = None
    retryable: bool = True


class EventInfo(msgspec.Struct, frozen=True):
    id: str
    name: str
    data: Any
    received_at: float
    idempotency_key: str | None = None


class MemoStep(msgspec.Struct, frozen=True):
    """A step whose result already reached the engine (replayed, not re-run)."""

    step_id: str
    name: str
    kind: StepKind
    status: str
    output: Any = None
    error: ErrorInfo | None = None


class ActiveJob(msgspec.Struct, frozen=True):
    """One job a worker is executing, with the fence it was assigned."""

    job_id: str
    run_id: str
    execution_seq: int
    lease_token: str
    started_at: float = 0.0


class JobLeaseStatus(msgspec.Struct, frozen=True):
    job_id: str
    run_id: str
    execution_seq: int
    state: LeaseState


class SleepYield(msgspec.Struct, frozen=True, tag="sleep"):
    until: float


class WaitYield(msgspec.Struct, frozen=True, tag="wait"):
    event: str
    timeout_at: float
    match: str | None = None
    match_value: Any = None


class InvokeYield(msgspec.Struct, frozen=True, tag="invoke"):
    function_id: str
    input: Any = None
    timeout_at: float | None = None


YieldInfo = SleepYield | WaitYield | InvokeYield


# ── worker → engine ─────────────────────────────────────────────────────────


class Register(msgspec.Struct, frozen=True, tag="register", forbid_unknown_fields=True):
    worker_id: str
    functions: list[FunctionDef]
    max_concurrent_jobs: int = 10
    sdk_version: str = SDK_VERSION
    hostname: str = ""


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    """``jobs=None`` is the compatibility fallback: refresh every lease of the session."""

    jobs: list[ActiveJob] | None = None


class JobAck(msgspec.Struct, frozen=True, tag="job_ack"):
    job_id: str
    run_id: str
    execution_seq: int
    lease_token: str


class JobNack(msgspec.Struct, frozen=True, tag="job_nack"):
    job_id: str
    run_id: str
    execution_seq: int
    lease_token: str
    reason: JobNackReason


class StepCompleted(msgspec.Struct, frozen=True, tag="step_completed"):
    job_id: str
    run_id: str
    execution_seq: int
    lease_token: str
    step_id: str
    name: str
    output: Any = None
    duration_ms: float = 0.0


class StepFailed(msgspec.Struct, frozen=True, tag="step_failed"):
    job_id: str
    run_id: str
    execution_seq: int
    lease_token: str
    step_id: str
    name: str
    error: ErrorInfo
    duration_ms: float = 0.0


class JobCompleted(msgspec.Struct, frozen=True, tag="job_completed"):
    job_id: str
    run_id: str
    execution_seq: int
    lease_token: str
    output: Any = None
    duration_ms: float = 0.0


class JobFailed(msgspec.Struct, frozen=True, tag="job_failed"):
    job_id: str
    run_id: str
    execution_seq: int
    lease_token: str
    error: ErrorInfo
    duration_ms: float = 0.0


class JobYielded(msgspec.Struct, frozen=True, tag="job_yielded"):
    job_id: str
    run_id: str
    execution_seq: int
    lease_token: str
    step_id: str
    name: str
    yield_info: YieldInfo


WorkerMessage = (
    Register
    | Heartbeat
    | JobAck
    | JobNack
    | StepCompleted
    | StepFailed
    | JobCompleted
    | JobFailed
    | JobYielded
)

# Messages that carry a fence and mutate a segment's state.
FencedMessage = JobAck | JobNack | StepCompleted | StepFailed | JobCompleted | JobFailed | JobYielded


# ── engine → worker ─────────────────────────────────────────────────────────


class Registered(msgspec.Struct, frozen=True, tag="registered"):
    session_id: str
    heartbeat_interval_ms: int
    lease_expiry_ms: int


class JobAssignment(msgspec.Struct, frozen=True, tag="job"):
    job_id: str
    run_id: str
    function_id: str
    event: EventInfo
    attempt: int
    max_attempts: int
    completed_steps: list[MemoStep]
    execution_seq: int
    lease_token: str


class LeaseStatus(msgspec.Struct, frozen=True, tag="lease_status"):
    jobs: list[JobLeaseStatus]


class Cancel(msgspec.Struct, frozen=True, tag="cancel"):
    job_id: str
    run_id: str
    reason: str = "cancelled"


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    reason: str
    drain_timeout_ms: int


class Refused(msgspec.Struct, frozen=True, tag="refused"):
    """A message was refused. ``job_id`` is set when the refusal is scoped to one job."""

    code: str
    message: str
    job_id: str | None = None
    run_id: str | None = None


EngineMessage = Registered | JobAssignment | LeaseStatus | Cancel | Shutdown | Refused


# ── encoders / decoders (module-level: building them is not free) ─────────

encoder = msgspec.json.Encoder()
worker_message_decoder = msgspec.json.Decoder(WorkerMessage)
engine_message_decoder = msgspec.json.Decoder(EngineMessage)


def job_id_for(run_id: str, execution_seq: int) -> str:
    """The job id of a segment: stable for its ``(run_id, execution_seq)``."""
    return f"{run_id}/{execution_seq}"


# ── HTTP bodies ─────────────────────────────────────────────────────────────


class EmitRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    data: Any = {}
    idempotency_key: str | None = None


class EmitResponse(msgspec.Struct, frozen=True):
    event_id: str
    run_ids: list[str]
    duplicate: bool = False


# One batch is one transaction; this bounds how long it holds the writer.
MAX_BATCH_EVENTS = 1000


class EmitBatchRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Body of ``POST /v1/events/batch``: persisted in one transaction, all or none."""

    events: list[EmitRequest]


class EmitBatchResponse(msgspec.Struct, frozen=True):
    events: list[EmitResponse]


class InvokeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    data: Any = {}


class CancelRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    reason: str = "cancelled by user"


FinishedRunStatus = Literal["completed", "failed", "cancelled"]


class PurgeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Body of ``POST /v1/runs/purge`` (platform only): delete finished history now."""

    # Runs that ended strictly longer ago than this go; positive, so that
    # "0" can never mean "everything".
    older_than_s: Annotated[float, msgspec.Meta(gt=0)]
    # Only runs in these finished statuses (default: all three).
    statuses: list[FinishedRunStatus] | None = None


class PurgeResponse(msgspec.Struct, frozen=True):
    """Rows one purge deleted, by kind."""

    runs: int
    steps: int
    audit: int
    events: int
    older_than_s: float


class PullPollRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Body of ``POST /v1/worker/sessions/{session_id}/poll``."""

    wait_s: float = 20.0
    max_jobs: int = 1


class PullPollResponse(msgspec.Struct, frozen=True):
    jobs: list[JobAssignment]


class FencedResponse(msgspec.Struct, frozen=True):
    """Answer to a pull worker's fenced call (ack, step, result, nack)."""

    ok: bool = True


class ApiError(msgspec.Struct, frozen=True):
    code: str
    message: str


class KeyCreateRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    platform: bool = False
    role: str = "admin"


class KeyCreateResponse(msgspec.Struct, frozen=True):
    id: str
    key: str
    kind: str
    role: str
