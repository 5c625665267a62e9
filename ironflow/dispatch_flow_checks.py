"""What a registration's dispatch-side flow control must satisfy beyond its
types (issue 24; docs/flow-control.md): at most one keyed concurrency
constraint, keys and the priority that compile. One function, used by the SDK
at declaration and by the engine at registration (actors/session.py).
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
