"""The step API through a real node and a real streaming worker (both backends):
any callable a user passes, parallel steps, the per-step idempotency key, the
awaited event as an Event, and invoke with the step name first."""

from __future__ import annotations

from typing import Any

import httpx
import trio

import ironflow
from ironflow.node import Node
from tests.integration.helpers import emit, wait_for_run


async def double(n: int) -> int:
    await trio.sleep(0)
    return n * 2


@ironflow.function(id="child", triggers=[])
async def child(ctx: Any) -> Any:
    return {"child_saw": ctx.event.data["x"]}


@ironflow.function(id="steps", triggers=[ironflow.event("steps.go")])
async def steps(ctx: Any) -> Any:
    a = await ctx.step.run("lambda-coroutine", lambda: double(21))
    b, c = await ctx.step.parallel([("left", double, 1), ("right", lambda: 7)])
    key = await ctx.step.run("key", lambda: ironflow.step_info().idempotency_key)
    ev = await ctx.step.wait_for_event("approval", event="steps.approved", match="data.order", timeout=30)
    got = await ctx.step.invoke("call-child", function=child, data={"x": ev.data["order"]})
    return {"a": a, "b": b, "c": c, "key": key, "event": [ev.name, ev.data], "child": got}


async def test_the_step_api_end_to_end(node: Node, http: httpx.AsyncClient, nursery: trio.Nursery) -> None:
    worker = ironflow.StreamingWorker(node.url, [steps, child], handle_signals=False, max_concurrent_jobs=4)
    await nursery.start(worker.run)
    run_id = (await emit(http, "steps.go", {"order": 5}))["run_ids"][0]
    await wait_for_run(http, run_id, "waiting")
    await emit(http, "steps.approved", {"order": 6})  # another order: must not resume it
    await emit(http, "steps.approved", {"order": 5})
    detail = await wait_for_run(http, run_id)
    out = detail["run"]["output"]
    assert detail["run"]["status"] == "completed", detail["run"]
    assert (out["a"], out["b"], out["c"]) == (42, 2, 7)
    assert out["key"].startswith("ifstep_")
    assert out["event"] == ["steps.approved", {"order": 5}]
    assert out["child"] == {"child_saw": 5}
    # The key was computed once; replays (after the wait and the invoke) kept it.
    names = [s["name"] for s in detail["steps"]]
    assert names.count("key") == 1 and {"left", "right"} <= set(names)
    worker.stop()


@ironflow.function(id="too-slow", triggers=[ironflow.event("slow.go")], timeout=1.0, retries=1)
async def too_slow(ctx: Any) -> Any:
    await ctx.step.run("forever", trio.sleep, 30)
    return "never"


async def test_a_run_past_its_function_timeout_fails_engine_side(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    worker = ironflow.StreamingWorker(node.url, [too_slow], handle_signals=False)
    await nursery.start(worker.run)
    t0 = trio.current_time()
    run_id = (await emit(http, "slow.go"))["run_ids"][0]
    detail = await wait_for_run(http, run_id, timeout=10)
    assert detail["run"]["status"] == "failed" and detail["run"]["error"]["code"] == "FUNCTION_TIMEOUT"
    assert 1.0 <= trio.current_time() - t0 < 4.0
    worker.stop()
