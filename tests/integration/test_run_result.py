"""GET /v1/runs/{id}/result: held open by the node and answered the moment the
run ends — woken by the run's end, not by a re-read interval (both backends)."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import trio

import ironflow
from ironflow.node import Node
from tests.integration.helpers import emit


@ironflow.function(id="slowish", triggers=[ironflow.event("slowish.go")], retries=1)
async def slowish(ctx: Any) -> Any:
    await ctx.step.run("wait", trio.sleep, ctx.event.data.get("s", 0.5))
    if ctx.event.data.get("fail"):
        raise ironflow.NonRetryableError("it broke", code="BROKE")
    return {"done": True}


async def test_a_result_request_is_answered_when_the_run_ends_not_by_polling(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With the re-read backstop out of the way, only the run-end wake-up can answer early.
    monkeypatch.setattr(node.config.timings, "result_recheck_s", 60.0)
    worker = ironflow.StreamingWorker(node.url, [slowish], handle_signals=False)
    await nursery.start(worker.run)
    run_id = (await emit(http, "slowish.go", {"s": 0.5}))["run_ids"][0]
    t0 = time.monotonic()
    resp = await http.get(f"/v1/runs/{run_id}/result", params={"wait_s": 30}, timeout=40)
    waited = time.monotonic() - t0
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["ended"] and body["status"] == "completed" and body["output"] == {"done": True}
    assert 0.4 < waited < 5.0  # the step's 0.5 s, not the 60 s re-read
    # A failed run answers with its error.
    run_id = (await emit(http, "slowish.go", {"s": 0.1, "fail": True}))["run_ids"][0]
    body = (await http.get(f"/v1/runs/{run_id}/result", params={"wait_s": 30}, timeout=40)).json()
    assert body["status"] == "failed" and body["error"]["code"] == "BROKE"
    worker.stop()


async def test_a_run_still_going_answers_202_and_bad_input_a_4xx(node: Node, http: httpx.AsyncClient) -> None:
    # The function is known (a pull worker registered it) but nobody polls: the run waits.
    reg = {"type": "register", "worker_id": "idle", "functions": [{"id": "idle", "triggers": [{"event": "idle.go"}]}]}
    assert (await http.post("/v1/worker/register", json=reg)).status_code == 201
    run_id = (await emit(http, "idle.go"))["run_ids"][0]
    resp = await http.get(f"/v1/runs/{run_id}/result", params={"wait_s": 0.2})
    assert resp.status_code == 202 and resp.json() == {
        "run_id": run_id, "status": "waiting_for_capacity", "ended": False, "output": None, "error": None,
    }
    assert (await http.get("/v1/runs/run_nope/result")).status_code == 404
    for bad in ("-1", "lots", "100000"):
        resp = await http.get(f"/v1/runs/{run_id}/result", params={"wait_s": bad})
        assert resp.status_code == 400 and "wait_s" in resp.json()["message"]
    # Cancelling wakes a waiter too.
    async with trio.open_nursery() as nursery:
        got: list[dict[str, Any]] = []

        async def wait() -> None:
            got.append((await http.get(f"/v1/runs/{run_id}/result", params={"wait_s": 30}, timeout=40)).json())

        nursery.start_soon(wait)
        await trio.sleep(0.2)
        await http.post(f"/v1/runs/{run_id}/cancel", json={"reason": "enough"})
    assert got[0]["status"] == "cancelled" and got[0]["error"]["code"] == "CANCELLED"



def count_reads(node: Node, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The run ids the node's store reads a run record of, from now on."""
    reads: list[str] = []
    read = node.store.get_run_record

    async def counted(run_id: str) -> Any:
        reads.append(run_id)
        return await read(run_id)

    monkeypatch.setattr(node.store, "get_run_record", counted)
    return reads


