"""StreamingWorker against a fake engine on a real local websocket."""

from __future__ import annotations

import logging

import anyio
import anyio.abc
import pytest
from sdk_fake_engine import FakeEngine, make_assignment

import ironflow
from ironflow.protocol import (
    Cancel,
    Heartbeat,
    JobAck,
    JobCompleted,
    JobLeaseStatus,
    JobNack,
    LeaseStatus,
    Refused,
    Register,
    Shutdown,
    StepCompleted,
    worker_frame_decoder,
)
from ironflow.sdk.ws import ConnectionClosed

# Every test here runs on asyncio and on trio (tests/sdk/conftest.py).
pytestmark = pytest.mark.anyio


def _worker(engine, functions, **kw):
    kw.setdefault("handle_signals", False)
    kw.setdefault("reconnect_delay", 0.05)
    return ironflow.StreamingWorker(engine.url, functions, **kw)


def _gated(function_id="fn"):
    """A function whose handler blocks until ``gate`` is set; ``started`` counts starts."""
    gate = anyio.Event()
    started = []

    @ironflow.function(id=function_id)
    async def handler(ctx):
        started.append(ctx.run.id)
        await gate.wait()
        return await ctx.step.run("s", lambda: {"done": True})

    return handler, gate, started


async def test_handshake_registers_full_definitions_and_sends_auth(engine: FakeEngine, task_group):
    fn, gate, _ = _gated()
    worker = _worker(engine, [fn], api_key="ifkey_x", max_concurrent_jobs=3)
    await task_group.start(worker.run)
    conn = await engine.accept()
    assert isinstance(conn.register, Register)
    assert conn.register.functions == [fn.definition]
    assert conn.register.max_concurrent_jobs == 3
    assert engine.auth_headers == ["Bearer ifkey_x"]
    assert worker.session_id == "sess-1" and worker.state == "connected"
    worker.stop()


async def test_ack_then_run_then_complete(engine, task_group):
    @ironflow.function(id="fn")
    async def handler(ctx):
        a = await ctx.step.run("a", lambda: 1)
        b = await ctx.step.run("b", lambda: 2)
        return {"sum": a + b}

    worker = _worker(engine, [handler])
    await task_group.start(worker.run)
    conn = await engine.accept()
    a = make_assignment(run_id="rA")
    await conn.send(a)
    ack = await conn.recv_until(JobAck)
    assert (ack.job_id, ack.execution_seq, ack.lease_token) == (a.job_id, 1, a.lease_token)
    s1 = await conn.recv_until(StepCompleted)
    s2 = await conn.recv_until(StepCompleted)
    assert (s1.step_id, s2.step_id) == ("rA:a:0", "rA:b:0")
    done = await conn.recv_until(JobCompleted)
    assert done.output == {"sum": 3} and done.lease_token == a.lease_token
    worker.stop()


async def test_at_capacity_nack_and_duplicate_assignment_dropped(engine, task_group, caplog):
    caplog.set_level(logging.INFO, "ironflow")
    fn, gate, started = _gated()
    worker = _worker(engine, [fn], max_concurrent_jobs=1)
    await task_group.start(worker.run)
    conn = await engine.accept()
    a1, a2 = make_assignment(run_id="r1"), make_assignment(run_id="r2")
    await conn.send(a1)
    await conn.recv_until(JobAck)
    await conn.send(a1)  # duplicate of a running job: dropped silently
    await conn.send(a2)
    nack = await conn.recv_until(JobNack)
    assert (nack.job_id, nack.reason, nack.lease_token) == (a2.job_id, "AT_CAPACITY", a2.lease_token)
    assert "At capacity, refusing job" in caplog.text
    gate.set()
    await conn.recv_until(StepCompleted)
    assert (await conn.recv_until(JobCompleted)).job_id == a1.job_id
    assert started == ["r1"]
    worker.stop()


