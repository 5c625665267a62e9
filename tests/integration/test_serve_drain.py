"""``ironflow serve`` as a real process receiving SIGTERM (seed: docs/seeds/graceful-drain.txt).

The node drains its streaming and its pull sessions: jobs that finish within
the node's deadline complete where they run and the node exits 0; a job that
outlives it is recovered at the deadline and completes after a restart
(SQLite) or on the other node (PostgreSQL). Workers are real processes
(``tests/procs/drain_worker.py``) running a streaming and a pull worker.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import trio

from tests.integration.conftest import ServedNode, serve_node
from tests.integration.procs import (
    Proc,
    count,
    read_effects,
    start_drain_worker,
    stored_audit,
    stored_runs,
    wait_effect,
)

pytestmark = pytest.mark.slow


async def emit_runs(url: str, n: int) -> list[str]:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        return [(await http.post("/v1/events", json={"name": "drain.go", "data": {}})).json()["run_ids"][0]
                for _ in range(n)]


async def test_serve_sigterm_lets_a_streaming_and_a_pull_job_finish_then_exits_0(
    database_url: str, tmp_path: Path, procs: list[Proc]
) -> None:
    node = await serve_node(procs, database_url, tmp_path, "node-a", "--drain-timeout", "15")
    effects = tmp_path / "effects.log"
    worker = await start_drain_worker(
        procs, node.url, effects, tmp_path, "worker", "--workers", "stream,pull", "--slow", "2"
    )
    runs = await emit_runs(node.url, 2)
    for run_id in runs:
        await wait_effect(effects, run_id, "start", pid=worker.pid, timeout=10)
    t0 = trio.current_time()
    node.proc.signal(signal.SIGTERM)
    assert await node.proc.wait_exit(timeout=15) == 0, node.proc.tail()
    waited = trio.current_time() - t0
    # The node waited for both jobs (about 2 s each, started together), not its 15 s.
    assert 1.0 < waited < 10.0
    # Both of the process's workers were told to drain and stopped cleanly.
    assert await worker.wait_exit(timeout=10) == 0, worker.tail()
    stored = await stored_runs(database_url, runs)
    for run_id in runs:
        run = stored[run_id]
        assert run.status == "completed" and run.output == {"pid": worker.pid}, run
        assert run.attempt == 1 and run.recovery_count == 0
    rows = read_effects(effects)
    assert all(count(rows, run_id, "done") == 1 for run_id in runs)
    drains = [a.type for a in await stored_audit(database_url) if a.type.startswith("node.drain.")]
    assert sorted(drains) == ["node.drain.completed", "node.drain.started"]


async def test_serve_sigterm_recovers_a_job_outliving_its_deadline_and_a_restarted_node_completes_it(
    tmp_path: Path, procs: list[Proc]
) -> None:
    db = str(tmp_path / "ironflow.db")
    node = await serve_node(procs, db, tmp_path, "node-a", "--drain-timeout", "1")
    effects = tmp_path / "effects.log"
    old = await start_drain_worker(
        procs, node.url, effects, tmp_path, "old", "--workers", "stream,pull", "--slow", "60",
        "--drain-timeout", "1",
    )
    runs = await outlive_the_node_deadline(node, old, effects)
    # The restarted node (same SQLite file) hands both runs to a new worker.
    again = await serve_node(procs, db, tmp_path, "node-a2")
    new = await start_drain_worker(
        procs, again.url, effects, tmp_path, "new", "--slow", "0.1", "--max-jobs", "2"
    )
    for run_id in runs:
        await wait_effect(effects, run_id, "done", pid=new.pid, timeout=20)
    await assert_completed_once_after_one_recovery(again.url, db, runs, new.pid, effects)


async def test_serve_sigterm_recovers_a_job_outliving_its_deadline_and_the_other_node_completes_it(
    pg_url: str, tmp_path: Path, procs: list[Proc]
) -> None:
    node = await serve_node(procs, pg_url, tmp_path, "node-a", "--drain-timeout", "1")
    other = await serve_node(procs, pg_url, tmp_path, "node-b")
    effects = tmp_path / "effects.log"
    old = await start_drain_worker(
        procs, node.url, effects, tmp_path, "old", "--workers", "stream,pull", "--slow", "60",
        "--drain-timeout", "1",
    )
    runs = await outlive_the_node_deadline(node, old, effects)
    assert other.proc.alive()
    new = await start_drain_worker(
        procs, other.url, effects, tmp_path, "new", "--slow", "0.1", "--max-jobs", "2"
    )
    for run_id in runs:
        await wait_effect(effects, run_id, "done", pid=new.pid, timeout=20)
    await assert_completed_once_after_one_recovery(other.url, pg_url, runs, new.pid, effects)


async def outlive_the_node_deadline(node: ServedNode, old: Proc, effects: Path) -> list[str]:
    """SIGTERM a node whose two jobs (streaming, pull) run past its 1 s drain.

    The node exits 0 at its deadline, having recovered both runs at once
    (waiting, recovery_count 1, attempt 1), not at lease expiry. The worker's
    deadline (the node's Shutdown) falls at the same instant, and the seed
    lets either side act on it: the node's drain recovery
    (``node.drain.recovered`` beside the recovery's ``capacity.*`` events) or
    the worker cancelling and closing its stream first, which the node
    recovers as a lost socket (``capacity.*`` alone). Which one wins is timing; that the run
    is recovered once, at once, is not.
    """
    runs = await emit_runs(node.url, 2)
    for run_id in runs:
        await wait_effect(effects, run_id, "start", pid=old.pid, timeout=10)
    t0 = trio.current_time()
    node.proc.signal(signal.SIGTERM)
    assert await node.proc.wait_exit(timeout=10) == 0, node.proc.tail()
    assert trio.current_time() - t0 < 1.0 + 2.0
    stored = await stored_runs(node.db, runs)
    for run_id in runs:
        run = stored[run_id]
        assert run.status == "waiting" and run.recovery_count == 1 and run.attempt == 1, run
        types = [a.type for a in await stored_audit(node.db, run_id)]
        assert types.count("capacity.segment.recovered") == 1, types  # either path writes it
    # The old worker outlives its node; a deploy stops it too.
    old.signal(signal.SIGTERM)
    assert await old.wait_exit(timeout=10) == 0, old.tail()
    assert all(count(read_effects(effects), run_id, "done") == 0 for run_id in runs)
    return runs


async def assert_completed_once_after_one_recovery(
    url: str, db: str, runs: list[str], pid: int, effects: Path
) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        for run_id in runs:
            with trio.fail_after(10):
                while (run := (await http.get(f"/v1/runs/{run_id}")).json()["run"])["status"] != "completed":
                    await trio.sleep(0.05)
            assert run["output"] == {"pid": pid}
            assert run["attempt"] == 1 and run["recovery_count"] == 1
    rows = read_effects(effects)
    for run_id in runs:
        assert count(rows, run_id, "start") == 2 and count(rows, run_id, "done") == 1
