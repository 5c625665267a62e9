"""The event client: request shapes, auth header, API errors."""

from __future__ import annotations

import httpx
import msgspec
import pytest

import ironflow

# Every test here runs on asyncio and on trio (tests/sdk/conftest.py).
pytestmark = pytest.mark.anyio


async def test_emit_sends_event_with_auth_and_decodes_response():
    seen = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"event_id": "e1", "run_ids": ["r1"], "duplicate": False})

    async with ironflow.Ironflow(
        "http://node.test", api_key="ifkey_k", transport=httpx.MockTransport(handle)
    ) as client:
        out = await client.emit("order.created", {"id": 1}, idempotency_key="k1")
    assert out.event_id == "e1" and out.run_ids == ["r1"]
    (req,) = seen
    assert req.url.path == "/v1/events" and req.headers["authorization"] == "Bearer ifkey_k"
    assert msgspec.json.decode(req.content) == {
        "name": "order.created", "data": {"id": 1}, "idempotency_key": "k1",
    }


async def test_api_errors_raise_with_status_code_and_message():
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"code": "FUNCTION_NOT_FOUND", "message": "no such fn"})

    async with ironflow.Ironflow("http://node.test", transport=httpx.MockTransport(handle)) as c:
        with pytest.raises(ironflow.IronflowAPIError) as excinfo:
            await c.invoke("missing", {})
    err = excinfo.value
    assert (err.status, err.code, err.message) == (404, "FUNCTION_NOT_FOUND", "no such fn")
