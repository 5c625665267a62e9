"""Several nodes on one PostgreSQL: kicks cross nodes through LISTEN/NOTIFY."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio

import ironflow
from ironflow.node import Node
from tests.integration.conftest import node_config
from tests.integration.helpers import emit, wait_for_run


async def test_event_on_one_node_reaches_a_worker_on_another_without_a_timer(
    pg_url: str, tmp_path: Path, nursery: trio.Nursery
) -> None:
    a: Node = await nursery.start(Node(node_config(pg_url, tmp_path / "a", node_heartbeat_s=1)).run)
    b: Node = await nursery.start(Node(node_config(pg_url, tmp_path / "b")).run)
    # Only a kick explains a fast start: the idle re-check is 30 s here.
    assert a.config.timings.dispatch_idle_poll_s >= 30
    started: list[float] = []

    @ironflow.function(id="far", triggers=[ironflow.event("far.go")])
    async def far(ctx: Any) -> str:
        started.append(trio.current_time())
        return "ran on a worker of node a"

    worker = ironflow.StreamingWorker(a.url, [far], handle_signals=False)
    await nursery.start(worker.run)
    await trio.sleep(0.3)  # every dispatcher idle
    async with httpx.AsyncClient(base_url=b.url) as http:
        t0 = trio.current_time()
        run_id = (await emit(http, "far.go"))["run_ids"][0]
        detail = await wait_for_run(http, run_id)
    assert detail["run"]["status"] == "completed"
    assert started[0] - t0 < 1.0
    assert detail["lease"] is None
    worker.stop()
    a.stop()
    b.stop()


async def test_a_result_wait_on_one_node_wakes_when_another_node_ends_the_run(
    pg_url: str, tmp_path: Path, nursery: trio.Nursery
) -> None:
    a: Node = await nursery.start(Node(node_config(pg_url, tmp_path / "a")).run)
    b: Node = await nursery.start(Node(node_config(pg_url, tmp_path / "b")).run)
    # Only node a's NOTIFY of the run's end can answer early: node b's re-read
    # backstop is pushed out of the way.
    b.config.timings.result_recheck_s = 60.0

    @ironflow.function(id="elsewhere", triggers=[ironflow.event("elsewhere.go")])
    async def elsewhere(ctx: Any) -> dict[str, bool]:
        await ctx.step.run("pause", trio.sleep, 0.5)
        return {"done": True}

    worker = ironflow.StreamingWorker(a.url, [elsewhere], handle_signals=False)
    await nursery.start(worker.run)
    async with httpx.AsyncClient(base_url=b.url, timeout=40) as http:
        run_id = (await emit(http, "elsewhere.go"))["run_ids"][0]
        t0 = trio.current_time()
        resp = await http.get(f"/v1/runs/{run_id}/result", params={"wait_s": 30})
        waited = trio.current_time() - t0
    assert resp.status_code == 200, resp.text
    assert resp.json()["status"] == "completed" and resp.json()["output"] == {"done": True}
    assert 0.4 < waited < 5.0  # the step's 0.5 s, not b's 60 s re-read
    worker.stop()
    a.stop()
    b.stop()
