"""``POST /v1/events`` and ``/v1/events/batch``: events in, runs started."""

from __future__ import annotations

import logging

from quart import Blueprint, Response, request

from actors.messages import kick
from ironflow import logs, tracing
from ironflow.api import flow
from ironflow.api.auth import require_org
from ironflow.api.errors import decode, json_response
from ironflow.api.state import ApiState, state
from ironflow.engine import metrics
from ironflow.protocol import EmitBatchRequest, EmitBatchResponse, EmitRequest, EmitResponse
from ironflow.store import IngestResult

log = logging.getLogger("ironflow.api")
bp = Blueprint("events", __name__)


@bp.post("/v1/events")
async def emit() -> Response:
    await require_org()
    answer, status = await ingest_one(
        state(), await request.get_data(), request.headers.get("traceparent")
    )
    return json_response(answer, status)


async def ingest_one(
    st: ApiState, raw: bytes | str, traceparent: str | None = None
) -> tuple[EmitResponse, int]:
    """One emit: decode the body, ingest it, kick the dispatcher; the answer and
    its status (201 new, 200 a duplicate inside the idempotency window).
    Shared by the route above and the framework-free hot path (``hot``).

    ``traceparent``: the request's header; the body's field wins. The event
    records the ``ironflow.ingest`` span's, when there is one (ironflow/tracing.py).
    """
    body = decode(raw, EmitRequest)
    producer = body.traceparent or traceparent
    if producer is None and not tracing.enabled():
        return await _ingested(st, body, None)
    with tracing.span(
        "ironflow.ingest", producer, {"ironflow.event.name": body.name}, kind=tracing.SpanKind.CONSUMER
    ) as span:
        answer, status = await _ingested(st, body, tracing.traceparent_of(span))
        span.set_attribute("ironflow.event.id", answer.event_id)
        span.set_attribute("ironflow.run_ids", answer.run_ids)
        return answer, status


async def _ingested(
    st: ApiState, body: EmitRequest, traceparent: str | None
) -> tuple[EmitResponse, int]:
    grouped = body.idempotency_key is None
    if grouped:
        # With the emits that arrive alongside (the group kicks the dispatcher,
        # or hands its runs out itself: ApiState._ingest_group).
        result = await st.emits((body.name, body.data, traceparent))
    elif traceparent is None:
        result = await st.store.ingest_event(
            body.name, body.data, body.idempotency_key, idempotency_window_s=st.config.idempotency_window_s
        )
    else:
        [result] = await st.store.ingest_traced_events(
            [(body.name, body.data, body.idempotency_key, traceparent)],
            idempotency_window_s=st.config.idempotency_window_s,
        )
    if not result.duplicate:
        metrics.EVENTS_EMITTED.inc()
        # New runs, and parked runs whose wait_for_event this event matched.
        if not grouped and (result.run_ids or result.resumed_run_ids):
            kick(st.deps.kicks, "event ingested")
        cancelled_by_event(st, result)
    logs.event(
        log, logging.DEBUG, "event: ingested",
        event_id=result.event_id, runs=len(result.run_ids), duplicate=result.duplicate,
    )
    if result.flow:
        flow.after_ingest(st, [result])
    answer = flow.emit_response(result)
    return answer, 200 if result.duplicate else 201


def cancelled_by_event(st: ApiState, result: IngestResult) -> None:
    """Runs the event cancelled (cancel_on): counted, logged, a slot freed (the
    store told their workers: ironflow/store/cancel_on.py)."""
    for outcome in result.cancelled:
        if not outcome.compensating:  # a compensating run ends once its undos ran
            metrics.run_ended("cancelled", outcome.function_id, outcome.duration_s)
        logs.event(
            log, logging.INFO, "run: cancelled by event",
            run_id=outcome.run_id, event_id=result.event_id, session_id=outcome.session_id,
            compensating=outcome.compensating or None,
        )
    if result.cancelled:
        kick(st.deps.kicks, "run cancelled by event")


@bp.post("/v1/events/batch")
async def emit_batch() -> Response:
    await require_org()
    body = decode(await request.get_data(), EmitBatchRequest)
    st = state()
    results = await st.store.ingest_events(
        [(e.name, e.data, e.idempotency_key) for e in body.events],
        idempotency_window_s=st.config.idempotency_window_s,
    )
    fresh = [r for r in results if not r.duplicate]
    metrics.EVENTS_EMITTED.inc(len(fresh))
    for result in fresh:
        cancelled_by_event(st, result)
    if any(r.run_ids or r.resumed_run_ids for r in fresh):
        kick(st.deps.kicks, "events ingested")
    flow.after_ingest(st, results)
    answers = [flow.emit_response(r) for r in results]
    return json_response(EmitBatchResponse(answers), 201)
