"""``Ironflow``: the event client — emit events, inspect and cancel runs over HTTP."""

from __future__ import annotations

import os
from types import TracebackType
from typing import Any

import httpx
import msgspec

from ironflow.config import DEFAULT_SERVER_URL
from ironflow.protocol import (
    ApiError,
    CancelRequest,
    EmitRequest,
    EmitResponse,
    InvokeRequest,
    encoder,
)
from ironflow.sdk.errors import IronflowAPIError

# REST calls are short; a slow node should surface as an error, not a hang.
DEFAULT_TIMEOUT_S = 30.0


def raise_for_api_error(resp: httpx.Response) -> None:
    """Raise ``IronflowAPIError(status, code, message)`` for a 4xx/5xx answer."""
    if resp.status_code < 400:
        return
    try:
        body = msgspec.json.decode(resp.content, type=ApiError)
    except msgspec.DecodeError:  # not our JSON error body (a proxy, a crash page)
        body = ApiError("HTTP_ERROR", resp.text[:500] if resp.content else resp.reason_phrase or "")
    raise IronflowAPIError(resp.status_code, body.code, body.message)


def auth_headers(api_key: str | None) -> dict[str, str]:
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    return headers


class Ironflow:
    """Client for an engine node's HTTP API.

    ``server_url`` defaults to ``IRONFLOW_SERVER_URL`` (else
    ``http://localhost:9123``), ``api_key`` to ``IRONFLOW_API_KEY``. Use as
    ``async with Ironflow() as client:`` or call ``aclose()``. Every method
    raises ``IronflowAPIError`` on a 4xx/5xx answer.
    """

    def __init__(
        self,
        server_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.server_url = (
            server_url or os.environ.get("IRONFLOW_SERVER_URL") or DEFAULT_SERVER_URL
        ).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("IRONFLOW_API_KEY")
        self._http = httpx.AsyncClient(
            base_url=self.server_url,
            headers=auth_headers(self.api_key),
            timeout=timeout,
            transport=transport,
        )

    async def __aenter__(self) -> Ironflow:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, body: Any = None, **params: Any) -> Any:
        content = None if body is None else encoder.encode(body)
        query = {k: v for k, v in params.items() if v is not None}
        resp = await self._http.request(method, path, content=content, params=query or None)
        raise_for_api_error(resp)
        return msgspec.json.decode(resp.content) if resp.content else None

    async def emit(
        self, name: str, data: Any = None, idempotency_key: str | None = None
    ) -> EmitResponse:
        """Emit event ``name`` with ``data``; returns the event id and the runs it started."""
        body = EmitRequest(name=name, data={} if data is None else data, idempotency_key=idempotency_key)
        out = await self._request("POST", "/v1/events", body)
        return msgspec.convert(out, EmitResponse)

    async def get_run(self, run_id: str) -> dict[str, Any]:
        """The run's detail: ``{run, steps, queue, lease, waiting_reason, db_now}``."""
        out: dict[str, Any] = await self._request("GET", f"/v1/runs/{run_id}")
        return out

    async def list_runs(
        self, *, status: str | None = None, function: str | None = None, limit: int | None = None
    ) -> list[dict[str, Any]]:
        """Runs, newest first, optionally filtered by status and function id."""
        out = await self._request("GET", "/v1/runs", status=status, function=function, limit=limit)
        runs: list[dict[str, Any]] = out["runs"]
        return runs

    async def cancel_run(self, run_id: str, reason: str = "cancelled by user") -> dict[str, Any]:
        """Cancel a run; its worker is told to stop the running segment."""
        out: dict[str, Any] = await self._request(
            "POST", f"/v1/runs/{run_id}/cancel", CancelRequest(reason=reason)
        )
        return out

    async def invoke(self, function_id: str, data: Any = None) -> str:
        """Start function ``function_id`` directly; returns the new run id."""
        out = await self._request(
            "POST",
            f"/v1/functions/{function_id}/invoke",
            InvokeRequest(data={} if data is None else data),
        )
        return str(out["run_id"])
