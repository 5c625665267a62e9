"""``GET /v1/audit``: the audit trail, filtered by run and type."""

from __future__ import annotations

from quart import Blueprint, Response, request

from ironflow.api.auth import require_org
from ironflow.api.errors import json_response, query_int
from ironflow.api.state import state
from ironflow.protocol import AuditList

bp = Blueprint("audit", __name__)


@bp.get("/v1/audit")
async def list_audit() -> Response:
    await require_org()
    events = await state().store.list_audit(
        run_id=request.args.get("run_id") or None,
        type=request.args.get("type") or None,
        limit=query_int("limit", 100),
    )
    return json_response(AuditList(events))