async def test_a_waiting_result_request_is_answered_from_the_commit_that_completes_the_run(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node.config.timings, "result_recheck_s", 60.0)  # no backstop re-read
    worker = ironflow.StreamingWorker(node.url, [slowish], handle_signals=False)
    await nursery.start(worker.run)
    run_id = (await emit(http, "slowish.go", {"s": 0.3}))["run_ids"][0]
    reads = count_reads(node, monkeypatch)
    resp = await http.get(f"/v1/runs/{run_id}/result", params={"wait_s": 30}, timeout=40)
    assert resp.json() == {"run_id": run_id, "status": "completed", "ended": True, "output": {"done": True}, "error": None}
    # The read on arrival; the answer came with the run's end, not a read back
    # (on PostgreSQL the node's own run-end NOTIFY, ids only, is not heard).
    assert reads == [run_id]
    worker.stop()


async def test_a_held_result_request_is_given_up_when_its_client_goes_away(
    node: Node, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node.config.timings, "result_recheck_s", 0.05)
    reg = {"type": "register", "worker_id": "idle", "functions": [{"id": "idle", "triggers": [{"event": "idle.go"}]}]}
    assert (await http.post("/v1/worker/register", json=reg)).status_code == 201
    run_id = (await emit(http, "idle.go"))["run_ids"][0]
    reads = count_reads(node, monkeypatch)
    with trio.move_on_after(0.3):  # the client gives up: its connection closes
        await http.get(f"/v1/runs/{run_id}/result", params={"wait_s": 30}, timeout=40)
    assert len(reads) > 2  # it was waiting, re-reading every 0.05 s
    await trio.sleep(0.1)
    gone = len(reads)
    await trio.sleep(0.3)
    assert len(reads) == gone  # the node stopped waiting for nobody


async def test_the_client_awaits_results_async_and_sync_and_the_cli_waits(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    from click.testing import CliRunner

    from ironflow.cli import main

    worker = ironflow.StreamingWorker(node.url, [slowish], handle_signals=False, max_concurrent_jobs=4)
    await nursery.start(worker.run)
    async with ironflow.Ironflow(node.url) as client:
        sent = await client.send("slowish.go", {"s": 0.05})
        assert await client.result(sent.run_ids[0], timeout=20) == {"done": True}
        assert await client.invoke(slowish, {"s": 0.05}, wait=True, timeout=20) == {"done": True}
        failing = (await client.send("slowish.go", {"s": 0.05, "fail": True})).run_ids[0]
        with pytest.raises(ironflow.RunFailedError) as failed:
            await client.result(failing, timeout=20)
        assert failed.value.code == "BROKE" and failed.value.status == "failed"
        slow = (await client.send("slowish.go", {"s": 5})).run_ids[0]
        with pytest.raises(TimeoutError):
            await client.result(slow, timeout=0.3)
        with pytest.raises(ironflow.IronflowAPIError) as missing:
            await client.result("run_nope", timeout=1)
        assert missing.value.status == 404

    def sync_part() -> Any:
        with ironflow.SyncClient(node.url) as sync:
            run_id = sync.send("slowish.go", {"s": 0.05}).run_ids[0]
            return sync.result(run_id, timeout=20)

    assert await trio.to_thread.run_sync(sync_part) == {"done": True}

    def cli(*args: str) -> Any:
        return CliRunner().invoke(main, ["--server", node.url, *args], catch_exceptions=False)

    done = await trio.to_thread.run_sync(cli, "emit", "slowish.go", "--data", '{"s": 0.05}', "--wait", "--timeout", "20")
    assert done.exit_code == 0 and '"done": true' in done.output.replace('"done":true', '"done": true'), done.output
    waited = await trio.to_thread.run_sync(cli, "runs", "wait", failing, "--timeout", "5")
    assert waited.exit_code == 1 and "BROKE" in waited.output
    waited = await trio.to_thread.run_sync(cli, "runs", "wait", slow, "--timeout", "0.2")
    assert waited.exit_code == 1 and "still" in waited.output
    worker.stop()
