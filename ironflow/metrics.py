"""Prometheus metrics of the node (names follow the original product's dashboards)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

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


def render() -> bytes:
    """The Prometheus text exposition of this node's metrics."""
    return generate_latest(REGISTRY)
