"""Pull workers: register, long-poll for jobs, and report over plain HTTP.

A session belongs to the worker that registered it: registration returns a
secret (stored hashed) that every later call must carry in the
``Ironflow-Session-Secret`` header. A streaming session's id, an unknown or
expired id and a wrong secret all answer the same 404 and change nothing.
"""

from __future__ import annotations

import logging
from typing import Any

import trio
from quart import Blueprint, Response, request

from actors import session as session_actor
from actors.directory import LocalSession, fresh_start
from actors.messages import kick
from ironflow import logs
from ironflow.api.auth import require_org
from ironflow.api.errors import decode, fail, json_response, optional_body
from ironflow.api.state import state
from ironflow.engine import metrics
from ironflow.protocol import (
    SESSION_SECRET_HEADER,
    EngineMessage,
    FencedResponse,
    Heartbeat,
    JobAck,
    JobCompleted,
    JobFailed,
    JobNack,
    JobYielded,
    PullPollRequest,
    PullPollResponse,
    Register,
    Registered,
    Shutdown,
    StepCompleted,
    StepFailed,
    WorkerMessage,
)
from ironflow.store import SessionInfo, SessionNotFound, StaleExecution
from ironflow.store.core import token_hash

log = logging.getLogger("ironflow.api")
bp = Blueprint("pull", __name__)

# Verified pull sessions kept in memory; past this the cache starts afresh
# (sessions that expire without a goodbye would otherwise accumulate).
PULL_SESSION_CACHE = 10_000


@bp.post("/v1/worker/register")
async def register() -> Response:
    await require_org()
    st = state()
    if st.deps.shutdown_requested.is_set():
        fail(503, "DRAINING", "this node is draining; register with another node")
    body = decode(await request.get_data(), Register)
    try:
        info = await session_actor.register(st.store, st.config, st.deps.node_id, body, "pull")
    except session_actor.RegistrationRefused as exc:
        fail(422, exc.code, str(exc))
    assert info.secret is not None
    st.pull_sessions[info.session_id] = (token_hash(info.secret), info)
    logs.event(
        log, logging.INFO, "session: pull worker registered",
        session_id=info.session_id, worker_id=body.worker_id,
    )
    t = st.config.timings
    answer = Registered(
        info.session_id,
        int(t.heartbeat_interval_s * 1000),
        int(t.lease_expiry_s * 1000),
        session_secret=info.secret,
        max_frame_bytes=st.config.max_frame_bytes,
    )
    return json_response(answer, 201)


async def owned_session(session_id: str) -> SessionInfo:
    """The pull session the caller proves it owns (its secret in the header), or a 404."""
    st = state()
    secret = request.headers.get(SESSION_SECRET_HEADER, "")
    digest = token_hash(secret) if secret else ""
    known = st.pull_sessions.get(session_id)
    if known is not None and secret and known[0] == digest:
        return known[1]
    found = await st.store.pull_session(session_id, secret) if secret else None
    if found is None:
        fail(404, "SESSION_NOT_FOUND", f"worker session {session_id} is unknown or expired; register again")
    if len(st.pull_sessions) >= PULL_SESSION_CACHE:
        st.pull_sessions.clear()
    st.pull_sessions[session_id] = (digest, found)
    return found


def _node_shutdown() -> Shutdown:
    """The Shutdown a pull poll carries while this node drains: the time left."""
    st = state()
    deadline = st.deps.directory.drain_deadline
    left = st.config.timings.drain_timeout_s if deadline is None else deadline - trio.current_time()
    # A positive deadline, or the worker would fall back to its own.
    return Shutdown("engine node shutting down", max(1, int(left * 1000)))


@bp.post("/v1/worker/sessions/<session_id>/poll")
async def poll(session_id: str) -> Response:
    await require_org()
    body = await optional_body(PullPollRequest)
    session = await owned_session(session_id)
    st = state()
    shutdown_requested = st.deps.shutdown_requested
    if shutdown_requested.is_set():
        # No new work during a node drain: the worker is told to drain.
        return json_response(PullPollResponse([], _node_shutdown()))
    wait_s = min(body.wait_s, st.config.timings.poll_max_wait_s)
    send, receive = trio.open_memory_channel[EngineMessage](body.max_jobs)
    jobs: list[Any] = []
    st.deps.directory.add(
        LocalSession(
            session_id, frozenset(session.function_ids), send, mode="pull",
            delayed_start=body.delayed_start,
        )
    )
    try:
        kick(st.deps.kicks, "pull poll")
        with trio.move_on_after(wait_s):
            async with trio.open_nursery() as waiting:

                async def answer_on_shutdown() -> None:
                    await shutdown_requested.wait()
                    waiting.cancel_scope.cancel()

                waiting.start_soon(answer_on_shutdown)
                jobs.append(await receive.receive())
                waiting.cancel_scope.cancel()
        # No checkpoint between draining and closing: the dispatcher cannot
        # slip an assignment into the buffer after we looked; a later send
        # fails and the dispatcher releases that reservation at once.
        while True:
            try:
                jobs.append(receive.receive_nowait())
            except trio.WouldBlock:
                break
    finally:
        st.deps.directory.remove(session_id, send)
        receive.close()
    # Jobs that were already on their way come back with the Shutdown: the
    # worker refuses them with JobNack(DRAINING), as a streaming worker does.
    shutdown = _node_shutdown() if shutdown_requested.is_set() else None
    now = trio.current_time()
    jobs = [fresh_start(a, st.deps.directory.db_clock, now) for a in jobs]
    return json_response(PullPollResponse(jobs, shutdown))


