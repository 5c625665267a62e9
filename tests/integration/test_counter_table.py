"""The seed's counter table, one test per row, through real node and worker processes.

docs/seeds/graceful-drain.txt, "Refusal is different from failure":

| What happened                                  | Retry attempt  | Recovery count |
|------------------------------------------------|----------------|----------------|
| B never started; the engine accepts its JobNack | Unchanged      | Unchanged      |
| A's handler reports a retryable failure        | Uses the retry budget | Not a lease recovery |
| A disappears without a terminal result          | Not a handler-failure retry | Counts toward the recovery ceiling |

The nack row is proven for both reasons, ``DRAINING`` (the seed's rolling
deploy, with a real SIGTERM) and ``AT_CAPACITY`` (a worker whose engine-side
credits exceed its free slots). The node is ``ironflow serve --dev`` (recovery
grace 1 s), on SQLite and on PostgreSQL; the workers are
``tests/procs/drain_worker.py`` processes.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.integration.conftest import ServedNode, serve_node
from tests.integration.procs import (
    Proc,
    assert_worker_loop,
    count,
    read_effects,
    start_drain_worker,
    wait_effect,
    wait_log,
)

pytestmark = pytest.mark.slow


@pytest.fixture
async def node(database_url: str, tmp_path: Path, procs: list[Proc]) -> ServedNode:
    return await serve_node(procs, database_url, tmp_path, "node")


async def emit(http: httpx.AsyncClient, name: str) -> str:
    resp = await http.post("/v1/events", json={"name": name, "data": {}})
    assert resp.status_code in (200, 201), resp.text
    return str(resp.json()["run_ids"][0])


async def finished(http: httpx.AsyncClient, run_id: str, timeout: float = 20.0) -> dict[str, Any]:
    with trio.fail_after(timeout):
        while True:
            run = (await http.get(f"/v1/runs/{run_id}")).json()["run"]
            if run["status"] in ("completed", "failed", "cancelled"):
                return dict(run)
            await trio.sleep(0.05)


async def audit(http: httpx.AsyncClient, run_id: str, kind: str | None = None) -> list[dict[str, Any]]:
    params = {"run_id": run_id, "include": "data", **({"type": kind} if kind else {})}
    return list((await http.get("/v1/audit", params=params)).json()["events"])


async def test_row_nack_draining_the_seeds_rolling_deploy_leaves_attempt_and_recovery_count(
    node: ServedNode, tmp_path: Path, procs: list[Proc]
) -> None:
    effects = tmp_path / "effects.log"
    async with httpx.AsyncClient(base_url=node.url, timeout=10) as http:
        # Two slots, so B is offered to the old worker while it drains.
        old = await start_drain_worker(procs, node.url, effects, tmp_path, "old", "--max-jobs", "2", "--slow", "3")
        a = await emit(http, "drain.go")
        await wait_effect(effects, a, "start", pid=old.pid, timeout=10)
        old.signal(signal.SIGTERM)
        await wait_log(old, "Waiting for 1 jobs to complete...")
        b = await emit(http, "drain.go")
        await wait_log(old, "Draining, refusing job")
        new = await start_drain_worker(procs, node.url, effects, tmp_path, "new", "--slow", "0.1")
        run_a, run_b = await finished(http, a), await finished(http, b)
        assert run_a["status"] == "completed" and run_a["output"] == {"pid": old.pid}
        assert run_a["attempt"] == 1 and run_a["recovery_count"] == 0
        assert run_b["status"] == "completed" and run_b["output"] == {"pid": new.pid}
        assert run_b["attempt"] == 1 and run_b["recovery_count"] == 0
        assert await old.wait_exit(timeout=10) == 0, old.tail()
        # B's handler never started on the old worker.
        assert [r[3] for r in read_effects(effects) if r[1] == b] == [new.pid, new.pid]
        stderr = old.log_path.read_text()
        for line in ("Draining worker...", "Waiting for 1 jobs to complete...", "Draining, refusing job"):
            assert line in stderr
        nacks = await audit(http, b, "capacity.job.nacked")
        assert [e["data"]["reason"] for e in nacks] == ["DRAINING"]
        assert not await audit(http, b, "capacity.lease.expired")


async def test_row_nack_at_capacity_leaves_attempt_and_recovery_count(
    node: ServedNode, tmp_path: Path, procs: list[Proc]
) -> None:
    effects = tmp_path / "effects.log"
    async with httpx.AsyncClient(base_url=node.url, timeout=10) as http:
        # The engine believes in two slots; the worker has one.
        worker = await start_drain_worker(
            procs, node.url, effects, tmp_path, "w", "--advertise", "2", "--max-jobs", "1", "--slow", "1.5"
        )
        a = await emit(http, "drain.go")
        await wait_effect(effects, a, "start", pid=worker.pid, timeout=10)
        b = await emit(http, "drain.go")
        await wait_log(worker, "At capacity, refusing job")
        run_a, run_b = await finished(http, a), await finished(http, b)
        assert run_a["status"] == run_b["status"] == "completed"
        assert run_b["attempt"] == 1 and run_b["recovery_count"] == 0 and run_b["error"] is None
        # B ran once, after A had freed the slot: the engine held the refused
        # credit back instead of sending B into the same full slot again.
        rows = read_effects(effects)
        assert count(rows, b, "start") == 1
        a_done = next(r[0] for r in rows if r[1] == a and r[2] == "done")
        b_start = next(r[0] for r in rows if r[1] == b and r[2] == "start")
        assert b_start >= a_done
        nacks = await audit(http, b, "capacity.job.nacked")
        assert [e["data"]["reason"] for e in nacks] == ["AT_CAPACITY"]
        assert not await audit(http, b, "capacity.lease.expired")


async def test_row_retryable_failure_spends_an_attempt_not_a_recovery(
    node: ServedNode, tmp_path: Path, procs: list[Proc]
) -> None:
    effects = tmp_path / "effects.log"
    async with httpx.AsyncClient(base_url=node.url, timeout=10) as http:
        worker = await start_drain_worker(procs, node.url, effects, tmp_path, "w")
        run_id = await emit(http, "flaky.go")
        run = await finished(http, run_id)
        assert run["status"] == "completed" and run["output"] == {"pid": worker.pid}
        assert run["attempt"] == 2 and run["recovery_count"] == 0
        assert count(read_effects(effects), run_id, "start") == 2
        assert not await audit(http, run_id, "capacity.lease.expired")
        assert not await audit(http, run_id, "capacity.job.nacked")


async def test_row_lost_worker_counts_a_recovery_not_an_attempt(
    node: ServedNode, tmp_path: Path, procs: list[Proc], worker_loop: str
) -> None:
    effects = tmp_path / "effects.log"
    async with httpx.AsyncClient(base_url=node.url, timeout=10) as http:
        lost = await start_drain_worker(procs, node.url, effects, tmp_path, "lost", "--slow", "60")
        run_id = await emit(http, "drain.go")
        await wait_effect(effects, run_id, "start", pid=lost.pid, timeout=10)
        lost.signal(signal.SIGKILL)  # no drain, no result: the worker disappears
        new = await start_drain_worker(procs, node.url, effects, tmp_path, "new", "--slow", "0.1")
        run = await finished(http, run_id)
        assert run["status"] == "completed" and run["output"] == {"pid": new.pid}
        assert run["attempt"] == 1 and run["recovery_count"] == 1
        rows = read_effects(effects)
        assert count(rows, run_id, "start") == 2 and count(rows, run_id, "done") == 1
        types = [e["type"] for e in await audit(http, run_id)]
        assert "capacity.lease.expired" in types and "capacity.segment.recovered" in types
        assert "capacity.job.nacked" not in types
    assert_worker_loop(new, worker_loop)
