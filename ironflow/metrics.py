"""Prometheus metrics of the node (names follow the original product's dashboards)."""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ironflow.store import Store

REGISTRY = CollectorRegistry()

EVENTS_EMITTED = Counter(
    "ironflow_events_emitted_total", "Events accepted by POST /v1/events", registry=REGISTRY
)
RUNS_FINISHED = Counter(
    "ironflow_runs_total", "Runs that reached a terminal status", ["status"], registry=REGISTRY
)
STEPS_RECORDED = Counter(
    "ironflow_steps_total", "Step results recorded", ["status"], registry=REGISTRY
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
    "A sleep's wake time (or a wait's / invoke's timeout) → this node's waker resumed the"
    " step and queued the run's next segment (database clock)",
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
STORE_CALL = Histogram(
    "ironflow_store_call_seconds",
    "A store method called on this node → its committed result back in the caller",
    ["method"],  # the Store interface's method names only (bounded)
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)

# Store methods not timed: ``watch_kicks`` lives as long as the node (it is a
# listener, not a call), and opening/closing are not calls an operator tunes.
_UNTIMED_STORE_METHODS = frozenset({"watch_kicks", "open", "close"})


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
    histogram = STORE_CALL.labels(method=method)

    @functools.wraps(call)
    async def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            result = await call(*args, **kwargs)
        except Exception:
            # A refused call (stale fence, conflict) still took its transaction;
            # a cancelled one (BaseException) did not finish and is not observed.
            histogram.observe(time.perf_counter() - started)
            raise
        histogram.observe(time.perf_counter() - started)
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
