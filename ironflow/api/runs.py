"""Runs: list, detail, cancel, run control (resume, bulk resume, pause), and
the operator's purge of old history."""

from __future__ import annotations

import logging

import trio
from quart import Blueprint, Response, request

from actors.messages import kick
from ironflow import logs
from ironflow.api.auth import require_org, require_platform
from ironflow.api.errors import decode, fail, json_response, optional_body, query_float
from ironflow.api.pages import page_request
from ironflow.api.state import ApiState, state
from ironflow.engine import metrics
from ironflow.protocol import (
    TERMINAL_RUN_STATUSES,
    CancelRequest,
    CancelResponse,
    PurgeRequest,
    PurgeResponse,
    RunResult,
)
from ironflow.protocol.run_control import (
    BulkResumeRequest,
    BulkResumeResponse,
    ResumeRequest,
    ResumeResponse,
    RunPauseResponse,
)
from ironflow.store import retention
from ironflow.store.records import ResumeOutcome

log = logging.getLogger("ironflow.api")
bp = Blueprint("runs", __name__)

# Longest a result request is held open; a client wanting longer asks again.
MAX_RESULT_WAIT_S = 300.0


@bp.get("/v1/runs")
async def list_runs() -> Response:
    """Runs, newest first, one page (ironflow/api/pages.py): no ``output``
    (nor an error's traceback) unless ``?include=data``; the run's GET has them."""
    await require_org()
    page = await state().store.runs_page(
        page_request(50),
        status=request.args.get("status") or None,
        function_id=request.args.get("function") or None,
    )
    return json_response(page)


@bp.get("/v1/runs/<run_id>")
async def get_run(run_id: str) -> Response:
    await require_org()
    return json_response(await state().store.get_run(run_id))


@bp.get("/v1/runs/<run_id>/step-output")
async def step_output(run_id: str) -> Response:
    """A completed step's output (``?step_id=``): what a worker reads when its
    assignment left the output out (``MemoStep.output_omitted``)."""
    await require_org()
    step_id = request.args.get("step_id")
    if not step_id:
        fail(400, "BAD_REQUEST", "step_id is required: /v1/runs/{run_id}/step-output?step_id=...")
    text = await state().store.step_output(run_id, step_id)
    return Response(text, status=200, content_type="application/json")


@bp.get("/v1/runs/<run_id>/result")
async def run_result(run_id: str) -> Response:
    """The run's output or error as soon as it ends (held open up to ``wait_s``)."""
    await require_org()
    wait_s = query_float("wait_s", 0.0, low=0.0, high=MAX_RESULT_WAIT_S)
    answer, status = await await_result(state(), run_id, wait_s)
    return json_response(answer, status)


async def await_result(st: ApiState, run_id: str, wait_s: float) -> tuple[RunResult, int]:
    """The run's result and 200 as soon as it ends, or its status and 202 if it
    has not ended within ``wait_s``. Shared by the route above and the
    framework-free hot path (``hot``). RunNotFound for an unknown run; a 429
    past ``limits.max_held_waits`` when it would be held (``wait_s`` > 0)."""
    if wait_s <= 0:
        return await _result(st, run_id, trio.current_time())
    with st.held_waits.hold():
        return await _result(st, run_id, trio.current_time() + wait_s)


async def _result(st: ApiState, run_id: str, deadline: float) -> tuple[RunResult, int]:
    while True:
        with st.run_waiters.watch(run_id) as waiter:
            run = await st.store.get_run_record(run_id)
            if run.status in TERMINAL_RUN_STATUSES:
                return RunResult(run.id, run.status, True, run.output, run.error), 200
            remaining = deadline - trio.current_time()
            if remaining <= 0:
                return RunResult(run.id, run.status, False), 202
            # Woken the moment this node ends the run; the re-read backstop covers
            # a run ended by another node.
            with trio.move_on_after(min(remaining, st.config.timings.result_recheck_s)):
                await waiter.ended.wait()
            if waiter.result is not None:
                # The commit that completed the run said how: no read back.
                return waiter.result, 200


@bp.post("/v1/runs/<run_id>/cancel")
async def cancel_run(run_id: str) -> Response:
    await require_org()
    body = await optional_body(CancelRequest)
    st = state()
    outcome = await st.store.cancel_run(run_id, body.reason)
    if outcome.session_id is not None and outcome.job_id is not None:
        # A streaming worker attached here is told; the fence refuses anything
        # the segment still sends, wherever its worker is.
        st.deps.directory.send_cancel(outcome.session_id, outcome.job_id, run_id, body.reason)
    if outcome.compensating:  # its undos run first (store/compensation.py)
        logs.event(log, logging.INFO, "run: cancelled, compensating", run_id=run_id, session_id=outcome.session_id)
        kick(st.deps.kicks, "run compensating")
        return json_response(CancelResponse(run_id, "waiting", compensating=True))
    metrics.run_ended("cancelled", outcome.function_id, outcome.duration_s)
    logs.event(log, logging.INFO, "run: cancelled", run_id=run_id, session_id=outcome.session_id)
    kick(st.deps.kicks, "run cancelled")  # a parent waiting on this run may resume
    return json_response(CancelResponse(run_id))


# ── run control (ironflow/store/run_control.py, docs/run-control.md) ──


def _resumed(out: ResumeOutcome) -> ResumeResponse:
    return ResumeResponse(
        out.run_id, out.function_id, out.execution_seq, out.resumed_from, out.from_step, out.steps_deleted,
        out.status,
    )


@bp.post("/v1/runs/<run_id>/resume")
async def resume_run(run_id: str) -> Response:
    """A failed run again from its failed step (or ``from_step``), or a paused run."""
    await require_org()
    body = await optional_body(ResumeRequest)
    st = state()
    out = await st.store.resume_run(run_id, body.from_step)
    logs.event(log, logging.INFO, "run: resumed", run_id=run_id, from_step=out.from_step)
    kick(st.deps.kicks, "run resumed")
    return json_response(_resumed(out))


@bp.post("/v1/runs/resume")
async def resume_runs() -> Response:
    """Bulk: the runs that failed in the last ``since_s`` seconds, one page."""
    await require_org()
    body = decode(await request.get_data(), BulkResumeRequest)
    st = state()
    resumed, cursor = await st.store.resume_failed_runs(
        function_id=body.function_id, since_s=body.since_s, limit=body.limit, cursor=body.cursor
    )
    logs.event(log, logging.INFO, "runs: resumed in bulk", function_id=body.function_id, runs=len(resumed))
    if resumed:
        kick(st.deps.kicks, "runs resumed")
    return json_response(BulkResumeResponse([_resumed(o) for o in resumed], cursor))


@bp.post("/v1/runs/<run_id>/pause")
async def pause_run(run_id: str) -> Response:
    """Off the queue; a running segment is fenced (its next write is refused)."""
    await require_org()
    out = await state().store.pause_run(run_id)
    logs.event(log, logging.INFO, "run: paused", run_id=run_id, session_id=out.session_id)
    return json_response(RunPauseResponse(run_id))


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
