"""A handler that kills its own worker every time ends in EXECUTION_RECOVERY_EXHAUSTED."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ironflow.node import Node
from tests.integration.helpers import emit
from tests.integration.procs import count, read_effects, start_worker

pytestmark = pytest.mark.slow


@pytest.fixture
def node_timings() -> dict[str, Any]:
    # A short grace keeps eleven worker restarts quick; the counting is the same.
    return {"recovery_grace_s": 0.2}


async def test_handler_that_always_dies_starts_eleven_times_then_fails(
    node: Node, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    effects = tmp_path / "effects.log"
    ceiling = int(node.config.timings.recovery_ceiling)
    worker = await start_worker(node.url, effects, tmp_path, name="w0")
    run_id = (await emit(http, "suicide.go"))["run_ids"][0]
    workers = 1
    with trio.fail_after(120):
        while True:
            try:
                await worker.wait_exit(timeout=30)
            finally:
                worker.stop()
            # The engine hears of the death when the socket closes: wait for
            # that recovery (or the final failure) before judging the run.
            while True:
                run = (await http.get(f"/v1/runs/{run_id}")).json()["run"]
                if run["status"] == "failed" or run["recovery_count"] == workers:
                    break
                await trio.sleep(0.01)
            if run["status"] == "failed":
                break
            # The worker died with its handler: start the next one.
            worker = await start_worker(node.url, effects, tmp_path, name=f"w{workers}")
            workers += 1
    assert run["error"]["code"] == "EXECUTION_RECOVERY_EXHAUSTED"
    assert run["recovery_count"] == ceiling
    assert count(read_effects(effects), run_id, "start") == ceiling + 1
    assert run["attempt"] == 1  # lease recovery never spends the retry budget
    events = (await http.get("/v1/audit", params={"include": "data", "run_id": run_id})).json()["events"]
    assert sum(e["type"] == "capacity.segment.recovered" for e in events) == ceiling
