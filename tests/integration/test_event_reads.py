"""Stored events with their runs, and a run's re-run: a new run of the same
function with the same event (both backends, a real node and an SDK worker)."""

from __future__ import annotations

from typing import Any

import httpx
import trio

import ironflow
from ironflow.node import Node
from tests.integration.helpers import emit, wait_for_run


@ironflow.function(id="echo", triggers=[ironflow.event("echo.go")])
async def echo(ctx: Any) -> Any:
    return await ctx.step.run("echo", lambda: {"got": ctx.event.data, "run": ctx.run.id})


async def _start_worker(nursery: trio.Nursery, node: Node) -> None:
    worker = ironflow.StreamingWorker(node.url, [echo], handle_signals=False, reconnect_delay=0.1)
    await nursery.start(worker.run)


async def test_events_are_listed_newest_first_with_the_runs_they_started(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    await _start_worker(nursery, node)
    first = await emit(http, "echo.go", {"n": 1})
    second = await emit(http, "echo.go", {"n": 2})
    unmatched = await emit(http, "nobody.listens", {"n": 3})

    listed = (await http.get("/v1/events", params={"limit": 10})).json()["events"]
    assert [e["id"] for e in listed] == [unmatched["event_id"], second["event_id"], first["event_id"]]
    assert listed[1]["run_ids"] == second["run_ids"] and len(second["run_ids"]) == 1
    assert listed[0]["run_ids"] == [] and listed[0]["data"] is None  # a list carries no payloads
    with_data = (await http.get("/v1/events", params={"limit": 1, "include": "data"})).json()["events"]
    assert with_data[0]["data"] == {"n": 3}

    by_name = (await http.get("/v1/events", params={"name": "nobody.listens"})).json()["events"]
    assert [e["id"] for e in by_name] == [unmatched["event_id"]]
    one = (await http.get(f"/v1/events/{first['event_id']}")).json()
    assert one["name"] == "echo.go" and one["data"] == {"n": 1} and one["run_ids"] == first["run_ids"]
    missing = await http.get("/v1/events/evt_nope")
    assert missing.status_code == 404 and missing.json()["code"] == "NOT_FOUND"


async def test_rerun_starts_a_new_run_of_the_same_function_with_the_same_event(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    await _start_worker(nursery, node)
    emitted = await emit(http, "echo.go", {"order": 42})
    original = emitted["run_ids"][0]
    await wait_for_run(http, original)

    resp = await http.post(f"/v1/runs/{original}/rerun")
    assert resp.status_code == 201, resp.text
    answer = resp.json()
    assert answer["rerun_of"] == original and answer["event_id"] == emitted["event_id"]
    assert answer["run_id"] != original

    detail = await wait_for_run(http, answer["run_id"])
    assert detail["run"]["status"] == "completed"
    assert detail["run"]["event_id"] == emitted["event_id"]
    assert detail["run"]["output"] == {"got": {"order": 42}, "run": answer["run_id"]}
    event = (await http.get(f"/v1/events/{emitted['event_id']}")).json()
    assert event["run_ids"] == [original, answer["run_id"]]


async def test_rerun_of_an_unknown_run_is_a_404(node: Node, http: httpx.AsyncClient) -> None:
    resp = await http.post("/v1/runs/run_nope/rerun")
    assert resp.status_code == 404 and resp.json()["code"] == "RUN_NOT_FOUND"


async def test_run_stats_count_recent_runs_by_status_per_minute_and_per_function(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    await _start_worker(nursery, node)
    done = [(await emit(http, "echo.go", {"i": i}))["run_ids"][0] for i in range(3)]
    for run_id in done:
        await wait_for_run(http, run_id)
    stats = (await http.get("/v1/stats/runs", params={"window_s": 600, "bucket_s": 60})).json()
    assert stats["window_s"] == 600 and stats["bucket_s"] == 60
    assert stats["functions"] == [{"function_id": "echo", "status": "completed", "count": 3}]
    assert sum(b["count"] for b in stats["buckets"]) == 3
    for bucket in stats["buckets"]:
        assert bucket["status"] == "completed" and bucket["start"] % 60 == 0
        assert stats["since"] - 60 <= bucket["start"] <= stats["db_now"]
    too_fine = await http.get("/v1/stats/runs", params={"window_s": 86400, "bucket_s": 10})
    assert too_fine.status_code == 400 and too_fine.json()["code"] == "VALIDATION_ERROR"
