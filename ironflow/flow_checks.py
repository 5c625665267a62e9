"""The checks of a definition's ingest-side flow control (ironflow/protocol/flow.py)
beyond its wire bounds: its keys compile as keys (ironflow/expressions.py), a
debounce's ``max_wait`` is no shorter than its period, and the mechanisms
that decide when a run starts (debounce, batch, singleton) are not combined.

Called by the engine at registration (``actors/session.py check_register``:
refused, HTTP 422) and by the SDK at declaration when the expression
language is installed (the light worker install leaves it to the engine).
"""

from __future__ import annotations

from ironflow.protocol import FunctionDef


def flow_problem(fd: FunctionDef) -> str | None:
    """What is wrong with ``fd``'s flow control (naming the field), or None.

    Raises:
      RuntimeError: the expression language is not installed (SDK light install).
    """
    from ironflow.expressions import ExpressionError, compile_key

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
