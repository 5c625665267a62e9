"""``POST /v1/runs/purge`` on a real node: platform key only, validated, audited."""

from __future__ import annotations

import httpx

import ironflow
from ironflow.node import Node
from tests.clock import skewed
from tests.integration.helpers import emit, wait_for_run


async def test_purge_needs_a_platform_key_even_in_dev(node: Node, http: httpx.AsyncClient) -> None:
    resp = await http.post("/v1/runs/purge", json={"older_than_s": 60})
    assert resp.status_code == 403 and resp.json()["code"] == "FORBIDDEN"
    _, org_key = await node.store.create_api_key("org")
    resp = await http.post(
        "/v1/runs/purge", json={"older_than_s": 60}, headers={"Authorization": f"Bearer {org_key}"}
    )
    assert resp.status_code == 403


async def test_purge_validates_its_body(node: Node, http: httpx.AsyncClient) -> None:
    _, key = await node.store.create_api_key("platform")
    auth = {"Authorization": f"Bearer {key}"}
    for body in ({"older_than_s": 0}, {"older_than_s": 60, "statuses": ["running"]}, {}):
        resp = await http.post("/v1/runs/purge", json=body, headers=auth)
        assert resp.status_code == 400 and resp.json()["code"] == "VALIDATION_ERROR", body


async def test_purge_deletes_finished_runs_past_the_cutoff_and_audits_the_pass(
    node: Node, http: httpx.AsyncClient, nursery
) -> None:
    @ironflow.function(id="echo", triggers=[ironflow.event("echo.go")])
    async def echo(ctx):
        return await ctx.step.run("echo", lambda: ctx.event.data)

    worker = ironflow.StreamingWorker(node.url, [echo], handle_signals=False)
    await nursery.start(worker.run)
    run_id = (await emit(http, "echo.go", {"n": 1}))["run_ids"][0]
    await wait_for_run(http, run_id)
    worker.stop()
    _, key = await node.store.create_api_key("platform")
    auth = {"Authorization": f"Bearer {key}"}
    resp = await http.post("/v1/runs/purge", json={"older_than_s": 3600}, headers=auth)
    assert resp.json() == {"runs": 0, "steps": 0, "audit": 0, "events": 0, "older_than_s": 3600}
    await skewed(node.store).advance_clock(3601)
    resp = await http.post(
        "/v1/runs/purge", json={"older_than_s": 3600, "statuses": ["completed"]}, headers=auth
    )
    assert resp.status_code == 200
    assert resp.json()["runs"] == 1 and resp.json()["steps"] == 1
    assert (await http.get(f"/v1/runs/{run_id}")).status_code == 404
    (audit,) = await node.store.list_audit(type="history.purged")
    assert audit.data["runs"] == 1 and audit.data["by"].startswith("api:key_")
