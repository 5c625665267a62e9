"""Liveness, readiness and metrics (no auth)."""

from __future__ import annotations

from quart import Blueprint, Response

from ironflow.api.errors import RETRY_AFTER_S, json_response
from ironflow.api.state import state
from ironflow.engine import metrics
from ironflow.protocol import Health

bp = Blueprint("health", __name__)


@bp.get("/healthz")
async def healthz() -> Response:
    return json_response(Health("ok", state().deps.node_id))


@bp.get("/readyz")
async def readyz() -> Response:
    deps = state().deps
    if deps.shutdown_requested.is_set():
        return json_response(Health("draining"), 503)
    if not deps.ready.is_set():
        return json_response(Health("starting"), 503)
    availability = deps.store.availability
    if not availability.up:
        response = json_response(
            Health("store_unavailable", deps.node_id, availability.cause), 503
        )
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response
    return json_response(Health("ready", deps.node_id))


@bp.get("/metrics")
async def prometheus() -> Response:
    return Response(metrics.render(), content_type="text/plain; version=0.0.4")
