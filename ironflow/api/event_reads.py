"""``GET /v1/events`` (recent events with their runs), ``GET /v1/events/{id}``
and ``POST /v1/runs/{id}/rerun`` (a new run of the same function with the
same event): the reads and the action behind the dashboard's events view and
its re-run button."""

from __future__ import annotations

import logging

from quart import Blueprint, Response, request

from actors.messages import kick
from ironflow import logs
from ironflow.api.auth import require_org
from ironflow.api.errors import json_response
from ironflow.api.pages import page_request
from ironflow.api.state import state
from ironflow.protocol import RerunResponse

log = logging.getLogger("ironflow.api")
bp = Blueprint("event_reads", __name__)


@bp.get("/v1/events")
async def list_events() -> Response:
    """Stored events, newest first, one page (ironflow/api/pages.py): no
    ``data`` unless ``?include=data``; ``GET /v1/events/{id}`` has it."""
    await require_org()
    page = await state().store.events_page(page_request(50), name=request.args.get("name") or None)
    return json_response(page)


@bp.get("/v1/events/<event_id>")
async def get_event(event_id: str) -> Response:
    await require_org()
    return json_response(await state().store.get_event(event_id))


@bp.post("/v1/runs/<run_id>/rerun")
async def rerun(run_id: str) -> Response:
    await require_org()
    st = state()
    new_run_id, event_id = await st.store.rerun(run_id)
    logs.event(log, logging.INFO, "run: re-run", run_id=new_run_id, rerun_of=run_id, event_id=event_id)
    kick(st.deps.kicks, "run re-run")
    return json_response(RerunResponse(new_run_id, run_id, event_id), 201)
