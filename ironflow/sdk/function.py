"""``@ironflow.function``: declare a durable function for a worker to register.

The decorator returns a ``Function`` holding the full ``FunctionDef`` (what
the worker registers) and the untouched handler coroutine function.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import msgspec

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


def _concurrency(c: Concurrency | Mapping[str, Any] | int | None) -> Concurrency | None:
    if c is None or isinstance(c, Concurrency):
        return c
    if isinstance(c, int):
        return Concurrency(limit=c)
    return Concurrency(**c)


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
    try:  # flow control's keys and combinations (ironflow/flow_checks.py)
        from ironflow.flow_checks import flow_problem

        problem = flow_problem(checked)
    except RuntimeError:
        problem = None  # the light install: the engine checks at registration
    if problem is not None:
        raise ValueError(f"@ironflow.function {definition.id!r}: {problem}")
    return checked


def function(
    id: str | None = None,
    *,
    triggers: Iterable[Trigger | str | Mapping[str, Any]] = (),
    retries: RetryPolicy | Mapping[str, Any] | int | None = None,
    concurrency: Concurrency | Mapping[str, Any] | int | None = None,
    timeout: float | timedelta | None = None,
    timeout_s: float | None = None,
    audit: bool = False,
    name: str | None = None,
    # Ingest-side flow control (ironflow/sdk/flow.py, docs/flow-control.md).
    rate_limit: RateLimit | None = None,
    debounce: Debounce | None = None,
    singleton: Singleton | None = None,
    batch: Batch | None = None,
) -> Callable[[Handler], Function]:
    """Declare ``async def handler(ctx)`` as a durable function.

    ``id`` defaults to the handler's name. ``triggers`` are ``event(...)``
    triggers (a bare string is accepted); ``retries`` a ``RetryPolicy``, a
    dict of its fields or a max attempt count; ``concurrency`` a
    ``Concurrency``, a dict or a limit. ``timeout`` (seconds or a timedelta)
    bounds a run from its first start to its end: past it the engine fails
    the run with ``FUNCTION_TIMEOUT``, even if no worker is alive (``timeout_s``
    is the older spelling). A sync handler is a ``TypeError``; a
    value outside the engine's bounds (``max_attempts`` 1..1000,
    ``backoff_factor`` 1..100, delays and ``timeout_s`` up to a year, ids and
    event names up to 256 characters) is a ``ValueError`` naming the field.
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
                rate_limit=rate_limit,
                debounce=debounce,
                singleton=singleton,
                batch=batch,
            )
        )
        return Function(definition, handler)

    return decorate
