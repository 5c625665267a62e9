"""Crash recovery with real processes: kill -9 and SIGSTOP workers, on both backends.

Side effects are counted in a file the worker processes append to, so
"nothing lost, nothing recorded twice" is checked against what really ran.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest
import trio
import trio_websocket

from ironflow.node import Node
from tests.clock import skewed
from tests.integration.helpers import emit, wait_for_run, wait_for_step
from tests.integration.procs import (
    Proc,
    assert_worker_loop,
    count,
    read_effects,
    start_worker,
    wait_effect,
)

pytestmark = pytest.mark.slow


async def audit_types(http: httpx.AsyncClient, run_id: str) -> list[str]:
    events = (await http.get("/v1/audit", params={"include": "data", "run_id": run_id})).json()["events"]
    return [e["type"] for e in events]


async def test_kill_9_streaming_worker_resumes_on_connected_peer(
    node: Node, http: httpx.AsyncClient, tmp_path: Path, procs: list[Proc], worker_loop: str
) -> None:
    effects = tmp_path / "effects.log"
    a = await start_worker(node.url, effects, tmp_path, name="a")
    procs.append(a)
    run_id = (await emit(http, "crash.go"))["run_ids"][0]
    await wait_effect(effects, run_id, "two-start", pid=a.pid)
    await wait_for_step(http, run_id, "one")
    b = await start_worker(node.url, effects, tmp_path, name="b")
    procs.append(b)
    killed_at = a.signal(signal.SIGKILL)
    resumed = await wait_effect(effects, run_id, "two-start", pid=b.pid, timeout=10)
    latency = resumed[0] - killed_at
    print(f"\nkill -9 → resumed on peer (streaming, {node.config.database_url.split(':')[0]}): {latency * 1000:.0f} ms")
    detail = await wait_for_run(http, run_id)
    run = detail["run"]
    assert run["status"] == "completed"
    assert run["output"] == {"pid": b.pid}
    assert run["attempt"] == 1 and run["recovery_count"] == 1
    rows = read_effects(effects)
    assert count(rows, run_id, "one") == 1  # the completed step was not re-executed
    assert count(rows, run_id, "two-done") == 1
    types = await audit_types(http, run_id)
    assert "capacity.lease.expired" in types and "capacity.segment.recovered" in types
    # Fast loss detection: the first recovery is not held back by the grace.
    assert latency < node.config.timings.recovery_grace_s + 1.0
    assert_worker_loop(b, worker_loop)


async def test_sigstop_past_lease_expiry_then_sigcont_is_fenced(
    node: Node, http: httpx.AsyncClient, tmp_path: Path, procs: list[Proc]
) -> None:
    effects = tmp_path / "effects.log"
    lease_s = node.config.timings.lease_expiry_s
    # The frozen worker's step outlives its lease; the peer's replay is quick.
    a = await start_worker(node.url, effects, tmp_path, name="a", slow=lease_s + 3)
    procs.append(a)
    run_id = (await emit(http, "crash.go"))["run_ids"][0]
    await wait_effect(effects, run_id, "two-start", pid=a.pid)
    await wait_for_step(http, run_id, "one")
    b = await start_worker(node.url, effects, tmp_path, name="b")
    procs.append(b)
    a.signal(signal.SIGSTOP)
    # Loop 1 (lease expiry; the socket is still open) hands the run to b.
    await wait_effect(effects, run_id, "two-done", pid=b.pid, timeout=lease_s + 10)
    detail = await wait_for_run(http, run_id)
    assert detail["run"]["output"] == {"pid": b.pid}
    a.signal(signal.SIGCONT)
    # The woken worker still holds execution_seq N: whether its step result,
    # its heartbeat (LeaseStatus STALE) or its expired session reaches the
    # engine first, every write it makes with the old fence is refused.
    await trio.sleep(3.0)
    detail = await wait_for_run(http, run_id)
    run = detail["run"]
    assert run["status"] == "completed" and run["output"] == {"pid": b.pid}
    assert run["recovery_count"] == 1
    two = [s for s in detail["steps"] if s["name"] == "two"]
    assert len(two) == 1 and two[0]["output"] == {"pid": b.pid}
    assert count(read_effects(effects), run_id, "one") == 1
    types = await audit_types(http, run_id)
    assert types.count("capacity.lease.expired") == 1 and types.count("capacity.segment.recovered") == 1
    assert a.alive()  # refused, not crashed


async def test_kill_9_pull_worker_recovers_through_lease_expiry(
    node: Node, http: httpx.AsyncClient, tmp_path: Path, procs: list[Proc]
) -> None:
    effects = tmp_path / "effects.log"
    t = node.config.timings
    a = await start_worker(node.url, effects, tmp_path, name="a", pull=True)
    procs.append(a)
    run_id = (await emit(http, "crash.go"))["run_ids"][0]
    await wait_effect(effects, run_id, "two-start", pid=a.pid)
    await wait_for_step(http, run_id, "one")
    b = await start_worker(node.url, effects, tmp_path, name="b", pull=True)
    procs.append(b)
    detail = (await http.get(f"/v1/runs/{run_id}")).json()
    lease_left = detail["lease"]["expires_at"] - detail["db_now"]
    killed_at = a.signal(signal.SIGKILL)
    resumed = await wait_effect(effects, run_id, "two-start", pid=b.pid, timeout=t.lease_expiry_s + 10)
    latency = resumed[0] - killed_at
    budget = lease_left + t.recovery_grace_s
    print(
        f"\nkill -9 → resumed (pull, {node.config.database_url.split(':')[0]}): {latency:.2f} s "
        f"(lease left {lease_left:.2f} s + grace {t.recovery_grace_s:g} s = {budget:.2f} s)"
    )
    # No scanner or dispatch tick on top: within lease left + grace + 1 s.
    assert latency <= budget + 1.0
    run = (await wait_for_run(http, run_id))["run"]
    assert run["status"] == "completed" and run["output"] == {"pid": b.pid}
    assert run["recovery_count"] == 1 and run["attempt"] == 1
    assert count(read_effects(effects), run_id, "one") == 1
    types = await audit_types(http, run_id)
    assert "capacity.lease.expired" in types and "capacity.segment.recovered" in types


async def test_capacity_endpoints_need_a_platform_principal(node: Node, http: httpx.AsyncClient) -> None:
    _, org_key = await node.store.create_api_key("org", "admin")
    _, platform_key = await node.store.create_api_key("platform", "platform_admin")
    for what in ("leases", "sessions", "queue"):
        for headers in ({}, {"Authorization": f"Bearer {org_key}"}, {"Authorization": f"Bearer {node.bootstrap_key}"}):
            resp = await http.get(f"/v1/capacity/{what}", headers=headers)
            assert resp.status_code == 403, (what, headers, resp.text)
            assert resp.json()["message"] == "platform credentials required here"
        resp = await http.get(f"/v1/capacity/{what}", headers={"Authorization": f"Bearer {platform_key}"})
        assert resp.status_code == 200 and what in resp.json()
    # Only a platform principal can mint a platform key.
    resp = await http.post("/v1/keys", json={"platform": True}, headers={"Authorization": f"Bearer {org_key}"})
    assert resp.status_code == 403
    resp = await http.post("/v1/keys", json={"platform": True}, headers={"Authorization": f"Bearer {platform_key}"})
    assert resp.status_code == 201 and resp.json()["key"].startswith("ifplatform_")
    _, viewer = await node.store.create_api_key("platform", "platform_viewer")
    resp = await http.post("/v1/keys", json={"platform": True}, headers={"Authorization": f"Bearer {viewer}"})
    assert resp.status_code == 403 and "platform admin" in resp.json()["message"]


async def test_a_worker_that_outlived_its_lease_is_refused_on_every_write(node: Node, http: httpx.AsyncClient) -> None:
    from ironflow.protocol import (
        ActiveJob,
        FunctionDef,
        Heartbeat,
        JobAck,
        JobAssignment,
        JobCompleted,
        LeaseStatus,
        Refused,
        StepCompleted,
        Trigger,
    )
    from tests.integration.helpers import raw_worker

    fn = FunctionDef(id="frozen", triggers=[Trigger("frozen.go")])
    async with raw_worker(node.url, [fn]) as frozen:
        run_id = (await emit(http, "frozen.go"))["run_ids"][0]
        job = await frozen.receive_type(JobAssignment)
        await frozen.send(JobAck(job.job_id, job.run_id, job.execution_seq, job.lease_token))
        await wait_for_run(http, run_id, "running")
        # Freeze: no heartbeat while the database clock passes the lease expiry.
        await skewed(node.store).advance_clock(node.config.timings.lease_expiry_s + 1)
        detail = await wait_for_run(http, run_id, "waiting", timeout=10)
        assert detail["run"]["current_execution_seq"] == job.execution_seq + 1
        # Wake up and write with the old execution_seq: every write is refused.
        fence = (job.job_id, job.run_id, job.execution_seq, job.lease_token)
        await frozen.send(StepCompleted(*fence, step_id=f"{run_id}:s:0", name="s", output=1))
        assert (await frozen.receive_type(Refused)).code == "STALE_EXECUTION"
        await frozen.send(JobCompleted(*fence, output="late"))
        assert (await frozen.receive_type(Refused)).job_id == job.job_id
        # Its session expired on the same clock: the heartbeat is refused by
        # closing the socket (the worker reconnects and registers afresh).
        await frozen.send(Heartbeat(jobs=[ActiveJob(*fence)]))
        with pytest.raises(trio_websocket.ConnectionClosed) as closed:
            await frozen.receive_type(LeaseStatus)
        assert closed.value.reason.code == 1008
    detail = (await http.get(f"/v1/runs/{run_id}")).json()
    assert detail["run"]["status"] != "completed" and detail["steps"] == []
    assert detail["run"]["recovery_count"] == 1
