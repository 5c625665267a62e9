"""The capacity layer as operators see it (platform keys only)."""

from __future__ import annotations

from quart import Blueprint, Response, request

from ironflow.api.auth import require_platform
from ironflow.api.errors import json_response
from ironflow.api.state import state
from ironflow.protocol import LeaseList, QueueList, SessionList

bp = Blueprint("capacity", __name__)


@bp.get("/v1/capacity/leases")
async def leases() -> Response:
    await require_platform()
    include_expired = request.args.get("all", "").lower() in ("1", "true", "yes")
    return json_response(LeaseList(await state().store.list_leases(include_expired=include_expired)))


@bp.get("/v1/capacity/sessions")
async def sessions() -> Response:
    await require_platform()
    return json_response(SessionList(await state().store.list_sessions()))


@bp.get("/v1/capacity/queue")
async def queue() -> Response:
    await require_platform()
    return json_response(QueueList(await state().store.list_queue()))
