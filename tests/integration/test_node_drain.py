"""A node told to shut down drains its streaming workers before it stops."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio

import ironflow
from ironflow.node import Node
from tests.integration.conftest import node_config
from tests.integration.helpers import emit


async def test_node_shutdown_lets_running_jobs_finish_then_stops(
    database_url: str, tmp_path: Path, nursery: trio.Nursery
) -> None:
    node = Node(node_config(database_url, tmp_path / "state", drain_timeout_s=10))
    stopped = trio.Event()

    async def run_node(task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
        await node.run(task_status=task_status)
        stopped.set()

    await nursery.start(run_node)
    started = trio.Event()

    @ironflow.function(id="long", triggers=[ironflow.event("long.go")])
    async def long(ctx: Any) -> Any:
        async def work() -> str:
            started.set()
            await trio.sleep(1.0)
            return "finished during the drain"

        return await ctx.step.run("work", work)

    worker = ironflow.StreamingWorker(node.url, [long], handle_signals=False, reconnect_delay=0.1)
    worker_done = trio.Event()

    async def run_worker() -> None:
        await worker.run()
        worker_done.set()

    nursery.start_soon(run_worker)
    async with httpx.AsyncClient(base_url=node.url) as http:
        with trio.fail_after(10):
            while worker.session_id is None:
                await trio.sleep(0.01)
        run_id = (await emit(http, "long.go"))["run_ids"][0]
        with trio.fail_after(5):
            await started.wait()
        node.request_shutdown()
        assert (await http.get("/readyz")).status_code == 503
        # New workers are turned away while the node drains.
        resp = await http.post("/v1/worker/register", json={"type": "register", "worker_id": "x", "functions": []})
        assert resp.status_code == 503 and resp.json()["code"] == "DRAINING"
        with trio.fail_after(8):
            await worker_done.wait()  # the engine's Shutdown drained the worker
        with trio.fail_after(8):
            await stopped.wait()  # and the node stopped once no session was left
    from ironflow.store import open_store

    store = open_store(database_url)
    await store.open()
    try:
        run = (await store.get_run(run_id)).run
    finally:
        await store.close()
    assert run.status == "completed" and run.output == "finished during the drain"
    assert run.recovery_count == 0


async def test_a_worker_that_ignores_shutdown_is_closed_with_1001_at_the_deadline(
    database_url: str, tmp_path: Path, nursery: trio.Nursery
) -> None:
    import trio_websocket

    from ironflow.protocol import FunctionDef, Shutdown, Trigger
    from tests.integration.helpers import raw_worker

    node = Node(node_config(database_url, tmp_path / "state", drain_timeout_s=0.5))
    await nursery.start(node.run)
    async with raw_worker(node.url, [FunctionDef(id="f", triggers=[Trigger("f.go")])]) as stubborn:
        node.request_shutdown()
        shutdown = await stubborn.receive_type(Shutdown)
        assert shutdown.drain_timeout_ms == 500
        # It neither drains nor closes; at the deadline the node stops anyway.
        with pytest.raises(trio_websocket.ConnectionClosed) as closed:
            await stubborn.receive(timeout=5)
        assert closed.value.reason.code == 1001


async def _run_node(node: Node, nursery: trio.Nursery) -> trio.Event:
    stopped = trio.Event()

    async def run_node(task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
        await node.run(task_status=task_status)
        stopped.set()

    await nursery.start(run_node)
    return stopped


def _slow_function(started: trio.Event, seconds: float) -> Any:
    @ironflow.function(id="pull-long", triggers=[ironflow.event("pull.go")])
    async def pull_long(ctx: Any) -> Any:
        async def work() -> str:
            started.set()
            await trio.sleep(seconds)
            return "done"

        return await ctx.step.run("work", work)

    return pull_long


async def _stored(database_url: str, run_id: str) -> tuple[Any, list[str]]:
    from ironflow.store import open_store

    store = open_store(database_url)
    await store.open()
    try:
        run = (await store.get_run(run_id)).run
        audit = [e.type for e in await store.list_audit(run_id=run_id)]
        drain = [e.type for e in await store.list_audit() if e.type.startswith("node.drain.")]
    finally:
        await store.close()
    return run, audit + drain


async def test_a_pull_worker_is_told_to_drain_and_the_node_waits_for_its_job(
    database_url: str, tmp_path: Path, nursery: trio.Nursery
) -> None:
    node = Node(node_config(database_url, tmp_path / "state", drain_timeout_s=10))
    stopped = await _run_node(node, nursery)
    started = trio.Event()
    worker = ironflow.PullWorker(
        node.url, [_slow_function(started, 1.5)], handle_signals=False, poll_wait=5.0, max_concurrent_jobs=2
    )
    await nursery.start(worker.run)
    async with httpx.AsyncClient(base_url=node.url) as http:
        run_id = (await emit(http, "pull.go"))["run_ids"][0]
        with trio.fail_after(5):
            await started.wait()
        t0 = trio.current_time()
        node.request_shutdown()
        # The poll waiting now is answered at once with the node's Shutdown.
        with trio.fail_after(2):
            while not worker.draining:
                await trio.sleep(0.01)
        assert not stopped.is_set()  # the node waits for the pull worker's job
        with trio.fail_after(8):
            await stopped.wait()
    assert trio.current_time() - t0 >= 1.0
    run, audit = await _stored(database_url, run_id)
    assert run.status == "completed" and run.output == "done"
    assert run.attempt == 1 and run.recovery_count == 0
    assert "node.drain.started" in audit and "node.drain.completed" in audit
    worker.stop()


async def test_a_pull_job_outliving_the_node_deadline_is_recovered_at_the_deadline(
    database_url: str, tmp_path: Path, nursery: trio.Nursery
) -> None:
    from ironflow.protocol import (
        SESSION_SECRET_HEADER,
        FunctionDef,
        JobAck,
        PullPollResponse,
        Register,
        Registered,
        Trigger,
        encoder,
    )

    node = Node(node_config(database_url, tmp_path / "state", drain_timeout_s=0.5))
    stopped = await _run_node(node, nursery)
    async with httpx.AsyncClient(base_url=node.url) as http:
        # A pull worker that acks its job and then neither finishes nor says goodbye.
        reg = Register("stubborn", [FunctionDef(id="f", triggers=[Trigger("f.go")])], 1)
        resp = await http.post("/v1/worker/register", content=encoder.encode(reg))
        registered = msgspec.json.decode(resp.content, type=Registered)
        base = f"/v1/worker/sessions/{registered.session_id}"
        headers = {SESSION_SECRET_HEADER: registered.session_secret or ""}
        run_id = (await emit(http, "f.go"))["run_ids"][0]
        resp = await http.post(f"{base}/poll", json={"wait_s": 5, "max_jobs": 1}, headers=headers)
        (job,) = msgspec.json.decode(resp.content, type=PullPollResponse).jobs
        ack = JobAck(job.job_id, job.run_id, job.execution_seq, job.lease_token)
        assert (await http.post(f"{base}/ack", content=encoder.encode(ack), headers=headers)).is_success
        t0 = trio.current_time()
        node.request_shutdown()
        # A poll during the drain gets no work and the node's Shutdown.
        resp = await http.post(f"{base}/poll", json={"wait_s": 5, "max_jobs": 1}, headers=headers)
        answer = msgspec.json.decode(resp.content, type=PullPollResponse)
        assert answer.jobs == [] and answer.shutdown is not None
        assert 0 < answer.shutdown.drain_timeout_ms <= 500
    with trio.fail_after(5):
        await stopped.wait()
    assert trio.current_time() - t0 < 2.0
    run, audit = await _stored(database_url, run_id)
    # Recovered at the node's deadline, not after the lease expires.
    assert run.status == "waiting" and run.recovery_count == 1 and run.attempt == 1
    assert "node.drain.recovered" in audit and "node.drain.deadline_reached" in audit
    assert "capacity.segment.recovered" in audit
