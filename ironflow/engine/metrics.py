"""Prometheus metrics of the node (names follow the original product's dashboards).

Imports nothing of the store: the store times its own calls with
``STORE_CALL`` (:mod:`ironflow.store.timing`) and counts with these metrics.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Iterator
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

REGISTRY = CollectorRegistry()


class _Histogram:
    """A histogram kept as plain per-label-set bucket counts (a collector).

    Observed on the hot path (every store call, step, run, assignment), so an
    observation costs a dict lookup, a ``bisect`` and two additions: a
    ``prometheus_client`` ``Histogram`` takes a lock per observation (and per
    ``labels()``) and walks the buckets. Observations and scrapes both run on
    the node's Trio thread, so no lock. The exposition, built at scrape time,
    is the one ``prometheus_client`` gives.
    """

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...],
                 labelnames: tuple[str, ...] = ()) -> None:
        self.name, self.documentation = name, documentation
        self._buckets, self._labelnames = buckets, labelnames
        # label values → counts per bucket (the last one: above every bound), sum, created
        self._counts: dict[tuple[str, ...], list[int]] = {}
        self._sums: dict[tuple[str, ...], float] = {}
        self._created: dict[tuple[str, ...], float] = {}
        if not labelnames:  # exposed from the start, as prometheus_client's
            self._new(())

    def _new(self, labels: tuple[str, ...]) -> list[int]:
        counts = self._counts[labels] = [0] * (len(self._buckets) + 1)
        self._sums[labels], self._created[labels] = 0.0, time.time()
        return counts

    def observe(self, value: float, labels: tuple[str, ...] = ()) -> None:
        counts = self._counts.get(labels) or self._new(labels)
        counts[bisect.bisect_left(self._buckets, value)] += 1  # le: bound >= value
        self._sums[labels] += value

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self._labelnames))
        bounds = [floatToGoString(b) for b in self._buckets] + ["+Inf"]
        for labels, counts in sorted(self._counts.items()):
            cumulative = list(itertools.accumulate(counts))
            family.add_metric(
                list(labels), buckets=list(zip(bounds, cumulative, strict=True)), sum_value=self._sums[labels]
            )
            family.samples.append(Sample(  # what add_metric has no parameter for
                f"{self.name}_created", dict(zip(self._labelnames, labels, strict=True)), self._created[labels]
            ))
        yield family


class _Counter:
    """A counter kept as plain numbers per label set (a collector), for the
    hot path: no lock and no ``labels()`` child per call (see :class:`_Histogram`)."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...] = ()) -> None:
        self.name = name.removesuffix("_total")
        self.documentation, self._labelnames = documentation, labelnames
        self._values: dict[tuple[str, ...], float] = {}
        self._created: dict[tuple[str, ...], float] = {}
        if not labelnames:  # exposed from the start, as prometheus_client's
            self.inc(0.0)

    def inc(self, amount: float = 1.0, labels: tuple[str, ...] = ()) -> None:
        value = self._values.get(labels)
        if value is None:
            value = 0.0
            self._created[labels] = time.time()
        self._values[labels] = value + amount

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=list(self._labelnames))
        for labels, value in sorted(self._values.items()):
            family.add_metric(list(labels), value, created=self._created[labels])
        yield family


_C = TypeVar("_C", _Counter, _Histogram)


def _registered(collector: _C) -> _C:
    REGISTRY.register(collector)  # type: ignore[arg-type]
    return collector


EVENTS_EMITTED = _registered(_Counter("ironflow_events_emitted_total", "Events accepted by POST /v1/events"))
# Ingest-side flow control (ironflow/store/flow.py): events a function skipped,
# debounced or batched, and runs cancelled for a new one (singleton, on_limit).
FLOW_EVENTS = Counter(
    "ironflow_flow_events_total",
    "Events flow control did not simply start a run for, per function",
    ["mechanism", "outcome"],  # rate_limit|singleton|debounce|batch|concurrency; skipped|debounced|batched|cancelled
    registry=REGISTRY,
)
RUNS_FINISHED = _registered(_Counter("ironflow_runs_total", "Runs that reached a terminal status", ("status",)))
STEPS_RECORDED = _registered(_Counter("ironflow_steps_total", "Step results recorded", ("status",)))
STORE_AVAILABLE = Gauge(
    "ironflow_store_available",
    "1 while this node reaches its database, 0 during an outage (actors/store_monitor.py)",
    registry=REGISTRY,
)
STORE_OUTAGE_SECONDS = Histogram(
    "ironflow_store_outage_seconds",
    "How long each outage of the database lasted, as this node saw it",
    buckets=(0.5, 1, 2, 5, 10, 30, 60, 300, 1800),
    registry=REGISTRY,
)
WORKERS_CONNECTED = Gauge(
    "ironflow_workers_connected", "Streaming worker sessions on this node", registry=REGISTRY
)
WORKER_DISCONNECTS = Counter(
    "ironflow_worker_disconnects_total", "Streaming worker sockets that closed", registry=REGISTRY
)
RECOVERIES = Counter(
    "ironflow_segments_recovered_total",
    "Segments fenced and re-enqueued by recovery",
    ["path"],  # lease_expiry | disconnect | drain_deadline
    registry=REGISTRY,
)
NACKS = Counter("ironflow_job_nacks_total", "JobNack accepted", ["reason"], registry=REGISTRY)
STALE_REFUSED = Counter(
    "ironflow_stale_messages_total", "Fenced messages refused as stale", registry=REGISTRY
)
ACTOR_RESTARTS = Counter(
    "ironflow_actor_restarts_total", "Actors restarted after a crash", ["actor"], registry=REGISTRY
)
ASSIGNMENTS = _registered(_Counter("ironflow_assignments_total", "JobAssignments handed to workers"))