async def test_draining_nack_wins_over_at_capacity_and_drain_waits_for_job(
    engine, task_group, caplog
):
    caplog.set_level(logging.INFO, "ironflow")
    fn, gate, started = _gated()
    worker = _worker(engine, [fn], max_concurrent_jobs=1, drain_timeout=10)
    await task_group.start(worker.run)
    conn = await engine.accept()
    a1, a2 = make_assignment(run_id="r1"), make_assignment(run_id="r2")
    await conn.send(a1)
    await conn.recv_until(JobAck)
    while not started:
        await anyio.sleep(0.001)

    drained = anyio.Event()

    async def drain():
        await worker.drain()
        drained.set()

    task_group.start_soon(drain)
    await anyio.sleep(0.01)
    assert worker.state == "draining"
    await conn.send(a2)  # full AND draining: DRAINING wins
    nack = await conn.recv_until(JobNack)
    assert nack.reason == "DRAINING"
    assert not drained.is_set()
    gate.set()
    await conn.recv_until(StepCompleted)
    await conn.recv_until(JobCompleted)
    # The worker closes the socket with 1000 once the job's result is flushed.
    with pytest.raises(ConnectionClosed) as excinfo:
        await conn.recv_until(type(None))
    assert excinfo.value.code == 1000
    with anyio.fail_after(5):
        await drained.wait()
    assert "Draining worker..." in caplog.text
    assert "Waiting for 1 jobs to complete..." in caplog.text
    assert "Draining, refusing job" in caplog.text


async def test_drain_deadline_cancels_running_job_and_drops_the_connection(engine, task_group, caplog):
    caplog.set_level(logging.INFO, "ironflow")
    fn, gate, started = _gated()
    worker = _worker(engine, [fn])
    await task_group.start(worker.run)
    conn = await engine.accept()
    await conn.send(make_assignment(run_id="r1"))
    await conn.recv_until(JobAck)
    while not started:
        await anyio.sleep(0.001)
    with anyio.fail_after(5):
        await conn.send(Shutdown(reason="node stopping", drain_timeout_ms=50))
        with pytest.raises(ConnectionClosed) as excinfo:
            await conn.recv_until(type(None))  # nothing but the close arrives
        await worker._finished.wait()
    # No time is left for a close handshake: the socket is dropped (1006) and
    # the engine recovers the job's lease at once, as for any lost socket.
    assert excinfo.value.code == 1006
    assert "Drain deadline reached; cancelling 1 active jobs" in caplog.text


async def test_lease_status_stale_abandons_only_that_job(engine, task_group):
    fn, gate, started = _gated()
    worker = _worker(engine, [fn])
    await task_group.start(worker.run)
    conn = await engine.accept()
    a1, a2 = make_assignment(run_id="r1"), make_assignment(run_id="r2")
    for a in (a1, a2):
        await conn.send(a)
        await conn.recv_until(JobAck)
    while len(started) < 2:
        await anyio.sleep(0.001)
    await conn.send(
        LeaseStatus(
            jobs=[
                JobLeaseStatus(job_id=a1.job_id, run_id="r1", execution_seq=1, state="STALE"),
                JobLeaseStatus(job_id=a2.job_id, run_id="r2", execution_seq=1, state="REFRESHED"),
            ]
        )
    )
    while worker.active_jobs != 1:
        await anyio.sleep(0.001)
    gate.set()
    await conn.recv_until(StepCompleted)
    done = await conn.recv_until(JobCompleted)
    assert done.job_id == a2.job_id
    worker.stop()


async def test_cancel_and_refused_abandon_without_reporting(engine, task_group):
    fn, gate, started = _gated()
    worker = _worker(engine, [fn])
    await task_group.start(worker.run)
    conn = await engine.accept()
    a1, a2, a3 = (make_assignment(run_id=f"r{i}") for i in (1, 2, 3))
    for a in (a1, a2, a3):
        await conn.send(a)
        await conn.recv_until(JobAck)
    while len(started) < 3:
        await anyio.sleep(0.001)
    await conn.send(Cancel(job_id=a1.job_id, run_id="r1"))
    await conn.send(
        Refused(code="STALE_EXECUTION", message="stale", job_id=a2.job_id, run_id="r2")
    )
    while worker.active_jobs != 1:
        await anyio.sleep(0.001)
    gate.set()
    await conn.recv_until(StepCompleted)
    assert (await conn.recv_until(JobCompleted)).job_id == a3.job_id
    worker.stop()


