"""A job with a start delay (a sleep the engine woke ahead of its time): the
worker acks it, holds its slot, and starts the handler at its start time,
never before. The hold itself in virtual time (``MockClock``), on both
workers; the wire behaviour against the fake engine on a real websocket."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from sdk_fake_engine import FakeEngine, ListReporter, make_assignment

import ironflow
from ironflow.protocol import Heartbeat, JobAck, JobCompleted, JobNack, Register
from ironflow.sdk.context import JobState
from ironflow.sdk.lifecycle import WorkerLifecycle


def _recorder() -> tuple[Any, list[float]]:
    """A function whose handler notes when it started (Trio clock)."""
    started: list[float] = []

    @ironflow.function(id="fn")
    async def handler(ctx: Any) -> str:
        started.append(trio.current_time())
        return "ok"

    return handler, started


def _workers(fn: Any) -> list[WorkerLifecycle]:
    return [
        ironflow.StreamingWorker("http://engine", [fn], handle_signals=False),
        ironflow.PullWorker("http://engine", [fn], handle_signals=False),
    ]


@pytest.mark.parametrize("kind", [0, 1], ids=["streaming", "pull"])
async def test_a_held_job_starts_its_handler_at_its_start_time_never_before(
    kind: int, autojump_clock: trio.testing.MockClock
) -> None:
    fn, started = _recorder()
    worker = _workers(fn)[kind]
    reporter = ListReporter()
    job = JobState(make_assignment(run_id="r1", start_delay_ms=2500))
    t0 = trio.current_time()
    await worker._execute(job, reporter)
    assert started == [t0 + 2.5]
    assert [type(m) for m in reporter.messages] == [JobCompleted]
    # A job without a delay starts at once.
    job = JobState(make_assignment(run_id="r2"))
    t1 = trio.current_time()
    await worker._execute(job, reporter)
    assert started[-1] == t1


@pytest.mark.parametrize("kind", [0, 1], ids=["streaming", "pull"])
async def test_a_drain_during_the_hold_hands_the_job_back_with_a_draining_nack_and_never_runs_it(
    kind: int, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    fn, started = _recorder()
    worker = _workers(fn)[kind]
    reporter = ListReporter()
    a = make_assignment(run_id="r1", start_delay_ms=2500)
    job = JobState(a)
    worker._jobs[a.job_id] = job
    nursery.start_soon(worker._execute, job, reporter)
    await trio.sleep(1.0)
    worker._begin_drain(30.0)
    await trio.sleep(0.001)
    assert reporter.messages == [JobNack(a.job_id, a.run_id, 1, a.lease_token, reason="DRAINING")]
    assert worker._jobs == {}  # the slot is free: the drain need not wait for it
    await trio.sleep(5.0)
    assert started == []


@pytest.mark.parametrize("kind", [0, 1], ids=["streaming", "pull"])
async def test_a_job_cancelled_during_its_hold_never_runs_and_reports_nothing(
    kind: int, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    fn, started = _recorder()
    worker = _workers(fn)[kind]
    reporter = ListReporter()
    a = make_assignment(run_id="r1", start_delay_ms=2500)
    job = JobState(a)
    worker._jobs[a.job_id] = job
    nursery.start_soon(worker._execute, job, reporter)
    await trio.sleep(1.0)
    job.abandon()  # Cancel from the engine, or a STALE lease status
    await trio.sleep(5.0)
    assert started == [] and reporter.messages == [] and worker._jobs == {}


async def test_the_streaming_worker_acks_at_once_heartbeats_the_held_job_and_starts_it_after_the_delay(
    nursery: trio.Nursery,
) -> None:
    engine = FakeEngine(heartbeat_interval_ms=20)
    await engine.start(nursery)
    fn, started = _recorder()
    worker = ironflow.StreamingWorker(engine.url, [fn], handle_signals=False, reconnect_delay=0.05)
    await nursery.start(worker.run)
    conn = await engine.accept()
    assert isinstance(conn.register, Register) and conn.register.delayed_start
    a = make_assignment(run_id="r1", start_delay_ms=400)
    sent = trio.current_time()
    await conn.send(a)
    await conn.recv_until(JobAck)
    assert trio.current_time() - sent < 0.3  # acked on receipt, not after the hold
    while True:
        hb = await conn.recv()
        if isinstance(hb, Heartbeat) and hb.jobs:
            break
    assert [j.job_id for j in hb.jobs] == [a.job_id] and started == []  # held, its lease kept
    await conn.recv_until(JobCompleted)
    assert started[0] - sent >= 0.4
    worker.stop()