HISTORY_DELETED = Counter(
    "ironflow_history_rows_deleted_total",
    "Rows deleted by history retention (janitor passes and operator purges)",
    ["kind"],  # runs | steps | audit | events
    registry=REGISTRY,
)
HISTORY_OLDEST_RUN_AGE = Gauge(
    "ironflow_history_oldest_run_age_seconds",
    "Age of the oldest finished run still stored (about history_retention when the janitor keeps up)",
    registry=REGISTRY,
)

# Latency buckets (seconds): a few ms on an idle node up to a minute of queueing.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Run durations (seconds): sub-second handlers up to day-long sleeps and waits.
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 6 * 3600, 86400)

EMIT_TO_DISPATCH = _registered(_Histogram(
    "ironflow_emit_to_dispatch_seconds",
    "Event received → its run's first segment handed to a worker on this node"
    " (the handler starts one JobAck later)",
    LATENCY_BUCKETS,
))
STEP_COMMIT = _registered(_Histogram(
    "ironflow_step_commit_seconds",
    "A step result received by this node → committed to the database",
    LATENCY_BUCKETS,
))
RUN_DURATION = _registered(_Histogram(
    "ironflow_run_duration_seconds",
    "Runs ended on this node (completed, failed — by the worker, the recovery ceiling or"
    " the function timeout — or cancelled): first start (or creation) → end",
    DURATION_BUCKETS,
    ("function", "status"),
))
# Flow control at dispatch (docs/flow-control.md).
FLOW_HELD = Counter(
    "ironflow_flow_held_total",
    "Queued segments flow control held back in this node's dispatch rounds",
    ["mechanism"],  # concurrency (a full limit or key: queued) | throttle (moved to its start time: delayed)
    registry=REGISTRY,
)
FLOW_FAIR_PASSES = Counter(
    "ironflow_flow_fair_passes_total",
    "Dispatch rounds that visited other concurrency keys because a full key held candidates back",
    registry=REGISTRY,
)
QUEUE_DEPTH = Gauge(
    "ironflow_queue_depth",
    "Segments in the dispatch queue, cluster-wide (sampled)",
    ["state"],  # runnable | in_grace (recovery) | delayed (retry backoff)
    registry=REGISTRY,
)
ACTIVE_LEASES = Gauge(
    "ironflow_active_leases", "Concurrency leases of executing segments, cluster-wide (sampled)",
    registry=REGISTRY,
)
SESSIONS = Gauge(
    "ironflow_sessions",
    "Live worker sessions, cluster-wide (sampled)",
    ["transport"],  # stream | pull
    registry=REGISTRY,
)


WAKE_LATENESS = _registered(_Histogram(
    "ironflow_wake_lateness_seconds",
    "A sleep's wake time (or a wait's / invoke's timeout) → the run's resumed segment handed"
    " to a worker by this node (database clock); one handed over ahead of its wake time is"
    " held until then and counts 0",
    LATENCY_BUCKETS,
))


STORE_CALL = _registered(_Histogram(
    "ironflow_store_call_seconds",
    "A store method called on this node → its committed result back in the caller",
    LATENCY_BUCKETS,
    ("method",),
))

def run_ended(status: str, function_id: str | None, duration_s: float | None) -> None:
    """Count a run that ended on this node and observe its duration.

    Every path that ends a run (a worker's final result, cancel, the recovery
    ceiling, the function timeout) calls this once with what its store call
    returned; the store's guarded UPDATE ends a run only once, so the run is
    observed once.
    """
    RUNS_FINISHED.inc(labels=(status,))
    if function_id is not None and duration_s is not None:
        RUN_DURATION.observe(max(duration_s, 0.0), (function_id, status))


def render() -> bytes:
    """The Prometheus text exposition of this node's metrics."""
    return generate_latest(REGISTRY)
