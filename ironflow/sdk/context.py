"""The handler's view of a run (``Context``) and the job runner shared by both workers.

Replay is Inngest-style: every segment runs the handler from the top. Each
step call derives a stable step id ``{run_id}:{escaped name}:{n}``; a step
whose id is memoised in the assignment returns its recorded output without
running again. ``step.sleep``/``wait_for_event``/``invoke`` end the segment by
raising ``_Yield`` (a ``BaseException``, so ``except Exception`` in user code
cannot swallow it); the runner turns it into ``JobYielded``.

A compensation segment (its memo holds the engine's ``compensate:begin``
step) replays the handler on recorded results only, then runs the undos
``step.compensate`` registered: ironflow/sdk/compensation.py.

The runner reports through a ``Reporter`` so the same code serves the
websocket and the HTTP transports.
"""

from __future__ import annotations

import contextvars
import hashlib
import inspect
import logging
import math
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from functools import partial
from typing import Any, Protocol

import anyio
import anyio.lowlevel
import anyio.to_thread
import msgspec

from ironflow.protocol import (
    COMPENSATE_PREFIX,
    MAX_STEP_NAME,
    ActiveJob,
    ErrorInfo,
    EventInfo,
    InvokeYield,
    JobAssignment,
    JobCompleted,
    JobFailed,
    JobNack,
    JobYielded,
    MemoStep,
    SleepYield,
    StepCompleted,
    StepFailed,
    WaitYield,
    YieldInfo,
    compensation_step_id,
    encoder,
    lookup_path,
)
from ironflow.sdk.compensation import Compensation, StopReplay, Undo, replayed_error, undo_name
from ironflow.sdk.errors import (
    InvokeError,
    IronflowError,
    SerializationError,
    StepError,
    StepOutputTooLargeError,
    StepTimeoutError,
    WrongEventLoopError,
)
from ironflow.sdk.function import Function
from ironflow.sdk.loops import current_loop
from ironflow.sdk.traces import step_span

# Inngest/Ironflow default: a wait that nobody answers gives up after a week.
DEFAULT_WAIT_TIMEOUT_S = 7 * 24 * 3600.0

# A step body's slice between two awaits longer than this blocked the loop:
# ordinary CPU work between awaits stays far below it, a blocking call (a sync
# HTTP client, time.sleep) shows up, and the heartbeat (seconds) has not yet
# been starved for long.
BLOCKED_LOOP_WARN_S = 1.0

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

    __slots__ = ("assignment", "scope", "abandoned", "started_at", "start_at", "done")

    def __init__(self, assignment: JobAssignment, start_at: float | None = None):
        self.assignment = assignment
        self.scope = anyio.CancelScope()
        # Set when the job must never report again (stale fence, cancel, lost session).
        self.abandoned = False
        self.started_at = time.time()
        # When the handler may start (loop clock); by default the assignment's
        # delay from now (the worker computes it from the receipt: see
        # WorkerLifecycle._start_time).
        self.start_at = (
            anyio.current_time() + assignment.start_delay_ms / 1000 if start_at is None else start_at
        )
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

    async def nack(self, job: JobState, msg: JobNack) -> None:
        """Hand back a job whose handler never started (a drain during its hold)."""

    @property
    def max_output_bytes(self) -> int:
        """The largest step output the engine can be sent (its frame limit)."""

    async def step_output(self, job: JobState, step_id: str) -> Any:
        """A memoised step's output the assignment left out (``MemoStep.output_omitted``)."""


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


class StepInfo(msgspec.Struct, frozen=True):
    """The step being executed (see :func:`step_info`).

    ``idempotency_key`` is the same on every re-execution of this step (a
    retry, a recovery after a crash, a drain hand-off) and differs between
    steps: pass it to a payment API or an ``INSERT … ON CONFLICT`` so the
    step's side effect happens once even if the step itself runs twice.
    """

    run_id: str
    step_id: str
    attempt: int
    idempotency_key: str


