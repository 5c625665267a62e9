"""Events → runs → memoised steps, end to end: a real node and an SDK worker in-process."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import trio

import ironflow
from ironflow.node import Node
from tests.integration.helpers import emit, wait_for_run

FAST_RETRY = ironflow.RetryPolicy(max_attempts=3, initial_delay_s=0.05, backoff_factor=2.0)


async def start_worker(nursery: trio.Nursery, node: Node, functions: list[Any], **kw: Any) -> ironflow.StreamingWorker:
    worker = ironflow.StreamingWorker(
        node.url, functions, handle_signals=False, reconnect_delay=0.1, **kw
    )
    await nursery.start(worker.run)
    return worker


async def test_event_runs_function_and_records_each_step(node: Node, http: httpx.AsyncClient, nursery: trio.Nursery) -> None:
    @ironflow.function(id="deploy-demo", triggers=[ironflow.event("deploy.demo")])
    async def process_order(ctx: Any) -> Any:
        ctx.logger.info(f"Starting run {ctx.run.id}")
        first = await ctx.step.run("load", lambda: {"order": ctx.event.data["order"]})
        return await ctx.step.run("process-order", lambda: {"processed": True, **first})

    await start_worker(nursery, node, [process_order], max_concurrent_jobs=1)
    emitted = await emit(http, "deploy.demo", {"order": 7})
    assert len(emitted["run_ids"]) == 1
    detail = await wait_for_run(http, emitted["run_ids"][0])
    run = detail["run"]
    assert run["status"] == "completed"
    assert run["output"] == {"processed": True, "order": 7}
    assert run["attempt"] == 1 and run["function_id"] == "deploy-demo"
    steps = detail["steps"]
    assert [s["name"] for s in steps] == ["load", "process-order"]
    assert all(s["status"] == "completed" and s["duration_ms"] is not None for s in steps)
    assert steps[0]["output"] == {"order": 7}


async def test_retry_replays_from_the_top_and_skips_completed_steps(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    executed: Counter[str] = Counter()

    @ironflow.function(id="flaky", triggers=[ironflow.event("flaky.go")], retries=FAST_RETRY)
    async def flaky(ctx: Any) -> Any:
        async def charge() -> str:
            executed["charge"] += 1
            return "charged"

        async def ship() -> str:
            executed["ship"] += 1
            if ctx.run.attempt < 2:
                raise RuntimeError("carrier down")
            return "shipped"

        a = await ctx.step.run("charge", charge)
        b = await ctx.step.run("ship", ship)
        return [a, b]

    await start_worker(nursery, node, [flaky])
    run_id = (await emit(http, "flaky.go"))["run_ids"][0]
    detail = await wait_for_run(http, run_id)
    assert detail["run"]["status"] == "completed"
    assert detail["run"]["attempt"] == 2
    assert detail["run"]["output"] == ["charged", "shipped"]
    # The completed step reached the engine before the failure: never re-run.
    assert executed == {"charge": 1, "ship": 2}


async def test_repeated_step_names_get_stable_distinct_ids(node: Node, http: httpx.AsyncClient, nursery: trio.Nursery) -> None:
    @ironflow.function(id="loop", triggers=[ironflow.event("loop.go")])
    async def loop(ctx: Any) -> Any:
        return [await ctx.step.run("tick", lambda i=i: i) for i in range(3)]

    await start_worker(nursery, node, [loop])
    run_id = (await emit(http, "loop.go"))["run_ids"][0]
    detail = await wait_for_run(http, run_id)
    assert detail["run"]["output"] == [0, 1, 2]
    ids = sorted(s["step_id"] for s in detail["steps"])
    # "{run_id}:{name}:{n}": n counts repeats of a name, so replays map each
    # call to the same id and repeats never collide.
    assert ids == [f"{run_id}:tick:{n}" for n in range(3)]


async def test_non_retryable_error_fails_the_run_at_once(node: Node, http: httpx.AsyncClient, nursery: trio.Nursery) -> None:
    @ironflow.function(id="strict", triggers=[ironflow.event("strict.go")], retries=FAST_RETRY)
    async def strict(ctx: Any) -> Any:
        raise ironflow.NonRetryableError("card declined", code="CARD_DECLINED")

    await start_worker(nursery, node, [strict])
    run_id = (await emit(http, "strict.go"))["run_ids"][0]
    run = (await wait_for_run(http, run_id))["run"]
    assert run["status"] == "failed" and run["attempt"] == 1
    assert run["error"]["code"] == "CARD_DECLINED"
    assert run["error"]["message"] == "card declined"
    assert "Traceback" in (run["error"]["traceback"] or "")


async def test_plain_exception_is_retried_until_attempts_run_out(node: Node, http: httpx.AsyncClient, nursery: trio.Nursery) -> None:
    starts: list[float] = []

    @ironflow.function(id="doomed", triggers=[ironflow.event("doomed.go")], retries=FAST_RETRY)
    async def doomed(ctx: Any) -> Any:
        starts.append(trio.current_time())
        raise ValueError("still broken")

    await start_worker(nursery, node, [doomed])
    run_id = (await emit(http, "doomed.go"))["run_ids"][0]
    run = (await wait_for_run(http, run_id))["run"]
    assert run["status"] == "failed" and run["attempt"] == 3
    assert run["error"]["code"] == "ERROR" and "still broken" in run["error"]["message"]
    assert len(starts) == 3
    # Backoff 0.05 s then 0.1 s (×2) between attempts.
    assert starts[1] - starts[0] >= 0.05 and starts[2] - starts[1] >= 0.1


async def test_idempotency_key_returns_the_first_event_and_creates_nothing(node: Node, http: httpx.AsyncClient) -> None:
    @ironflow.function(id="once", triggers=[ironflow.event("pay.*")])
    async def once(ctx: Any) -> Any:
        return None

    # Register the function through a raw worker registration (no execution needed).
    from tests.integration.helpers import raw_worker

    async with raw_worker(node.url, [once.definition]):
        first = await emit(http, "pay.requested", {"n": 1}, idempotency_key="k-1")
        again = await emit(http, "pay.requested", {"n": 2}, idempotency_key="k-1")
    assert again["event_id"] == first["event_id"]
    assert again["run_ids"] == first["run_ids"] and len(first["run_ids"]) == 1
    assert again["duplicate"] is True
    runs = (await http.get("/v1/runs", params={"include": "data", "function": "once"})).json()["runs"]
    assert len(runs) == 1


async def test_wildcard_and_exact_triggers(node: Node, http: httpx.AsyncClient) -> None:
    from tests.integration.helpers import raw_worker

    @ironflow.function(id="any-order", triggers=[ironflow.event("order.*")])
    async def any_order(ctx: Any) -> None: ...

    @ironflow.function(id="created-only", triggers=[ironflow.event("order.created")])
    async def created_only(ctx: Any) -> None: ...

    async with raw_worker(node.url, [any_order.definition, created_only.definition]):
        created = await emit(http, "order.created")
        shipped = await emit(http, "order.shipped")
        other = await emit(http, "user.created")
    assert len(created["run_ids"]) == 2
    assert len(shipped["run_ids"]) == 1
    assert other["run_ids"] == []


async def test_cancel_stops_the_running_handler(node: Node, http: httpx.AsyncClient, nursery: trio.Nursery) -> None:
    started = trio.Event()
    cancelled = trio.Event()

    @ironflow.function(id="slow", triggers=[ironflow.event("slow.go")])
    async def slow(ctx: Any) -> Any:
        async def forever() -> None:
            started.set()
            try:
                await trio.sleep(60)
            except trio.Cancelled:
                cancelled.set()
                raise

        return await ctx.step.run("wait", forever)

    await start_worker(nursery, node, [slow])
    run_id = (await emit(http, "slow.go"))["run_ids"][0]
    with trio.fail_after(5):
        await started.wait()
    resp = await http.post(f"/v1/runs/{run_id}/cancel", json={"reason": "user asked"})
    assert resp.status_code == 200, resp.text
    with trio.fail_after(5):
        await cancelled.wait()
    detail = await wait_for_run(http, run_id)
    assert detail["run"]["status"] == "cancelled"
    assert detail["lease"] is None and detail["queue"] is None
    again = await http.post(f"/v1/runs/{run_id}/cancel")
    assert again.status_code == 409 and again.json()["code"] == "CONFLICT"


async def test_emit_reaches_an_idle_worker_without_waiting_on_a_timer(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    # The dispatcher's idle re-check is 30 s in these tests: only a kick explains a fast start.
    assert node.config.timings.dispatch_idle_poll_s >= 30
    started_at: list[float] = []

    @ironflow.function(id="quick", triggers=[ironflow.event("quick.go")])
    async def quick(ctx: Any) -> None:
        started_at.append(trio.current_time())

    await start_worker(nursery, node, [quick])
    await trio.sleep(0.2)  # worker idle, dispatcher asleep
    t0 = trio.current_time()
    run_id = (await emit(http, "quick.go"))["run_ids"][0]
    await wait_for_run(http, run_id)
    assert started_at and started_at[0] - t0 < 1.0


async def test_crashing_actors_mid_load_lose_no_run_and_duplicate_none(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    side_effects: Counter[str] = Counter()

    @ironflow.function(id="work", triggers=[ironflow.event("work.go")])
    async def work(ctx: Any) -> Any:
        async def effect() -> str:
            side_effects[ctx.run.id] += 1
            await trio.sleep(0.01)
            return "done"

        return await ctx.step.run("effect", effect)

    await start_worker(nursery, node, [work], max_concurrent_jobs=10)
    assert node.supervisor is not None
    run_ids: list[str] = []
    for i in range(40):
        run_ids += (await emit(http, "work.go", {"i": i}))["run_ids"]
        if i % 8 == 3:
            for actor in node.supervisor.names:
                if actor != "drain-coordinator":
                    node.supervisor.crash(actor)
    for run_id in run_ids:
        detail = await wait_for_run(http, run_id, timeout=30)
        assert detail["run"]["status"] == "completed"
    assert set(side_effects) == set(run_ids)
    assert all(n == 1 for n in side_effects.values()), side_effects
    assert node.supervisor.restarts("dispatcher") >= 3  # a crash during a restart backoff is a no-op
    assert (await http.get("/healthz")).status_code == 200


async def test_batch_emit_persists_every_event_and_its_runs_in_one_call(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    @ironflow.function(id="batched", triggers=[ironflow.event("batch.*")])
    async def batched(ctx: Any) -> Any:
        return await ctx.step.run("double", lambda: ctx.event.data["n"] * 2)

    await start_worker(nursery, node, [batched], max_concurrent_jobs=10)
    events = [{"name": "batch.item", "data": {"n": i}} for i in range(20)]
    events.append({"name": "batch.item", "data": {"n": 0}, "idempotency_key": "dup"})
    events.append({"name": "batch.item", "data": {"n": 1}, "idempotency_key": "dup"})
    events.append({"name": "other.thing", "data": {}})
    resp = await http.post("/v1/events/batch", json={"events": events})
    assert resp.status_code == 201, resp.text
    results = resp.json()["events"]
    assert len(results) == 23
    assert all(len(r["run_ids"]) == 1 for r in results[:22]) and results[22]["run_ids"] == []
    # The repeated key inside one batch still dedupes to the first event.
    assert results[21]["duplicate"] and results[21]["event_id"] == results[20]["event_id"]
    outputs = sorted([(await wait_for_run(http, r["run_ids"][0]))["run"]["output"] for r in results[:20]])
    assert outputs == sorted(i * 2 for i in range(20))
    for bad in ({"events": []}, {"events": [{"name": ""}]}, {"events": [{"name": "x"}] * 1001}):
        resp = await http.post("/v1/events/batch", json=bad)
        assert resp.status_code == 400 and resp.json()["code"] == "VALIDATION_ERROR"
