"""A node told to shut down drains its streaming workers before it stops."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import ironflow
from ironflow.node import Node
from tests.integration.conftest import node_config
from tests.integration.helpers import emit


async def test_node_shutdown_lets_running_jobs_finish_then_stops(
    database_url: str, tmp_path: Path, nursery: trio.Nursery
) -> None:
    node = Node(node_config(database_url, tmp_path / "state", drain_timeout_s=10))
    stopped = trio.Event()

    async def run_node(task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
        await node.run(task_status=task_status)
        stopped.set()

    await nursery.start(run_node)
    started = trio.Event()

    @ironflow.function(id="long", triggers=[ironflow.event("long.go")])
    async def long(ctx: Any) -> Any:
        async def work() -> str:
            started.set()
            await trio.sleep(1.0)
            return "finished during the drain"

        return await ctx.step.run("work", work)

    worker = ironflow.StreamingWorker(node.url, [long], handle_signals=False, reconnect_delay=0.1)
    worker_done = trio.Event()

    async def run_worker() -> None:
        await worker.run()
        worker_done.set()

    nursery.start_soon(run_worker)
    async with httpx.AsyncClient(base_url=node.url) as http:
        with trio.fail_after(10):
            while worker.session_id is None:
                await trio.sleep(0.01)
        run_id = (await emit(http, "long.go"))["run_ids"][0]
        with trio.fail_after(5):
            await started.wait()
        node.request_shutdown()
        assert (await http.get("/readyz")).status_code == 503
        # New workers are turned away while the node drains.
        resp = await http.post("/v1/worker/register", json={"type": "register", "worker_id": "x", "functions": []})
        assert resp.status_code == 503 and resp.json()["code"] == "DRAINING"
        with trio.fail_after(8):
            await worker_done.wait()  # the engine's Shutdown drained the worker
        with trio.fail_after(8):
            await stopped.wait()  # and the node stopped once no session was left
    from ironflow.store import open_store

    store = open_store(database_url)
    await store.open()
    try:
        run = (await store.get_run(run_id)).run
    finally:
        await store.close()
    assert run.status == "completed" and run.output == "finished during the drain"
    assert run.recovery_count == 0


async def test_a_worker_that_ignores_shutdown_is_closed_with_1001_at_the_deadline(
    database_url: str, tmp_path: Path, nursery: trio.Nursery
) -> None:
    import trio_websocket

    from ironflow.protocol import FunctionDef, Shutdown, Trigger
    from tests.integration.helpers import raw_worker

    node = Node(node_config(database_url, tmp_path / "state", drain_timeout_s=0.5))
    await nursery.start(node.run)
    async with raw_worker(node.url, [FunctionDef(id="f", triggers=[Trigger("f.go")])]) as stubborn:
        node.request_shutdown()
        shutdown = await stubborn.receive_type(Shutdown)
        assert shutdown.drain_timeout_ms == 500
        # It neither drains nor closes; at the deadline the node stops anyway.
        with pytest.raises(trio_websocket.ConnectionClosed) as closed:
            await stubborn.receive(timeout=5)
        assert closed.value.reason.code == 1001
