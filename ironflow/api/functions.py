"""Functions: the live ones workers registered, and direct invocation."""

from __future__ import annotations

from quart import Blueprint, Response, request

from actors.messages import kick
from ironflow.api.auth import require_org
from ironflow.api.errors import json_response, optional_body
from ironflow.api.state import state
from ironflow.protocol import FunctionList, InvokeRequest, InvokeResponse

bp = Blueprint("functions", __name__)


@bp.get("/v1/functions")
async def list_functions() -> Response:
    await require_org()
    st = state()
    records = await st.store.list_functions(live_within_s=st.config.limits.function_live_s)
    if request.args.get("all", "").lower() not in ("1", "true", "yes"):
        records = [r for r in records if r.live]
    return json_response(FunctionList(records))


@bp.post("/v1/functions/<function_id>/invoke")
async def invoke(function_id: str) -> Response:
    await require_org()
    body = await optional_body(InvokeRequest)
    run_id = await state().store.invoke_function(function_id, body.data)
    kick(state().deps.kicks, "function invoked")
    return json_response(InvokeResponse(run_id), 201)
