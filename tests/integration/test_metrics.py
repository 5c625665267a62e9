"""The operator's metrics through a real node (both backends): latency
histograms observed as runs go by, capacity gauges sampled from the database."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

import ironflow
from ironflow.node import Node
from ironflow.protocol import SESSION_SECRET_HEADER
from ironflow.store import timing
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


PULLED = {"id": "pulled-metered", "triggers": [{"event": "pulled.go"}],
          "retries": {"max_attempts": 1}}


async def _pull_session(http: httpx.AsyncClient) -> tuple[str, dict[str, str]]:
    """A pull worker for ``PULLED`` with one slot: its session id and secret header."""
    resp = await http.post(
        "/v1/worker/register",
        json={"type": "register", "worker_id": "p1", "functions": [PULLED], "max_concurrent_jobs": 1},
    )
    assert resp.status_code == 201, resp.text
    return resp.json()["session_id"], {SESSION_SECRET_HEADER: resp.json()["session_secret"]}


async def _take(http: httpx.AsyncClient, sid: str, secret: dict[str, str]) -> str:
    """Poll one job on the pull session and ack it; returns its run id."""
    resp = await http.post(f"/v1/worker/sessions/{sid}/poll", json={"wait_s": 5, "max_jobs": 1}, headers=secret)
    (job,) = resp.json()["jobs"]
    ack = {k: job[k] for k in ("job_id", "run_id", "execution_seq", "lease_token")}
    resp = await http.post(f"/v1/worker/sessions/{sid}/ack", json={"type": "job_ack", **ack}, headers=secret)
    assert resp.status_code == 200, resp.text
    return str(job["run_id"])


@pytest.mark.parametrize("node_timings", [{"recovery_ceiling": 1}])
async def test_a_cancelled_run_and_a_run_failed_at_a_pull_goodbye_are_each_observed_once(
    node: Node, http: httpx.AsyncClient
) -> None:
    before = await _samples(http)
    sid, secret = await _pull_session(http)
    held = (await emit(http, "pulled.go"))["run_ids"][0]
    assert await _take(http, sid, secret) == held
    # The worker leaves holding `held`: recovered (the first recovery has no grace).
    assert (await http.delete(f"/v1/worker/sessions/{sid}", headers=secret)).status_code == 200
    sid, secret = await _pull_session(http)
    assert await _take(http, sid, secret) == held
    queued = (await emit(http, "pulled.go"))["run_ids"][0]  # no free slot: it waits
    assert (await http.post(f"/v1/runs/{queued}/cancel", json={})).status_code == 200
    # It leaves again: past the recovery ceiling (1), the run fails.
    assert (await http.delete(f"/v1/worker/sessions/{sid}", headers=secret)).status_code == 200
    assert (await wait_for_run(http, held))["run"]["error"]["code"] == "EXECUTION_RECOVERY_EXHAUSTED"
    assert (await wait_for_run(http, queued))["run"]["status"] == "cancelled"
    after = await _samples(http)

    def grew(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    fn = "pulled-metered"
    assert grew("ironflow_run_duration_seconds_count", function=fn, status="cancelled") == 1
    assert grew("ironflow_run_duration_seconds_count", function=fn, status="failed") == 1
    assert grew("ironflow_runs_total", status="cancelled") == 1
    assert grew("ironflow_runs_total", status="failed") == 1
    # Every store call went through the timing wrapper, labelled by its method only.
    assert grew("ironflow_store_call_seconds_count", method="cancel_run") == 1
    assert grew("ironflow_store_call_seconds_count", method="close_session") == 2
    methods = {
        dict(labels)["method"] for name, labels in after if name == "ironflow_store_call_seconds_count"
    }
    assert methods and methods <= timing.store_methods()
