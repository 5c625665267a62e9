"""Prometheus metrics of the node (names follow the original product's dashboards)."""

from __future__ import annotations

import bisect
import functools
import inspect
import itertools
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from ironflow.store import Store

REGISTRY = CollectorRegistry()

EVENTS_EMITTED = Counter(
    "ironflow_events_emitted_total", "Events accepted by POST /v1/events", registry=REGISTRY
)
# Ingest-side flow control (ironflow/store/flow.py): events a function skipped,
# debounced or batched, and runs cancelled for a new one (singleton, on_limit).
FLOW_EVENTS = Counter(
    "ironflow_flow_events_total",
    "Events flow control did not simply start a run for, per function",
    ["mechanism", "outcome"],  # rate_limit|singleton|debounce|batch|concurrency; skipped|debounced|batched|cancelled
    registry=REGISTRY,
)
RUNS_FINISHED = Counter(
    "ironflow_runs_total", "Runs that reached a terminal status", ["status"], registry=REGISTRY
)
STEPS_RECORDED = Counter(
    "ironflow_steps_total", "Step results recorded", ["status"], registry=REGISTRY
)
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
ASSIGNMENTS = Counter(
    "ironflow_assignments_total", "JobAssignments handed to workers", registry=REGISTRY
)

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

EMIT_TO_DISPATCH = Histogram(
    "ironflow_emit_to_dispatch_seconds",
    "Event received → its run's first segment handed to a worker on this node"
    " (the handler starts one JobAck later)",
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
STEP_COMMIT = Histogram(
    "ironflow_step_commit_seconds",
    "A step result received by this node → committed to the database",
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
RUN_DURATION = Histogram(
    "ironflow_run_duration_seconds",
    "Runs ended on this node (completed, failed — by the worker, the recovery ceiling or"
    " the function timeout — or cancelled): first start (or creation) → end",
    ["function", "status"],
    buckets=DURATION_BUCKETS,
    registry=REGISTRY,
)
# Flow control at dispatch (issue 24; docs/flow-control.md).
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


WAKE_LATENESS = Histogram(
    "ironflow_wake_lateness_seconds",
    "A sleep's wake time (or a wait's / invoke's timeout) → the run's resumed segment handed"
    " to a worker by this node (database clock); one handed over ahead of its wake time is"
    " held until then and counts 0",
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)


class _StoreCallHistogram:
    """``ironflow_store_call_seconds{method}``, kept as plain per-method bucket counts.

    Every store call passes through here, so an observation must cost next to
    nothing: a ``bisect`` and two additions (a ``prometheus_client``
    ``Histogram.observe`` takes a lock and walks the buckets, several µs).
    Store calls and scrapes both run on the node's Trio thread, so no lock.
    The exposition is built at scrape time.
    """

    name = "ironflow_store_call_seconds"
    documentation = "A store method called on this node → its committed result back in the caller"

    def __init__(self) -> None:
        # method → counts per bucket (the last one: above every bound), seconds observed
        self._counts: dict[str, list[int]] = {}
        self._sums: dict[str, float] = {}

    def observe(self, method: str, seconds: float) -> None:
        counts = self._counts.get(method)
        if counts is None:
            counts = self._counts[method] = [0] * (len(LATENCY_BUCKETS) + 1)
            self._sums[method] = 0.0
        counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1  # le: bound >= seconds
        self._sums[method] += seconds

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["method"])
        for method, counts in sorted(self._counts.items()):
            cumulative = list(itertools.accumulate(counts))
            bounds = [floatToGoString(b) for b in LATENCY_BUCKETS] + ["+Inf"]
            family.add_metric(
                [method], buckets=list(zip(bounds, cumulative, strict=True)), sum_value=self._sums[method]
            )
        yield family


STORE_CALL = _StoreCallHistogram()
REGISTRY.register(STORE_CALL)  # type: ignore[arg-type]

# Store methods not timed: ``watch_kicks`` lives as long as the node (it is a
# listener, not a call), and opening/closing are not calls an operator tunes.
_UNTIMED_STORE_METHODS = frozenset({"watch_kicks", "open", "close", "probe"})


def run_ended(status: str, function_id: str | None, duration_s: float | None) -> None:
    """Count a run that ended on this node and observe its duration.

    Every path that ends a run (a worker's final result, cancel, the recovery
    ceiling, the function timeout) calls this once with what its store call
    returned; the store's guarded UPDATE ends a run only once, so the run is
    observed once.
    """
    RUNS_FINISHED.labels(status=status).inc()
    if function_id is not None and duration_s is not None:
        RUN_DURATION.labels(function=function_id, status=status).observe(max(duration_s, 0.0))


def store_methods() -> frozenset[str]:
    """The ``Store`` interface's timed methods: every label value ``method`` can take."""
    return frozenset(
        name
        for name, fn in inspect.getmembers(Store, inspect.iscoroutinefunction)
        if not name.startswith("_") and name not in _UNTIMED_STORE_METHODS
    )


def _timed(method: str, call: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    observe = STORE_CALL.observe

    @functools.wraps(call)
    async def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            result = await call(*args, **kwargs)
        except Exception:
            # A refused call (stale fence, conflict) still took its transaction;
            # a cancelled one (BaseException) did not finish and is not observed.
            observe(method, time.perf_counter() - started)
            raise
        observe(method, time.perf_counter() - started)
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


def render() -> bytes:
    """The Prometheus text exposition of this node's metrics."""
    return generate_latest(REGISTRY)
