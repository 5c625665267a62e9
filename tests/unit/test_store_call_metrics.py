"""``ironflow_store_call_seconds``: every store interface call on a node's store
is timed under its method name, refused calls included, cancelled ones not."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from ironflow import metrics
from ironflow.store import RunNotFound, Store


def _calls(method: str) -> tuple[float, float]:
    get = metrics.REGISTRY.get_sample_value
    labels = {"method": method}
    return (get("ironflow_store_call_seconds_count", labels) or 0.0,
            get("ironflow_store_call_seconds_sum", labels) or 0.0)


async def test_a_timed_store_observes_each_call_under_its_method_once_even_when_wrapped_twice(
    store: Store, autojump_clock: trio.testing.MockClock
) -> None:
    assert metrics.time_store_calls(metrics.time_store_calls(store)) is store
    count0, _ = _calls("db_now")
    await store.db_now()
    await store.db_now()
    assert _calls("db_now")[0] - count0 == 2


async def test_a_refused_call_is_observed_and_a_cancelled_one_is_not(
    store: Store, autojump_clock: trio.testing.MockClock
) -> None:
    metrics.time_store_calls(store)
    count0, _ = _calls("get_run")
    with pytest.raises(RunNotFound):
        await store.get_run("run_nope")
    assert _calls("get_run")[0] - count0 == 1
    with trio.CancelScope() as scope:
        scope.cancel()
        await store.get_run("run_nope")
    assert _calls("get_run")[0] - count0 == 1


def test_the_method_label_can_only_take_the_store_interfaces_method_names() -> None:
    methods = metrics.store_methods()
    assert {"record_step", "complete_job", "reserve_segments", "resume_claimed_steps"} <= methods
    # Not a call: the node-long kick listener; nor anything private.
    assert "watch_kicks" not in methods and not any(m.startswith("_") for m in methods)
    assert all(callable(getattr(Store, m)) for m in methods)
