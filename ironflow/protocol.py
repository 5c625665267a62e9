"""Wire types shared by the engine node and the worker SDK.

Every message that crosses a process boundary is a frozen ``msgspec.Struct``.
Worker ↔ engine frames are tagged unions (the ``type`` field names the
message) so a frame is decoded with one typed decoder and bad input fails at
the edge with a clear ``msgspec.ValidationError``.

This module imports nothing of ours: the SDK, the API, the actors and the
store all depend on it, never the other way round.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

# Hard ceiling for one websocket frame or HTTP JSON body. Large enough for a
# JobAssignment carrying a few hundred memoised steps, small enough that a
# runaway payload cannot balloon the node's memory.
MAX_FRAME_BYTES = 4 * 1024 * 1024
# Deepest JSON nesting accepted in a frame or body. Decoders recurse per level
# and Python's recursion limit is 1,000 frames shared with the caller's stack;
# 100 levels leave a payload room for real documents and the node its stack.
MAX_JSON_DEPTH = 100

# ── bounds of every number and name on the wire ──────────────────────────────
# Integers are stored in 64-bit database columns; 2**53 - 1 also survives a
# round trip through JSON consumers that use doubles (JavaScript dashboards).
MAX_WIRE_INT = 2**53 - 1
# Epoch seconds: up to the year 5138 — far past any real deadline, far below
# what a float column or datetime conversion cannot represent.
MAX_EPOCH_S = 1e11
# One year: the longest delay, timeout or backoff cap a definition may ask for.
MAX_DURATION_S = 365 * 24 * 3600.0
# Hard ceilings of the types; the node's configurable limits (NodeConfig.limits)
# are lower by default and decide what one node actually accepts.
MAX_SLOTS_HARD = 100_000
MAX_FUNCTIONS_HARD = 100_000
MAX_TRIGGERS_HARD = 1_000

Seq = Annotated[int, Meta(ge=1, le=MAX_WIRE_INT)]
Epoch = Annotated[float, Meta(ge=0, le=MAX_EPOCH_S)]
DurationMs = Annotated[float, Meta(ge=0, le=MAX_DURATION_S * 1000)]
Name = Annotated[str, Meta(min_length=1, max_length=256)]
Id = Annotated[str, Meta(min_length=1, max_length=256)]
Token = Annotated[str, Meta(min_length=1, max_length=256)]
ShortText = Annotated[str, Meta(max_length=1024)]
# Longest step name; its id (run id, escaped name, counter) fits in twice that plus change.
MAX_STEP_NAME = 512
StepName = Annotated[str, Meta(min_length=1, max_length=MAX_STEP_NAME)]
StepId = Annotated[str, Meta(min_length=1, max_length=4 * MAX_STEP_NAME)]

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

    event: Name


class RetryPolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a retryable failure is retried. ``max_attempts`` counts all attempts."""

    max_attempts: Annotated[int, Meta(ge=1, le=1000)] = 3
    initial_delay_s: Annotated[float, Meta(ge=0, le=MAX_DURATION_S)] = 1.0
    backoff_factor: Annotated[float, Meta(ge=1, le=100)] = 2.0
    max_delay_s: Annotated[float, Meta(ge=0, le=MAX_DURATION_S)] = 300.0

    def delay_after(self, attempt: int) -> float:
        """Seconds to wait before attempt ``attempt + 1`` after attempt ``attempt`` failed."""
        try:
            delay = self.initial_delay_s * self.backoff_factor ** max(attempt - 1, 0)
        except OverflowError:  # a large factor to a large power: the cap applies
            delay = self.max_delay_s
        return float(min(delay, self.max_delay_s))


