"""Ingest-side flow control on the API (ironflow/store/flow.py): what an emit
answers about it, the worker ``Cancel`` a singleton's cancel sends, its
metrics, and ``GET /v1/debounces`` (the pending debounces)."""

from __future__ import annotations

from quart import Blueprint, Response, request

from ironflow.api.auth import require_org
from ironflow.api.errors import json_response, query_int
from ironflow.api.state import ApiState, state
from ironflow.engine import metrics
from ironflow.protocol import DebounceList, EmitResponse
from ironflow.store import IngestResult

bp = Blueprint("flow", __name__)


def emit_response(result: IngestResult) -> EmitResponse:
    """The emit's answer: the paused functions it did not start
    (ironflow/store/cron.py) and what flow control did per function."""
    if not result.flow:
        return EmitResponse(result.event_id, result.run_ids, result.duplicate, result.paused_function_ids)
    return EmitResponse(
        result.event_id, result.run_ids, result.duplicate, result.paused_function_ids,
        skipped=[n for n in result.flow if n.outcome == "skipped"],
        debounced=[n for n in result.flow if n.outcome == "debounced"],
        batched=[n for n in result.flow if n.outcome == "batched"],
    )


def after_ingest(st: ApiState, results: list[IngestResult]) -> None:
    """Count what flow control did. The runs a singleton cancelled are counted
    and their workers told with a cancel-on's (api/events.py
    ``cancelled_by_event``, store/cancel_on.py)."""
    for result in results:
        if result.duplicate:
            continue
        for note in result.flow:
            metrics.FLOW_EVENTS.labels(note.mechanism, note.outcome).inc()


@bp.get("/v1/debounces")
async def list_debounces() -> Response:
    await require_org()
    pending = await state().store.list_debounces(
        function_id=request.args.get("function") or None, limit=query_int("limit", 100)
    )
    return json_response(DebounceList(pending))
