"""``GET /v1/audit``: the audit trail, filtered by run and type, paged."""

from __future__ import annotations

from quart import Blueprint, Response, request

from ironflow.api.auth import require_org
from ironflow.api.errors import json_response
from ironflow.api.pages import page_request
from ironflow.api.state import state

bp = Blueprint("audit", __name__)


@bp.get("/v1/audit")
async def list_audit() -> Response:
    """The audit trail, oldest first, one page (ironflow/api/pages.py): no
    ``data`` unless ``?include=data``."""
    await require_org()
    page = await state().store.audit_page(
        page_request(100), run_id=request.args.get("run_id") or None, type=request.args.get("type") or None
    )
    return json_response(page)
