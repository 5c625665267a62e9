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


def test_its_buckets_sum_and_count_are_those_a_prometheus_histogram_gives_the_same_observations() -> None:
    from prometheus_client import CollectorRegistry, Histogram

    ours = metrics._StoreCallHistogram()
    registry = CollectorRegistry()
    reference = Histogram("ref_seconds", "", ["method"], buckets=metrics.LATENCY_BUCKETS, registry=registry)
    # On a bound, between bounds, below the first and above the last.
    for seconds in (0.0001, 0.001, 0.0011, 0.05, 0.07, 2.5, 59.0, 61.0, 1000.0):
        ours.observe("record_step", seconds)
        reference.labels(method="record_step").observe(seconds)

    def samples(families: object, prefix: str) -> list[tuple[str, list[tuple[str, str]], float]]:
        return sorted(
            (s.name.replace(prefix, ""), sorted(s.labels.items()), s.value)
            for f in families for s in f.samples  # type: ignore[attr-defined]
            if not s.name.endswith("_created")
        )

    assert samples(ours.collect(), "ironflow_store_call_seconds") == samples(registry.collect(), "ref_seconds")
