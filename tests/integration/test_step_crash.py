"""Steps under kill -9 (real worker processes, both backends): a parallel
step's finished branch is not re-run, and a step's idempotency key is the same
when the step runs again after its worker died."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from ironflow.node import Node
from tests.integration.helpers import emit, wait_for_run, wait_for_step
from tests.integration.procs import Proc, count, read_effects, start_worker, wait_effect

pytestmark = pytest.mark.slow


async def test_a_parallel_branch_that_finished_is_not_rerun_after_kill_9(
    node: Node, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    effects = tmp_path / "effects.log"
    procs: list[Proc] = []
    try:
        a = await start_worker(node.url, effects, tmp_path, name="a")
        procs.append(a)
        run_id = (await emit(http, "par.go"))["run_ids"][0]
        await wait_effect(effects, run_id, "slow-start", pid=a.pid)
        await wait_for_step(http, run_id, "fast")  # its result reached the engine
        b = await start_worker(node.url, effects, tmp_path, name="b")
        procs.append(b)
        a.signal(signal.SIGKILL)
        detail = await wait_for_run(http, run_id, timeout=30)
        assert detail["run"]["status"] == "completed"
        assert detail["run"]["output"] == ["fast-done", b.pid]
        rows = read_effects(effects)
        assert count(rows, run_id, "fast") == 1  # replayed from the engine, not re-run
        assert count(rows, run_id, "slow-start") == 2 and count(rows, run_id, "slow-done") == 1
    finally:
        for proc in procs:
            proc.stop()


async def test_a_steps_idempotency_key_survives_its_worker_being_killed(
    node: Node, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    effects = tmp_path / "effects.log"
    procs: list[Proc] = []
    try:
        a = await start_worker(node.url, effects, tmp_path, name="a")
        procs.append(a)
        run_id = (await emit(http, "keyed.go"))["run_ids"][0]
        await wait_effect(effects, run_id, "pay-start", pid=a.pid)
        b = await start_worker(node.url, effects, tmp_path, name="b")
        procs.append(b)
        a.signal(signal.SIGKILL)  # mid-step: the step runs again on b
        detail = await wait_for_run(http, run_id, timeout=30)
        rows = read_effects(effects)
        keys = [what for _, rid, what, _ in rows if rid == run_id and what.startswith("key:")]
        assert count(rows, run_id, "pay-start") == 2 and len(keys) == 2
        assert keys[0] == keys[1] == "key:" + detail["run"]["output"]
    finally:
        for proc in procs:
            proc.stop()
