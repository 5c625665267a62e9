"""Prometheus metrics of the node (names follow the original product's dashboards)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
    "Runs that completed or failed on this node: first start (or creation) → end",
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


def render() -> bytes:
    """The Prometheus text exposition of this node's metrics."""
    return generate_latest(REGISTRY)
