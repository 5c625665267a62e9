"""Trigger filters and cancel-on through a real node (both backends) and real
workers over the wire (docs/triggers.md): the event record, the 422 and the
websocket refusal of a bad expression, a run mid-step told ``Cancel`` with
its late step result refused as stale (a hand-driven worker), and, with node
and worker processes, a sleeping run, a run mid-step and a run waiting for a
child cancelled by an event, nothing else."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import ironflow
from ironflow.node import Node
from ironflow.protocol import (
    Cancel,
    CancelOn,
    FunctionDef,
    JobAck,
    JobAssignment,
    Refused,
    Register,
    StepCompleted,
    Trigger,
)
from tests.integration.conftest import serve_node
from tests.integration.helpers import emit, raw_worker, wait_for_run
from tests.integration.procs import ROOT, Proc

pytestmark = pytest.mark.slow

UNSUB = ironflow.CancelOn("user.unsubscribed", match="data.user_id")


async def test_a_filter_through_the_api_and_the_event_record_says_why(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    @ironflow.function(id="big", triggers=[ironflow.event("order.*", expression="event.data.amount > 100")])
    async def big(ctx: Any) -> Any:
        return ctx.event.data["amount"]

    worker = ironflow.StreamingWorker(node.url, [big], handle_signals=False)
    await nursery.start(worker.run)
    yes, no, bad = [await emit(http, "order.created", {"amount": a}) for a in (500, 5, "x")]
    assert len(yes["run_ids"]) == 1 and no["run_ids"] == [] == bad["run_ids"]
    assert (await wait_for_run(http, yes["run_ids"][0]))["run"]["output"] == 500
    record = (await http.get(f"/v1/events/{no['event_id']}")).json()
    assert record["filtered"] == [
        {"function_id": "big", "reason": "filter 'event.data.amount > 100' was false", "error": False,
         "code": None}
    ]
    (note,) = (await http.get(f"/v1/events/{bad['event_id']}")).json()["filtered"]
    assert note["error"] is True and "No such overload" in note["reason"]
    assert note["code"] == "EXPRESSION_FAILED"
    worker.stop()


async def test_a_bad_expression_is_refused_on_the_pull_register_and_the_websocket(
    node: Node, http: httpx.AsyncClient
) -> None:
    bad = {"id": "f", "triggers": [{"event": "e", "expression": "event.data.x >"}]}
    resp = await http.post("/v1/worker/register", json={"type": "register", "worker_id": "p", "functions": [bad]})
    assert resp.status_code == 422, resp.text
    assert "triggers[0].expression" in resp.json()["message"] and "line 1, column 15" in resp.json()["message"]
    no_event = {"id": "f", "cancel_on": [{"match": "data.user_id"}]}
    resp = await http.post("/v1/worker/register", json={"type": "register", "worker_id": "p", "functions": [no_event]})
    # Malformed, as every body the schema refuses: 400 naming the field; nothing stored.
    assert resp.status_code == 400 and resp.json()["code"] == "VALIDATION_ERROR", resp.text
    assert "missing required field `event`" in resp.json()["message"]
    assert "cancel_on[0]" in resp.json()["message"]
    fd = FunctionDef(id="f", cancel_on=[CancelOn("u", expression="async.data ==")])
    async with raw_worker(node.url, None, register=False) as raw:
        await raw.send(Register(worker_id="w", functions=[fd]))
        refused = await raw.receive_type(Refused)
        assert refused.code == "REGISTRATION_REFUSED" and "cancel_on[0].expression" in refused.message
    assert [f["id"] for f in (await http.get("/v1/functions?all=1")).json()["functions"]] == []


async def test_a_run_mid_step_gets_cancel_and_its_late_step_result_is_refused(
    node: Node, http: httpx.AsyncClient
) -> None:
    fd = FunctionDef(id="drip", triggers=[Trigger("user.created")], cancel_on=[UNSUB])
    async with raw_worker(node.url, [fd]) as raw:
        run_id = (await emit(http, "user.created", {"user_id": 9}))["run_ids"][0]
        job = await raw.receive_type(JobAssignment)
        fence = {"job_id": job.job_id, "run_id": run_id, "execution_seq": job.execution_seq,
                 "lease_token": job.lease_token}
        await raw.send(JobAck(**fence))
        await wait_for_run(http, run_id, "running")
        await emit(http, "user.unsubscribed", {"user_id": 9})
        cancel = await raw.receive_type(Cancel)
        assert (cancel.job_id, cancel.run_id) == (job.job_id, run_id)
        await raw.send(StepCompleted(**fence, step_id="s", name="s", output=1))
        refused = await raw.receive_type(Refused)
        assert refused.code == "STALE_EXECUTION" and refused.job_id == job.job_id
    detail = await wait_for_run(http, run_id)
    assert detail["run"]["status"] == "cancelled" and detail["steps"] == []


async def test_real_processes_an_event_cancels_a_sleeping_run_one_mid_step_and_one_waiting_for_a_child(
    database_url: str, tmp_path: Path, procs: list[Proc]
) -> None:
    served = await serve_node(procs, database_url, tmp_path, "n1")
    worker = Proc([sys.executable, str(ROOT / "tests" / "procs" / "cancel_worker.py"), served.url],
                  tmp_path / "worker.log")
    procs.append(worker)
    await worker.wait_line("READY")
    async with httpx.AsyncClient(base_url=served.url, timeout=10) as http:
        runs = {
            kind: (await emit(http, "user.created", {"user_id": user, "kind": kind}))["run_ids"][0]
            for user, kind in enumerate(("sleep", "step", "invoke"))
        }
        kept = (await emit(http, "user.created", {"user_id": 9, "kind": "sleep"}))["run_ids"][0]
        await wait_for_run(http, runs["sleep"], "waiting")
        await wait_for_run(http, runs["step"], "running")
        await wait_for_run(http, runs["invoke"], "waiting")
        await wait_for_run(http, kept, "waiting")
        for user in range(3):
            await emit(http, "user.unsubscribed", {"user_id": user})
        for kind in ("sleep", "step", "invoke"):
            assert (await wait_for_run(http, runs[kind]))["run"]["status"] == "cancelled"
        # The worker holding the mid-step run was told (and cancelled its step).
        with trio.fail_after(10):
            while "Run cancelled; cancelling job" not in worker.log_path.read_text(errors="replace"):
                await trio.sleep(0.05)
        listed = {r["id"]: (r["function_id"], r["status"]) for r in (await http.get("/v1/runs", params={"include": "data"})).json()["runs"]}
        assert listed[kept] == ("drip", "waiting")
        assert [s for f, s in listed.values() if f == "slow-child"] == ["waiting"]
        assert (await http.get(f"/v1/runs/{runs['step']}")).json()["steps"] == []
