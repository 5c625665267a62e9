"""A function definition's expressions, compiled once and judged per event.

What a definition computes from an event (docs/triggers.md): the trigger
filters (``Trigger.expression``), the concurrency key (``Concurrency.key``, a
dotted path or CEL) and the cancel-on conditions (``CancelOn``). Compiled by
:func:`compile_definition` — at registration, where a bad one refuses the
function (:class:`DefinitionRefused`, naming the field, line and column), and
by the store once per stored definition version, where :func:`start_verdict`
decides per emit whether a triggered function starts. The expression language
itself is ironflow/expressions.py.
"""

from __future__ import annotations

import re
from typing import Any

from ironflow.expressions import (
    BudgetExceeded,
    EvaluationError,
    Expression,
    ExpressionError,
    KeyExpression,
    Variables,
    bind,
    compile_expression,
    compile_key,
    event_variables,
)
from ironflow.protocol import CancelOn, FunctionDef, concurrency_keyed

__all__ = [
    "CompiledDefinition",
    "DefinitionRefused",
    "EventBinding",
    "compile_definition",
    "failure_code",
    "start_verdict",
    "triggers_name",
]

# A cancel-on ``match``: identifiers and list indexes, as ``wait_for_event``'s.
_MATCH_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.([A-Za-z_][A-Za-z0-9_]*|[0-9]+))*")
# An event record's code for an expression that failed on the event.
EXPRESSION_FAILED = "EXPRESSION_FAILED"
# The variables of a cancel-on condition: the run's triggering event, the incoming one.
CANCEL_VARIABLES = ("event", "async")


class DefinitionRefused(ValueError):
    """A definition the engine will not register; the text names the function,
    the field and (for an expression) the line and column."""


def triggers_name(pattern: str | None, name: str) -> bool:
    """Whether trigger ``pattern`` (an exact name or ``prefix.*``) covers event ``name``
    (None: a cron trigger, which covers no event)."""
    if pattern is None:
        return False
    return pattern == name or (pattern.endswith(".*") and name.startswith(pattern[:-1]))


class CompiledDefinition:
    """``fd``'s expressions, compiled: per trigger its filter (or None), the
    concurrency key (or None), per cancel-on entry its condition (or None)."""

    __slots__ = ("fd", "filters", "key", "cancel_conditions")

    def __init__(
        self,
        fd: FunctionDef,
        filters: list[Expression | None],
        key: KeyExpression | None,
        cancel_conditions: list[Expression | None],
    ) -> None:
        self.fd = fd
        self.filters = filters
        self.key = key
        self.cancel_conditions = cancel_conditions

    @property
    def has_filters(self) -> bool:
        return any(f is not None for f in self.filters)

    def concurrency_key(self, name: str, data: Any, event_id: str | None = None) -> str | None:
        """The run's concurrency key for this event (None: no key).

        Raises:
          EvaluationError: a key expression failed on the event (the run must not start).
        """
        if self.key is None:
            return None
        try:
            return self.key.key(name, data, event_id)
        except EvaluationError as exc:
            raise EvaluationError(f"concurrency key {exc}") from None


def _refuse(fd: FunctionDef, field: str, exc: Exception) -> DefinitionRefused:
    return DefinitionRefused(f"function {fd.id!r}: {field}: {exc}")


def _check_cancel_on(fd: FunctionDef, place: int, spec: CancelOn, seen: set[tuple[str, str | None]]) -> None:
    field = f"cancel_on[{place}]"
    if "*" in spec.event:
        raise DefinitionRefused(
            f"function {fd.id!r}: {field}.event: {spec.event!r} must be an exact event name (no wildcard)"
        )
    if spec.match is not None and not _MATCH_PATH.fullmatch(spec.match):
        raise DefinitionRefused(
            f"function {fd.id!r}: {field}.match: {spec.match!r} is not a dotted path (data.user_id)"
        )
    if (spec.event, spec.match) in seen:
        raise DefinitionRefused(
            f"function {fd.id!r}: {field}: event {spec.event!r} with match {spec.match!r} is declared twice"
        )
    seen.add((spec.event, spec.match))


