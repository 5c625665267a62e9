"""``@ironflow.function``: declare a durable function for a worker to register.

The decorator returns a ``Function`` holding the full ``FunctionDef`` (what
the worker registers) and the untouched handler coroutine function.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import msgspec

from ironflow.flow_rules import dispatch_flow_problem, flow_problem
from ironflow.protocol import (
    Batch,
    Concurrency,
    Debounce,
    FunctionDef,
    RateLimit,
    RetryPolicy,
    Singleton,
    Trigger,
)
from ironflow.protocol import CancelOn as CancelOnSpec
from ironflow.protocol import Throttle as ThrottleDef
from ironflow.protocol.cron import trigger_problem
from ironflow.protocol.worker import CatchupPolicy

if TYPE_CHECKING:
    from ironflow.sdk.context import Context

Handler = Callable[["Context"], Awaitable[Any]]


def event(name: str, expression: str | None = None) -> Trigger:
    """A trigger on event ``name``: an exact name (``order.created``) or ``prefix.*``.

    ``expression``: a CEL filter on the event (``event.data.amount > 100``);
    the run starts only when it is true (docs/triggers.md). The engine compiles
    it when the worker registers (a bad one refuses the registration); this
    SDK compiles it here too when the expression library is installed.
    """
    if not name:
        raise ValueError("an event trigger needs a name")
    if expression is not None and not isinstance(expression, str):
        raise TypeError(f"ironflow.event expression= takes a CEL string, got {expression!r}")
    if expression is not None and not expression.strip():
        raise ValueError("ironflow.event expression= cannot be empty")
    return Trigger(event=name, expression=expression)


# ── cancel on an event (docs/triggers.md) ────────────────────────────────────


def CancelOn(  # noqa: N802 (reads as the declaration it builds)
    event: str,
    match: str | None = None,
    expression: str | None = None,
    timeout: float | timedelta | None = None,
) -> CancelOnSpec:
    """Cancel a run that has not ended when event ``event`` arrives.

    ``match``: a dotted path (``data.user_id``) that must hold the same value in
    the incoming event as in the run's triggering event; ``expression``: a CEL
    condition over ``event`` (the run's triggering event) and ``async`` (the
    incoming one); ``timeout`` (seconds or a timedelta): after that long from
    the run's creation, this no longer applies.
    """
    if not isinstance(event, str) or not event:
        raise ValueError("ironflow.CancelOn needs an event name: CancelOn(event='user.unsubscribed')")
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    return CancelOnSpec(event=event, match=match, expression=expression, timeout_s=timeout)


def _cancel_on(entries: Iterable[CancelOnSpec | Mapping[str, Any]]) -> list[CancelOnSpec]:
    out = []
    for entry in entries:
        if isinstance(entry, CancelOnSpec):
            out.append(entry)
        elif isinstance(entry, Mapping):
            if "event" not in entry:
                raise ValueError(f"a cancel_on entry needs an event: {dict(entry)!r}")
            out.append(CancelOn(**entry))
        else:
            raise TypeError(f"cancel_on takes ironflow.CancelOn(...) entries, got {entry!r}")
    return out


def _has_cel(definition: FunctionDef) -> bool:
    """Whether ``definition`` carries an expression that is CEL: a trigger
    filter, a cancel-on condition, a priority, or a key that is not a dotted path."""
    from ironflow.expressions import is_dotted_path
    from ironflow.protocol import concurrency_limits

    if definition.priority is not None:
        return True
    if any(t.expression is not None for t in definition.triggers):
        return True
    if any(c.expression is not None for c in definition.cancel_on):
        return True
    keys = [c.key for c in concurrency_limits(definition)]
    for spec in (definition.throttle, definition.rate_limit, definition.debounce,
                 definition.singleton, definition.batch):
        keys.append(getattr(spec, "key", None))
    return any(k is not None and not is_dotted_path(k) for k in keys)


def _compile_locally(definition: FunctionDef) -> None:
    """Compile ``definition``'s expressions here when the expression library is
    installed (the light install has none: the engine checks at registration).
    A definition with no CEL in it is checked without importing the library
    (~0.5 s to import, once per worker process)."""
    if _has_cel(definition):
        try:
            import cel  # type: ignore[import-not-found]  # noqa: F401
        except ImportError:
            return
    from ironflow.definitions import DefinitionRefused, compile_definition

    try:
        compile_definition(definition)
    except DefinitionRefused as exc:
        raise ValueError(f"@ironflow.function: {exc}") from None


def cron(
    schedule: str,
    *,
    timezone: str = "UTC",
    catchup: CatchupPolicy = "latest",
    catchup_window: float | timedelta = 86_400.0,
) -> Trigger:
    """A schedule trigger (docs/schedules.md): a run per tick of ``schedule``.

    ``schedule`` is 5-field cron (``0 3 * * *``) or 6 fields, seconds first
    (``*/2 * * * * *``), read in ``timezone`` (an IANA name). ``catchup`` is
    what the engine does about ticks missed while no node was up: ``"latest"``
    (default) one run for the latest, ``"none"`` nothing, ``"all"`` one per
    missed tick within ``catchup_window`` (seconds or a timedelta; at most
    1,000). Each run's event is ``ironflow.cron`` with ``data = {"scheduled_at",
    "scheduled_at_epoch", "cron", "timezone"}``. A bad field is a ValueError
    naming it.
    """
    window = catchup_window.total_seconds() if isinstance(catchup_window, timedelta) else catchup_window
    try:
        trigger = msgspec.convert(
            {"cron": schedule, "timezone": timezone, "catchup": catchup, "catchup_window_s": window},
            Trigger,
        )
    except msgspec.ValidationError as exc:
        raise ValueError(f"ironflow.cron: {exc}") from exc
    problem = trigger_problem(trigger)
    if problem is not None:
        raise ValueError(f"ironflow.cron: {problem}")
    return trigger


class Function:
    """A declared function: ``definition`` (a ``FunctionDef``) and its ``handler``."""

    __slots__ = ("definition", "handler")

    def __init__(self, definition: FunctionDef, handler: Handler):
        self.definition = definition
        self.handler = handler

    @property
    def id(self) -> str:
        return self.definition.id

    def __repr__(self) -> str:
        return f"Function(id={self.id!r})"


def _trigger(t: Trigger | str | Mapping[str, Any]) -> Trigger:
    if isinstance(t, Trigger):
        return t
    if isinstance(t, str):
        return event(t)
    return Trigger(**t)


def _retries(r: RetryPolicy | Mapping[str, Any] | int | None) -> RetryPolicy:
    if r is None:
        return RetryPolicy()
    if isinstance(r, RetryPolicy):
        return r
    if isinstance(r, int):
        return RetryPolicy(max_attempts=r)
    return RetryPolicy(**r)


ConcurrencySpec = Concurrency | Mapping[str, Any] | int


def _one_concurrency(c: ConcurrencySpec) -> Concurrency:
    if isinstance(c, Concurrency):
        return c
    if isinstance(c, int):
        return Concurrency(limit=c)
    return Concurrency(**c)


def _concurrency(
    c: ConcurrencySpec | list[ConcurrencySpec] | tuple[ConcurrencySpec, ...] | None,
) -> Concurrency | list[Concurrency] | None:
    if c is None:
        return None
    if isinstance(c, list | tuple):
        if not 1 <= len(c) <= 2:
            raise ValueError(f"concurrency: one or two constraints, got {len(c)}")
        return [_one_concurrency(x) for x in c]
    return _one_concurrency(c)


# ── durations (flow control periods; one parser for every such field) ─────

_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: float | int | timedelta | str, *, field: str = "duration") -> float:
    """Seconds from a number of seconds, a timedelta or a string such as
    ``"500ms"``, ``"1s"``, ``"10m"``, ``"2h"``, ``"1d"``.

    Raises:
      ValueError: naming ``field``, for text that is no duration or a value not above 0.
    """
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool):
        raise TypeError(f"{field}: a duration is seconds, a timedelta or text like '10s'")
    elif isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        match = _DURATION.fullmatch(value)
        if match is None:
            raise ValueError(
                f"{field}: {value!r} is not a duration (seconds, or text like '500ms', '1s', '10m', '2h')"
            )
        seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    else:
        raise TypeError(f"{field}: a duration is seconds, a timedelta or text like '10s'")
    if not seconds > 0:
        raise ValueError(f"{field}: a duration must be above 0, got {value!r}")
    return seconds


def Throttle(
    limit: int, period: float | timedelta | str, key: str | None = None, burst: int = 1
) -> ThrottleDef:
    """A throttle (``ironflow.Throttle``): runs start no faster than ``limit`` per ``period`` (seconds,
    a timedelta or text like ``"1s"``) per ``key``, ``burst`` at once."""
    return ThrottleDef(limit=limit, period_s=parse_duration(period, field="throttle.period"), key=key, burst=burst)


def _timeout(timeout: float | timedelta | None, timeout_s: float | None) -> float | None:
    if timeout is not None and timeout_s is not None:
        raise TypeError("@ironflow.function takes timeout= (seconds or a timedelta); drop timeout_s=")
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return timeout if timeout is not None else timeout_s


def _checked(definition: FunctionDef) -> FunctionDef:
    """``definition`` if the engine will accept it, else a ValueError naming the field.

    The engine validates every registration against the same bounds; checking
    here turns a refused worker at start-up into an error at the decorator.
    """
    try:
        checked = msgspec.convert(msgspec.to_builtins(definition), FunctionDef)
    except msgspec.ValidationError as exc:
        raise ValueError(f"@ironflow.function {definition.id!r}: {exc}") from exc
    for i, trigger in enumerate(checked.triggers):
        problem = trigger_problem(trigger)
        if problem is not None:
            raise ValueError(f"@ironflow.function {definition.id!r}: {problem} - at `$.triggers[{i}]`")
    try:  # flow control's keys and combinations (ironflow/flow_rules.py)
        problem = flow_problem(checked)
    except RuntimeError:
        problem = None  # the light install: the engine checks at registration
    if problem is not None:
        raise ValueError(f"@ironflow.function {definition.id!r}: {problem}")
    return checked


def _check_flow(definition: FunctionDef) -> None:
    """The engine's flow-control checks (ironflow/flow_rules.py), at declaration;
    expressions are compiled where the engine's packages are installed."""
    try:
        problem = dispatch_flow_problem(definition)
    except RuntimeError:  # the light install: no expression library here
        problem = dispatch_flow_problem(definition, compile_expressions=False)
    if problem is not None:
        raise ValueError(f"@ironflow.function {definition.id!r}: {problem}")