async def test_heartbeat_lists_active_jobs_with_fences(task_group):
    engine = FakeEngine(heartbeat_interval_ms=20)
    await engine.start(task_group)
    fn, gate, started = _gated()
    worker = _worker(engine, [fn])
    await task_group.start(worker.run)
    conn = await engine.accept()
    a = make_assignment(run_id="r1")
    await conn.send(a)
    await conn.recv_until(JobAck)
    while True:
        hb = await conn.recv()
        assert isinstance(hb, Heartbeat)
        if hb.jobs:
            break
    (job,) = hb.jobs
    assert (job.job_id, job.run_id, job.execution_seq, job.lease_token) == (
        a.job_id, "r1", 1, a.lease_token,
    )
    worker.stop()


async def test_lost_connection_cancels_jobs_and_reconnects(engine, task_group):
    fn, gate, started = _gated()
    worker = _worker(engine, [fn])
    await task_group.start(worker.run)
    conn = await engine.accept()
    await conn.send(make_assignment(run_id="r1"))
    await conn.recv_until(JobAck)
    while not started:
        await anyio.sleep(0.001)
    await conn.ws.aclose()
    with anyio.fail_after(5):
        conn2 = await engine.accept()
    assert worker.active_jobs == 0
    assert isinstance(conn2.register, Register)
    worker.stop()


async def test_auth_rejection_stops_without_reconnect(task_group):
    engine = FakeEngine(reject_status=401)
    await engine.start(task_group)
    fn, _, _ = _gated()
    worker = _worker(engine, [fn])
    with pytest.raises(ironflow.WorkerAuthError):
        await worker.run()
    assert len(engine.auth_headers) == 1


async def test_with_an_engine_that_reads_batches_the_worker_batches_and_reads_batched_frames(task_group):
    engine = FakeEngine(batch_frames=True)
    await engine.start(task_group)

    @ironflow.function(id="fn")
    async def handler(ctx):
        a = await ctx.step.run("a", lambda: 1)
        b = await ctx.step.run("b", lambda: 2)
        return {"sum": a + b, "run": ctx.run.id}

    worker = _worker(engine, [handler], max_concurrent_jobs=10)
    await task_group.start(worker.run)
    conn = await engine.accept()
    assert conn.register.batch_frames  # the SDK says it reads batches
    assignments = [make_assignment(run_id=f"rB{i}") for i in range(8)]
    await conn.send(assignments)  # one frame, eight jobs
    seen: dict[str, list[str]] = {a.run_id: [] for a in assignments}
    done = 0
    with anyio.fail_after(10):
        while done < len(assignments):
            msg = await conn.recv()
            if isinstance(msg, JobAck | StepCompleted | JobCompleted):
                seen[msg.run_id].append(type(msg).__name__)
            if isinstance(msg, JobCompleted):
                assert msg.output == {"sum": 3, "run": msg.run_id}
                done += 1
    # Every job's messages complete and in order, however they were framed.
    assert all(v == ["JobAck", "StepCompleted", "StepCompleted", "JobCompleted"] for v in seen.values())
    assert conn.batched_frames > 0  # eight jobs at once: the worker's writer batched
    worker.stop()


@pytest.mark.parametrize("body", ["async", "sync"])
async def test_a_jobs_last_step_result_and_its_result_go_to_the_engine_in_one_frame(task_group, body):
    # The engine commits what one frame brings together: the step, the job's
    # result and the run's end in one transaction instead of two.
    engine = FakeEngine(batch_frames=True)
    await engine.start(task_group)

    async def async_step():
        return 1

    step = async_step if body == "async" else (lambda: 1)  # a sync body runs in a thread

    @ironflow.function(id="fn")
    async def handler(ctx):
        return {"n": await ctx.step.run("a", step)}

    worker = _worker(engine, [handler])
    await task_group.start(worker.run)
    conn = await engine.accept()
    for i in range(5):
        await conn.send(make_assignment(run_id=f"rF{i}"))
        frames: list[list[str]] = []
        with anyio.fail_after(10):
            while not frames or "JobCompleted" not in frames[-1]:
                frame = worker_frame_decoder.decode(await conn.ws.get_message())
                frames.append([type(m).__name__ for m in (frame if isinstance(frame, list) else [frame])])
        assert frames == [["JobAck"], ["StepCompleted", "JobCompleted"]]
    worker.stop()
