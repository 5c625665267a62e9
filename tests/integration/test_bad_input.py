"""Bad input gets a clear error and never takes the node down or loses data."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
import trio_websocket

import ironflow
from ironflow.node import Node
from ironflow.protocol import FunctionDef, Heartbeat, JobAck, JobAssignment, Refused, Trigger
from tests.integration.helpers import emit, raw_worker, wait_for_run

FN = FunctionDef(id="echo", triggers=[Trigger("echo.go")])


async def assert_node_still_works(node: Node, http: httpx.AsyncClient, nursery: trio.Nursery) -> None:
    @ironflow.function(id="echo", triggers=[ironflow.event("echo.go")])
    async def echo(ctx: Any) -> Any:
        return await ctx.step.run("echo", lambda: ctx.event.data)

    worker = ironflow.StreamingWorker(node.url, [echo], handle_signals=False)
    await nursery.start(worker.run)
    run_id = (await emit(http, "echo.go", {"ok": 1}))["run_ids"][0]
    assert (await wait_for_run(http, run_id))["run"]["output"] == {"ok": 1}
    worker.stop()


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "BAD_REQUEST"),
        (b"", 400, "BAD_REQUEST"),
        (b'{"name": 5}', 400, "VALIDATION_ERROR"),
        (b'{"name": "x", "surprise": 1}', 400, "VALIDATION_ERROR"),
        (b"[1, 2]", 400, "VALIDATION_ERROR"),
    ],
)
async def test_malformed_event_bodies_get_a_json_error(
    node: Node, http: httpx.AsyncClient, body: bytes, status: int, code: str
) -> None:
    resp = await http.post("/v1/events", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == status
    payload = resp.json()
    assert payload["code"] == code and payload["message"]


async def test_http_errors_are_json_with_stable_codes(node: Node, http: httpx.AsyncClient, nursery: trio.Nursery) -> None:
    too_big = b'{"name": "x", "data": "' + b"a" * (node.config.max_frame_bytes + 10) + b'"}'
    # Own connection: the node answers 413 without reading the body, so that
    # connection cannot be reused.
    async with httpx.AsyncClient(base_url=node.url, timeout=10) as other:
        resp = await other.post("/v1/events", content=too_big)
    assert resp.status_code == 413 and resp.json()["code"] == "PAYLOAD_TOO_LARGE"
    resp = await http.post("/v1/functions/nope/invoke", json={"data": {}})
    assert resp.status_code == 404 and resp.json()["code"] == "FUNCTION_NOT_FOUND"
    resp = await http.get("/v1/runs/run_missing")
    assert resp.status_code == 404 and resp.json()["code"] == "RUN_NOT_FOUND"
    resp = await http.get("/v1/runs", params={"limit": "lots"})
    assert resp.status_code == 400 and resp.json()["code"] == "VALIDATION_ERROR"
    resp = await http.get("/v1/no/such/route")
    assert resp.status_code == 404 and resp.json()["code"] == "NOT_FOUND"
    resp = await http.post("/v1/events", json={"name": "x"}, headers={"Authorization": "Bearer ifkey_wrong"})
    assert resp.status_code == 401 and resp.json()["code"] == "UNAUTHORIZED"
    await assert_node_still_works(node, http, nursery)


async def test_an_oversized_emit_streamed_without_a_length_is_refused_with_413(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    # The emit route is served ahead of the framework (ironflow/api/hot.py):
    # it must count a chunked body itself, as quart's MAX_CONTENT_LENGTH would.
    async def chunks() -> Any:
        yield b'{"name": "x", "data": "'
        for _ in range(node.config.max_frame_bytes // 65536 + 2):
            yield b"a" * 65536
        yield b'"}'

    async with httpx.AsyncClient(base_url=node.url, timeout=10) as other:
        resp = await other.post("/v1/events", content=chunks())
    assert resp.status_code == 413 and resp.json()["code"] == "PAYLOAD_TOO_LARGE"
    assert resp.headers["content-type"] == "application/json"
    listed = await http.get("/v1/events")  # the same path's GET is the framework's
    assert listed.status_code == 200
    await assert_node_still_works(node, http, nursery)


def ws_url(node: Node) -> str:
    return node.url.replace("http://", "ws://") + "/v1/worker"


async def close_of(node: Node, frame: str | bytes) -> tuple[int | None, str | None]:
    """Send one frame on a fresh socket; return the close code and reason the node chose."""
    async with trio_websocket.open_websocket_url(ws_url(node), max_message_size=64 * 1024 * 1024) as ws:
        await ws.send_message(frame)
        with trio.fail_after(5):
            try:
                while True:
                    await ws.get_message()
            except trio_websocket.ConnectionClosed as exc:
                return exc.reason.code, exc.reason.reason
    raise AssertionError("socket did not close")


async def test_bad_websocket_frames_close_with_a_reason(node: Node, http: httpx.AsyncClient, nursery: trio.Nursery) -> None:
    code, reason = await close_of(node, "this is not json")
    assert code == 1002 and "invalid message" in (reason or "")
    # Well-formed JSON that is no valid message: invalid payload data.
    code, reason = await close_of(node, '{"type": "teleport", "to": "mars"}')
    assert code == 1007 and "invalid message" in (reason or "")
    code, reason = await close_of(node, '{"type": "register", "worker_id": 5, "functions": []}')
    assert code == 1007 and "worker_id" in (reason or "")
    code, reason = await close_of(node, b"\x00\x01binary")
    assert code == 1003 and "binary" in (reason or "")
    code, reason = await close_of(node, '{"type": "heartbeat", "jobs": null}')
    assert code == 1002 and "register" in (reason or "")
    code, _ = await close_of(node, "x" * (node.config.max_frame_bytes + 1))
    assert code == 1009
    await assert_node_still_works(node, http, nursery)


async def test_stale_fence_is_refused_for_that_job_only(node: Node, http: httpx.AsyncClient) -> None:
    async with raw_worker(node.url, [FN], max_concurrent_jobs=2) as worker:
        first = (await emit(http, "echo.go"))["run_ids"][0]
        second = (await emit(http, "echo.go"))["run_ids"][0]
        a = await worker.receive_type(JobAssignment)
        b = await worker.receive_type(JobAssignment)
        assert {a.run_id, b.run_id} == {first, second}
        # A forged token for job a: refused, scoped to that job.
        await worker.send(JobAck(a.job_id, a.run_id, a.execution_seq, "0" * 32))
        refused = await worker.receive_type(Refused)
        assert refused.code == "STALE_EXECUTION" and refused.job_id == a.job_id
        # A seq that is not the live one for job b: refused too.
        await worker.send(JobAck(b.job_id, b.run_id, b.execution_seq + 1, b.lease_token))
        refused = await worker.receive_type(Refused)
        assert refused.job_id == b.job_id
        # The real fence still works on the same connection.
        await worker.send(JobAck(b.job_id, b.run_id, b.execution_seq, b.lease_token))
        await worker.send(Heartbeat(jobs=None))
        detail = await wait_for_run(http, b.run_id, "running")
        assert detail["lease"]["execution_seq"] == b.execution_seq


async def test_a_method_a_route_does_not_serve_gets_a_405_naming_the_ones_it_does(
    node: Node, http: httpx.AsyncClient
) -> None:
    # Found by Schemathesis (tests/integration/test_fuzz_openapi.py): the 405
    # carried no Allow header, which RFC 9110 requires.
    resp = await http.request("TRACE", "/v1/runs")
    assert resp.status_code == 405 and resp.json()["code"] == "METHOD_NOT_ALLOWED"
    assert "GET" in [m.strip() for m in resp.headers["Allow"].split(",")]
    resp = await http.delete("/v1/events")
    assert resp.status_code == 405
    assert {"GET", "POST"} <= {m.strip() for m in resp.headers["Allow"].split(",")}
