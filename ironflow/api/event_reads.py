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
from ironflow.api.errors import json_response, query_int
from ironflow.api.state import state
from ironflow.protocol import EventList, RerunResponse

log = logging.getLogger("ironflow.api")
bp = Blueprint("event_reads", __name__)


@bp.get("/v1/events")
async def list_events() -> Response:
    await require_org()
    events = await state().store.list_events(
        name=request.args.get("name") or None, limit=query_int("limit", 50)
    )
    return json_response(EventList(events))


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