# (run_id, step_id, attempt) of the running step; StepInfo is built on request
# (the key is a hash: most steps never ask for it).
_STEP_INFO: contextvars.ContextVar[tuple[str, str, int] | None] = contextvars.ContextVar(
    "ironflow_step_info", default=None
)


def step_info() -> StepInfo:
    """The :class:`StepInfo` of the ``step.run`` body calling this (also in its thread).

    Raises:
      RuntimeError: called outside a running step.
    """
    current = _STEP_INFO.get()
    if current is None:
        raise RuntimeError("ironflow.step_info() is only available inside a running step.run body")
    run_id, step_id, attempt = current
    return StepInfo(run_id, step_id, attempt, _idempotency_key(step_id))


def _idempotency_key(step_id: str) -> str:
    return "ifstep_" + hashlib.sha256(step_id.encode()).hexdigest()[:32]


def _timeout_seconds(timeout: float | timedelta | None, what: str) -> float | None:
    if timeout is None:
        return None
    seconds = _to_seconds(timeout)
    if not seconds > 0 or not math.isfinite(seconds):
        raise ValueError(f"{what}: timeout must be a positive number of seconds, got {timeout!r}")
    return seconds


class _Awaitable:
    """Carries an awaitable out of a worker thread (the loop awaits it, not the thread)."""

    __slots__ = ("awaitable",)

    def __init__(self, awaitable: Any):
        self.awaitable = awaitable


def _is_async_callable(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
    )


def _checked_callable(fn: Any, what: str) -> None:
    """A ``TypeError`` for a step body that is not a callable (a coroutine object
    passed as ``fetch()`` instead of ``fetch``); the coroutine is closed so it
    does not also warn that it was never awaited."""
    if callable(fn):
        return
    if inspect.iscoroutine(fn):
        fn.close()
        raise TypeError(
            f"{what} takes a callable, got a coroutine object: pass the function and its"
            " arguments (step.run(name, fetch, 42)) or a lambda (step.run(name, lambda: fetch(42)))"
        )
    raise TypeError(f"{what} takes a callable, got {type(fn).__name__} {fn!r}")


class _Timed:
    """Awaits a step body's coroutine, timing each slice it runs without yielding.

    A slice longer than ``BLOCKED_LOOP_WARN_S`` blocked the event loop (every
    other job, the heartbeat, the socket): warned about, naming the step, so
    the user moves the blocking call to a sync function (which runs in a
    thread). Passes every yield, send and throw through unchanged, so it works
    on asyncio and Trio alike.
    """

    __slots__ = ("_coro", "_name")

    def __init__(self, coro: Any, name: str):
        self._coro = coro
        self._name = name

    def __await__(self) -> Any:
        coro = self._coro
        send: Any = None
        thrown: BaseException | None = None
        while True:
            t0 = time.perf_counter()
            try:
                if thrown is not None:
                    yielded = coro.throw(thrown)
                else:
                    yielded = coro.send(send)
            except StopIteration as stop:
                return stop.value
            finally:
                blocked = time.perf_counter() - t0
                if blocked > BLOCKED_LOOP_WARN_S:
                    _log.warning(
                        "step %r blocked the event loop for %.1f s without awaiting; move"
                        " blocking calls into a sync function (step.run runs it in a thread)",
                        self._name, blocked, extra={"fields": {"step": self._name}},
                    )
            try:
                send, thrown = (yield yielded), None
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # handed to the body, which decides
                send, thrown = None, exc


async def _call(fn: Callable[..., Any], args: tuple[Any, ...], name: str) -> Any:
    """``fn(*args)`` for any callable a user passes: async, awaitable-returning or sync.

    An async body runs on the worker's own loop (asyncio or Trio), so it may
    await that loop's libraries; a sync one runs in a worker thread.
    """
    if _is_async_callable(fn):
        return await _Timed(fn(*args), name)

    def in_thread() -> Any:
        out = fn(*args)
        return _Awaitable(out) if inspect.isawaitable(out) else out

    out = await anyio.to_thread.run_sync(in_thread, abandon_on_cancel=True)
    if isinstance(out, _Awaitable):
        return await out.awaitable
    return out


