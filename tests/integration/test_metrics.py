"""The operator's metrics through a real node (both backends): latency
histograms observed as runs go by, capacity gauges sampled from the database."""

from __future__ import annotations

from typing import Any

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

import ironflow
from ironflow.node import Node
from tests.integration.helpers import emit, wait_for_run


@ironflow.function(id="metered", triggers=[ironflow.event("metered.go")])
async def metered(ctx: Any) -> Any:
    first = await ctx.step.run("a", lambda: 1)
    return first + await ctx.step.run("b", lambda: 2)


@ironflow.function(id="doomed", triggers=[ironflow.event("doomed.go")],
                   retries=ironflow.RetryPolicy(max_attempts=1))
async def doomed(ctx: Any) -> Any:
    raise ValueError("no")


async def _samples(http: httpx.AsyncClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = (await http.get("/metrics")).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_emit_step_and_run_latencies_are_observed_per_function_and_status(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    before = await _samples(http)
    worker = ironflow.StreamingWorker(node.url, [metered, doomed], handle_signals=False, reconnect_delay=0.1)
    await nursery.start(worker.run)
    ok = (await emit(http, "metered.go"))["run_ids"][0]
    bad = (await emit(http, "doomed.go"))["run_ids"][0]
    assert (await wait_for_run(http, ok))["run"]["status"] == "completed"
    assert (await wait_for_run(http, bad))["run"]["status"] == "failed"
    after = await _samples(http)

    def grew(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert grew("ironflow_emit_to_dispatch_seconds_count") == 2
    assert grew("ironflow_step_commit_seconds_count") == 2  # steps a and b
    assert grew("ironflow_run_duration_seconds_count", function="metered", status="completed") == 1
    assert grew("ironflow_run_duration_seconds_count", function="doomed", status="failed") == 1
    assert grew("ironflow_run_duration_seconds_count", function="metered", status="failed") == 0
    # The largest bucket holds every observation.
    assert grew("ironflow_run_duration_seconds_bucket", function="metered", status="completed", le="+Inf") == 1


async def test_capacity_gauges_follow_sessions_and_the_queue(
    node: Node, http: httpx.AsyncClient
) -> None:
    async def wait_gauges(**wanted: float) -> None:
        with trio.fail_after(15):  # the sampler reads every 5 s
            while True:
                samples = await _samples(http)
                got = {
                    "stream": _value(samples, "ironflow_sessions", transport="stream"),
                    "runnable": _value(samples, "ironflow_queue_depth", state="runnable"),
                    "leases": _value(samples, "ironflow_active_leases"),
                }
                if all(got[k] == v for k, v in wanted.items()):
                    return
                await trio.sleep(0.2)

    async with trio.open_nursery() as inner:
        worker = ironflow.StreamingWorker(node.url, [metered], handle_signals=False, reconnect_delay=0.1)
        await inner.start(worker.run)
        await wait_gauges(stream=1, runnable=0, leases=0)
        inner.cancel_scope.cancel()
    # No worker left: a new run waits in the queue, runnable now.
    await emit(http, "metered.go")
    await wait_gauges(stream=0, runnable=1, leases=0)
