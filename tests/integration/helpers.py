"""Helpers for tests that drive a real node over HTTP and websockets."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio
import trio_websocket

from ironflow.protocol import (
    EngineMessage,
    FunctionDef,
    Register,
    Registered,
    WorkerMessage,
    encoder,
    engine_message_decoder,
)


async def wait_for_run(
    http: httpx.AsyncClient,
    run_id: str,
    statuses: set[str] | str = frozenset({"completed", "failed", "cancelled"}),
    *,
    timeout: float = 15.0,
    interval: float = 0.02,
) -> dict[str, Any]:
    """Poll ``GET /v1/runs/{id}`` until the run's status is in ``statuses``."""
    wanted = {statuses} if isinstance(statuses, str) else set(statuses)
    detail: dict[str, Any] = {}
    with trio.move_on_after(timeout):
        while True:
            resp = await http.get(f"/v1/runs/{run_id}")
            resp.raise_for_status()
            detail = resp.json()
            if detail["run"]["status"] in wanted:
                return detail
            await trio.sleep(interval)
    raise AssertionError(f"run {run_id} did not reach {wanted} in {timeout}s: {detail.get('run')}")


async def wait_for_step(
    http: httpx.AsyncClient, run_id: str, name: str, *, timeout: float = 15.0
) -> dict[str, Any]:
    """Wait until the engine has recorded step ``name`` of the run as completed.

    A step result travels asynchronously: a worker killed right after a step
    may take the result with it, and then the step legitimately runs again.
    Crash tests wait for this before killing, so "a completed step is never
    re-executed" is asserted only for results that reached the engine.
    """
    with trio.fail_after(timeout):
        while True:
            resp = await http.get(f"/v1/runs/{run_id}")
            for step in resp.json().get("steps", []):
                if step["name"] == name and step["status"] == "completed":
                    return dict(step)
            await trio.sleep(0.01)


async def emit(http: httpx.AsyncClient, name: str, data: Any = None, **extra: Any) -> dict[str, Any]:
    resp = await http.post("/v1/events", json={"name": name, "data": data or {}, **extra})
    assert resp.status_code in (200, 201), resp.text
    return resp.json()


class RawWorker:
    """A hand-driven streaming worker: send and receive protocol messages directly."""

    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        self.ws = ws
        self.session_id = ""

    async def send(self, msg: WorkerMessage) -> None:
        await self.ws.send_message(encoder.encode(msg).decode())

    async def send_raw(self, frame: str) -> None:
        await self.ws.send_message(frame)

    async def receive(self, timeout: float = 5.0) -> EngineMessage:
        with trio.fail_after(timeout):
            return engine_message_decoder.decode(await self.ws.get_message())

    async def receive_type(self, kind: type, timeout: float = 5.0) -> Any:
        """Skip messages until one of type ``kind`` arrives."""
        with trio.fail_after(timeout):
            while True:
                msg = await self.receive(timeout)
                if isinstance(msg, kind):
                    return msg


@asynccontextmanager
async def raw_worker(
    url: str,
    functions: list[FunctionDef] | None,
    *,
    max_concurrent_jobs: int = 1,
    register: bool = True,
    headers: list[tuple[str, str]] | None = None,
) -> AsyncIterator[RawWorker]:
    ws_url = url.replace("http://", "ws://") + "/v1/worker"
    async with trio_websocket.open_websocket_url(
        ws_url, extra_headers=headers or [], max_message_size=16 * 1024 * 1024
    ) as ws:
        worker = RawWorker(ws)
        if register:
            await worker.send(
                Register(worker_id="raw", functions=functions or [], max_concurrent_jobs=max_concurrent_jobs)
            )
            registered = await worker.receive_type(Registered)
            worker.session_id = registered.session_id
        yield worker


async def eventually(
    check: Any, *, timeout: float, interval: float = 0.05, message: str = "condition"
) -> Any:
    """Await ``check()`` (an async callable) until it returns a truthy value,
    at most ``timeout`` seconds; returns that value, or fails naming ``message``
    and the last value seen."""
    last: Any = None
    with trio.move_on_after(timeout):
        while True:
            last = await check()
            if last:
                return last
            await trio.sleep(interval)
    raise AssertionError(f"{message} not reached in {timeout:g}s (last: {last!r})")
