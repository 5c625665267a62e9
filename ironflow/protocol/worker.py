"""Worker ↔ engine frames and the function definitions workers register.

Every message is a frozen ``msgspec.Struct``; frames are tagged unions (the
``type`` field names the message), decoded with one typed decoder so bad
input fails at the edge with a clear ``msgspec.ValidationError``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from ironflow.protocol.bounds import (
    MAX_DURATION_S,
    MAX_FUNCTIONS_HARD,
    MAX_SLOTS_HARD,
    MAX_TRIGGERS_HARD,
    DurationMs,
    Epoch,
    Id,
    Name,
    Seq,
    StepId,
    StepName,
    Token,
)
from ironflow.protocol.flow import Batch, Debounce, RateLimit, Singleton

SDK_VERSION = "0.1.0"

JobNackReason = Literal["DRAINING", "AT_CAPACITY"]
LeaseState = Literal["REFRESHED", "STALE", "UNKNOWN"]
StepKind = Literal["run", "sleep", "wait", "invoke"]
RunStatus = Literal[
    "waiting_for_capacity", "running", "waiting", "completed", "failed", "cancelled",
    "paused",  # off the queue until resumed (ironflow/store/run_control.py)
]
TERMINAL_RUN_STATUSES: frozenset[str] = frozenset({"completed", "failed", "cancelled"})


# ── function definitions (registered by workers) ───────────────────────────


# Cron triggers (docs/schedules.md): what a schedule does about ticks missed
# while no node was up — none, the latest one, or all within the window.
CatchupPolicy = Literal["none", "latest", "all"]
# Longest expression (trigger filter, key, cancel-on condition) a definition may carry.
MAX_EXPRESSION = 4096
Expression = Annotated[str, Meta(min_length=1, max_length=MAX_EXPRESSION)]


class Trigger(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """An event trigger: an exact name (``order.created``) or ``prefix.*``;
    or (cron triggers) a schedule: ``cron`` in ``timezone`` (IANA name).

    Exactly one of ``event`` / ``cron``: the SDK and the engine check it, and
    the cron text and timezone, with ``ironflow.protocol.cron.trigger_problem``.
    Defaults are left out of the JSON: an event trigger encodes as it always did.

    ``expression`` (trigger filters, docs/triggers.md): a CEL condition on the
    event (``event.data.amount > 100``); the run starts only when it is true.
    """

    event: Name | None = None
    expression: Expression | None = None
    # ── cron triggers (ironflow/protocol/cron.py, ironflow/store/cron.py) ──
    cron: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    timezone: Annotated[str, Meta(min_length=1, max_length=64)] = "UTC"
    catchup: CatchupPolicy = "latest"
    # How far back ``catchup="all"`` looks (``latest`` fires one tick within it).
    catchup_window_s: Annotated[float, Meta(gt=0, le=MAX_DURATION_S)] = 86_400.0


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


# What a new run does when its concurrency key is full (decided at ingest, store/flow.py).
OnLimit = Literal["queue", "cancel_in_progress", "skip"]


class Concurrency(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """At most ``limit`` segments execute at once, per value of ``key`` if given.

    ``key`` is a dotted path into the event data (``customer.id``; a leading
    ``event.data.`` or ``data.`` is accepted and ignored) or a CEL expression
    over ``event`` (``event.data.region + ':' + event.data.tier``):
    ironflow/expressions.py ``compile_key``, docs/triggers.md.

    ``on_limit`` says what a new run does when its key already has ``limit``
    runs in flight (docs/flow-control.md#what-a-full-key-does-on_limit):
    ``queue`` (wait for a slot), ``skip`` (not started, the emit's answer says
    so) or ``cancel_in_progress`` (the oldest runs of the key are cancelled).
    """

    limit: Annotated[int, Meta(ge=1, le=1_000_000)]
    key: Annotated[str, Meta(min_length=1, max_length=MAX_EXPRESSION)] | None = None
    on_limit: OnLimit = "queue"


# ── cancel on an event (docs/triggers.md#cancel-on-an-event) ─────────────────

# Most cancel_on entries one function may declare.
MAX_CANCEL_ON = 16


class CancelOn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Cancel a run that has not ended when event ``event`` arrives.

    ``match``: a dotted path that must hold the same value in the incoming
    event as in the run's triggering event (as ``wait_for_event``'s match);
    ``expression``: a CEL condition over ``event`` (the run's triggering
    event) and ``async`` (the incoming one); ``timeout_s``: seconds after the
    run's creation past which this no longer applies.
    """

    event: Name
    match: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    expression: Expression | None = None
    timeout_s: Annotated[float, Meta(gt=0, le=MAX_DURATION_S)] | None = None


# ── flow control, dispatch side (docs/flow-control.md) ───────────


class Throttle(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Runs *start* no faster than ``limit`` per ``period_s`` per value of
    ``key`` (a dotted path or CEL, like a concurrency key), ``burst`` at once
    after a quiet spell; excess runs wait in the queue (GCRA in the database)."""

    limit: Annotated[int, Meta(ge=1, le=1_000_000)]
    period_s: Annotated[float, Meta(gt=0, le=MAX_DURATION_S)]
    key: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    burst: Annotated[int, Meta(ge=1, le=1_000_000)] = 1


# Priority bounds in seconds: a run starts as if queued that much earlier (or
# later); bounded so the lowest priority waits at most this long behind others.
PRIORITY_MAX_S = 600.0


def concurrency_limits(fd: FunctionDef) -> list[Concurrency]:
    """A definition's concurrency constraints as a list (none, one or two)."""
    c = fd.concurrency
    if c is None:
        return []
    return [c] if isinstance(c, Concurrency) else list(c)


def concurrency_keyed(fd: FunctionDef) -> Concurrency | None:
    """The constraint whose key fills ``concurrency_key`` (at most one has a key)."""
    return next((c for c in concurrency_limits(fd) if c.key is not None), None)


class FunctionDef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A function's full definition, as a worker registers it on connect."""

    id: Id
    triggers: Annotated[list[Trigger], Meta(max_length=MAX_TRIGGERS_HARD)] = []
    retries: RetryPolicy = RetryPolicy()
    # One constraint, or two layered ones (e.g. 100 in all and 2 per customer).
    concurrency: Concurrency | Annotated[list[Concurrency], Meta(min_length=1, max_length=2)] | None = None
    timeout_s: Annotated[float, Meta(gt=0, le=MAX_DURATION_S)] | None = None
    audit: bool = False
    name: Annotated[str, Meta(max_length=256)] | None = None
    # Cancel on an event (docs/triggers.md).
    cancel_on: Annotated[list[CancelOn], Meta(max_length=MAX_CANCEL_ON)] = []
    # Ingest-side flow control (ironflow/protocol/flow.py, docs/flow-control.md).
    rate_limit: RateLimit | None = None
    debounce: Debounce | None = None
    singleton: Singleton | None = None
    batch: Batch | None = None
    # Flow control, dispatch side (docs/flow-control.md).
    throttle: Throttle | None = None
    # A CEL expression over ``event`` giving seconds (clamped to ±PRIORITY_MAX_S).
    priority: Annotated[str, Meta(min_length=1, max_length=1024)] | None = None


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
    # The W3C traceparent the run's spans descend from (ironflow/tracing.py).
    traceparent: str | None = None


class MemoStep(msgspec.Struct, frozen=True, omit_defaults=True):
    """A step whose result already reached the engine (replayed, not re-run).

    ``output_omitted``: the output is not in the assignment (the run's state
    is past the inline budget, ``limits.memo_inline_bytes``); the SDK fetches
    it when the handler reaches the step: ``GET /v1/runs/{run_id}/step-output?step_id=``."""

    step_id: str
    name: str
    kind: StepKind
    status: str
    output: Any = None
    error: ErrorInfo | None = None
    output_omitted: bool = False




# ── compensation (step.compensate; docs/compensation.md) ────────────────────

# The names of a run's undo steps begin with this ("compensate:refund"); a
# handler's own steps may not, so the engine can tell a run's undo rows apart.
COMPENSATE_PREFIX = "compensate:"
# What began a run's compensation: its final failure, or a cancel.
CompensationCause = Literal["failure", "cancel"]
CompensationMarker = Literal["registered", "begin"]


class CompensationBegin(msgspec.Struct, frozen=True):
    """The output of a run's ``compensate:begin`` step, which the engine writes
    when the run's compensation begins: why, and the error the run ends with
    (the original one) once its undos have run."""

    cause: CompensationCause
    error: ErrorInfo


def compensation_step_id(run_id: str, marker: CompensationMarker) -> str:
    """The step id of one of a run's two compensation markers: ``registered``
    (the SDK records it at the run's first ``step.compensate``: the engine
    then knows the run has undos) and ``begin`` (the engine writes it when
    compensation begins).

    Under the undos' prefix (:func:`compensation_id_prefix`) but without the
    ``:<n>`` counter every id the SDK derives from a step name ends with, so
    no step, undo or not, can have it.
    """
    return f"{compensation_id_prefix(run_id)}{marker}"


def compensation_id_prefix(run_id: str) -> str:
    """What the id of each of a run's undo steps and markers begins with: the
    run id, then ``compensate:`` with its colon escaped as the SDK escapes step
    names (``escape_step_name``), as any step named ``compensate:…`` would be."""
    return f"{run_id}:compensate\\:"


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
    # The worker reads a frame that holds a JSON array of engine messages.
    batch_frames: bool = False
    # The worker honours ``JobAssignment.start_delay_ms`` (acks, holds the
    # slot, starts the handler after the delay). A worker that does not say so
    # is never sent a job before its start time (the node holds it instead).
    delayed_start: bool = False


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    """``jobs=None`` is the compatibility fallback: refresh every lease of the session."""

    jobs: Annotated[list[ActiveJob], Meta(max_length=MAX_SLOTS_HARD)] | None = None


class FencedFrame(msgspec.Struct, frozen=True):
    """The fence every segment-changing frame carries: which job, and the
    ``(execution_seq, lease_token)`` it was assigned. The engine accepts the
    frame only while that is still the live fence of the run."""

    job_id: Id
    run_id: Id
    execution_seq: Seq
    lease_token: Token


class ActiveJob(FencedFrame, frozen=True):
    """One job a worker is executing (in a Heartbeat), with the fence it was assigned."""

    started_at: Epoch = 0.0


class JobAck(FencedFrame, frozen=True, tag="job_ack"):
    """The worker took the job and starts the handler."""


class JobNack(FencedFrame, frozen=True, tag="job_nack"):
    reason: JobNackReason


class StepCompleted(FencedFrame, frozen=True, tag="step_completed"):
    step_id: StepId
    name: StepName
    output: Any = None
    duration_ms: DurationMs = 0.0


class StepFailed(FencedFrame, frozen=True, tag="step_failed"):
    step_id: StepId
    name: StepName
    error: ErrorInfo
    duration_ms: DurationMs = 0.0


class JobCompleted(FencedFrame, frozen=True, tag="job_completed"):
    output: Any = None
    duration_ms: DurationMs = 0.0


class JobFailed(FencedFrame, frozen=True, tag="job_failed"):
    error: ErrorInfo
    duration_ms: DurationMs = 0.0


class JobYielded(FencedFrame, frozen=True, tag="job_yielded"):
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
    # The engine reads a frame that holds a JSON array of worker messages.
    batch_frames: bool = False
    # The largest frame the engine reads: a step whose output would not fit
    # fails as that step's error (STEP_OUTPUT_TOO_LARGE) instead of being sent.
    max_frame_bytes: int | None = None


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
    # Start the handler this many ms after receiving the job, not before: a
    # sleep the waker resumed ahead of its wake time (``waker_lookahead``).
    # Relative, computed from the database clock when the job was reserved, so
    # the worker's own clock does not matter; the time in transit only makes
    # the start later, never earlier. Sent only to a worker that registered
    # with ``delayed_start``; 0 = start at once.
    start_delay_ms: int = 0
    # With a start delay: the database clock (epoch seconds) it was computed
    # from. Only differences of it are used: a worker may learn from the jobs
    # it received a lower bound of the database clock against its own
    # monotonic clock, and hold a job until ``db_now + start_delay_ms`` by that
    # bound when it is tighter than the delay from receipt (the time the job
    # spent in queues and transit is then not added to its start).
    db_now: float | None = None
    # A batch run (FunctionDef.batch): every event of its batch in arrival
    # order (``event`` is the first); None for any other run.
    events: list[EventInfo] | None = None


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


# ── event data paths (one rule for the engine and the SDK) ──────────────────


def lookup_path(data: Any, path: str) -> Any:
    """The value at dotted ``path`` in event ``data``, or None if there is none.

    A leading ``event.data.`` or ``data.`` is ignored; a digit part indexes a
    list (``items.0.sku``). Used by ``wait_for_event``'s ``match`` (the SDK
    reads the value to wait for, the engine compares incoming events) and by
    concurrency keys, so both sides always agree on what a path means.
    """
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


# ── encoders / decoders (module-level: building them is not free) ─────────

encoder = msgspec.json.Encoder()
worker_message_decoder = msgspec.json.Decoder(WorkerMessage)
engine_message_decoder = msgspec.json.Decoder(EngineMessage)

# Most messages one batched frame may carry (the frame size limit also holds).
MAX_BATCH_MESSAGES = 4096
# A websocket frame: one message, or — once the peer said it reads them
# (``Register.batch_frames`` / ``Registered.batch_frames``) — a JSON array of
# messages, applied in order. Under load a sender writes everything queued in
# one frame: one send and one parse instead of one per message.
WorkerFrame = (
    WorkerMessage | Annotated[list[WorkerMessage], Meta(min_length=1, max_length=MAX_BATCH_MESSAGES)]
)
EngineFrame = (
    EngineMessage | Annotated[list[EngineMessage], Meta(min_length=1, max_length=MAX_BATCH_MESSAGES)]
)
worker_frame_decoder = msgspec.json.Decoder(WorkerFrame)
engine_frame_decoder = msgspec.json.Decoder(EngineFrame)


def job_id_for(run_id: str, execution_seq: int) -> str:
    """The job id of a segment: stable for its ``(run_id, execution_seq)``."""
    return f"{run_id}/{execution_seq}"