def compile_definition(fd: FunctionDef) -> CompiledDefinition:
    """Compile every expression of ``fd``.

    Raises:
      DefinitionRefused: an expression that does not compile (line and
        column named), a key that evidently gives a list or a map, a cancel-on
        entry with a wildcard event, a match that is not a dotted path, or
        declared twice.
      RuntimeError: the expression library is not installed (a light install:
        only the engine checks).
    """
    filters: list[Expression | None] = []
    for place, trigger in enumerate(fd.triggers):
        if trigger.expression is None:
            filters.append(None)
            continue
        try:
            filters.append(compile_expression(trigger.expression))
        except ExpressionError as exc:
            raise _refuse(fd, f"triggers[{place}].expression", exc) from None
    key = None
    keyed = concurrency_keyed(fd)  # the one keyed constraint (layered limits: docs/flow-control.md)
    if keyed is not None and keyed.key is not None:
        try:
            key = compile_key(keyed.key)
        except ExpressionError as exc:
            raise _refuse(fd, "concurrency.key", exc) from None
    conditions: list[Expression | None] = []
    seen: set[tuple[str, str | None]] = set()
    for place, spec in enumerate(fd.cancel_on):
        _check_cancel_on(fd, place, spec, seen)
        if spec.expression is None:
            conditions.append(None)
            continue
        try:
            conditions.append(compile_expression(spec.expression, CANCEL_VARIABLES))
        except ExpressionError as exc:
            raise _refuse(fd, f"cancel_on[{place}].expression", exc) from None
    return CompiledDefinition(fd, filters, key, conditions)


class EventBinding:
    """One event's ``event`` variable, converted to CEL at most once however
    many filters judge it (ironflow/expressions.py ``bind``)."""

    __slots__ = ("name", "data", "event_id", "_bound")

    def __init__(self, name: str, data: Any, event_id: str) -> None:
        self.name, self.data, self.event_id = name, data, event_id
        self._bound: Variables | None = None

    def variables(self) -> Variables:
        if self._bound is None:
            self._bound = bind(event_variables(self.name, self.data, self.event_id))
        return self._bound


def start_verdict(
    compiled: CompiledDefinition, name: str, data: Any, event_id: str,
    binding: EventBinding | None = None,
) -> tuple[bool, str | None, str | None]:
    """Whether event ``name`` starts a run of the function: ``(starts, reason,
    code)``. It starts when any trigger covering the name has no filter or a
    filter that is true. Otherwise ``reason`` says why not: the first filter
    that failed to evaluate (``code`` names how: :func:`failure_code`) or, all
    being false, the filters (``code`` None).
    ``binding``: the event's variables, shared by every function it triggers."""
    failure: str | None = None
    code: str | None = None
    false: list[str] = []
    binding = binding or EventBinding(name, data, event_id)
    for trigger, condition in zip(compiled.fd.triggers, compiled.filters, strict=True):
        if not triggers_name(trigger.event, name):
            continue
        if condition is None:
            return True, None, None
        variables = binding.variables()
        try:
            if condition.test(variables):
                return True, None, None
            false.append(condition.source)
        except EvaluationError as exc:
            if failure is None:
                failure, code = f"filter {exc}", failure_code(exc)
    if failure is not None:
        return False, failure, code
    if not false:
        return False, "no trigger covers this event", None
    return False, "filter " + " / ".join(repr(s) for s in false) + " was false", None


def failure_code(exc: EvaluationError) -> str:
    """The code an event record gives an expression that did not evaluate:
    over its budget (not run) or failed."""
    return BudgetExceeded.code if isinstance(exc, BudgetExceeded) else EXPRESSION_FAILED
