"""Runs: list, detail, cancel, and the operator's purge of old history."""

from __future__ import annotations

import logging

import trio
from quart import Blueprint, Response, request

from actors.messages import kick
from ironflow import logs, metrics, retention
from ironflow.api.auth import require_org, require_platform
from ironflow.api.errors import decode, json_response, optional_body, query_int
from ironflow.api.state import state
from ironflow.protocol import (
    TERMINAL_RUN_STATUSES,
    Cancel,
    CancelRequest,
    CancelResponse,
    PurgeRequest,
    PurgeResponse,
    RunList,
)

log = logging.getLogger("ironflow.api")
bp = Blueprint("runs", __name__)


@bp.get("/v1/runs")
async def list_runs() -> Response:
    await require_org()
    runs = await state().store.list_runs(
        status=request.args.get("status") or None,
        function_id=request.args.get("function") or None,
        limit=query_int("limit", 50),
    )
    return json_response(RunList(runs))


@bp.get("/v1/runs/<run_id>")
async def get_run(run_id: str) -> Response:
    await require_org()
    return json_response(await state().store.get_run(run_id))


@bp.post("/v1/runs/<run_id>/cancel")
async def cancel_run(run_id: str) -> Response:
    await require_org()
    body = await optional_body(CancelRequest)
    st = state()
    outcome = await st.store.cancel_run(run_id, body.reason)
    if outcome.session_id is not None and outcome.job_id is not None:
        local = st.deps.directory.get(outcome.session_id)
        if local is not None:
            try:
                local.outbox.send_nowait(Cancel(outcome.job_id, run_id, body.reason))
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the fence refuses anything the segment still sends
    metrics.RUNS_FINISHED.labels(status="cancelled").inc()
    logs.event(log, logging.INFO, "run: cancelled", run_id=run_id, session_id=outcome.session_id)
    kick(st.deps.kicks, "run cancelled")  # a parent waiting on this run may resume
    return json_response(CancelResponse(run_id))


@bp.post("/v1/runs/purge")
async def purge_runs() -> Response:
    caller = await require_platform()
    body = decode(await request.get_data(), PurgeRequest)
    st = state()
    counts = await retention.purge_pass(
        st.store,
        older_than_s=body.older_than_s,
        idempotency_window_s=st.config.idempotency_window_s,
        by=f"api:{caller.key_id}",
        statuses=frozenset(body.statuses) if body.statuses else TERMINAL_RUN_STATUSES,
        wait_for_lock=True,  # an operator asked now: wait out another node's batch
    )
    logs.event(
        log, logging.INFO, "runs: purged on request", key_id=caller.key_id,
        runs=counts.runs, steps=counts.steps, audit=counts.audit, events=counts.events,
    )
    answer = PurgeResponse(counts.runs, counts.steps, counts.audit, counts.events, body.older_than_s)
    return json_response(answer)