def _wrong_loop(exc: BaseException, name: str) -> IronflowError | None:
    """A clear error for a step body that awaited another loop's API, else None.

    On Trio, asyncio code fails with "no running event loop" (it looks for its
    loop) or with Trio's "unrecognized yield message" (it yielded a Future).
    """
    text = str(exc)
    if current_loop() == "trio" and (
        (isinstance(exc, RuntimeError) and "no running event loop" in text)
        or (isinstance(exc, TypeError) and "unrecognized yield message" in text)
    ):
        return WrongEventLoopError(
            f"step {name!r} awaited an asyncio-only API, but this worker runs on trio:"
            " start the worker with asyncio.run(...) to use asyncio libraries"
            f" ({type(exc).__name__}: {text.splitlines()[0] if text else ''})"
        )
    return None


def _first_error(group: BaseExceptionGroup[Any]) -> BaseException:
    """The error to raise for a failed ``parallel``: a step's own error, not the group."""
    cancelled = anyio.get_cancelled_exc_class()
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_error(exc)
        if not isinstance(exc, cancelled):
            return exc
    return group


class Step:
    """``ctx.step``: durable steps. Every call derives the next step id for its name."""

    __slots__ = ("_job", "_reporter", "_memo", "_counters", "_run_id", "saga")

    def __init__(self, job: JobState, reporter: Reporter):
        a = job.assignment
        self._job = job
        self._reporter = reporter
        self._run_id = a.run_id
        self._memo: dict[str, MemoStep] = {m.step_id: m for m in a.completed_steps}
        self._counters: dict[str, int] = {}
        # The run's undos (step.compensate) and, in a compensation segment,
        # what began it: ironflow/sdk/compensation.py.
        self.saga = Compensation(a.run_id, self._memo)

    def _next_id(self, name: str, *, undo: bool = False) -> str:
        if not isinstance(name, str) or not name:
            raise ValueError("a step needs a non-empty name")
        if not undo and name.startswith(COMPENSATE_PREFIX):
            raise ValueError(
                f"step name {name[:40]!r}: names beginning {COMPENSATE_PREFIX!r} are the undos'"
                " (step.compensate); choose another name"
            )
        if len(name) > MAX_STEP_NAME:
            raise ValueError(
                f"step name {name[:40]!r}… is {len(name)} characters; the engine accepts"
                f" at most {MAX_STEP_NAME}: use a shorter name"
            )
        n = self._counters.get(name, 0)
        self._counters[name] = n + 1
        return f"{self._run_id}:{escape_step_name(name)}:{n}"

    async def _memo_output(self, memo: MemoStep) -> Any:
        """A memoised step's output, read from the engine when the assignment
        left it out (the run's state is past the inline budget)."""
        if not memo.output_omitted:
            return memo.output
        return await self._reporter.step_output(self._job, memo.step_id)

    def _fence(self) -> tuple[str, str, int, str]:
        a = self._job.assignment
        return a.job_id, a.run_id, a.execution_seq, a.lease_token

    async def run(
        self, name: str, fn: Callable[..., Any], *args: Any, timeout: float | timedelta | None = None
    ) -> Any:
        """Run ``fn(*args)`` once, durably, and return its JSON output.

        ``fn`` may be an ``async def``, a callable returning an awaitable (a
        lambda around a coroutine call), or a sync function (run in a worker
        thread). A memoised step returns its recorded output without calling
        ``fn``. The result is reported (``StepCompleted``) before this returns.

        ``timeout`` (seconds) cancels the step's code when it runs out (a
        thread-run function is abandoned and its late result ignored) and
        raises ``StepTimeoutError``, retried per the function's retry policy.
        A raising ``fn`` is reported as ``StepFailed`` and raised as
        ``StepError`` (retryable unless ``fn`` raised a non-retryable
        ``IronflowError``). An output that is not JSON is a non-retryable
        ``SerializationError`` naming the step and the type.
        """
        _checked_callable(fn, f"step.run({name!r})")
        limit = _timeout_seconds(timeout, f"step.run({name!r})")
        step_id = self._next_id(name)
        return await self._run_step(step_id, name, fn, args, limit)

    async def parallel(self, steps: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Run several steps concurrently; return their outputs in the given order.

        Each entry is ``(name, fn, *args)``. Step ids are fixed by the names
        in list order, never by which step finishes first, so a replay after a
        crash reuses every finished step and re-runs only the others. Names
        within one call must be distinct. If a step fails, the others are
        cancelled and its error is raised.
        """
        entries = [tuple(entry) for entry in steps]
        names = [entry[0] if entry else None for entry in entries]
        for entry in entries:
            if len(entry) >= 2:
                _checked_callable(entry[1], f"step.parallel entry {entry[0]!r}")
        if any(len(entry) < 2 or not callable(entry[1]) for entry in entries):
            raise TypeError('step.parallel takes [(name, fn, *args), ...], e.g. [("a", fetch_a), ("b", fetch_b, 42)]')
        if len(set(names)) != len(names):
            raise ValueError(f"step.parallel needs distinct step names, got {names}")
        ids = [self._next_id(entry[0]) for entry in entries]  # fixed before anything runs
        results: list[Any] = [None] * len(entries)

        async def one(i: int) -> None:
            entry = entries[i]
            results[i] = await self._run_step(ids[i], entry[0], entry[1], entry[2:], None)

        try:
            async with anyio.create_task_group() as nursery:
                for i in range(len(entries)):
                    nursery.start_soon(one, i)
        except BaseExceptionGroup as group:
            raise _first_error(group) from None
        return results

    async def _run_step(
        self, step_id: str, name: str, fn: Callable[..., Any], args: tuple[Any, ...], limit: float | None
    ) -> Any:
        memo = self._memo.get(step_id)
        if memo is not None and memo.status == "completed":
            return await self._memo_output(memo)
        if self.saga.begin is not None:  # a compensating replay runs none of the handler's steps
            if memo is not None and memo.status == "failed":
                raise replayed_error(memo, name)
            raise StopReplay(name)
        return await self._execute(step_id, name, fn, args, limit)

    async def _execute(
        self, step_id: str, name: str, fn: Callable[..., Any], args: tuple[Any, ...], limit: float | None
    ) -> Any:
        """Run ``fn(*args)`` as step ``step_id`` and report its result (a
        failure: reported, then raised)."""
        fence = self._fence()
        a = self._job.assignment
        token = _STEP_INFO.set((a.run_id, step_id, a.attempt))
        t0 = time.perf_counter()
        try:
            timed_out = False
            with step_span(a, step_id, name):
                if limit is None:
                    out = await _call(fn, args, name)
                else:
                    # A scope of its own rather than fail_after: a TimeoutError the
                    # body raises itself is the body's error, not the step's timeout.
                    # Only for a step with a limit (a scope costs on asyncio).
                    with anyio.CancelScope(deadline=anyio.current_time() + limit) as scope:
                        out = await _call(fn, args, name)
            if limit is not None and scope.cancelled_caught:
                timed_out = True
                raise StepTimeoutError(f"step {name!r} timed out after {limit:g} s")
            raw, value = encode_strict(out, f"output of step {name!r}")
            if len(raw) > self._reporter.max_output_bytes:
                raise StepOutputTooLargeError(
                    f"output of step {name!r} is {len(raw):,} bytes of JSON, over the"
                    f" {self._reporter.max_output_bytes:,} the engine reads in one frame"
                    " (max_frame_bytes): return less, or store it elsewhere and return a reference"
                )
        except Exception as exc:
            exc = _wrong_loop(exc, name) or exc
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
            if timed_out or isinstance(
                exc, StepError | SerializationError | StepOutputTooLargeError | WrongEventLoopError
            ):
                raise exc from None
            raise StepError(
                f"step {name!r} failed: {info.message}",
                step_id=step_id,
                name=name,
                code=None if info.retryable else info.code,
                retryable=info.retryable,
            ) from exc
        finally:
            _STEP_INFO.reset(token)
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

    async def compensate(
        self, name: str, fn: Callable[..., Any], *args: Any, timeout: float | timedelta | None = None
    ) -> None:
        """Register ``fn(*args)`` as an undo of what the run did so far.

        If the run fails for good (a non-retryable error, or its last attempt)
        or is cancelled, the engine has the registered undos run newest-first,
        each once as a durable step named ``compensate:<name>``; a failing undo
        is recorded and the others still run; the run then ends ``failed`` (or
        ``cancelled``) with the original error. ``fn`` is called like a
        ``step.run`` body (async, awaitable-returning or sync, in a thread);
        ``timeout`` bounds each call. Not retried: an undo that must succeed
        retries inside itself. Registering costs one step write per run.
        See docs/compensation.md.

        Raises:
          TypeError: ``fn`` is not callable.
          ValueError: an empty or too long ``name``, a bad ``timeout``.
        """
        _checked_callable(fn, f"step.compensate({name!r})")
        recorded_as = undo_name(name)
        limit = _timeout_seconds(timeout, f"step.compensate({name!r})")
        step_id = self._next_id(recorded_as, undo=True)
        self.saga.undos.append(Undo(step_id, recorded_as, fn, args, limit))
        if self.saga.begin is None and not self.saga.registered:
            self.saga.registered = True
            await self._reporter.step(
                self._job,
                StepCompleted(
                    *self._fence(),
                    step_id=compensation_step_id(self._run_id, "registered"),
                    name="compensate:registered",
                ),
            )

    async def execute_undo(self, undo: Undo) -> Any:
        """Run ``undo`` as a durable step (a compensation segment's undos)."""
        return await self._execute(undo.step_id, undo.name, undo.fn, undo.args, undo.limit)

    def _parked(self, step_id: str, name: str, info: YieldInfo) -> BaseException:
        """What a sleep, wait or invoke without a final record raises: ``_Yield``
        (the segment ends there), or, replaying to compensate, ``StopReplay``."""
        return StopReplay(name) if self.saga.begin is not None else _Yield(step_id, name, info)

    async def sleep(self, name: str, duration: float | timedelta) -> None:
        """Sleep durably for ``duration`` seconds: the segment ends; the engine resumes it."""
        seconds = _to_seconds(duration)
        if not seconds > 0:
            raise ValueError("step.sleep needs a positive duration")
        step_id = self._next_id(name)
        if self._memo.get(step_id) is not None and self._memo[step_id].status == "completed":
            return None
        raise self._parked(step_id, name, SleepYield(until=_ceil_ms(time.time() + seconds)))

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
        raise self._parked(step_id, name, SleepYield(until=_ceil_ms(until)))

    async def wait_for_event(
        self,
        name: str,
        *,
        event: str,
        match: str | None = None,
        match_value: Any = None,
        timeout: float | timedelta = DEFAULT_WAIT_TIMEOUT_S,
    ) -> EventInfo | None:
        """Wait durably for an event named ``event``; return it (``None`` on timeout).

        The event is the same type as ``ctx.event`` (``.id``, ``.name``,
        ``.data``, ``.received_at``), on the first run and on every replay.

        ``match`` is a dotted path in the event data; the awaited event must
        carry ``match_value`` there (default: the triggering event's value at
        that path).
        """
        step_id = self._next_id(name)
        memo = self._memo.get(step_id)
        if memo is not None:
            if memo.status == "completed":
                return msgspec.convert(await self._memo_output(memo), EventInfo)
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
        raise self._parked(step_id, name, info)

    async def invoke(
        self,
        *args: str,
        function: str | Function | None = None,
        data: Any = None,
        timeout: float | timedelta | None = None,
        **legacy: Any,
    ) -> Any:
        """``invoke(name, *, function, data=None, timeout=None)``: run ``function``
        (an id or a ``Function``) as a child run and return its output.

        ``step.invoke("charge", function=charge_card, data={"amount": 5})``.
        A failed (or timed-out) child raises ``InvokeError``, never retried.
        The old form ``invoke(function_id, data, name=...)`` is a ``TypeError``
        that shows this one.
        """
        name = args[0] if len(args) == 1 else None
        if name is None or legacy or function is None:
            raise TypeError(
                "step.invoke takes the step name first and the function by keyword: "
                "await ctx.step.invoke('call-child', function='child-fn', data={...}, timeout=60)"
            )
        function_id = function.id if isinstance(function, Function) else function
        if not isinstance(function_id, str) or not function_id:
            raise TypeError(f"step.invoke function= must be a function id or a Function, got {function!r}")
        step_id = self._next_id(name)
        memo = self._memo.get(step_id)
        if memo is not None:
            if memo.status == "completed":
                return await self._memo_output(memo)
            if memo.status in ("failed", "timed_out"):
                message = memo.error.message if memo.error else f"invoke {memo.status}"
                code = memo.error.code if memo.error else "INVOKE_FAILED"
                raise InvokeError(f"invoke of {function_id!r} failed: {message} ({code})")
        raw = encode_strict(data, f"input of invoke {function_id!r}")[0]
        limit = _timeout_seconds(timeout, f"step.invoke({name!r})")
        timeout_at = None if limit is None else time.time() + limit
        raise self._parked(
            step_id, name, InvokeYield(function_id=function_id, input=raw, timeout_at=timeout_at)
        )


class Context:
    """What a handler receives: ``event``, ``run``, ``step`` and a run-scoped ``logger``.

    ``events``: every event of the run, in arrival order — a batch's events
    (``batch=ironflow.Batch(...)``), of which ``event`` is the first; any
    other run's one event.
    """

    __slots__ = ("event", "events", "run", "step", "logger")

    def __init__(self, job: JobState, reporter: Reporter):
        a = job.assignment
        self.event: EventInfo = a.event
        self.events: list[EventInfo] = a.events if a.events is not None else [a.event]
        self.run = RunInfo(
            id=a.run_id, function_id=a.function_id, attempt=a.attempt, max_attempts=a.max_attempts
        )
        self.step = Step(job, reporter)
        self.logger = _RunLoggerAdapter(
            logging.getLogger(f"ironflow.fn.{a.function_id}"), {"run_id": a.run_id}
        )


# ── the job runner ───────────────────────────────────────────────────────────


async def execute_job(
    function: Function | None, job: JobState, reporter: Reporter, ctx: Context | None = None
) -> None:
    """Run one segment's handler and report exactly one terminal message.

    Returns without reporting if the job is cancelled (the cancellation
    propagates: the loop's cancellation exception) or abandoned. ``function=None`` reports a non-retryable
    ``FUNCTION_NOT_FOUND``. ``ctx``: the handler's context if already built
    (for ``job`` and ``reporter``). A compensation segment (its memo holds
    ``compensate:begin``) replays the handler, runs the undos and reports
    the original error instead (ironflow/sdk/compensation.py).
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
        if ctx is None:
            ctx = Context(job, reporter)
        if ctx.step.saga.begin is not None:
            error = await ctx.step.saga.compensate(partial(function.handler, ctx), ctx.step.execute_undo)
            msg = JobFailed(*fence, error=error, duration_ms=(time.perf_counter() - t0) * 1000.0)
        else:
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
    # Yield before the bookkeeping: when many held jobs start at one instant
    # (a burst of sleeps due together), every handler gets its turn before any
    # job's report is encoded and sent, not after all the reports queued ahead.
    await anyio.lowlevel.cancel_shielded_checkpoint()
    if not job.abandoned:
        await reporter.result(job, msg)