async def _apply(session_id: str, kinds: tuple[type, ...]) -> Response:
    """Apply one fenced message (or a heartbeat) of an accepted kind to the session."""
    await require_org()
    msg: WorkerMessage = decode(await request.get_data(), WorkerMessage)  # type: ignore[arg-type]
    if not isinstance(msg, kinds):
        expected = " or ".join(k.__name__ for k in kinds)
        fail(400, "VALIDATION_ERROR", f"{type(msg).__name__} is not accepted here; expected {expected}")
    await owned_session(session_id)
    st = state()
    try:
        if isinstance(msg, StepCompleted | JobCompleted | JobFailed | JobYielded | JobNack):
            budget = st.pull_budgets.get(session_id)
            if budget is None:
                if len(st.pull_budgets) >= PULL_SESSION_CACHE:
                    st.pull_budgets.clear()  # sessions gone without a goodbye: counted afresh
                budget = st.pull_budgets[session_id] = session_actor.RunStateBudget(
                    st.deps.directory, st.config.limits.max_run_state_bytes
                )
            applied = budget.check(msg, session_id)
            if applied[0] is not msg:
                for one in applied:  # the step's failure, then the job's
                    await session_actor.handle(st.store, st.config, session_id, one, st.deps.kicks)
                fail(409, session_actor.RUN_STATE_TOO_LARGE, applied[0].error.message)  # type: ignore[union-attr]
        answer = await session_actor.handle(st.store, st.config, session_id, msg, st.deps.kicks)
    except StaleExecution as exc:
        metrics.STALE_REFUSED.inc()
        fail(409, "STALE_EXECUTION", str(exc) or "stale execution: this segment was fenced")
    except SessionNotFound as exc:
        st.pull_sessions.pop(session_id, None)
        fail(404, "SESSION_NOT_FOUND", str(exc) or "worker session unknown or expired")
    except session_actor.ProtocolViolation as exc:
        fail(400, "PROTOCOL_ERROR", str(exc))
    return json_response(answer if answer is not None else FencedResponse())


@bp.post("/v1/worker/sessions/<session_id>/heartbeat")
async def heartbeat(session_id: str) -> Response:
    return await _apply(session_id, (Heartbeat,))


@bp.post("/v1/worker/sessions/<session_id>/ack")
async def ack(session_id: str) -> Response:
    return await _apply(session_id, (JobAck,))


@bp.post("/v1/worker/sessions/<session_id>/nack")
async def nack(session_id: str) -> Response:
    return await _apply(session_id, (JobNack,))


@bp.post("/v1/worker/sessions/<session_id>/steps")
async def steps(session_id: str) -> Response:
    return await _apply(session_id, (StepCompleted, StepFailed))


@bp.post("/v1/worker/sessions/<session_id>/result")
async def result(session_id: str) -> Response:
    return await _apply(session_id, (JobCompleted, JobFailed, JobYielded))


@bp.delete("/v1/worker/sessions/<session_id>")
async def goodbye(session_id: str) -> Response:
    await require_org()
    await owned_session(session_id)
    st = state()
    st.pull_sessions.pop(session_id, None)
    st.pull_budgets.pop(session_id, None)
    t = st.config.timings
    # A pull worker says goodbye after its jobs ended; anything it still
    # held is recovered now rather than at lease expiry.
    recovered = await st.store.close_session(
        session_id,
        recover_leases=True,
        recovery_grace_s=t.recovery_grace_s,
        recovery_ceiling=int(t.recovery_ceiling),
    )
    for seg in recovered:
        if seg.exhausted:
            metrics.run_ended("failed", seg.function_id, seg.duration_s)
    if recovered:
        kick(st.deps.kicks, "pull session closed")
    return json_response(FencedResponse())
