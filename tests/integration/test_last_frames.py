"""A worker's last frames before it closes its socket reach the engine, even
when the engine's session actor is behind (found by scripts/rolling_restart.py
on an overloaded machine: a drained worker's results were lost and their
leases recovered, spending recoveries the drain exists to avoid)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from actors import session as session_actor
from ironflow.api.worker_socket import INBOUND_BUFFER
from ironflow.node import Node
from ironflow.protocol import FunctionDef, Heartbeat, JobAck, JobAssignment, JobCompleted, Trigger
from tests.integration.helpers import emit, raw_worker, wait_for_run

FN = FunctionDef(id="f", triggers=[Trigger("f.go")])


async def test_frames_sent_before_a_close_are_applied_even_when_the_session_actor_is_behind(
    node: Node, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = trio.Event()
    stalled = trio.Event()
    original = session_actor._handle_batch

    async def behind(*args: Any, **kwargs: Any) -> Any:
        if stall[0]:
            stalled.set()
            await gate.wait()  # the store is slow: the actor falls behind the socket
        return await original(*args, **kwargs)

    stall = [False]
    monkeypatch.setattr(session_actor, "_handle_batch", behind)
    async with raw_worker(node.url, [FN]) as worker:
        run_id = (await emit(http, "f.go"))["run_ids"][0]
        job = await worker.receive_type(JobAssignment)
        fence = (job.job_id, job.run_id, job.execution_seq, job.lease_token)
        await worker.send(JobAck(*fence))
        with trio.fail_after(5):
            while (await http.get(f"/v1/runs/{run_id}")).json()["lease"] is None:
                await trio.sleep(0.01)
        stall[0] = True
        await worker.send(Heartbeat(jobs=None))
        with trio.fail_after(5):
            await stalled.wait()
        # Enough frames to fill the engine's inbound buffer and leave the
        # last ones in the framework's, then the result, then a clean close.
        for _ in range(INBOUND_BUFFER + 4):
            await worker.send(Heartbeat(jobs=None))
        await worker.send(JobCompleted(*fence, output="done"))
        await worker.ws.aclose(1000)
    await trio.sleep(0.5)  # the engine has seen the close while the actor is stalled
    gate.set()
    run = (await wait_for_run(http, run_id, timeout=10))["run"]
    assert run["status"] == "completed" and run["output"] == "done"
    assert run["recovery_count"] == 0 and run["attempt"] == 1
