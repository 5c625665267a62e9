"""JobNack over a real socket: requeued at once, no attempt used, the seed's log line."""

from __future__ import annotations

import logging

import httpx
import pytest
import trio

from ironflow.node import Node
from ironflow.protocol import FunctionDef, JobAssignment, JobNack, Trigger
from tests.integration.helpers import emit, raw_worker

FN = FunctionDef(id="f", triggers=[Trigger("f.go")])


async def test_draining_nack_requeues_at_once_without_spending_an_attempt(
    node: Node, http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ironflow")
    async with raw_worker(node.url, [FN]) as old:
        run_id = (await emit(http, "f.go"))["run_ids"][0]
        job = await old.receive_type(JobAssignment)
        async with raw_worker(node.url, [FN]) as replacement:
            await old.send(JobNack(job.job_id, job.run_id, job.execution_seq, job.lease_token, "DRAINING"))
            t0 = trio.current_time()
            again = await replacement.receive_type(JobAssignment)
            # No recovery grace: the replacement has it within moments.
            assert trio.current_time() - t0 < 1.0
            assert again.run_id == run_id and again.execution_seq == job.execution_seq + 1
            assert again.attempt == job.attempt
    detail = (await http.get(f"/v1/runs/{run_id}")).json()
    assert detail["run"]["attempt"] == 1 and detail["run"]["recovery_count"] == 0
    assert detail["run"]["error"] is None
    lines = [r for r in caplog.records if r.getMessage() == "capacity: job nacked, re-queued with no attempt used"]
    assert lines and lines[0].fields["run_id"] == run_id and lines[0].fields["reason"] == "DRAINING"  # type: ignore[attr-defined]


async def test_draining_session_is_offered_no_more_work(node: Node, http: httpx.AsyncClient) -> None:
    async with raw_worker(node.url, [FN], max_concurrent_jobs=5) as old:
        await emit(http, "f.go")
        job = await old.receive_type(JobAssignment)
        await old.send(JobNack(job.job_id, job.run_id, job.execution_seq, job.lease_token, "DRAINING"))
        with trio.fail_after(5):  # the engine has applied the nack
            while (await http.get(f"/v1/runs/{job.run_id}")).json()["run"]["current_execution_seq"] == job.execution_seq:
                await trio.sleep(0.01)
        # The nack marked the session draining: even with 5 free slots, the
        # requeued run and a new one are not offered to it again.
        await emit(http, "f.go")
        with pytest.raises(trio.TooSlowError):
            await old.receive_type(JobAssignment, timeout=1.0)
