"""The ``/v1`` calls a client makes: method, path, body and the answer's type.

Each function here describes one endpoint call as a :class:`Call`; the async
:class:`~ironflow.sdk.client.Ironflow` and the sync
:class:`~ironflow.sdk.client.IronflowSync` send the same descriptions, so the
two clients cannot disagree on a path, a body or how an answer is decoded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

import msgspec

from ironflow.protocol import (
    AuditList,
    CancelRequest,
    CancelResponse,
    DebounceList,
    DeleteFunctionResponse,
    EmitRequest,
    EmitResponse,
    EventList,
    FinishedRunStatus,
    FunctionList,
    InvokeRequest,
    InvokeResponse,
    KeyCreateRequest,
    KeyCreateResponse,
    LeaseList,
    PauseResponse,
    PurgeRequest,
    PurgeResponse,
    QueueList,
    ResumeFunctionRequest,
    RunDetail,
    RunList,
    RunResult,
    SessionList,
    encoder,
)
from ironflow.protocol.run_control import (
    BulkResumeRequest,
    BulkResumeResponse,
    ResumeRequest,
    ResumeResponse,
    RunPauseResponse,
)

T = TypeVar("T")


class Call(msgspec.Struct, Generic[T], frozen=True):
    """One request to a node and the type its answer decodes into.

    ``params`` with a ``None`` value are left out of the query string.
    """

    method: str
    path: str
    answer: type[T]
    body: msgspec.Struct | None = None
    params: Mapping[str, Any] = {}
    # Seconds the answer may take (a held-open result wait); None: the client's default.
    timeout: float | None = None

    def content(self) -> bytes | None:
        """The body as JSON, its ``None`` fields left out.

        Every optional field of a request body defaults to ``None`` on the
        API's side, so leaving it out says the same thing and keeps the body
        as a person would write it.
        """
        if self.body is None:
            return None
        fields = msgspec.structs.asdict(self.body)
        return encoder.encode({k: v for k, v in fields.items() if v is not None})

    def query(self) -> dict[str, Any]:
        return {k: v for k, v in self.params.items() if v is not None}

    def decode(self, content: bytes) -> T:
        """The answer as ``self.answer``; ``msgspec.DecodeError`` if it is not one."""
        return msgspec.json.decode(content, type=self.answer)


class Answer(msgspec.Struct, Generic[T], frozen=True):
    """A decoded answer with the bytes it came from (the API's own JSON)."""

    value: T
    content: bytes


def emit(
    name: str, data: Any = None, idempotency_key: str | None = None, traceparent: str | None = None
) -> Call[EmitResponse]:
    """``traceparent``: the producer's span (W3C), which the run's trace joins."""
    body = EmitRequest(
        name=name, data={} if data is None else data, idempotency_key=idempotency_key,
        traceparent=traceparent,
    )
    return Call("POST", "/v1/events", EmitResponse, body)


def get_run(run_id: str) -> Call[RunDetail]:
    return Call("GET", f"/v1/runs/{run_id}", RunDetail)


# Longest one result request is held open by the node; longer waits are several requests.
RESULT_WAIT_MAX_S = 60.0
# Added to a held-open request's timeout: the node answers at wait_s, plus transit.
RESULT_TIMEOUT_SLACK_S = 10.0


def run_result(run_id: str, wait_s: float) -> Call[RunResult]:
    """The run's outcome: 200 once it ended, 202 with its status if not within ``wait_s``."""
    wait_s = max(0.0, min(wait_s, RESULT_WAIT_MAX_S))
    return Call(
        "GET", f"/v1/runs/{run_id}/result", RunResult,
        params={"wait_s": wait_s}, timeout=wait_s + RESULT_TIMEOUT_SLACK_S,
    )


def _include(include_data: bool) -> str | None:
    """The ``include`` query parameter of a list: its payloads, or none (the default)."""
    return "data" if include_data else None


def list_runs(
    *, status: str | None = None, function: str | None = None, limit: int | None = None,
    cursor: str | None = None, include_data: bool = False,
) -> Call[RunList]:
    """One page of runs, newest first (``cursor``: the page before's ``next_cursor``)."""
    params = {
        "status": status, "function": function, "limit": limit, "cursor": cursor,
        "include": _include(include_data),
    }
    return Call("GET", "/v1/runs", RunList, params=params)


def list_events(
    *, name: str | None = None, limit: int | None = None, cursor: str | None = None,
    include_data: bool = False,
) -> Call[EventList]:
    """One page of stored events, newest first."""
    params = {"name": name, "limit": limit, "cursor": cursor, "include": _include(include_data)}
    return Call("GET", "/v1/events", EventList, params=params)


def cancel_run(run_id: str, reason: str | None = None) -> Call[CancelResponse]:
    body = CancelRequest() if reason is None else CancelRequest(reason=reason)
    return Call("POST", f"/v1/runs/{run_id}/cancel", CancelResponse, body)


# ── run control (docs/run-control.md) ──


def resume_run(run_id: str, from_step: str | None = None) -> Call[ResumeResponse]:
    return Call("POST", f"/v1/runs/{run_id}/resume", ResumeResponse, ResumeRequest(from_step=from_step))


def resume_runs(
    since_s: float, *, function_id: str | None = None, limit: int = 100, cursor: str | None = None
) -> Call[BulkResumeResponse]:
    body = BulkResumeRequest(since_s=since_s, function_id=function_id, limit=limit, cursor=cursor)
    return Call("POST", "/v1/runs/resume", BulkResumeResponse, body)


def pause_run(run_id: str) -> Call[RunPauseResponse]:
    return Call("POST", f"/v1/runs/{run_id}/pause", RunPauseResponse)


def purge_runs(
    older_than_s: float, statuses: Sequence[FinishedRunStatus] | None = None
) -> Call[PurgeResponse]:
    body = PurgeRequest(older_than_s=older_than_s, statuses=list(statuses) if statuses else None)
    return Call("POST", "/v1/runs/purge", PurgeResponse, body)


def list_functions(*, include_deleted: bool = False) -> Call[FunctionList]:
    params = {"all": "true" if include_deleted else None}
    return Call("GET", "/v1/functions", FunctionList, params=params)


def delete_function(function_id: str) -> Call[DeleteFunctionResponse]:
    return Call("DELETE", f"/v1/functions/{function_id}", DeleteFunctionResponse)


def invoke(function_id: str, data: Any = None) -> Call[InvokeResponse]:
    body = InvokeRequest(data={} if data is None else data)
    return Call("POST", f"/v1/functions/{function_id}/invoke", InvokeResponse, body)


def pause_function(function_id: str) -> Call[PauseResponse]:
    return Call("POST", f"/v1/functions/{function_id}/pause", PauseResponse)


def resume_function(function_id: str, *, catchup: bool = False) -> Call[PauseResponse]:
    body = ResumeFunctionRequest(catchup=catchup)
    return Call("POST", f"/v1/functions/{function_id}/resume", PauseResponse, body)


def list_audit(
    *, run_id: str | None = None, type: str | None = None, limit: int | None = None,
    cursor: str | None = None, include_data: bool = False,
) -> Call[AuditList]:
    """One page of the audit trail, oldest first."""
    params = {
        "run_id": run_id, "type": type, "limit": limit, "cursor": cursor, "include": _include(include_data),
    }
    return Call("GET", "/v1/audit", AuditList, params=params)


def list_debounces(*, function_id: str | None = None, limit: int | None = None) -> Call[DebounceList]:
    """Pending debounces, soonest first (ingest-side flow control)."""
    return Call("GET", "/v1/debounces", DebounceList, params={"function": function_id, "limit": limit})


def list_leases(*, include_expired: bool = False) -> Call[LeaseList]:
    params = {"all": "true"} if include_expired else {}
    return Call("GET", "/v1/capacity/leases", LeaseList, params=params)


def list_sessions() -> Call[SessionList]:
    return Call("GET", "/v1/capacity/sessions", SessionList)


def list_queue() -> Call[QueueList]:
    return Call("GET", "/v1/capacity/queue", QueueList)


def create_key(*, platform: bool = False, role: str = "admin") -> Call[KeyCreateResponse]:
    return Call("POST", "/v1/keys", KeyCreateResponse, KeyCreateRequest(platform=platform, role=role))
