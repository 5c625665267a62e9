"""Run control through real processes (docs/run-control.md): a node, a worker, and the
``ironflow`` CLI. A run of ``resume3`` (tests/procs/resume_worker.py) fails at
step two; once the cause is gone, ``ironflow runs resume`` runs steps two and
three again under the same run id, and step one is not run again. A run of
``pause2`` paused in its sleep stays paused past its wake time, and ``runs
resume`` finishes it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from click.testing import CliRunner

from ironflow.cli import main
from tests.integration.procs import ROOT, Proc, free_port, start_node

pytestmark = pytest.mark.slow

RESUME_WORKER = ROOT / "tests" / "procs" / "resume_worker.py"


async def run_status(client: httpx.AsyncClient, run_id: str, want: str) -> dict[str, Any]:
    with trio.fail_after(20):
        while True:
            detail = (await client.get(f"/v1/runs/{run_id}")).json()
            if detail["run"]["status"] == want:
                return detail
            await trio.sleep(0.1)


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ironflow", "--server", url, *args],
        capture_output=True, text=True, cwd=ROOT, timeout=30,
    )


async def cli_in_thread(url: str, *args: str) -> str:
    """The CLI in this process (a thread): quicker than a process, same code."""
    result = await trio.to_thread.run_sync(
        lambda: CliRunner().invoke(main, ["--server", url, *args], catch_exceptions=False)
    )
    assert result.exit_code == 0, result.output
    return result.output


async def step_status(client: httpx.AsyncClient, run_id: str, step: str, want: str) -> dict[str, Any]:
    with trio.fail_after(20):
        while True:
            detail = (await client.get(f"/v1/runs/{run_id}")).json()
            if any(s["name"] == step and s["status"] == want for s in detail["steps"]):
                return detail
            await trio.sleep(0.1)


async def test_cli_resumes_a_failed_run_from_its_failed_step(store_url: str, tmp_path: Path) -> None:
    effects, flag = tmp_path / "effects.txt", tmp_path / "flag"
    flag.touch()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs: list[Proc] = []
    try:
        procs.append(await start_node(store_url, tmp_path / "state", tmp_path, node_id="rc", port=port))
        worker = Proc([sys.executable, str(RESUME_WORKER), url, str(effects), str(flag)], tmp_path / "w.log")
        procs.append(worker)
        await worker.wait_line("READY")
        async with httpx.AsyncClient(base_url=url) as client:
            emitted = await client.post("/v1/events", json={"name": "resume.go", "data": {}})
            (run_id,) = emitted.json()["run_ids"]
            failed = await run_status(client, run_id, "failed")
            before = [(s["name"], s["status"]) for s in failed["steps"]]
            assert before == [("one", "completed"), ("two", "failed")]

            flag.unlink()
            resumed = await trio.to_thread.run_sync(cli, url, "runs", "resume", run_id)
            assert resumed.returncode == 0, resumed.stdout + resumed.stderr
            assert f"run {run_id} resumed (was failed) from step 'two'" in resumed.stdout
            # A second resume while the first is queued or running (or done): 409.
            again = await client.post(f"/v1/runs/{run_id}/resume", json={})
            assert again.status_code == 409 and again.json()["code"] == "CONFLICT"

            completed = await run_status(client, run_id, "completed")
            after = [(s["name"], s["status"]) for s in completed["steps"]]
            assert after == [("one", "completed"), ("two", "completed"), ("three", "completed")]
            assert completed["run"]["output"] == [1, 2, 3] and completed["run"]["attempt"] == 1
            ran = [line.split()[1] for line in effects.read_text().splitlines() if line.startswith(run_id)]
            assert ran == ["one", "two", "two", "three"]  # one never again
            audit = (await client.get("/v1/audit", params={"include": "data", "run_id": run_id, "type": "run.resumed"})).json()
            assert [e["data"]["from_step"] for e in audit["events"]] == ["two"]

            emitted = await client.post("/v1/events", json={"name": "pause.go", "data": {"nap": 3.0}})
            (paused_id,) = emitted.json()["run_ids"]
            await step_status(client, paused_id, "nap", "sleeping")
            out = await cli_in_thread(url, "runs", "pause", paused_id)
            assert f"run {paused_id} paused" in out
            # The sleep ends (the waker settles it); the run stays paused, off the queue.
            # (3 s: longer than the waker's 1 s lookahead, so it is seen sleeping.)
            detail = await step_status(client, paused_id, "nap", "completed")
            assert detail["run"]["status"] == "paused" and detail["queue"] is None
            out = await cli_in_thread(url, "runs", "resume", paused_id)
            assert f"run {paused_id} resumed (was paused)" in out
            await run_status(client, paused_id, "completed")
            ran = [line.split()[1] for line in effects.read_text().splitlines() if line.startswith(paused_id)]
            assert ran == ["one", "two"]
    finally:
        for proc in procs:
            proc.stop()
