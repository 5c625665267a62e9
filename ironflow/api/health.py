"""Liveness, readiness and metrics (no auth)."""

from __future__ import annotations

from quart import Blueprint, Response

from ironflow import metrics
from ironflow.api.errors import json_response
from ironflow.api.state import state
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
    return json_response(Health("ready", deps.node_id))


@bp.get("/metrics")
async def prometheus() -> Response:
    return Response(metrics.render(), content_type="text/plain; version=0.0.4")
