"""A definition's flow rules beyond its wire types (ironflow/protocol/flow.py;
docs/flow-control.md), one function per side.

- :func:`dispatch_flow_problem`, the dispatch side: at most one keyed
  concurrency constraint, at most one ``on_limit`` other than ``queue`` (and
  none beside a debounce, batch or singleton, which decide when a run starts),
  keys and the priority that compile.
- :func:`flow_problem`, the ingest side: see its docstring.

Called by the engine at registration (``actors/session.py check_register``:
refused, HTTP 422) and by the SDK at declaration; where the expression
language is not installed (the light worker install), compiling raises
``RuntimeError`` and the engine checks at registration.
"""

from __future__ import annotations

from ironflow.expressions import ExpressionError, compile_expression, compile_key
from ironflow.protocol import FunctionDef, concurrency_limits


def dispatch_flow_problem(fd: FunctionDef, *, compile_expressions: bool = True) -> str | None:
    """Why ``fd``'s concurrency, throttle or priority is refused, naming the
    field; None when it is fine. ``compile_expressions=False`` skips what needs
    the engine's expression library (a light SDK install)."""
    limits = concurrency_limits(fd)
    if sum(1 for c in limits if c.key is not None) > 1:
        return "concurrency: at most one of the two constraints may have a key"
    deciding = [(i, c.on_limit) for i, c in enumerate(limits) if c.on_limit != "queue"]
    if deciding:
        place = f"concurrency[{deciding[0][0]}].on_limit" if len(limits) > 1 else "concurrency.on_limit"
        if len(deciding) > 1:
            return "concurrency: at most one of the two constraints may have an on_limit other than 'queue'"
        others = [n for n, v in (("debounce", fd.debounce), ("batch", fd.batch), ("singleton", fd.singleton)) if v]
        if others:
            return (
                f"{place}={deciding[0][1]!r} cannot be combined with {others[0]}"
                " (each decides whether a new run starts)"
            )
    if not compile_expressions:
        return None
    keys = [("concurrency.key", c.key) for c in limits]
    keys.append(("throttle.key", fd.throttle.key if fd.throttle else None))
    for name, source in keys:
        try:
            if source is not None:
                compile_key(source)
        except ExpressionError as exc:
            return f"{name}: {exc}"
    try:
        if fd.priority is not None:
            compile_expression(fd.priority)
    except ExpressionError as exc:
        return f"priority: {exc}"
    return None


def flow_problem(fd: FunctionDef) -> str | None:
    """What is wrong with ``fd``'s ingest-side flow control (naming the field), or None.

    Ingest side: the keys of rate_limit, debounce, singleton and batch compile
    as keys, a debounce's ``max_wait`` is no shorter than its period, and the
    mechanisms that decide when a run starts (debounce, batch, singleton) are
    not combined.

    Raises:
      RuntimeError: the expression language is not installed (SDK light install).
    """
    deciding = [
        name for name, value in
        (("debounce", fd.debounce), ("batch", fd.batch), ("singleton", fd.singleton))
        if value is not None
    ]
    if len(deciding) > 1:
        return f"{' and '.join(deciding)} cannot be combined (each decides when a run starts)"
    if fd.debounce is not None and fd.debounce.max_wait_s is not None:
        if fd.debounce.max_wait_s < fd.debounce.period_s:
            return (
                f"debounce.max_wait={fd.debounce.max_wait_s:g}s is shorter than its"
                f" period={fd.debounce.period_s:g}s"
            )
    for field, value in (
        ("rate_limit", fd.rate_limit), ("debounce", fd.debounce),
        ("singleton", fd.singleton), ("batch", fd.batch),
    ):
        key = getattr(value, "key", None) if value is not None else None
        if key is not None:
            try:
                compile_key(key)
            except ExpressionError as exc:
                return f"{field}.key: {exc}"
    return None
