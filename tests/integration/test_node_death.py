"""Two nodes on one PostgreSQL: kill -9 one, the survivor recovers everything it held."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest
import trio

from tests.integration.helpers import emit, wait_for_run, wait_for_step
from tests.integration.procs import (
    Proc,
    count,
    free_port,
    read_effects,
    start_node,
    start_worker,
    wait_effect,
)

pytestmark = pytest.mark.slow


async def test_killed_node_sessions_and_leases_are_reaped_by_the_survivor(
    pg_url: str, tmp_path: Path, procs: list[Proc]
) -> None:
    a_port, b_port = free_port(), free_port()
    node_a = await start_node(pg_url, tmp_path / "a", tmp_path, node_id="node-a", port=a_port)
    procs.append(node_a)
    node_b = await start_node(pg_url, tmp_path / "b", tmp_path, node_id="node-b", port=b_port)
    procs.append(node_b)
    a_url, b_url = f"http://127.0.0.1:{a_port}", f"http://127.0.0.1:{b_port}"
    effects = tmp_path / "effects.log"
    worker_a = await start_worker(a_url, effects, tmp_path, name="worker-a")
    procs.append(worker_a)
    async with httpx.AsyncClient(base_url=b_url, timeout=10) as http:
        run_id = (await emit(http, "crash.go"))["run_ids"][0]
        await wait_effect(effects, run_id, "two-start", pid=worker_a.pid)
        await wait_for_step(http, run_id, "one")
        detail = (await http.get(f"/v1/runs/{run_id}")).json()
        assert detail["lease"]["node_id"] == "node-a"
        node_a.signal(signal.SIGKILL)
        await node_a.wait_exit()
        # The worker of the dead node is gone too (its node's socket died); it
        # comes back through the surviving node, as behind a load balancer.
        worker_a.signal(signal.SIGKILL)
        worker_b = await start_worker(b_url, effects, tmp_path, name="worker-b")
        procs.append(worker_b)
        detail = await wait_for_run(http, run_id, timeout=30)
        run = detail["run"]
        assert run["status"] == "completed" and run["output"] == {"pid": worker_b.pid}
        assert run["recovery_count"] == 1
        assert count(read_effects(effects), run_id, "one") == 1
        types = [e["type"] for e in (await http.get("/v1/audit", params={"include": "data", "run_id": run_id})).json()["events"]]
        assert "capacity.lease.expired" in types and "capacity.segment.recovered" in types
        # The dead node's worker session was reaped by node-b's scanner (database time).
        with trio.fail_after(15):
            while True:
                key = await _platform_key(pg_url)
                sessions = (
                    await http.get("/v1/capacity/sessions", headers={"Authorization": f"Bearer {key}"})
                ).json()["sessions"]
                if all(s["node_id"] != "node-a" for s in sessions):
                    break
                await trio.sleep(0.5)
        assert any(s["node_id"] == "node-b" for s in sessions)


async def _platform_key(db: str) -> str:
    from ironflow.store import open_store

    store = open_store(db)
    await store.open()
    try:
        return (await store.create_api_key("platform", "platform_admin"))[1]
    finally:
        await store.close()
