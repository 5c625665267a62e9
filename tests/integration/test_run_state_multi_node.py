"""The run state budget and the memo left out of assignments, across two
nodes on one PostgreSQL, driven through the API at full rate: runs whose
segments (split by sleeps) are resumed by either node's workers read the
outputs their assignments left out from whichever node they are attached to,
and each fails exactly once, at the step that crosses the budget, counted
from what the database holds whichever node ran the earlier segments."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio

import ironflow
from ironflow.node import Node
from tests.integration.conftest import node_config
from tests.integration.helpers import wait_for_run

pytestmark = pytest.mark.serial

STEP = 300 * 1024
BUDGET = 2 * 1024 * 1024  # 6 steps fit (1.76 MiB of JSON), the 7th crosses
RUNS = 20


def blob(run: int, i: int) -> str:
    return (f"{run:03d}{i:03d}" * (STEP // 6 + 1))[:STEP]


def config(pg_url: str, state_dir: Path) -> Any:
    base = node_config(pg_url, state_dir)
    limits = msgspec.structs.replace(base.limits, max_run_state_bytes=BUDGET, memo_inline_bytes=512 * 1024)
    return msgspec.structs.replace(base, limits=limits)


async def test_segments_resumed_on_either_node_read_their_state_and_fail_once_past_the_budget(
    pg_url: str, tmp_path: Path, nursery: trio.Nursery
) -> None:
    a: Node = await nursery.start(Node(config(pg_url, tmp_path / "a")).run)
    b: Node = await nursery.start(Node(config(pg_url, tmp_path / "b")).run)
    seen: dict[int, list[str]] = {}

    @ironflow.function(id="hop", triggers=[ironflow.event("hop.go")], retries=3)
    async def hop(ctx: Any) -> Any:
        n = ctx.event.data["n"]
        outputs = []
        for i in range(10):
            outputs.append(await ctx.step.run(f"s{i}", lambda i=i: blob(n, i)))
            await ctx.step.sleep(f"z{i}", 0.05)  # the next segment: either node's worker
        seen[n] = [hashlib.sha256(o.encode()).hexdigest() for o in outputs]
        return "never"

    workers = [
        ironflow.StreamingWorker(node.url, [hop], handle_signals=False, max_concurrent_jobs=8)
        for node in (a, b)
    ]
    for worker in workers:
        await nursery.start(worker.run)
    clients = [httpx.AsyncClient(base_url=node.url, timeout=30) for node in (a, b)]
    try:
        run_ids: list[str] = []

        async def emit(n: int) -> None:
            resp = await clients[n % 2].post("/v1/events", json={"name": "hop.go", "data": {"n": n}})
            assert resp.status_code in (200, 201), resp.text
            run_ids.extend(resp.json()["run_ids"])

        async with trio.open_nursery() as burst:
            for n in range(RUNS):
                burst.start_soon(emit, n)
        assert len(run_ids) == RUNS
        for run_id in run_ids:
            run = await wait_for_run(clients[0], run_id, timeout=90)
            assert run["run"]["status"] == "failed", run["run"]
            assert run["run"]["error"]["code"] == "RUN_STATE_TOO_LARGE" and run["run"]["attempt"] == 1
            assert "step 's6'" in run["run"]["error"]["message"], run["run"]["error"]
            steps = {s["name"]: s["status"] for s in run["steps"] if s["name"].startswith("s")}
            assert steps == {**{f"s{i}": "completed" for i in range(6)}, "s6": "failed"}, steps
        assert seen == {}  # no handler got past the failing step
    finally:
        for client in clients:
            await client.aclose()
        for worker in workers:
            worker.stop()
