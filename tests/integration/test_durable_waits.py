"""Durable sleeps, waits and invokes through a real node and real workers
(both backends): the worker is free while a run sleeps, waits resume on the
right event or time out, invokes report the child's outcome, and a worker
killed while its run sleeps loses nothing and repeats nothing."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import ironflow
from ironflow.node import Node
from tests.integration.helpers import emit, wait_for_run, wait_for_step
from tests.integration.procs import Proc, count, read_effects, start_worker


@ironflow.function(id="napper", triggers=[ironflow.event("nap.go")])
async def napper(ctx: Any) -> Any:
    await ctx.step.sleep("nap", 2)
    return "rested"


@ironflow.function(id="quick", triggers=[ironflow.event("quick.go")])
async def quick(ctx: Any) -> Any:
    return await ctx.step.run("q", lambda: "quick")


@ironflow.function(id="waiter", triggers=[ironflow.event("wait.go")])
async def waiter(ctx: Any) -> Any:
    if ctx.event.data.get("pre"):
        await ctx.step.run("pre", trio.sleep, ctx.event.data["pre"])  # the segment is busy
    ev = await ctx.step.wait_for_event(
        "approval", event="wait.approved", match="data.key", timeout=ctx.event.data.get("timeout", 30)
    )
    return None if ev is None else ev.data


@ironflow.function(id="kid", triggers=[])
async def kid(ctx: Any) -> Any:
    if ctx.event.data.get("fail"):
        raise ironflow.NonRetryableError("kid failed", code="KID")
    if ctx.event.data.get("slow"):
        await ctx.step.sleep("dawdle", 30)
    return {"kid": ctx.event.data}


@ironflow.function(id="parent", triggers=[ironflow.event("parent.go")])
async def parent(ctx: Any) -> Any:
    try:
        return await ctx.step.invoke("call", function=kid, data=ctx.event.data, timeout=ctx.event.data.get("t", 30))
    except ironflow.InvokeError as exc:
        return {"invoke_error": str(exc)}


ALL = [napper, quick, waiter, kid, parent]


async def start(node: Node, nursery: trio.Nursery, slots: int = 1) -> ironflow.StreamingWorker:
    worker = ironflow.StreamingWorker(node.url, ALL, handle_signals=False, max_concurrent_jobs=slots)
    await nursery.start(worker.run)
    return worker


async def test_a_sleeping_run_frees_its_only_slot_for_other_work(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    await start(node, nursery, slots=1)
    t0 = trio.current_time()
    sleeper = (await emit(http, "nap.go"))["run_ids"][0]
    await wait_for_run(http, sleeper, "waiting")
    other = (await emit(http, "quick.go"))["run_ids"][0]
    assert (await wait_for_run(http, other))["run"]["status"] == "completed"
    assert trio.current_time() - t0 < 1.5  # done while the 2 s sleep is still going
    detail = await wait_for_run(http, sleeper, timeout=10)
    assert detail["run"]["output"] == "rested" and trio.current_time() - t0 >= 2.0


async def test_a_wait_resumes_only_on_its_match_and_times_out_with_none(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    await start(node, nursery, slots=4)
    matched = (await emit(http, "wait.go", {"key": "k1"}))["run_ids"][0]
    timing_out = (await emit(http, "wait.go", {"key": "k2", "timeout": 1}))["run_ids"][0]
    await wait_for_run(http, matched, "waiting")
    await emit(http, "wait.approved", {"key": "other"})
    await trio.sleep(0.3)
    assert (await http.get(f"/v1/runs/{matched}")).json()["run"]["status"] == "waiting"
    await emit(http, "wait.approved", {"key": "k1", "ok": True})
    assert (await wait_for_run(http, matched))["run"]["output"] == {"key": "k1", "ok": True}
    detail = await wait_for_run(http, timing_out, timeout=10)
    assert detail["run"]["status"] == "completed" and detail["run"]["output"] is None


async def test_an_event_arriving_while_the_wait_is_being_parked_is_not_lost(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    await start(node, nursery, slots=4)
    runs = []
    for i in range(5):
        run_id = (await emit(http, "wait.go", {"key": f"race{i}", "timeout": 15, "pre": 0.3}))["run_ids"][0]
        runs.append(run_id)
    for i, run_id in enumerate(runs):
        await wait_for_run(http, run_id, "running")
        # The segment that will park the wait is running: the event lands before
        # the park commits, so ingest finds no parked wait to match.
        await emit(http, "wait.approved", {"key": f"race{i}"})
    outcomes = [(await wait_for_run(http, r, timeout=30))["run"] for r in runs]
    assert [run["output"] for run in outcomes] == [{"key": f"race{i}"} for i in range(5)]


async def test_invoke_returns_the_childs_output_or_raises_on_failure_and_timeout(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    await start(node, nursery, slots=6)
    ok = (await emit(http, "parent.go", {"x": 1}))["run_ids"][0]
    failing = (await emit(http, "parent.go", {"fail": True}))["run_ids"][0]
    slow = (await emit(http, "parent.go", {"slow": True, "t": 1}))["run_ids"][0]
    assert (await wait_for_run(http, ok))["run"]["output"] == {"kid": {"x": 1}}
    out = (await wait_for_run(http, failing))["run"]["output"]
    assert "kid failed" in out["invoke_error"]
    out = (await wait_for_run(http, slow, timeout=15))["run"]["output"]
    assert "invoke_error" in out


@pytest.mark.slow
async def test_a_worker_killed_while_its_run_sleeps_loses_and_repeats_nothing(
    node: Node, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    effects = tmp_path / "effects.log"
    procs: list[Proc] = []
    try:
        a = await start_worker(node.url, effects, tmp_path, name="a")
        procs.append(a)
        run_id = (await emit(http, "sleepy.go", {"nap": 2}))["run_ids"][0]
        await wait_for_step(http, run_id, "before")
        await wait_for_run(http, run_id, "waiting")
        a.signal(signal.SIGKILL)
        b = await start_worker(node.url, effects, tmp_path, name="b")
        procs.append(b)
        detail = await wait_for_run(http, run_id, timeout=20)
        assert detail["run"]["status"] == "completed" and detail["run"]["output"] == b.pid
        rows = read_effects(effects)
        assert count(rows, run_id, "before") == 1 and count(rows, run_id, "after") == 1
    finally:
        for proc in procs:
            proc.stop()