def function(
    id: str | None = None,
    *,
    triggers: Iterable[Trigger | str | Mapping[str, Any]] = (),
    retries: RetryPolicy | Mapping[str, Any] | int | None = None,
    concurrency: ConcurrencySpec | list[ConcurrencySpec] | tuple[ConcurrencySpec, ...] | None = None,
    throttle: ThrottleDef | None = None,
    priority: str | None = None,
    timeout: float | timedelta | None = None,
    timeout_s: float | None = None,
    audit: bool = False,
    name: str | None = None,
    cancel_on: Iterable[CancelOnSpec | Mapping[str, Any]] = (),
    # Ingest-side flow control (ironflow/sdk/flow.py, docs/flow-control.md).
    rate_limit: RateLimit | None = None,
    debounce: Debounce | None = None,
    singleton: Singleton | None = None,
    batch: Batch | None = None,
) -> Callable[[Handler], Function]:
    """Declare ``async def handler(ctx)`` as a durable function.

    ``id`` defaults to the handler's name. ``triggers`` are ``event(...)``
    and ``cron(...)`` triggers (a bare string is an event name); ``retries`` a ``RetryPolicy``, a
    dict of its fields or a max attempt count; ``concurrency`` a
    ``Concurrency``, a dict or a limit, or a list of two (layered: e.g. 100 in
    all and 2 per customer), whose ``on_limit`` says what a new run of a full
    key does (``queue``, ``skip``, ``cancel_in_progress``); ``throttle`` a ``Throttle``; ``priority`` an
    expression giving seconds (docs/flow-control.md). ``timeout`` (seconds or a timedelta)
    bounds a run from its first start to its end: past it the engine fails
    the run with ``FUNCTION_TIMEOUT``, even if no worker is alive (``timeout_s``
    is the older spelling). A sync handler is a ``TypeError``; a
    value outside the engine's bounds (``max_attempts`` 1..1000,
    ``backoff_factor`` 1..100, delays and ``timeout_s`` up to a year, ids and
    event names up to 256 characters) is a ``ValueError`` naming the field.
    ``cancel_on``: ``ironflow.CancelOn(...)`` entries, the events that cancel a
    run that has not ended (docs/triggers.md).
    ``rate_limit``, ``debounce``, ``singleton`` and ``batch`` shape which
    events start runs and when (``ironflow.RateLimit(...)`` etc.).
    """

    def decorate(handler: Handler) -> Function:
        if not inspect.iscoroutinefunction(handler):
            raise TypeError(
                f"@ironflow.function needs an async def handler, got {handler!r}"
            )
        definition = _checked(
            FunctionDef(
                id=id or handler.__name__,
                triggers=[_trigger(t) for t in triggers],
                retries=_retries(retries),
                concurrency=_concurrency(concurrency),
                timeout_s=_timeout(timeout, timeout_s),
                audit=audit,
                name=name,
                cancel_on=_cancel_on(cancel_on),
                rate_limit=rate_limit,
                debounce=debounce,
                singleton=singleton,
                batch=batch,
                throttle=throttle,
                priority=priority,
            )
        )
        _compile_locally(definition)
        _check_flow(definition)
        return Function(definition, handler)

    return decorate
