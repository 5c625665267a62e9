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
    "BudgetExceeded",
    "EvaluationError",
    "Expression",
    "ExpressionError",
    "ExpressionLimits",
    "KeyExpression",
    "Variables",
    "bind",
    "compile_expression",
    "compile_key",
    "configure",
    "current_limits",
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


# ---------------------------------------------------------------------------
# Bounds: what an expression may be, and what one evaluation may cost.
#
# Evaluation runs on the node's one Trio thread and the library has no cost
# tracking, so the cost is estimated before each evaluation from the
# expression's shape (counted once, at compile) and the values it reads of
# this event (pruned to the paths it names, counted with a budget of their
# own). The figures below are measured on cel-rust 0.10 (docs/triggers.md,
# "Expression budgets"): the estimate is an upper bound of the time with some
# margin, not a timer, so a refusal never depends on the machine's load.

# Per evaluation: the call into the library and back.
_COST_BASE_US = 5.0
# Per value of the event handed to the library (converted to CEL each time).
_COST_PER_VALUE_US = 2.5
# Per byte of the strings handed over (copied on conversion).
_COST_PER_STRING_BYTE_US = 0.0005
# Per token of the expression, per time it is evaluated.
_COST_PER_TOKEN_US = 0.1
# Per element a comprehension visits (exists, all, exists_one, map, filter).
_COST_PER_ITERATION_US = 0.6
# map and filter rebuild their result list at every element: quadratic.
_COST_ACCUMULATE_US = 0.03
# Per byte a `+` may copy (string and list concatenation).
_COST_PER_CONCAT_BYTE_US = 0.0012
# Per byte a string function may scan (contains, matches, startsWith, endsWith).
_COST_PER_SCAN_BYTE_US = 0.0002
# Per element an `in` may compare.
_COST_PER_MEMBER_US = 0.05

# The small event an accepted expression must fit the budget on (a few
# fields, short strings): at registration, before any event is known.
_NOMINAL_VALUES, _NOMINAL_ELEMENTS, _NOMINAL_STRING = 16, 4, 64

_MACROS = frozenset({"all", "exists", "exists_one", "map", "filter"})
_ACCUMULATING = frozenset({"map", "filter"})
_SCANNING = frozenset({"contains", "matches", "startsWith", "endsWith"})
_OPEN = {"(": ")", "[": "]", "{": "}"}
_TOKEN = re.compile(
    r"(?P<skip>\s+|//[^\n]*)"
    r"|(?P<num>0[xX][0-9a-fA-F]+[uU]?|(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?[uU]?)"
    r"|(?P<id>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<op>==|!=|<=|>=|&&|\|\||[-+*/%!<>?:.,()\[\]{}])"
)
_QUOTES = ('"""', "'''", '"', "'")


class ExpressionLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What an expression may be (checked at compile) and cost (checked per
    evaluation); the node's come from ``limits`` in its config (``configure``)."""

    max_tokens: int = 1024
    max_nesting: int = 32
    max_comprehension_depth: int = 2
    budget_us: float = 1000.0


_limits = ExpressionLimits()


def configure(limits: ExpressionLimits) -> None:
    """Set this process's expression limits (a node does it once, from its
    config, before it compiles any); compiled expressions are compiled again."""
    global _limits
    _limits = limits
    _compiled.clear()


def current_limits() -> ExpressionLimits:
    """This process's expression limits (:func:`configure`)."""
    return _limits


class BudgetExceeded(EvaluationError):
    """An evaluation whose estimated cost on this event is over the budget:
    it is not run (``code`` is what the event record says)."""

    code = "EXPRESSION_BUDGET_EXCEEDED"


class _Token(msgspec.Struct, frozen=True):
    kind: str  # "num", "id", "op" or "str"
    text: str
    offset: int


def _tokens(source: str) -> list[_Token]:
    """``source``'s tokens (it has compiled, so it is valid CEL); a string
    literal is one token whatever its quotes and prefix."""
    out: list[_Token] = []
    at, end = 0, len(source)
    while at < end:
        prefix = 0
        while prefix < 2 and at + prefix < end and source[at + prefix] in "rRbB":
            prefix += 1
        quote = next((q for q in _QUOTES if source.startswith(q, at + prefix)), None)
        if quote is not None:
            raw = "r" in source[at : at + prefix].lower()
            i = at + prefix + len(quote)
            while i < end and not source.startswith(quote, i):
                i += 2 if source[i] == "\\" and not raw else 1
            i = min(end, i + len(quote))
            out.append(_Token("str", source[at:i], at))
            at = i
            continue
        match = _TOKEN.match(source, at)
        if match is None:
            raise ExpressionError(source, f"unexpected character {source[at]!r}", *_line_column(source, at))
        if match.lastgroup != "skip":
            out.append(_Token(match.lastgroup or "op", match.group(), at))
        at = match.end()
    return out


