"""What a registration's dispatch-side flow control must satisfy beyond its
types (issue 24; docs/flow-control.md): at most one keyed concurrency
constraint, at most one ``on_limit`` other than ``queue`` (and none beside a
debounce, batch or singleton, which decide when a run starts), keys and the
priority that compile. One function, used by the SDK at declaration and by the
engine at registration (actors/session.py).
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
