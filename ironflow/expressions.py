"""The expression language of triggers, keys and priorities: CEL.

One language everywhere a function definition computes something from an
event — a trigger filter (``event.data.amount > 100``), a concurrency,
throttle, rate-limit, debounce, singleton or batch key, a priority, a
cancel-on condition. Expressions are the Common Expression Language
(https://cel.dev), evaluated by ``common-expression-language`` (cel-rust);
this module is the only place that imports it.

* :func:`compile_expression` compiles once (cached by text) and refuses a bad
  expression with an :class:`ExpressionError` naming line and column — at
  registration, so a bad definition never reaches an emit.
* :meth:`Expression.evaluate` runs it; any failure (a missing field, a wrong
  type, a division by zero) is an :class:`EvaluationError` whose text says
  why, for the event record.
* A **key** may also be a plain dotted path into the event data
  (``customer.id``, ``event.data.customer.id``), the older form, read with
  :func:`ironflow.protocol.lookup_path` (a missing field is no key, as
  before): :func:`compile_key`.

Variables: ``event`` is ``{"name", "data", "id"}`` of the event the
expression is about (:func:`event_variables`); a cancel-on condition also
sees ``async``, the incoming event (Inngest's name for it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from ironflow.protocol import lookup_path

__all__ = [
    "EvaluationError",
    "Expression",
    "ExpressionError",
    "KeyExpression",
    "Variables",
    "bind",
    "compile_expression",
    "compile_key",
    "event_variables",
    "key_text",
]

# The most expressions kept compiled (a definition's few, times the functions
# registered): past it the cache starts over rather than grow without bound.
_CACHE_MAX = 4096
_POSITION = re.compile(r"<input>:(\d+):(\d+): (.*)")
# A dotted path (the older key form): identifiers and list indexes.
_DOTTED_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.([A-Za-z_][A-Za-z0-9_]*|[0-9]+))*")
_json_encode = msgspec.json.Encoder().encode


class ExpressionError(ValueError):
    """An expression that does not compile: ``line`` and ``column`` (1-based)
    point at the problem when the parser names a place."""

    def __init__(self, source: str, message: str, line: int | None = None, column: int | None = None):
        self.source = source
        self.message = message
        self.line = line
        self.column = column
        where = f" at line {line}, column {column}" if line is not None else ""
        super().__init__(f"expression {source!r}{where}: {message}")


class EvaluationError(Exception):
    """An expression that compiled but could not be evaluated on this event
    (its text is what the event record says)."""


def _cel() -> Any:
    try:
        import cel  # type: ignore[import-not-found]
    except ImportError as exc:  # the light install: the engine evaluates, not the SDK
        raise RuntimeError(
            "evaluating expressions needs the engine's packages: pip install 'ironflow-py[server]'"
        ) from exc
    return cel


class Variables:
    """Variables converted to CEL once, for several evaluations (one event
    judged by many filters: a plain dict is converted again by each)."""

    __slots__ = ("context",)

    def __init__(self, context: Any):
        self.context = context


def bind(variables: Mapping[str, Any]) -> Variables:
    """``variables`` converted once (:class:`Variables`)."""
    return Variables(_cel().Context(dict(variables)))


class Expression:
    """A compiled CEL expression (see the module docstring)."""

    __slots__ = ("source", "_program")

    def __init__(self, source: str, program: Any):
        self.source = source
        self._program = program

    def evaluate(self, variables: Mapping[str, Any] | Variables) -> Any:
        """The expression's value with ``variables`` bound (a mapping, or
        :func:`bind`'s conversion of one, shared by several evaluations).

        Raises:
          EvaluationError: a missing field, a wrong type, any failure.
        """
        try:
            if isinstance(variables, Variables):
                return self._program.execute(variables.context)
            return self._program.execute(dict(variables))
        except KeyError as exc:
            raise EvaluationError(f"{self.source!r}: no such key: {exc.args[0] if exc.args else '?'}") from None
        except Exception as exc:  # the library raises TypeError, ValueError, ZeroDivisionError, ...
            text = str(exc).split(". ", 1)[0] if isinstance(exc, TypeError) else str(exc)
            raise EvaluationError(f"{self.source!r}: {text}") from None

    def test(self, variables: Mapping[str, Any] | Variables) -> bool:
        """A filter's verdict: True only for a boolean true.

        Raises:
          EvaluationError: it failed, or gave something other than a boolean.
        """
        value = self.evaluate(variables)
        if not isinstance(value, bool):
            raise EvaluationError(
                f"{self.source!r}: gave {_kind(value)}, a filter must give true or false"
            )
        return value

    def __repr__(self) -> str:
        return f"Expression({self.source!r})"


_compiled: dict[tuple[str, tuple[str, ...]], Expression] = {}


def compile_expression(source: str, variables: Iterable[str] = ("event",)) -> Expression:
    """Compile ``source`` (cached), allowing only ``variables`` in it.

    Raises:
      ExpressionError: it does not parse, or names a variable not allowed.
    """
    allowed = tuple(sorted(variables))
    cached = _compiled.get((source, allowed))
    if cached is not None:
        return cached
    if not source.strip():
        raise ExpressionError(source, "an expression cannot be empty")
    cel = _cel()
    try:
        program = cel.compile(source)
    except Exception as exc:
        match = _POSITION.search(str(exc))
        if match is None:
            raise ExpressionError(source, str(exc)) from None
        message = match.group(3).split(" expecting ", 1)[0]
        raise ExpressionError(source, message, int(match.group(1)), int(match.group(2))) from None
    unknown = sorted(set(program.variables()) - set(allowed))
    if unknown:
        known = ", ".join(allowed)
        raise ExpressionError(source, f"unknown variable {unknown[0]!r} (this expression may use: {known})")
    expression = Expression(source, program)
    if len(_compiled) >= _CACHE_MAX:
        _compiled.clear()
    _compiled[(source, allowed)] = expression
    return expression


def event_variables(name: str, data: Any, event_id: str | None = None) -> dict[str, Any]:
    """The ``event`` variable for an event: ``{"name", "data", "id"}``."""
    return {"event": {"name": name, "data": data, "id": event_id or ""}}


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "a map"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return type(value).__name__


def key_text(value: Any) -> str | None:
    """A key's stored text: a string as itself, a number or boolean as JSON,
    null as no key.

    Raises:
      EvaluationError: a list or a map (a key is one value).
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool | int | float):
        return _json_encode(value).decode()
    raise EvaluationError(f"a key must be a string, number or boolean, got {_kind(value)}")


