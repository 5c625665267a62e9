"""``GET /openapi.json``: the OpenAPI 3.1 description of this API, generated.

The schemas come from the typed contract (``ironflow.protocol``) through
``msgspec.json.schema_components``; what each route takes and answers is the
route table :data:`ROUTES` below, one :class:`Route` per method and path. A
test compares the table with the routes the app really serves, so a route
added without a line here (or a line left for a route that is gone) fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal

import msgspec
from quart import Blueprint, Response

from ironflow import protocol as p
from ironflow.protocol import run_control as rc

bp = Blueprint("openapi", __name__)

OPENAPI_VERSION = "3.1.0"
# Where ``$ref``s point inside the document.
REF_TEMPLATE = "#/components/schemas/{name}"

Auth = Literal["none", "org", "platform", "session"]


@dataclass(frozen=True)
class Query:
    """One query parameter: its name, JSON Schema and meaning."""

    name: str
    schema: dict[str, Any]
    description: str


@dataclass(frozen=True)
class Route:
    """What one method on one path takes and answers.

    ``path`` is written the OpenAPI way (``/v1/runs/{run_id}``). ``body`` and
    the values of ``answers`` are protocol types (a Struct or a union of
    them); ``None`` in ``answers`` means a non-JSON answer described by
    ``media``.
    """

    method: str
    path: str
    summary: str
    auth: Auth
    answers: dict[int, Any]
    body: Any = None
    body_required: bool = True
    query: tuple[Query, ...] = ()
    media: str = "application/json"
    websocket: bool = False
    tags: tuple[str, ...] = field(default=())


_LIMIT = Query("limit", {"type": "integer", "minimum": 1, "maximum": 1000}, "at most this many")
# A list route's paging (ironflow/api/pages.py): rows, the cursor, the payloads.
_PAGE = (
    Query("limit", {"type": "integer", "minimum": 1, "maximum": 1000},
          "at most this many rows (and limits.max_page_bytes of records)"),
    Query("cursor", {"type": "string"}, "the next_cursor of the page before"),
    Query("include", {"type": "string", "enum": ["data"]}, "data: the payloads a list leaves out"),
)
_WORKER_FRAMES = "Streaming-worker frames (see docs/http-api.md); each is one tagged JSON text frame"

# Every route the node serves. Keep in step with the blueprints (a test checks).
ROUTES: tuple[Route, ...] = (
    Route("get", "/", "The dashboard (HTML)", "none", {200: None}, media="text/html",
          tags=("dashboard",)),
    Route("get", "/dashboard/{filename}", "The dashboard's script and style sheet", "none",
          {200: None}, media="application/octet-stream", tags=("dashboard",)),
    Route("get", "/healthz", "Liveness", "none", {200: p.Health}, tags=("health",)),
    Route("get", "/readyz", "Readiness: 503 while starting or draining", "none",
          {200: p.Health, 503: p.Health}, tags=("health",)),
    Route("get", "/metrics", "Prometheus text exposition", "none", {200: None},
          media="text/plain", tags=("health",)),
    Route("get", "/openapi.json", "This document", "none", {200: None}, tags=("health",)),
    Route("post", "/v1/events", "Emit an event; starts the runs it triggers", "org",
          {201: p.EmitResponse, 200: p.EmitResponse}, body=p.EmitRequest, tags=("events",)),
    Route("post", "/v1/events/batch", "Emit up to 1000 events in one transaction", "org",
          {201: p.EmitBatchResponse}, body=p.EmitBatchRequest, tags=("events",)),
    Route("get", "/v1/events", "Stored events, newest first, with the runs each started", "org",
          {200: p.EventList},
          query=(Query("name", {"type": "string"}, "only events of this name"), *_PAGE),
          tags=("events",)),
    Route("get", "/v1/events/{event_id}", "One stored event", "org", {200: p.EventRecord},
          tags=("events",)),
    # Ingest-side flow control (ironflow/api/flow.py).
    Route("get", "/v1/debounces", "Pending debounces, soonest first", "org", {200: p.DebounceList},
          query=(Query("function", {"type": "string"}, "only debounces of this function id"),
                 _LIMIT), tags=("events",)),
    Route("post", "/v1/runs/{run_id}/rerun", "A new run of the same function with the same event",
          "org", {201: p.RerunResponse}, tags=("runs",)),
    Route("get", "/v1/runs", "Runs, newest first", "org", {200: p.RunList},
          query=(Query("status", {"type": "string"}, "only runs in this status"),
                 Query("function", {"type": "string"}, "only runs of this function id"),
                 *_PAGE), tags=("runs",)),
    Route("get", "/v1/runs/{run_id}", "A run with its steps, queue entry, lease and why it waits",
          "org", {200: p.RunDetail}, tags=("runs",)),
    Route("get", "/v1/runs/{run_id}/result",
          "The run's outcome, held open up to wait_s and answered the moment it ends",
          "org", {200: p.RunResult, 202: p.RunResult},
          query=(Query("wait_s", {"type": "number", "minimum": 0, "maximum": 300},
                       "how long the node may hold the request (default 0)"),),
          tags=("runs",)),
    Route("get", "/v1/runs/{run_id}/step-output",
          "A completed step's output: what a worker reads when its assignment left it out",
          "org", {200: None}, media="application/json",
          query=(Query("step_id", {"type": "string"}, "the step's id (MemoStep.step_id)"),),
          tags=("runs",)),
    Route("post", "/v1/runs/{run_id}/cancel", "Cancel a run that has not ended", "org",
          {200: p.CancelResponse}, body=p.CancelRequest, body_required=False, tags=("runs",)),
    # run control (docs/run-control.md)
    Route("post", "/v1/runs/{run_id}/resume",
          "Resume a failed run from its failed step (or from_step), or a paused run", "org",
          {200: rc.ResumeResponse}, body=rc.ResumeRequest, body_required=False, tags=("runs",)),
    Route("post", "/v1/runs/resume", "Resume the runs that failed in the last since_s, one page",
          "org", {200: rc.BulkResumeResponse}, body=rc.BulkResumeRequest, tags=("runs",)),
    Route("post", "/v1/runs/{run_id}/pause", "Pause a run at its next step boundary", "org",
          {200: rc.RunPauseResponse}, tags=("runs",)),
    Route("post", "/v1/runs/purge", "Delete finished history now (platform only)", "platform",
          {200: p.PurgeResponse}, body=p.PurgeRequest, tags=("runs",)),
    Route("get", "/v1/stats/runs", "Recent runs by status, per time bucket and per function",
          "org", {200: p.RunStats},
          query=(Query("window_s", {"type": "integer", "minimum": 60, "maximum": 86400},
                       "how far back (default 3600)"),
                 Query("bucket_s", {"type": "integer", "minimum": 10, "maximum": 86400},
                       "bucket width (default 60; at most 1440 buckets)")),
          tags=("runs",)),
    Route("get", "/v1/functions", "Registered functions, live or not (deleted ones with all=true)",
          "org", {200: p.FunctionList},
          query=(Query("all", {"type": "string"}, "true: deleted functions too"),),
          tags=("functions",)),
    Route("delete", "/v1/functions/{function_id}",
          "Delete a function: no new runs; runs in flight finish; a worker registering it restores it",
          "org", {200: p.DeleteFunctionResponse}, tags=("functions",)),
    Route("post", "/v1/functions/{function_id}/invoke", "Start a run of a function directly",
          "org", {201: p.InvokeResponse}, body=p.InvokeRequest, body_required=False,
          tags=("functions",)),
    # Function pause/resume (docs/schedules.md).
    Route("post", "/v1/functions/{function_id}/pause",
          "Pause a function: its events and cron ticks start no run", "org",
          {200: p.PauseResponse}, tags=("functions",)),
    Route("post", "/v1/functions/{function_id}/resume",
          "Resume a paused function; catchup: a run for the latest tick skipped while paused",
          "org", {200: p.PauseResponse}, body=p.ResumeFunctionRequest, body_required=False,
          tags=("functions",)),
    Route("get", "/v1/audit", "The audit trail", "org", {200: p.AuditList},
          query=(Query("run_id", {"type": "string"}, "only entries of this run"),
                 Query("type", {"type": "string"}, "only entries of this type"),
                 *_PAGE), tags=("audit",)),
    Route("post", "/v1/keys", "Mint an API key", "org", {201: p.KeyCreateResponse},
          body=p.KeyCreateRequest, body_required=False, tags=("keys",)),
    Route("get", "/v1/capacity/leases", "Concurrency leases (platform only)", "platform",
          {200: p.LeaseList}, tags=("capacity",)),
    Route("get", "/v1/capacity/sessions", "Worker sessions (platform only)", "platform",
          {200: p.SessionList}, tags=("capacity",)),
    Route("get", "/v1/capacity/queue", "The dispatch queue (platform only)", "platform",
          {200: p.QueueList}, tags=("capacity",)),
    Route("get", "/v1/chaos/actors",
          "Supervised actors and their restarts (platform only; a --chaos node, else 404)",
          "platform", {200: p.ActorList}, tags=("chaos",)),
    Route("post", "/v1/chaos/crash",
          "Crash one actor now (platform only; a --chaos node, else 404)", "platform",
          {202: p.ActorList}, body=p.ChaosCrashRequest, tags=("chaos",)),
    Route("post", "/v1/worker/register", "Register a pull worker session", "org",
          {201: p.Registered}, body=p.Register, tags=("pull workers",)),
    Route("post", "/v1/worker/sessions/{session_id}/poll", "Long-poll for job assignments",
          "session", {200: p.PullPollResponse}, body=p.PullPollRequest, body_required=False,
          tags=("pull workers",)),
    Route("post", "/v1/worker/sessions/{session_id}/heartbeat", "Refresh the session's leases",
          "session", {200: p.LeaseStatus}, body=p.Heartbeat, tags=("pull workers",)),
    Route("post", "/v1/worker/sessions/{session_id}/ack", "Accept an assignment", "session",
          {200: p.FencedResponse}, body=p.JobAck, tags=("pull workers",)),
    Route("post", "/v1/worker/sessions/{session_id}/nack", "Refuse an assignment", "session",
          {200: p.FencedResponse}, body=p.JobNack, tags=("pull workers",)),
    Route("post", "/v1/worker/sessions/{session_id}/steps", "Report a step's result", "session",
          {200: p.FencedResponse}, body=p.StepCompleted | p.StepFailed, tags=("pull workers",)),
    Route("post", "/v1/worker/sessions/{session_id}/result", "Report a segment's end", "session",
          {200: p.FencedResponse}, body=p.JobCompleted | p.JobFailed | p.JobYielded,
          tags=("pull workers",)),
    Route("delete", "/v1/worker/sessions/{session_id}", "Close a pull session", "session",
          {200: p.FencedResponse}, tags=("pull workers",)),
    Route("get", "/v1/worker", "The streaming-worker websocket (upgrade required)", "org",
          {101: None}, websocket=True, tags=("streaming workers",)),
)

_SECURITY: dict[Auth, list[dict[str, list[str]]]] = {
    "none": [],
    "org": [{"bearer": []}],
    "platform": [{"bearer": []}],
    "session": [{"bearer": [], "sessionSecret": []}],
}


def _types(routes: tuple[Route, ...]) -> list[Any]:
    """Every protocol type the routes mention, in a stable order."""
    found: list[Any] = [p.ApiError, p.WorkerMessage, p.EngineMessage]
    for route in routes:
        for kind in (route.body, *route.answers.values()):
            if kind is not None and kind not in found:
                found.append(kind)
    return found


def _path_parameters(path: str) -> list[dict[str, Any]]:
    names = [part[1:-1] for part in path.split("/") if part.startswith("{")]
    return [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in names]


def _operation_id(route: Route) -> str:
    """``get_v1_runs_run_id`` for ``GET /v1/runs/{run_id}``; ``get_index`` for ``/``."""
    words = route.path.strip("/").replace("{", "").replace("}", "").replace(".", "_").split("/")
    return "_".join([route.method, *(w for w in words if w)]) if any(words) else f"{route.method}_index"


def _operation(route: Route, schema_of: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    responses: dict[str, Any] = {}
    for status, kind in sorted(route.answers.items()):
        answer: dict[str, Any] = {"description": route.summary if status < 300 else "see body"}
        if route.websocket:
            answer["description"] = "Switching Protocols: " + _WORKER_FRAMES
        elif kind is None:
            # Untyped: a JSON answer is still an object (this document), anything else text.
            untyped = {"type": "object"} if route.media == "application/json" else {"type": "string"}
            answer["content"] = {route.media: {"schema": untyped}}
        else:
            answer["content"] = {"application/json": {"schema": schema_of[kind]}}
        responses[str(status)] = answer
    responses["default"] = {
        "description": "An error: a stable code and a human message",
        "content": {"application/json": {"schema": schema_of[p.ApiError]}},
    }
    op: dict[str, Any] = {
        "summary": route.summary,
        "operationId": _operation_id(route),
        "tags": list(route.tags),
        "security": _SECURITY[route.auth],
        "responses": responses,
    }
    params = _path_parameters(route.path)
    params += [{"name": q.name, "in": "query", "required": False, "schema": q.schema,
                "description": q.description} for q in route.query]
    if params:
        op["parameters"] = params
    if route.body is not None:
        op["requestBody"] = {
            "required": route.body_required,
            "content": {"application/json": {"schema": schema_of[route.body]}},
        }
    if route.websocket:
        op["x-websocket"] = {
            "client-messages": schema_of[p.WorkerMessage],
            "server-messages": schema_of[p.EngineMessage],
        }
    return op


def build_document(routes: tuple[Route, ...] = ROUTES) -> dict[str, Any]:
    """The OpenAPI 3.1 document for ``routes``, schemas generated from their types."""
    kinds = _types(routes)
    schemas, components = msgspec.json.schema_components(kinds, ref_template=REF_TEMPLATE)
    schema_of = dict(zip(kinds, schemas, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method] = _operation(route, schema_of)
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "Ironflow engine node",
            "version": _package_version(),
            "description": "Events, runs, functions, capacity and workers. "
            "Generated from ironflow.protocol; see docs/http-api.md.",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer",
                           "description": "an org key (ifkey_…) or a platform key (ifplatform_…)"},
                "sessionSecret": {"type": "apiKey", "in": "header", "name": p.SESSION_SECRET_HEADER},
            },
        },
    }


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ironflow-py")
    except PackageNotFoundError:
        return "0"


@cache
def _encoded() -> bytes:
    return msgspec.json.encode(build_document())


@bp.get("/openapi.json")
async def openapi_json() -> Response:
    return Response(_encoded(), content_type="application/json")