def _line_column(source: str, offset: int) -> tuple[int, int]:
    line = source.count("\n", 0, offset) + 1
    return line, offset - (source.rfind("\n", 0, offset) + 1) + 1


def _plain_string(token: _Token) -> str | None:
    """A string literal's value when it has no prefix and no escapes."""
    text = token.text
    if text[0] not in "\"'" or "\\" in text:
        return None
    quote = 3 if text.startswith(('"""', "'''")) else 1
    return text[quote:-quote]


class _Level:
    """The tokens evaluated once per visit of one comprehension's body (or
    of the whole expression: the top level) and the comprehensions inside."""

    __slots__ = ("macro", "tokens", "concat", "scans", "members", "inner")

    def __init__(self, macro: str | None):
        self.macro = macro
        self.tokens = 0
        self.concat = 0
        self.scans = 0
        self.members = 0
        self.inner: list[_Level] = []

    def cost_us(self, elements: float, concat_bytes: float, scan_bytes: float) -> float:
        own = (
            (self.tokens + self.concat + self.scans + self.members) * _COST_PER_TOKEN_US
            + self.concat * concat_bytes * _COST_PER_CONCAT_BYTE_US
            + self.scans * scan_bytes * _COST_PER_SCAN_BYTE_US
            + self.members * elements * _COST_PER_MEMBER_US
        )
        inner = sum(level.cost_us(elements, concat_bytes, scan_bytes) for level in self.inner)
        if self.macro is None:
            return own + inner
        visits = elements * (_COST_PER_ITERATION_US + own + inner)
        if self.macro in _ACCUMULATING:
            visits += _COST_ACCUMULATE_US * elements * elements
        return visits


# A path trie: a name's sub-trie, or _WHOLE where the value is read whole.
_WHOLE: dict[str, Any] = {}


class _Shape:
    """What an expression reads of its variables and how its cost grows with
    them (see the bounds section above)."""

    __slots__ = (
        "top", "reads", "bound", "concat", "literal_elements", "literal_bytes", "static_us",
        "zero_us", "flat", "reads_key",
    )

    def __init__(
        self, top: _Level, reads: dict[str, Any], bound: frozenset[str],
        concat: int, literal_elements: int, literal_bytes: int,
    ):
        self.top = top
        self.bound = bound  # the names comprehensions bind (``x`` of ``l.all(x, x > 0)``)
        self.reads = reads
        self.concat = concat
        self.literal_elements = literal_elements
        self.literal_bytes = literal_bytes
        self.static_us = self.cost_us(_NOMINAL_VALUES, _NOMINAL_VALUES * _NOMINAL_STRING, _NOMINAL_ELEMENTS, _NOMINAL_STRING)
        self.zero_us = self.cost_us(0, 0, 0)
        self.flat = not top.inner and not (top.concat or top.scans or top.members)
        # Expressions that read the same paths share one pruned copy of an
        # event's variables (and its conversion): see :class:`Variables`.
        self.reads_key = _paths(reads)

    def cost_us(self, values: int, string_bytes: int, elements: int, longest_string: int = 0) -> float:
        """The estimated time of one evaluation reading ``values`` values of
        the event (``string_bytes`` in strings, the longest ``longest_string``
        bytes), the largest list or map of ``elements``."""
        grow = 1 + self.concat  # each `+` may concatenate what it iterates
        elements_bound = max(elements, self.literal_elements, 1) * grow
        bytes_bound = max(longest_string, self.literal_bytes, elements) * grow
        return (
            _COST_BASE_US
            + values * _COST_PER_VALUE_US
            + string_bytes * _COST_PER_STRING_BYTE_US
            + self.top.cost_us(elements_bound, bytes_bound, max(longest_string, self.literal_bytes))
        )

    def read(self, variables: Mapping[str, Any], budget_us: float) -> tuple[dict[str, Any], _Counter]:
        """The variables pruned to what the expression reads, and their
        count, which stops past what any expression could read within
        ``budget_us`` (so the count is bounded too)."""
        counter = _Counter(int(budget_us / _COST_PER_VALUE_US) + 1)
        pruned = {
            name: _prune(variables[name], sub, counter)
            for name, sub in self.reads.items()
            if name in variables
        }
        return pruned, counter

    def check(self, counter: _Counter, budget_us: float) -> None:
        """Whether one evaluation on what ``counter`` counted fits ``budget_us``.

        Raises:
          BudgetExceeded: its estimated cost is over it.
        """
        if counter.over:
            raise BudgetExceeded(
                f"{BudgetExceeded.code}: it reads more than {counter.cap} values of this event, "
                f"over the evaluation budget of {budget_us:g} µs (limits.expression_budget_us)"
            )
        if self.flat:  # no comprehension, concatenation, scan or `in`: a sum
            cost = self.zero_us + counter.values * _COST_PER_VALUE_US + counter.string_bytes * _COST_PER_STRING_BYTE_US
        else:
            cost = self.cost_us(counter.values, counter.string_bytes, counter.elements, counter.longest_string)
        if cost > budget_us:
            raise BudgetExceeded(
                f"{BudgetExceeded.code}: estimated {cost:,.0f} µs on this event "
                f"({counter.values} values, the largest list or map of {counter.elements}), "
                f"over the evaluation budget of {budget_us:g} µs (limits.expression_budget_us)"
            )