class KeyExpression:
    """A key: a dotted path into the event data (a missing field: no key) or a
    CEL expression over ``event`` (a missing field: an evaluation error)."""

    __slots__ = ("source", "_path", "_expression")

    def __init__(self, source: str, path: str | None, expression: Expression | None):
        self.source = source
        self._path = path
        self._expression = expression

    @property
    def is_path(self) -> bool:
        return self._path is not None

    def key(self, name: str, data: Any, event_id: str | None = None) -> str | None:
        """The key's text for an event (None: the event has no key).

        Raises:
          EvaluationError: the expression failed or gave a list or a map.
        """
        if self._path is not None:
            value = lookup_path(data, self._path)
            # The older path form: a list or map value keys by its JSON text.
            return value if value is None or isinstance(value, str) else _json_encode(value).decode()
        assert self._expression is not None
        return key_text(self._expression.evaluate(event_variables(name, data, event_id)))


def is_dotted_path(source: str) -> bool:
    """Whether key text ``source`` is the older dotted-path form (read with
    ``lookup_path``, no CEL): see :func:`compile_key`."""
    reads_event = source == "event" or (
        source.startswith("event.") and not source.startswith("event.data.")
    )
    return _DOTTED_PATH.fullmatch(source) is not None and not reads_event


def compile_key(source: str) -> KeyExpression:
    """A key from its definition text (see :class:`KeyExpression`).

    A dotted path is one unless it starts with a name other than ``event``
    or ``data`` that CEL would read as a variable (``customer.id`` is the
    path ``customer.id``); anything else compiles as CEL.

    Raises:
      ExpressionError: it does not compile, or evidently gives a list or a
      map (a literal one).
    """
    if is_dotted_path(source):
        return KeyExpression(source, source, None)
    expression = compile_expression(source)
    try:
        probe = expression.evaluate(event_variables("", {}))
    except EvaluationError:
        probe = None  # depends on fields the probe lacks: judged per event
    if isinstance(probe, list | tuple | dict):
        raise ExpressionError(source, f"a key must be one value, this gives {_kind(probe)}")
    return KeyExpression(source, None, expression)
