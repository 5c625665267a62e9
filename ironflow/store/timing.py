"""``ironflow_store_call_seconds``: a node's store, every interface call timed.

The node wraps its store once (:func:`time_store_calls`); the histogram is
:data:`ironflow.engine.metrics.STORE_CALL`, labelled by method name.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ironflow.engine.metrics import STORE_CALL
from ironflow.store.base import Store

# Store methods not timed: ``watch_kicks`` lives as long as the node (it is a
# listener, not a call), and opening/closing are not calls an operator tunes.
_UNTIMED_STORE_METHODS = frozenset({"watch_kicks", "open", "close", "probe"})


def store_methods() -> frozenset[str]:
    """The ``Store`` interface's timed methods: every label value ``method`` can take."""
    return frozenset(
        name
        for name, fn in inspect.getmembers(Store, inspect.iscoroutinefunction)
        if not name.startswith("_") and name not in _UNTIMED_STORE_METHODS
    )


def _timed(method: str, call: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    observe, labels = STORE_CALL.observe, (method,)

    @functools.wraps(call)
    async def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            result = await call(*args, **kwargs)
        except Exception:
            # A refused call (stale fence, conflict) still took its transaction;
            # a cancelled one (BaseException) did not finish and is not observed.
            observe(time.perf_counter() - started, labels)
            raise
        observe(time.perf_counter() - started, labels)
        return result

    return timed


def time_store_calls(store: Store) -> Store:
    """Observe ``ironflow_store_call_seconds`` for every interface call on ``store``.

    Wraps the instance's bound methods (the class is untouched, so a store
    built by a test without a node is not timed). Calling it twice is harmless.
    Returns ``store``.
    """
    if getattr(store, "_ironflow_timed", False):
        return store
    for name in store_methods():
        setattr(store, name, _timed(name, getattr(store, name)))
    store._ironflow_timed = True  # type: ignore[attr-defined]
    return store