class _Counter:
    """Values, string bytes and the largest collection among the pruned
    variables, counted until ``cap`` values (then ``over``)."""

    __slots__ = ("cap", "values", "string_bytes", "longest_string", "elements", "over")

    def __init__(self, cap: int):
        self.cap = cap
        self.values = self.string_bytes = self.longest_string = self.elements = 0
        self.over = False

    def count(self, value: Any) -> None:
        stack = [value]
        while stack and not self.over:
            item = stack.pop()
            self.values += 1
            kind = type(item)
            if kind is dict or kind is list:
                size = len(item)
                if size > self.elements:
                    self.elements = size
                if self.values + size > self.cap:
                    self.over = True
                    return
                stack.extend(item.values() if kind is dict else item)
            elif kind is str:
                size = len(item)
                self.string_bytes += size
                if size > self.longest_string:
                    self.longest_string = size
            if self.values > self.cap:
                self.over = True


def _prune(value: Any, reads: dict[str, Any], counter: _Counter) -> Any:
    if counter.over:
        return None
    if reads is _WHOLE or type(value) is not dict:
        counter.count(value)
        return value
    counter.values += 1
    return {name: _prune(value[name], sub, counter) for name, sub in reads.items() if name in value}


def _paths(reads: dict[str, Any], prefix: tuple[str, ...] = ()) -> tuple[tuple[str, ...], ...]:
    """A path trie as its sorted paths (hashable: the key of a pruned copy)."""
    if reads is _WHOLE:
        return (prefix,)
    return tuple(path for name in sorted(reads) for path in _paths(reads[name], (*prefix, name)))


def _read(reads: dict[str, Any], path: list[str]) -> None:
    node = reads
    for name in path[:-1]:
        sub = node.setdefault(name, {})
        if sub is _WHOLE:
            return
        node = sub
    node[path[-1]] = _WHOLE


def _shape(source: str, tokens: list[_Token], roots: tuple[str, ...], limits: ExpressionLimits) -> _Shape:
    """``source``'s shape, or the limit it is past.

    Raises:
      ExpressionError: past a limit, naming it and the place.
    """

    def refuse(token: _Token, message: str) -> ExpressionError:
        return ExpressionError(source, message, *_line_column(source, token.offset))

    if len(tokens) > limits.max_tokens:
        raise refuse(
            tokens[limits.max_tokens],
            f"{len(tokens)} tokens is over the limit of {limits.max_tokens} (limits.expression_max_tokens)",
        )
    top = _Level(None)
    levels = [top]
    closers: list[tuple[str, bool]] = []  # (closing bracket, opens a comprehension)
    reads: dict[str, Any] = {}
    concat = literal_elements = literal_bytes = 0
    element_counts: list[int] = []
    bound: set[str] = set()
    shadowing = False
    for i, token in enumerate(tokens):
        text, level = token.text, levels[-1]
        previous = tokens[i - 1].text if i else ""
        if token.kind == "str":
            literal_bytes = max(literal_bytes, len(text))
        if text in _OPEN and token.kind == "op":
            macro = text == "(" and i >= 2 and tokens[i - 1].kind == "id" and tokens[i - 1].text in _MACROS and tokens[i - 2].text == "."
            if len(closers) >= limits.max_nesting:
                raise refuse(token, f"nesting deeper than {limits.max_nesting} (limits.expression_max_nesting)")
            closers.append((_OPEN[text], macro))
            empty = i + 1 < len(tokens) and tokens[i + 1].text == _OPEN[text]
            element_counts.append(0 if empty or text == "(" else 1)
            if macro:
                depth = sum(1 for _, is_macro in closers if is_macro)
                if depth > limits.max_comprehension_depth:
                    raise refuse(
                        token,
                        f"comprehensions nested {depth} deep, over the limit of "
                        f"{limits.max_comprehension_depth} (limits.expression_max_comprehension_depth)",
                    )
                if i + 1 < len(tokens) and tokens[i + 1].kind == "id":
                    bound.add(tokens[i + 1].text)
                    # A comprehension variable named like a root: read the roots whole.
                    shadowing = shadowing or tokens[i + 1].text in roots
                inner = _Level(tokens[i - 1].text)
                level.inner.append(inner)
                levels.append(inner)
                continue
        elif closers and text == closers[-1][0] and token.kind == "op":
            _, was_macro = closers.pop()
            literal_elements = max(literal_elements, element_counts.pop())
            if was_macro:
                levels.pop()
                continue
        elif text == "," and element_counts and token.kind == "op":
            element_counts[-1] += 1
        if token.kind == "op" and text == "+":
            level.concat += 1
            concat += 1
        elif token.kind == "id" and text == "in":
            level.members += 1
        elif token.kind == "id" and text in _SCANNING and previous == ".":
            level.scans += 1
        else:
            level.tokens += 1
        if token.kind == "id" and text in roots and previous != ".":
            _read(reads, _path(tokens, i))
    if shadowing:
        reads = {root: _WHOLE for root in roots}
    return _Shape(top, reads, frozenset(bound), concat, literal_elements, literal_bytes)


