"""Cron triggers and function pause/resume through a real node, its HTTP API
and the CLI (both backends); bad cron input refused at the SDK and the engine."""

from __future__ import annotations

import json
from typing import Any

import httpx
import msgspec
import pytest
import trio

import ironflow
from ironflow.node import Node
from ironflow.protocol import FunctionDef, Trigger
from ironflow.sdk.function import Function
from tests.integration.helpers import emit, eventually
from tests.integration.test_cli_e2e import cli

pytestmark = pytest.mark.slow


async def cron_runs(http: httpx.AsyncClient, fid: str) -> list[dict[str, Any]]:
    return (await http.get("/v1/runs", params={"include": "data", "function": fid, "limit": 1000})).json()["runs"]


async def test_pause_stops_events_and_ticks_and_resume_with_catchup_starts_the_latest(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    @ironflow.function(id="pausable", triggers=[ironflow.event("p.go"), ironflow.cron("* * * * * *")])
    async def pausable(ctx: Any) -> Any:
        return ctx.event.name

    worker = ironflow.StreamingWorker(node.url, [pausable], handle_signals=False)
    await nursery.start(worker.run)

    paused = await cli(node, "functions", "pause", "pausable")
    assert paused.exit_code == 0 and "pausable paused" in paused.output, paused.output
    assert "already paused" in (await cli(node, "functions", "pause", "pausable")).output
    before = len(await cron_runs(http, "pausable"))  # ticks fired before the pause
    answer = await emit(http, "p.go")
    assert answer["run_ids"] == [] and answer["paused_function_ids"] == ["pausable"]
    await trio.sleep(2.2)  # two ticks pass, paused
    assert len(await cron_runs(http, "pausable")) == before

    listed = json.loads((await cli(node, "functions", "list", "--json")).output)["functions"]
    [record] = [f for f in listed if f["id"] == "pausable"]
    assert record["paused_at"] is not None and record["schedules"][0]["cron"] == "* * * * * *"
    table = (await cli(node, "functions", "list")).output
    assert "NEXT TICK" in table and "paused" in table and "cron '* * * * * *'" in table

    resumed = await cli(node, "functions", "resume", "pausable", "--catchup")
    assert resumed.exit_code == 0 and "resumed; catch-up run run_" in resumed.output, resumed.output
    # Events and ticks start runs again.
    assert len((await emit(http, "p.go"))["run_ids"]) == 1

    async def ticking() -> bool:
        done = [r for r in await cron_runs(http, "pausable") if r["status"] == "completed"]
        return len(done) >= before + 3

    await eventually(ticking, timeout=20, message="ticks run again after resume")
    again = await http.post("/v1/functions/pausable/resume", json={"catchup": True})
    assert again.json() == {"function_id": "pausable", "paused": False, "changed": False,
                            "catchup_run_id": None}
    audit = (await http.get("/v1/audit", params={"include": "data", "type": "function.resumed"})).json()["events"]
    assert audit[0]["function_id"] == "pausable" and audit[0]["data"]["catchup"] is True
    missing = await http.post("/v1/functions/nope/pause")
    assert missing.status_code == 404 and missing.json()["code"] == "FUNCTION_NOT_FOUND"
    worker.stop()


async def test_delete_stops_events_and_ticks_lets_a_run_in_flight_finish_and_a_worker_restores_it(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    release = trio.Event()

    @ironflow.function(id="doomed", triggers=[ironflow.event("d.go"), ironflow.cron("* * * * * *")])
    async def doomed(ctx: Any) -> Any:
        if ctx.event.data.get("hold"):
            await release.wait()
        return ctx.event.name

    async def status(run_id: str) -> str:
        return str((await http.get(f"/v1/runs/{run_id}")).json()["run"]["status"])

    async def listed_ids(**params: str) -> list[str]:
        return [f["id"] for f in (await http.get("/v1/functions", params=params)).json()["functions"]]

    worker = ironflow.StreamingWorker(node.url, [doomed], handle_signals=False)
    await nursery.start(worker.run)
    [held] = (await emit(http, "d.go", {"hold": True}))["run_ids"]

    async def held_is(expected: str) -> bool:
        return await status(held) == expected

    await eventually(lambda: held_is("running"), timeout=10, message="the held run started")
    deleted = await cli(node, "functions", "delete", "doomed")
    assert deleted.exit_code == 0 and "function doomed deleted" in deleted.output, deleted.output
    assert "already deleted" in (await cli(node, "functions", "delete", "doomed")).output
    # No new run from its events or its ticks, nor by invoking it.
    assert (await emit(http, "d.go"))["run_ids"] == []
    before = len(await cron_runs(http, "doomed"))
    await trio.sleep(2.2)
    assert len(await cron_runs(http, "doomed")) == before
    invoked = await http.post("/v1/functions/doomed/invoke", json={"data": {}})
    assert invoked.status_code == 404 and invoked.json()["code"] == "FUNCTION_NOT_FOUND"
    # The run in flight finishes; the definition stays for its history.
    release.set()
    await eventually(lambda: held_is("completed"), timeout=10, message="the held run completed")
    assert await listed_ids() == [] and await listed_ids(all="true") == ["doomed"]
    shown = json.loads((await cli(node, "functions", "list", "--all", "--json")).output)["functions"]
    assert shown[0]["deleted_at"] is not None and shown[0]["definition"]["id"] == "doomed"
    assert "deleted" in (await cli(node, "functions", "list", "--all")).output
    missing = await http.delete("/v1/functions/nope")
    assert missing.status_code == 404 and missing.json()["code"] == "FUNCTION_NOT_FOUND"
    unknown = await cli(node, "functions", "delete", "nope")
    assert unknown.exit_code != 0 and "FUNCTION_NOT_FOUND" in unknown.output, unknown.output
    worker.stop()

    # A worker registering it again brings it back, audited.
    again = ironflow.StreamingWorker(node.url, [doomed], handle_signals=False)
    await nursery.start(again.run)

    async def restored() -> bool:
        return await listed_ids() == ["doomed"]

    async def ticking() -> bool:
        return len(await cron_runs(http, "doomed")) > before

    await eventually(restored, timeout=10, message="the function restored")
    assert len((await emit(http, "d.go"))["run_ids"]) == 1
    await eventually(ticking, timeout=10, message="its ticks start runs again")
    for kind in ("function.deleted", "function.restored"):
        [entry] = (await http.get("/v1/audit", params={"include": "data", "type": kind})).json()["events"]
        assert entry["function_id"] == "doomed"
    again.stop()


def _raw_function(trigger: dict[str, Any]) -> Function:
    """A function whose trigger skipped the SDK's checks (as another SDK might send it)."""

    async def handler(ctx: Any) -> None:
        return None

    return Function(FunctionDef(id="raw", triggers=[msgspec.convert(trigger, Trigger)]), handler)


BAD_TRIGGERS = [
    ({"cron": "* * * * * * *"}, "7 fields"),
    ({"cron": "* * * * *", "timezone": "Mars/Olympus"}, "Mars/Olympus"),
    ({"cron": "* 25 * * *"}, "is not valid"),
    ({"event": "a.b", "cron": "* * * * *"}, "exactly one of event= or cron="),
]


# The checks are the engine's, before the store: one backend proves them.
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_bad_cron_trigger_is_refused_at_registration(node: Node, http: httpx.AsyncClient) -> None:
    for trigger, named in BAD_TRIGGERS:
        fd = msgspec.to_builtins(_raw_function(trigger).definition)
        pulled = await http.post("/v1/worker/register", json={"worker_id": "w", "functions": [fd]})
        assert pulled.status_code == 422, pulled.text
        assert named in pulled.json()["message"] and "triggers[0]" in pulled.json()["message"]
        worker = ironflow.StreamingWorker(node.url, [_raw_function(trigger)], handle_signals=False)
        with pytest.raises(ironflow.RegistrationRefusedError, match="triggers"):
            with trio.fail_after(20):
                await worker.run()
    assert (await http.get("/v1/functions?all=true")).json()["functions"] == []
    # catchup outside the enum is refused where it is decoded, naming the field.
    bad = {"id": "raw", "triggers": [{"cron": "* * * * *", "catchup": "sometimes"}]}
    refused = await http.post("/v1/worker/register", json={"worker_id": "w", "functions": [bad]})
    assert refused.status_code == 400 and "catchup" in refused.json()["message"]
    assert (await http.get("/v1/functions?all=true")).json()["functions"] == []  # nothing stored
