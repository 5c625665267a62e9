"""Functions: those workers registered, direct invocation, pause/resume, delete."""

from __future__ import annotations

from quart import Blueprint, Response, request

from actors.messages import kick
from ironflow.api.auth import require_org
from ironflow.api.errors import json_response, optional_body
from ironflow.api.state import state
from ironflow.protocol import (
    DeleteFunctionResponse,
    FunctionList,
    InvokeRequest,
    InvokeResponse,
    PauseResponse,
    ResumeFunctionRequest,
)
from ironflow.store import Principal

bp = Blueprint("functions", __name__)


@bp.get("/v1/functions")
async def list_functions() -> Response:
    await require_org()
    st = state()
    records = await st.store.list_functions(live_within_s=st.config.limits.function_live_s)
    if request.args.get("all", "").lower() not in ("1", "true", "yes"):
        # Not live ones stay listed (a schedule skipping ticks is what an
        # operator must see); deleted ones only when asked.
        records = [r for r in records if r.deleted_at is None]
    return json_response(FunctionList(records))


@bp.post("/v1/functions/<function_id>/invoke")
async def invoke(function_id: str) -> Response:
    await require_org()
    body = await optional_body(InvokeRequest)
    run_id = await state().store.invoke_function(function_id, body.data)
    kick(state().deps.kicks, "function invoked")
    return json_response(InvokeResponse(run_id), 201)


# ── function pause/resume (docs/schedules.md) ──


def _by(principal: Principal | None) -> str:
    """Who did it, for the audit record: the key's id (``dev`` without a key)."""
    return "dev" if principal is None else principal.key_id


@bp.delete("/v1/functions/<function_id>")
async def delete(function_id: str) -> Response:
    """No new runs from its events or ticks; runs in flight finish; a worker
    registering it restores it (ironflow/store/function_life.py)."""
    principal = await require_org()
    changed = await state().store.delete_function(function_id, by=_by(principal))
    return json_response(DeleteFunctionResponse(function_id, deleted=True, changed=changed))


@bp.post("/v1/functions/<function_id>/pause")
async def pause(function_id: str) -> Response:
    principal = await require_org()
    changed = await state().store.pause_function(function_id, by=_by(principal))
    return json_response(PauseResponse(function_id, paused=True, changed=changed))


@bp.post("/v1/functions/<function_id>/resume")
async def resume(function_id: str) -> Response:
    principal = await require_org()
    body = await optional_body(ResumeFunctionRequest)
    st = state()
    was_paused, run_id = await st.store.resume_function(
        function_id, catchup=body.catchup, by=_by(principal), node_id=st.deps.node_id
    )
    if run_id is not None:
        kick(st.deps.kicks, "function resumed with catch-up")
    return json_response(
        PauseResponse(function_id, paused=False, changed=was_paused, catchup_run_id=run_id)
    )