def _path(tokens: list[_Token], start: int) -> list[str]:
    """The field path read from the root variable at ``tokens[start]``:
    ``event.data.customer.id`` and ``event.data["a-b"]``; it ends where
    anything else is done with the value (a method, a computed index)."""
    path = [tokens[start].text]
    i, end = start + 1, len(tokens)
    while i + 1 < end:
        if tokens[i].text == "." and tokens[i + 1].kind == "id" and (i + 2 >= end or tokens[i + 2].text != "("):
            path.append(tokens[i + 1].text)
            i += 2
        elif tokens[i].text == "[" and tokens[i + 1].kind == "str" and i + 2 < end and tokens[i + 2].text == "]":
            name = _plain_string(tokens[i + 1])
            if name is None:
                break
            path.append(name)
            i += 3
        else:
            break
    return path


class Variables:
    """One event's variables, shared by the several expressions that judge it:
    each hands the library only the part it reads (:meth:`_Shape.read`),
    pruned, counted and converted once for all the expressions that read the
    same paths (many filters of one event name read the same fields)."""

    __slots__ = ("values", "_prepared")

    def __init__(self, values: Mapping[str, Any]):
        self.values = values
        # reads key → (the pruned variables converted to CEL, their count)
        self._prepared: dict[tuple[tuple[str, ...], ...], tuple[Any, _Counter]] = {}

    def prepared(self, shape: _Shape, budget_us: float) -> tuple[Any, _Counter]:
        entry = self._prepared.get(shape.reads_key)
        if entry is None:
            pruned, counter = shape.read(self.values, budget_us)
            entry = (None if counter.over else _cel().Context(pruned), counter)
            self._prepared[shape.reads_key] = entry
        return entry


def bind(variables: Mapping[str, Any]) -> Variables:
    """``variables`` for several evaluations (:class:`Variables`)."""
    return Variables(dict(variables))


class Expression:
    """A compiled CEL expression (see the module docstring)."""

    __slots__ = ("source", "_program", "_shape")

    def __init__(self, source: str, program: Any, shape: _Shape):
        self.source = source
        self._program = program
        self._shape = shape

    @property
    def static_cost_us(self) -> float:
        """The estimated time of one evaluation on a small event (a few short fields)."""
        return self._shape.static_us

    def evaluate(self, variables: Mapping[str, Any] | Variables) -> Any:
        """The expression's value with ``variables`` bound (a mapping, or
        :func:`bind`'s conversion of one, shared by several evaluations).

        Raises:
          BudgetExceeded: its estimated cost on these variables is over the
            budget (``limits.expression_budget_us``): it was not run.
          EvaluationError: a missing field, a wrong type, any failure.
        """
        shape, budget_us = self._shape, _limits.budget_us
        if isinstance(variables, Variables):
            bound, counter = variables.prepared(shape, budget_us)
        else:
            bound, counter = shape.read(variables, budget_us)
        shape.check(counter, budget_us)
        try:
            return self._program.execute(bound)
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
    shape = _shape(source, _tokens(source), allowed, _limits)
    unknown = sorted(set(program.variables()) - set(allowed) - shape.bound)
    if unknown:
        known = ", ".join(allowed)
        raise ExpressionError(source, f"unknown variable {unknown[0]!r} (this expression may use: {known})")
    if shape.static_us > _limits.budget_us:
        raise ExpressionError(
            source,
            f"estimated {shape.static_us:,.0f} µs per evaluation even on a small event "
            f"({_NOMINAL_VALUES} short fields), "
            f"over the evaluation budget of {_limits.budget_us:g} µs (limits.expression_budget_us)",
        )
    expression = Expression(source, program, shape)
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
