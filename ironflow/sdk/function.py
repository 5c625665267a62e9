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

from ironflow.flow_checks import dispatch_flow_problem
from ironflow.protocol import Concurrency, FunctionDef, RetryPolicy, Trigger
from ironflow.protocol import Throttle as ThrottleDef

if TYPE_CHECKING:
    from ironflow.sdk.context import Context

Handler = Callable[["Context"], Awaitable[Any]]


def event(name: str) -> Trigger:
    """A trigger on event ``name``: an exact name (``order.created``) or ``prefix.*``."""
    if not name:
        raise ValueError("an event trigger needs a name")
    return Trigger(event=name)


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
        return msgspec.convert(msgspec.to_builtins(definition), FunctionDef)
    except msgspec.ValidationError as exc:
        raise ValueError(f"@ironflow.function {definition.id!r}: {exc}") from exc


def _check_flow(definition: FunctionDef) -> None:
    """The engine's flow-control checks (ironflow/flow_checks.py), at declaration;
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
) -> Callable[[Handler], Function]:
    """Declare ``async def handler(ctx)`` as a durable function.

    ``id`` defaults to the handler's name. ``triggers`` are ``event(...)``
    triggers (a bare string is accepted); ``retries`` a ``RetryPolicy``, a
    dict of its fields or a max attempt count; ``concurrency`` a
    ``Concurrency``, a dict or a limit, or a list of two (layered: e.g. 100 in
    all and 2 per customer); ``throttle`` a ``Throttle``; ``priority`` an
    expression giving seconds (docs/flow-control.md). ``timeout`` (seconds or a timedelta)
    bounds a run from its first start to its end: past it the engine fails
    the run with ``FUNCTION_TIMEOUT``, even if no worker is alive (``timeout_s``
    is the older spelling). A sync handler is a ``TypeError``; a
    value outside the engine's bounds (``max_attempts`` 1..1000,
    ``backoff_factor`` 1..100, delays and ``timeout_s`` up to a year, ids and
    event names up to 256 characters) is a ``ValueError`` naming the field.
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
                throttle=throttle,
                priority=priority,
            )
        )
        _check_flow(definition)
        return Function(definition, handler)

    return decorate
