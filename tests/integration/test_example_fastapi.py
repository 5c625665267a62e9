"""examples/fastapi_app.py on uvicorn: each request emits, its run executes on the
worker in the same asyncio process, and the response is the run's output; a
SIGTERM to uvicorn drains that worker through the app's lifespan."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import httpx
import pytest
import trio

from ironflow.node import Node
from tests.integration.procs import ROOT, Proc, free_port

pytestmark = pytest.mark.slow


async def test_the_fastapi_example_answers_each_request_with_its_runs_output_and_drains_on_sigterm(
    node: Node, tmp_path: Path
) -> None:
    port = free_port()
    proc = Proc(
        [sys.executable, "-m", "uvicorn", "--app-dir", str(ROOT / "examples"),
         "fastapi_app:app", "--host", "127.0.0.1", "--port", str(port)],
        tmp_path / "app.log",
        env={"IRONFLOW_SERVER_URL": node.url},
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20) as http:
            with trio.fail_after(30):
                # uvicorn binds its socket only after the lifespan (which starts
                # the worker) has run: wait for both, or a request can be refused.
                while not all(
                    line in proc.log_path.read_text(errors="replace")
                    for line in ("Worker registered", "Uvicorn running on")
                ):
                    assert proc.alive(), proc.tail()
                    await trio.sleep(0.05)
            answers: dict[int, dict[str, object]] = {}

            async def order(amount: int) -> None:
                resp = await http.post("/orders", json={"amount": amount})
                assert resp.status_code == 200, resp.text
                answers[amount] = resp.json()

            async with trio.open_nursery() as nursery:
                for amount in (5, 10, 20):
                    nursery.start_soon(order, amount)
            assert answers == {
                a: {"total": round(a * 1.2, 2), "receipt": f"order of {a} -> {round(a * 1.2, 2)}"}
                for a in (5, 10, 20)
            }
        proc.signal(signal.SIGTERM)
        # uvicorn re-raises the signal it handled once shut down: killed by SIGTERM,
        # after the lifespan's exit (the drain) completed.
        assert await proc.wait_exit(timeout=20) in (0, -signal.SIGTERM), proc.tail()
        log = proc.log_path.read_text(errors="replace")
        assert "Draining worker..." in log and "Worker stopped" in log, log[-2000:]
        assert log.index("Worker stopped") < log.index("Application shutdown complete"), log[-2000:]
    finally:
        proc.stop()
