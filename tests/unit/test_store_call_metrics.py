"""``ironflow_store_call_seconds``: every store interface call on a node's store
is timed under its method name, refused calls included, cancelled ones not."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from ironflow.engine import metrics
from ironflow.store import RunNotFound, Store, timing


def _calls(method: str) -> tuple[float, float]:
    get = metrics.REGISTRY.get_sample_value
    labels = {"method": method}
    return (get("ironflow_store_call_seconds_count", labels) or 0.0,
            get("ironflow_store_call_seconds_sum", labels) or 0.0)


async def test_a_timed_store_observes_each_call_under_its_method_once_even_when_wrapped_twice(
    store: Store, autojump_clock: trio.testing.MockClock
) -> None:
    assert timing.time_store_calls(timing.time_store_calls(store)) is store
    count0, _ = _calls("db_now")
    await store.db_now()
    await store.db_now()
    assert _calls("db_now")[0] - count0 == 2


async def test_a_refused_call_is_observed_and_a_cancelled_one_is_not(
    store: Store, autojump_clock: trio.testing.MockClock
) -> None:
    timing.time_store_calls(store)
    count0, _ = _calls("get_run")
    with pytest.raises(RunNotFound):
        await store.get_run("run_nope")
    assert _calls("get_run")[0] - count0 == 1
    with trio.CancelScope() as scope:
        scope.cancel()
        await store.get_run("run_nope")
    assert _calls("get_run")[0] - count0 == 1


def test_the_method_label_can_only_take_the_store_interfaces_method_names() -> None:
    methods = timing.store_methods()
    assert {"record_step", "complete_job", "reserve_segments", "resume_claimed_steps"} <= methods
    # Not a call: the node-long kick listener; nor anything private.
    assert "watch_kicks" not in methods and not any(m.startswith("_") for m in methods)
    assert all(callable(getattr(Store, m)) for m in methods)


def test_its_buckets_sum_and_count_are_those_a_prometheus_histogram_gives_the_same_observations() -> None:
    """The node's lock-free histograms (``ironflow_store_call_seconds`` and the
    others observed per step, run or assignment) against ``prometheus_client``'s."""
    from prometheus_client import CollectorRegistry, Histogram

    def samples(families: object, prefix: str) -> list[tuple[str, list[tuple[str, str]], float]]:
        return sorted(
            (s.name.replace(prefix, ""), sorted(s.labels.items()), s.value if not s.name.endswith("_created") else 1)
            for f in families for s in f.samples  # type: ignore[attr-defined]
        )

    ours = metrics._Histogram("ironflow_store_call_seconds", "", metrics.LATENCY_BUCKETS, ("method",))
    registry = CollectorRegistry()
    reference = Histogram("ref_seconds", "", ["method"], buckets=metrics.LATENCY_BUCKETS, registry=registry)
    # On a bound, between bounds, below the first and above the last; two label values.
    for seconds in (0.0001, 0.001, 0.0011, 0.05, 0.07, 2.5, 59.0, 61.0, 1000.0):
        ours.observe(seconds, ("record_step",))
        reference.labels(method="record_step").observe(seconds)
    ours.observe(0.2, ("db_now",))
    reference.labels(method="db_now").observe(0.2)
    assert samples(ours.collect(), "ironflow_store_call_seconds") == samples(registry.collect(), "ref_seconds")

    # unlabelled: exposed, at 0, before its first observation
    plain = metrics._Histogram("ironflow_x_seconds", "", metrics.LATENCY_BUCKETS)
    plain_registry = CollectorRegistry()
    plain_reference = Histogram("ref_seconds", "", buckets=metrics.LATENCY_BUCKETS, registry=plain_registry)
    assert samples(plain.collect(), "ironflow_x_seconds") == samples(plain_registry.collect(), "ref_seconds")
    plain.observe(0.003)
    plain_reference.observe(0.003)
    assert samples(plain.collect(), "ironflow_x_seconds") == samples(plain_registry.collect(), "ref_seconds")


def test_a_counter_exposes_what_a_prometheus_counter_gives_the_same_increments() -> None:
    """The node's lock-free counters (``ironflow_runs_total`` and the others
    counted per run or step) against ``prometheus_client``'s, samples and
    ``_created`` series alike; an unlabelled one shows 0 before its first."""
    from prometheus_client import CollectorRegistry, Counter

    registry = CollectorRegistry()
    labelled, plain = metrics._Counter("ironflow_x_total", "", ("status",)), metrics._Counter("ironflow_y_total", "")
    ref_labelled = Counter("ironflow_x_total", "", ["status"], registry=registry)
    ref_plain = Counter("ironflow_y_total", "", registry=registry)

    def samples(families: object) -> list[tuple[str, list[tuple[str, str]], bool]]:
        return sorted(
            (s.name, sorted(s.labels.items()), s.value if not s.name.endswith("_created") else s.value > 0)
            for f in families for s in f.samples  # type: ignore[attr-defined]
        )

    def ours() -> list[tuple[str, list[tuple[str, str]], bool]]:
        return samples([*labelled.collect(), *plain.collect()])

    assert ours() == samples(registry.collect())  # before any increment
    for status, amount in (("completed", 1), ("failed", 1), ("completed", 1), ("completed", 3)):
        labelled.inc(amount, (status,))
        ref_labelled.labels(status=status).inc(amount)
    plain.inc(2)
    ref_plain.inc(2)
    assert ours() == samples(registry.collect())
