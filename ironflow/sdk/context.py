"""The handler's view of a run (``Context``) and the job runner shared by both workers.

Replay is Inngest-style: every segment runs the handler from the top. Each
step call derives a stable step id ``{run_id}:{escaped name}:{n}``; a step
whose id is memoised in the assignment returns its recorded output without
running again. ``step.sleep``/``wait_for_event``/``invoke`` end the segment by
raising ``_Yield`` (a ``BaseException``, so ``except Exception`` in user code
cannot swallow it); the runner turns it into ``JobYielded``.

The runner reports through a ``Reporter`` so the same code serves the
websocket and the HTTP transports.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any, Protocol

import msgspec
import trio

from ironflow.protocol import (
    MAX_STEP_NAME,
    ActiveJob,
    ErrorInfo,
    EventInfo,
    InvokeYield,
    JobAssignment,
    JobCompleted,
    JobFailed,
    JobYielded,
    MemoStep,
    SleepYield,
    StepCompleted,
    StepFailed,
    WaitYield,
    YieldInfo,
    encoder,
    lookup_path,
)
from ironflow.sdk.errors import (
    InvokeError,
    IronflowError,
    SerializationError,
    StepError,
)
from ironflow.sdk.function import Function

# Inngest/Ironflow default: a wait that nobody answers gives up after a week.
DEFAULT_WAIT_TIMEOUT_S = 7 * 24 * 3600.0

_log = logging.getLogger("ironflow.sdk")


# ── JSON strictness ──────────────────────────────────────────────────────────


def _has_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, Mapping):
        return any(_has_non_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_has_non_finite(v) for v in value)
    return False


def encode_strict(value: Any, what: str) -> tuple[msgspec.Raw, Any]:
    """Encode ``value`` as strict JSON: ``(raw bytes, value as JSON reads it back)``.

    msgspec writes NaN/Infinity as ``null``; that silent change is refused
    here, like anything msgspec cannot encode, as a non-retryable
    ``SerializationError``.
    """
    try:
        raw = encoder.encode(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise SerializationError(f"{what} is not JSON-serialisable: {exc}") from exc
    if b"null" in raw and _has_non_finite(value):
        raise SerializationError(f"{what} contains NaN or Infinity, which JSON cannot carry")
    return msgspec.Raw(raw), msgspec.json.decode(raw)


def error_info(exc: BaseException) -> ErrorInfo:
    """The wire form of an exception: ``IronflowError`` keeps its code and retryability."""
    tb = "".join(traceback.format_exception(exc))
    if isinstance(exc, IronflowError):
        return ErrorInfo(
            message=exc.message or str(exc), code=exc.code, traceback=tb, retryable=exc.retryable
        )
    return ErrorInfo(message=str(exc) or type(exc).__name__, code="ERROR", traceback=tb)


def escape_step_name(name: str) -> str:
    """Escape ``\\`` as ``\\\\`` and ``:`` as ``\\:`` so a name cannot forge an id."""
    return name.replace("\\", "\\\\").replace(":", "\\:")


# ── job state and reporting ──────────────────────────────────────────────────


class JobState:
    """One accepted assignment: its fence (captured once), cancel scope and status."""

    __slots__ = ("assignment", "scope", "abandoned", "started_at", "done")

    def __init__(self, assignment: JobAssignment):
        self.assignment = assignment
        self.scope = trio.CancelScope()
        # Set when the job must never report again (stale fence, cancel, lost session).
        self.abandoned = False
        self.started_at = time.time()
        self.done = False

    def abandon(self) -> None:
        self.abandoned = True
        self.scope.cancel()

    def active_job(self) -> ActiveJob:
        a = self.assignment
        return ActiveJob(
            job_id=a.job_id,
            run_id=a.run_id,
            execution_seq=a.execution_seq,
            lease_token=a.lease_token,
            started_at=self.started_at,
        )


class Reporter(Protocol):
    """Carries a job's messages to the engine (websocket outbox or HTTP posts)."""

    async def step(self, job: JobState, msg: StepCompleted | StepFailed) -> None: ...

    async def result(self, job: JobState, msg: JobCompleted | JobFailed | JobYielded) -> None: ...


class _Yield(BaseException):
    """Ends the segment at a sleep, wait or invoke step. Not an error."""

    def __init__(self, step_id: str, name: str, info: YieldInfo):
        super().__init__(name)
        self.step_id = step_id
        self.name = name
        self.info = info