class Concurrency(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """At most ``limit`` segments execute at once, per value of ``key`` if given.

    ``key`` is a dotted path into the event data (``customer.id``); a leading
    ``event.data.`` or ``data.`` is accepted and ignored.
    """

    limit: Annotated[int, Meta(ge=1, le=1_000_000)]
    key: Annotated[str, Meta(min_length=1, max_length=256)] | None = None


class FunctionDef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A function's full definition, as a worker registers it on connect."""

    id: Id
    triggers: Annotated[list[Trigger], Meta(max_length=MAX_TRIGGERS_HARD)] = []
    retries: RetryPolicy = RetryPolicy()
    concurrency: Concurrency | None = None
    timeout_s: Annotated[float, Meta(gt=0, le=MAX_DURATION_S)] | None = None
    audit: bool = False
    name: Annotated[str, Meta(max_length=256)] | None = None


# ── pieces carried inside messages ──────────────────────────────────────────


class ErrorInfo(msgspec.Struct, frozen=True):
    """A handler or step error as the worker reports it."""

    message: str
    code: Annotated[str, Meta(max_length=128)] = "ERROR"
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

    job_id: Id
    run_id: Id
    execution_seq: Seq
    lease_token: Token
    started_at: Epoch = 0.0


class JobLeaseStatus(msgspec.Struct, frozen=True):
    job_id: str
    run_id: str
    execution_seq: int
    state: LeaseState


class SleepYield(msgspec.Struct, frozen=True, tag="sleep"):
    until: Epoch


class WaitYield(msgspec.Struct, frozen=True, tag="wait"):
    event: Name
    timeout_at: Epoch
    match: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    match_value: Any = None


class InvokeYield(msgspec.Struct, frozen=True, tag="invoke"):
    function_id: Id
    input: Any = None
    timeout_at: Epoch | None = None


YieldInfo = SleepYield | WaitYield | InvokeYield


# ── worker → engine ─────────────────────────────────────────────────────────


class Register(msgspec.Struct, frozen=True, tag="register", forbid_unknown_fields=True):
    worker_id: Id
    functions: Annotated[list[FunctionDef], Meta(max_length=MAX_FUNCTIONS_HARD)]
    max_concurrent_jobs: Annotated[int, Meta(ge=1, le=MAX_SLOTS_HARD)] = 10
    sdk_version: Annotated[str, Meta(max_length=64)] = SDK_VERSION
    hostname: Annotated[str, Meta(max_length=256)] = ""


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    """``jobs=None`` is the compatibility fallback: refresh every lease of the session."""

    jobs: Annotated[list[ActiveJob], Meta(max_length=MAX_SLOTS_HARD)] | None = None


class JobAck(msgspec.Struct, frozen=True, tag="job_ack"):
    job_id: Id
    run_id: Id
    execution_seq: Seq
    lease_token: Token


class JobNack(msgspec.Struct, frozen=True, tag="job_nack"):
    job_id: Id
    run_id: Id
    execution_seq: Seq
    lease_token: Token
    reason: JobNackReason


class StepCompleted(msgspec.Struct, frozen=True, tag="step_completed"):
    job_id: Id
    run_id: Id
    execution_seq: Seq
    lease_token: Token
    step_id: StepId
    name: StepName
    output: Any = None
    duration_ms: DurationMs = 0.0


class StepFailed(msgspec.Struct, frozen=True, tag="step_failed"):
    job_id: Id
    run_id: Id
    execution_seq: Seq
    lease_token: Token
    step_id: StepId
    name: StepName
    error: ErrorInfo
    duration_ms: DurationMs = 0.0


class JobCompleted(msgspec.Struct, frozen=True, tag="job_completed"):
    job_id: Id
    run_id: Id
    execution_seq: Seq
    lease_token: Token
    output: Any = None
    duration_ms: DurationMs = 0.0


class JobFailed(msgspec.Struct, frozen=True, tag="job_failed"):
    job_id: Id
    run_id: Id
    execution_seq: Seq
    lease_token: Token
    error: ErrorInfo
    duration_ms: DurationMs = 0.0


class JobYielded(msgspec.Struct, frozen=True, tag="job_yielded"):
    job_id: Id
    run_id: Id
    execution_seq: Seq
    lease_token: Token
    step_id: StepId
    name: StepName
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
    """Answer to Register. ``session_secret`` (pull sessions only, shown once)
    must accompany every later call on the session, in the
    ``Ironflow-Session-Secret`` header: a session id alone grants nothing."""

    session_id: str
    heartbeat_interval_ms: int
    lease_expiry_ms: int
    session_secret: str | None = None


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

# Header carrying a pull session's secret on every call after registration.
SESSION_SECRET_HEADER = "Ironflow-Session-Secret"

# A JSON string literal (escapes included): brackets inside one do not nest.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
# Keeps only brackets, with objects folded into arrays: only the depth matters.
_BRACKETS_ONLY = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class JsonTooDeep(ValueError):
    """A JSON document nests deeper than :data:`MAX_JSON_DEPTH`."""


def check_json_depth(data: bytes | str, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise :class:`JsonTooDeep` when ``data`` nests arrays/objects deeper than ``limit``.

    Runs before decoding, at C speed: a document with at most ``limit``
    brackets cannot be too deep (the common case, one ``count``); otherwise
    strings are cut out, everything but brackets is deleted, and each pass of
    ``replace("[]", "")`` peels exactly one level off the innermost pairs, so
    a document still non-empty after ``limit`` passes is deeper than that (or
    unbalanced, which is no valid JSON either).
    """
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return
    # Without escapes, strings are exactly the odd pieces between quotes.
    unquoted = _JSON_STRING.sub(b"", raw) if b"\\" in raw else b"".join(raw.split(b'"')[::2])
    brackets = unquoted.translate(_BRACKETS_ONLY, _NOT_BRACKETS)
    if b"[" * (limit + 1) in brackets:
        raise JsonTooDeep(f"JSON nests deeper than the limit of {limit} levels")
    for _ in range(limit):
        if not brackets:
            return
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) == len(brackets):
            break  # unbalanced: nothing left to peel
        brackets = shorter
    if brackets:
        raise JsonTooDeep(f"JSON nests deeper than the limit of {limit} levels (or is unbalanced)")

encoder = msgspec.json.Encoder()
worker_message_decoder = msgspec.json.Decoder(WorkerMessage)
engine_message_decoder = msgspec.json.Decoder(EngineMessage)


def job_id_for(run_id: str, execution_seq: int) -> str:
    """The job id of a segment: stable for its ``(run_id, execution_seq)``."""
    return f"{run_id}/{execution_seq}"


# ── HTTP bodies ─────────────────────────────────────────────────────────────


class EmitRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: Name
    data: Any = {}
    idempotency_key: Annotated[str, Meta(min_length=1, max_length=256)] | None = None


class EmitResponse(msgspec.Struct, frozen=True):
    event_id: str
    run_ids: list[str]
    duplicate: bool = False


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
    role: Annotated[str, Meta(min_length=1, max_length=64)] = "admin"


class KeyCreateResponse(msgspec.Struct, frozen=True):
    id: str
    key: str
    kind: str
    role: str
