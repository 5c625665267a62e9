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
