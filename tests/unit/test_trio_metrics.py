"""The lock-free metrics (``TrioCounter``, ``TrioHistogram`` in ironflow/metrics.py)
expose exactly what ``prometheus_client``'s ``Counter`` and ``Histogram`` expose
for the same calls, sample for sample (``_created`` values aside: clock reads)."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from ironflow import metrics


def _samples(registry: CollectorRegistry) -> list[tuple[str, list[tuple[str, str]], float]]:
    return sorted(
        (s.name, sorted(s.labels.items()), 0.0 if s.name.endswith("_created") else s.value)
        for family in registry.collect()
        for s in family.samples
    )


def _text(registry: CollectorRegistry) -> list[str]:
    """The exposition's lines, ``_created`` values blanked."""
    lines = generate_latest(registry).decode().splitlines()
    return sorted(line.rsplit(" ", 1)[0] if "_created" in line and not line.startswith("#") else line
                  for line in lines)


def _pair() -> tuple[CollectorRegistry, CollectorRegistry]:
    return CollectorRegistry(), CollectorRegistry()


def test_a_counter_exposes_what_a_prometheus_counter_exposes() -> None:
    ours_reg, ref_reg = _pair()
    ours = metrics.TrioCounter("x_total", "Things", ("status",), registry=ours_reg)
    ref = Counter("x_total", "Things", ["status"], registry=ref_reg)
    bound = ours.labels(status="completed")  # bound once, as hot call sites do
    for _ in range(3):
        bound.inc()
        ref.labels(status="completed").inc()
    ours.labels("failed").inc(2.5)
    ref.labels("failed").inc(2.5)
    plain_ours = metrics.TrioCounter("y_total", "Plain", registry=ours_reg)
    plain_ref = Counter("y_total", "Plain", registry=ref_reg)
    plain_ours.inc()
    plain_ref.inc()
    assert _samples(ours_reg) == _samples(ref_reg)
    assert _text(ours_reg) == _text(ref_reg)


def test_a_histogram_exposes_what_a_prometheus_histogram_exposes() -> None:
    ours_reg, ref_reg = _pair()
    ours = metrics.TrioHistogram("h_seconds", "Times", ("method",), buckets=metrics.LATENCY_BUCKETS,
                                 registry=ours_reg)
    ref = Histogram("h_seconds", "Times", ["method"], buckets=metrics.LATENCY_BUCKETS, registry=ref_reg)
    # On a bound, between bounds, below the first and above the last.
    for seconds in (0.0001, 0.001, 0.0011, 0.05, 0.07, 2.5, 59.0, 61.0, 1000.0):
        ours.labels("record_step").observe(seconds)
        ref.labels(method="record_step").observe(seconds)
    ours.labels(method="get_run").observe(0.003, 3)  # one value observed three times
    for _ in range(3):
        ref.labels(method="get_run").observe(0.003)
    plain_ours = metrics.TrioHistogram("p_seconds", "Plain", buckets=(0.1, 1.0), registry=ours_reg)
    plain_ref = Histogram("p_seconds", "Plain", buckets=(0.1, 1.0), registry=ref_reg)
    plain_ours.observe(0.5)
    plain_ref.observe(0.5)
    assert _samples(ours_reg) == _samples(ref_reg)
    assert _text(ours_reg) == _text(ref_reg)


@pytest.mark.parametrize("call", [
    lambda m: m.labels("a", "b"), lambda m: m.labels(other="a"), lambda m: m.inc(),
])
def test_wrong_labels_are_refused_as_prometheus_refuses_them(call: Any) -> None:
    counter = metrics.TrioCounter("z_total", "Z", ("status",), registry=CollectorRegistry())
    with pytest.raises((ValueError, KeyError)):
        call(counter)
