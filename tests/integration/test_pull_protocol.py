"""The pull-worker HTTP protocol: long-poll held by the node, same fencing as streaming."""

from __future__ import annotations

import httpx
import trio

from ironflow.node import Node
from ironflow.protocol import SESSION_SECRET_HEADER
from tests.integration.helpers import emit, wait_for_run

FN = {"id": "pulled", "triggers": [{"event": "pull.go"}]}


async def register(http: httpx.AsyncClient) -> str:
    """Register a pull session; ``http`` then presents its secret on every call."""
    resp = await http.post(
        "/v1/worker/register",
        json={"type": "register", "worker_id": "p1", "functions": [FN], "max_concurrent_jobs": 2},
    )
    assert resp.status_code == 201, resp.text
    http.headers[SESSION_SECRET_HEADER] = resp.json()["session_secret"]
    return str(resp.json()["session_id"])


def fenced(job: dict, kind: str, **extra: object) -> dict:
    return {
        "type": kind,
        "job_id": job["job_id"],
        "run_id": job["run_id"],
        "execution_seq": job["execution_seq"],
        "lease_token": job["lease_token"],
        **extra,
    }


async def test_poll_is_held_open_until_work_arrives(node: Node, http: httpx.AsyncClient, nursery: trio.Nursery) -> None:
    sid = await register(http)
    got: list[dict] = []
    t0 = trio.current_time()

    async def poll() -> None:
        resp = await http.post(f"/v1/worker/sessions/{sid}/poll", json={"wait_s": 10, "max_jobs": 1})
        got.extend(resp.json()["jobs"])

    nursery.start_soon(poll)
    await trio.sleep(0.5)
    assert got == []  # still held open by the node
    run_id = (await emit(http, "pull.go"))["run_ids"][0]
    with trio.fail_after(5):
        while not got:
            await trio.sleep(0.01)
    assert got[0]["run_id"] == run_id and trio.current_time() - t0 < 2
    # An empty poll returns after wait_s with no jobs.
    resp = await http.post(f"/v1/worker/sessions/{sid}/poll", json={"wait_s": 0.2, "max_jobs": 1})
    assert resp.status_code == 200 and resp.json()["jobs"] == []


async def test_stale_fence_gets_409_and_the_live_one_completes(node: Node, http: httpx.AsyncClient) -> None:
    sid = await register(http)
    run_id = (await emit(http, "pull.go"))["run_ids"][0]
    resp = await http.post(f"/v1/worker/sessions/{sid}/poll", json={"wait_s": 5, "max_jobs": 1})
    (job,) = resp.json()["jobs"]
    forged = {**job, "lease_token": "f" * 32}
    resp = await http.post(f"/v1/worker/sessions/{sid}/ack", json=fenced(forged, "job_ack"))
    assert resp.status_code == 409 and resp.json()["code"] == "STALE_EXECUTION"
    assert (await http.post(f"/v1/worker/sessions/{sid}/ack", json=fenced(job, "job_ack"))).status_code == 200
    step = fenced(job, "step_completed", step_id=f"{run_id}:s:0", name="s", output={"x": 1})
    assert (await http.post(f"/v1/worker/sessions/{sid}/steps", json=step)).status_code == 200
    resp = await http.post(f"/v1/worker/sessions/{sid}/heartbeat", json={"type": "heartbeat", "jobs": [{"job_id": 1}]})
    assert resp.status_code == 400 and resp.json()["code"] == "VALIDATION_ERROR"
    active = {k: job[k] for k in ("job_id", "run_id", "execution_seq", "lease_token")}
    resp = await http.post(f"/v1/worker/sessions/{sid}/heartbeat", json={"type": "heartbeat", "jobs": [active]})
    assert resp.status_code == 200 and resp.json()["jobs"][0]["state"] == "REFRESHED"
    # A message of the wrong kind for the route is refused with a clear error.
    resp = await http.post(f"/v1/worker/sessions/{sid}/steps", json=fenced(job, "job_completed", output=1))
    assert resp.status_code == 400 and "not accepted here" in resp.json()["message"]
    done = fenced(job, "job_completed", output={"ok": True})
    assert (await http.post(f"/v1/worker/sessions/{sid}/result", json=done)).status_code == 200
    # The segment is over: the same fence is now stale.
    resp = await http.post(f"/v1/worker/sessions/{sid}/result", json=done)
    assert resp.status_code == 409 and resp.json()["code"] == "STALE_EXECUTION"
    detail = await wait_for_run(http, run_id)
    assert detail["run"]["output"] == {"ok": True}
    assert [s["output"] for s in detail["steps"]] == [{"x": 1}]


async def test_unknown_session_gets_404_so_the_worker_registers_again(node: Node, http: httpx.AsyncClient) -> None:
    for path, body in (("poll", {"wait_s": 0}), ("heartbeat", {"type": "heartbeat", "jobs": []})):
        resp = await http.post(f"/v1/worker/sessions/ses_nope/{path}", json=body)
        assert resp.status_code == 404 and resp.json()["code"] == "SESSION_NOT_FOUND", (path, resp.text)