# ── the handler's context ────────────────────────────────────────────────────


class RunInfo(msgspec.Struct, frozen=True):
    id: str
    function_id: str
    attempt: int
    max_attempts: int


class _RunLoggerAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        extra = kwargs.setdefault("extra", {})
        fields = dict(extra.get("fields") or {})
        fields.update(self.extra or {})
        extra["fields"] = fields
        extra.setdefault("run_id", fields.get("run_id"))
        return msg, kwargs


def _to_seconds(value: float | timedelta) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def _ceil_ms(t: float) -> float:
    return math.ceil(t * 1000.0) / 1000.0


class Step:
    """``ctx.step``: durable steps. Every call derives the next step id for its name."""

    __slots__ = ("_job", "_reporter", "_memo", "_counters", "_run_id")

    def __init__(self, job: JobState, reporter: Reporter):
        a = job.assignment
        self._job = job
        self._reporter = reporter
        self._run_id = a.run_id
        self._memo: dict[str, MemoStep] = {m.step_id: m for m in a.completed_steps}
        self._counters: dict[str, int] = {}

    def _next_id(self, name: str) -> str:
        if not isinstance(name, str) or not name:
            raise ValueError("a step needs a non-empty name")
        if len(name) > MAX_STEP_NAME:
            raise ValueError(
                f"step name {name[:40]!r}… is {len(name)} characters; the engine accepts"
                f" at most {MAX_STEP_NAME}: use a shorter name"
            )
        n = self._counters.get(name, 0)
        self._counters[name] = n + 1
        return f"{self._run_id}:{escape_step_name(name)}:{n}"

    def _fence(self) -> tuple[str, str, int, str]:
        a = self._job.assignment
        return a.job_id, a.run_id, a.execution_seq, a.lease_token

    async def run(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` once, durably, and return its JSON output.

        ``fn`` may be async, or sync (run in a worker thread). A memoised step
        returns its recorded output without calling ``fn``. The result is
        reported (``StepCompleted``) before this returns. A raising ``fn`` is
        reported as ``StepFailed`` and raised as ``StepError`` (retryable unless
        ``fn`` raised a non-retryable ``IronflowError``).
        """
        step_id = self._next_id(name)
        memo = self._memo.get(step_id)
        if memo is not None and memo.status == "completed":
            return memo.output
        fence = self._fence()
        t0 = time.perf_counter()
        try:
            if inspect.iscoroutinefunction(fn):
                out = await fn(*args)
            else:
                out = await trio.to_thread.run_sync(fn, *args)
                if inspect.isawaitable(out):
                    out = await out
            raw, value = encode_strict(out, f"output of step {name!r}")
        except Exception as exc:
            info = error_info(exc)
            await self._reporter.step(
                self._job,
                StepFailed(
                    *fence,
                    step_id=step_id,
                    name=name,
                    error=info,
                    duration_ms=(time.perf_counter() - t0) * 1000.0,
                ),
            )
            if isinstance(exc, StepError):
                raise
            raise StepError(
                f"step {name!r} failed: {info.message}",
                step_id=step_id,
                name=name,
                code=None if info.retryable else info.code,
                retryable=info.retryable,
            ) from exc
        await self._reporter.step(
            self._job,
            StepCompleted(
                *fence,
                step_id=step_id,
                name=name,
                output=raw,
                duration_ms=(time.perf_counter() - t0) * 1000.0,
            ),
        )
        return value

    async def sleep(self, name: str, duration: float | timedelta) -> None:
        """Sleep durably for ``duration`` seconds: the segment ends; the engine resumes it."""
        seconds = _to_seconds(duration)
        if not seconds > 0:
            raise ValueError("step.sleep needs a positive duration")
        step_id = self._next_id(name)
        if self._memo.get(step_id) is not None and self._memo[step_id].status == "completed":
            return None
        raise _Yield(step_id, name, SleepYield(until=_ceil_ms(time.time() + seconds)))

    async def sleep_until(self, name: str, when: datetime | float) -> None:
        """Sleep durably until ``when`` (a timezone-aware datetime or epoch seconds)."""
        if isinstance(when, datetime):
            if when.tzinfo is None:
                raise ValueError("step.sleep_until needs a timezone-aware datetime")
            until = when.timestamp()
        else:
            until = float(when)
        step_id = self._next_id(name)
        if self._memo.get(step_id) is not None and self._memo[step_id].status == "completed":
            return None
        raise _Yield(step_id, name, SleepYield(until=_ceil_ms(until)))

    async def wait_for_event(
        self,
        name: str,
        *,
        event: str,
        match: str | None = None,
        match_value: Any = None,
        timeout: float | timedelta = DEFAULT_WAIT_TIMEOUT_S,
    ) -> Any:
        """Wait durably for an event named ``event``; return it (``None`` on timeout).

        ``match`` is a dotted path in the event data; the awaited event must
        carry ``match_value`` there (default: the triggering event's value at
        that path).
        """
        step_id = self._next_id(name)
        memo = self._memo.get(step_id)
        if memo is not None:
            if memo.status == "completed":
                return memo.output
            if memo.status == "timed_out":
                return None
        if match is not None and match_value is None:
            match_value = lookup_path(self._job.assignment.event.data, match)
        if match_value is not None:
            match_value = encode_strict(match_value, f"match_value of {name!r}")[0]
        info = WaitYield(
            event=event,
            timeout_at=time.time() + _to_seconds(timeout),
            match=match,
            match_value=match_value,
        )
        raise _Yield(step_id, name, info)

    async def invoke(
        self,
        function_id: str,
        data: Any = None,
        *,
        timeout: float | timedelta | None = None,
        name: str | None = None,
    ) -> Any:
        """Run function ``function_id`` as a child run and return its output.

        The step name defaults to the function id. A failed (or timed-out)
        child raises ``InvokeError``, which is never retried.
        """
        step_name = name or function_id
        step_id = self._next_id(step_name)
        memo = self._memo.get(step_id)
        if memo is not None:
            if memo.status == "completed":
                return memo.output
            if memo.status in ("failed", "timed_out"):
                message = memo.error.message if memo.error else f"invoke {memo.status}"
                code = memo.error.code if memo.error else "INVOKE_FAILED"
                raise InvokeError(f"invoke of {function_id!r} failed: {message} ({code})")
        raw = encode_strict(data, f"input of invoke {function_id!r}")[0]
        timeout_at = None if timeout is None else time.time() + _to_seconds(timeout)
        raise _Yield(
            step_id, step_name, InvokeYield(function_id=function_id, input=raw, timeout_at=timeout_at)
        )


class Context:
    """What a handler receives: ``event``, ``run``, ``step`` and a run-scoped ``logger``."""

    __slots__ = ("event", "run", "step", "logger")

    def __init__(self, job: JobState, reporter: Reporter):
        a = job.assignment
        self.event: EventInfo = a.event
        self.run = RunInfo(
            id=a.run_id, function_id=a.function_id, attempt=a.attempt, max_attempts=a.max_attempts
        )
        self.step = Step(job, reporter)
        self.logger = _RunLoggerAdapter(
            logging.getLogger(f"ironflow.fn.{a.function_id}"), {"run_id": a.run_id}
        )


# ── the job runner ───────────────────────────────────────────────────────────


async def execute_job(
    function: Function | None, job: JobState, reporter: Reporter
) -> None:
    """Run one segment's handler and report exactly one terminal message.

    Returns without reporting if the job is cancelled (``trio.Cancelled``
    propagates) or abandoned. ``function=None`` reports a non-retryable
    ``FUNCTION_NOT_FOUND``.
    """
    a = job.assignment
    fence = (a.job_id, a.run_id, a.execution_seq, a.lease_token)
    t0 = time.perf_counter()
    msg: JobCompleted | JobFailed | JobYielded
    if function is None:
        msg = JobFailed(
            *fence,
            error=ErrorInfo(
                message=f"function {a.function_id!r} is not registered on this worker",
                code="FUNCTION_NOT_FOUND",
                retryable=False,
            ),
        )
    else:
        ctx = Context(job, reporter)
        try:
            output = await function.handler(ctx)
            raw = encode_strict(output, "handler output")[0]
        except _Yield as y:
            msg = JobYielded(*fence, step_id=y.step_id, name=y.name, yield_info=y.info)
        except Exception as exc:
            _log.debug("handler raised", exc_info=exc, extra={"fields": {"run_id": a.run_id}})
            msg = JobFailed(
                *fence, error=error_info(exc), duration_ms=(time.perf_counter() - t0) * 1000.0
            )
        else:
            msg = JobCompleted(
                *fence, output=raw, duration_ms=(time.perf_counter() - t0) * 1000.0
            )
    if not job.abandoned:
        await reporter.result(job, msg)
