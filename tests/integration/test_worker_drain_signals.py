"""Graceful drain with real worker processes and real signals (seed: docs/seeds/graceful-drain.txt).

The seed's rolling deploy is the DRAINING row of the counter table, in
``test_counter_table.py``; ``ironflow serve`` receiving SIGTERM is in
``test_serve_drain.py``.

The worker processes (``tests/procs/drain_worker.py``) configure no logging,
so their stderr shows what a user running ``python worker.py`` sees.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ironflow.node import Node
from tests.integration.conftest import node_config
from tests.integration.helpers import emit, wait_for_run
from tests.integration.procs import (
    Proc,
    assert_worker_loop,
    read_effects,
    start_drain_worker,
    wait_effect,
    wait_log,
)

pytestmark = pytest.mark.slow


def log_lines(proc: Proc) -> list[str]:
    return proc.log_path.read_text(errors="replace").splitlines()


async def run_of(http: httpx.AsyncClient, run_id: str) -> dict[str, Any]:
    return dict((await wait_for_run(http, run_id))["run"])


async def test_one_sigterm_drains_every_worker_in_the_process(
    node: Node, http: httpx.AsyncClient, tmp_path: Path, procs: list[Proc], worker_loop: str
) -> None:
    effects = tmp_path / "effects.log"
    # A streaming and a pull worker in one process, one job each.
    proc = await start_drain_worker(
        procs, node.url, effects, tmp_path, "both", "--workers", "stream,pull", "--slow", "2"
    )
    runs = [(await emit(http, "drain.go"))["run_ids"][0] for _ in range(2)]
    for run_id in runs:
        await wait_effect(effects, run_id, "start", pid=proc.pid, timeout=10)
    proc.signal(signal.SIGTERM)
    assert await proc.wait_exit(timeout=15) == 0, proc.tail()
    for run_id in runs:
        run = await run_of(http, run_id)
        assert run["status"] == "completed" and run["output"] == {"pid": proc.pid}
        assert run["attempt"] == 1 and run["recovery_count"] == 0
    rows = read_effects(effects)
    assert sorted(r[1] for r in rows if r[2] == "done") == sorted(runs)
    assert sum("Draining worker..." in line for line in log_lines(proc)) == 2
    assert_worker_loop(proc, worker_loop)


async def test_a_sigterm_during_an_engine_shutdown_keeps_the_engines_deadline(
    database_url: str, tmp_path: Path, nursery: trio.Nursery, procs: list[Proc]
) -> None:
    node = Node(node_config(database_url, tmp_path / "state", drain_timeout_s=8))
    stopped = trio.Event()

    async def run_node(task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
        await node.run(task_status=task_status)
        stopped.set()

    await nursery.start(run_node)
    effects = tmp_path / "effects.log"
    proc = await start_drain_worker(procs, node.url, effects, tmp_path, "w", "--slow", "2")
    async with httpx.AsyncClient(base_url=node.url) as http:
        run_id = (await emit(http, "drain.go"))["run_ids"][0]
    await wait_effect(effects, run_id, "start", pid=proc.pid, timeout=10)
    started = trio.current_time()
    node.request_shutdown()
    await wait_log(proc, "Draining worker...")
    # The user's first signal arrives while the engine's drain is under way.
    proc.signal(signal.SIGTERM)
    assert await proc.wait_exit(timeout=10) == 0, proc.tail()
    with trio.fail_after(10):
        await stopped.wait()
    assert trio.current_time() - started < 8
    await wait_effect(effects, run_id, "done", pid=proc.pid, timeout=1)
    from ironflow.store import open_store

    store = open_store(database_url)
    await store.open()
    try:
        run = (await store.get_run(run_id)).run
    finally:
        await store.close()
    assert run.status == "completed" and run.output == {"pid": proc.pid}
    assert run.attempt == 1 and run.recovery_count == 0
    assert not any("Second signal" in line for line in log_lines(proc))


async def test_a_worker_drain_deadline_ends_the_process_on_time(
    node: Node, http: httpx.AsyncClient, tmp_path: Path, procs: list[Proc], worker_loop: str
) -> None:
    effects = tmp_path / "effects.log"
    proc = await start_drain_worker(
        procs, node.url, effects, tmp_path, "w", "--slow", "30", "--drain-timeout", "1"
    )
    run_id = (await emit(http, "drain.go"))["run_ids"][0]
    await wait_effect(effects, run_id, "start", pid=proc.pid, timeout=10)
    t0 = trio.current_time()
    proc.signal(signal.SIGTERM)
    assert await proc.wait_exit(timeout=10) == 0, proc.tail()
    # The 1 s drain plus process exit; no close handshake after the deadline.
    assert trio.current_time() - t0 < 1.0 + 1.0
    assert "Drain deadline reached; cancelling 1 active jobs" in "\n".join(log_lines(proc))
    run = (await wait_for_run(http, run_id, "waiting", timeout=5))["run"]
    assert run["recovery_count"] == 1 and run["attempt"] == 1
    assert_worker_loop(proc, worker_loop)
