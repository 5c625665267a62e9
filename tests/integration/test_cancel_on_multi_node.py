"""Cancel-on across two nodes sharing one PostgreSQL (ironflow/store/cancel_on.py):
the worker holding a cancelled job on one node is told by a cancel event
ingested on the other, and at full rate exactly the runs an event names are
cancelled, each ended once."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import ironflow
from ironflow.node import Node
from ironflow.protocol import Cancel, FunctionDef, JobAck, JobAssignment, Trigger
from tests.integration.conftest import node_config
from tests.integration.helpers import emit, eventually, raw_worker, wait_for_run

pytestmark = pytest.mark.slow

UNSUB = ironflow.CancelOn("user.unsubscribed", match="data.user_id")
RUNS = 200


async def test_a_cancel_event_on_one_node_reaches_the_worker_holding_the_job_on_another(
    pg_url: str, tmp_path: Path, nursery: trio.Nursery
) -> None:
    a: Node = await nursery.start(Node(node_config(pg_url, tmp_path / "a")).run)
    b: Node = await nursery.start(Node(node_config(pg_url, tmp_path / "b")).run)
    fd = FunctionDef(id="drip", triggers=[Trigger("user.created")], cancel_on=[UNSUB])
    async with raw_worker(a.url, [fd]) as raw, httpx.AsyncClient(base_url=b.url) as http:
        run_id = (await emit(http, "user.created", {"user_id": 1}))["run_ids"][0]
        job = await raw.receive_type(JobAssignment)
        await raw.send(JobAck(job.job_id, run_id, job.execution_seq, job.lease_token))
        await wait_for_run(http, run_id, "running")
        await emit(http, "user.unsubscribed", {"user_id": 1})  # on node b
        cancel = await raw.receive_type(Cancel, timeout=10)
        assert (cancel.job_id, cancel.run_id) == (job.job_id, run_id)
    a.stop()
    b.stop()


async def test_at_full_rate_through_two_nodes_exactly_the_named_runs_are_cancelled_once(
    pg_url: str, tmp_path: Path, nursery: trio.Nursery
) -> None:
    a: Node = await nursery.start(Node(node_config(pg_url, tmp_path / "a")).run)
    b: Node = await nursery.start(Node(node_config(pg_url, tmp_path / "b")).run)

    @ironflow.function(id="drip", triggers=[ironflow.event("user.created")], cancel_on=[UNSUB], audit=True)
    async def drip(ctx: Any) -> Any:
        await ctx.step.run("work", trio.sleep, random.random() * 0.3)
        await ctx.step.sleep("nap", 600)
        return "never"

    worker = ironflow.StreamingWorker(a.url, [drip], handle_signals=False, max_concurrent_jobs=50)
    await nursery.start(worker.run)
    run_of: dict[int, str] = {}
    async with httpx.AsyncClient(base_url=a.url, timeout=30) as on_a, \
            httpx.AsyncClient(base_url=b.url, timeout=30) as on_b:

        async def create(user: int) -> None:
            run_of[user] = (await emit(on_a, "user.created", {"user_id": user}))["run_ids"][0]

        async def unsubscribe(user: int) -> None:
            await emit(on_b, "user.unsubscribed", {"user_id": user})

        async with trio.open_nursery() as emits:
            for user in range(RUNS):
                emits.start_soon(create, user)
        # Cancel every even user's run, through node b, while the runs are
        # queued, mid-step on node a's worker, or asleep.
        async with trio.open_nursery() as emits:
            for user in range(0, RUNS, 2):
                emits.start_soon(unsubscribe, user)

        async def settled() -> dict[str, str] | None:
            runs = (await on_b.get("/v1/runs", params={"include": "data", "limit": 1000})).json()["runs"]
            status = {r["id"]: r["status"] for r in runs}
            done = all(status.get(run_of[u]) in ("cancelled", "waiting") for u in range(RUNS))
            return status if done and len(status) == RUNS else None

        # An odd user's run is asleep once its "nap" step is recorded.
        status = await eventually(settled, timeout=20, interval=0.2, message="every run cancelled or asleep")
        assert {u for u in range(RUNS) if status[run_of[u]] == "cancelled"} == set(range(0, RUNS, 2))
        audits = (await on_b.get("/v1/audit", params={"include": "data", "type": "run.cancelled", "limit": 1000})).json()["events"]
        ended = [e["run_id"] for e in audits]
        assert sorted(ended) == sorted(run_of[u] for u in range(0, RUNS, 2)), "a run ended twice or not at all"
        assert all(e["data"]["cause"] == "cancel-on-event" for e in audits)
    worker.stop()
    a.stop()
    b.stop()
