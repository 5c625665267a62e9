"""A job with a start delay (a sleep the engine woke ahead of its time): the
worker acks it, holds its slot, and starts the handler at its start time,
never before. The hold itself in virtual time (``MockClock``), on both
workers; the wire behaviour against the fake engine on a real websocket."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.abc
import pytest
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
        started.append(anyio.current_time())
        return "ok"

    return handler, started


def _workers(fn: Any) -> list[WorkerLifecycle]:
    return [
        ironflow.StreamingWorker("http://engine", [fn], handle_signals=False),
        ironflow.PullWorker("http://engine", [fn], handle_signals=False),
    ]


def _held(worker: WorkerLifecycle, task_group: anyio.abc.TaskGroup, delay_ms: int, run_id: str = "r1") -> JobState:
    """A job received now with ``delay_ms``, accepted (its slot taken) and executing."""
    a = make_assignment(run_id=run_id, start_delay_ms=delay_ms)
    job = JobState(a)
    worker._jobs[a.job_id] = job
    return job


async def _one_second_into_a_hold(
    kind: int, task_group: anyio.abc.TaskGroup
) -> tuple[WorkerLifecycle, JobState, ListReporter, list[float]]:
    """Worker ``kind`` (0 streaming, 1 pull) executing one job held for 2.5 s,
    1 s into the hold: the worker, the job, its reporter, the handler's starts."""
    fn, started = _recorder()
    worker = _workers(fn)[kind]
    task_group.start_soon(worker._start_gates.run)
    reporter = ListReporter()
    job = _held(worker, task_group, 2500)
    task_group.start_soon(worker._execute, job, reporter)
    await anyio.sleep(1.0)
    return worker, job, reporter, started


@pytest.mark.parametrize("kind", [0, 1], ids=["streaming", "pull"])
async def test_held_jobs_start_their_handlers_at_their_start_times_never_before(
    kind: int, task_group: anyio.abc.TaskGroup, autojump_clock: trio.testing.MockClock
) -> None:
    fn, started = _recorder()
    worker = _workers(fn)[kind]
    task_group.start_soon(worker._start_gates.run)
    reporter = ListReporter()
    t0 = anyio.current_time()
    # Received now; a delay of 2.5 s, three held to one instant, one to 0.75 s.
    for i, delay in enumerate([2500, 2500, 750, 2500]):
        task_group.start_soon(worker._execute, _held(worker, task_group, delay, f"r{i}"), reporter)
    await anyio.sleep(0.7499)
    assert started == []
    await anyio.sleep(3)
    assert started == [t0 + 0.75] + [t0 + 2.5] * 3
    assert [type(m) for m in reporter.messages] == [JobCompleted] * 4
    # Received 1 s ago with a 0.4 s delay: the delay ran from the receipt, it starts at once.
    late = make_assignment(run_id="late", start_delay_ms=400)
    t1 = anyio.current_time()
    await worker._execute(JobState(late, t1 - 1.0), reporter)
    assert started[-1] == t1


@pytest.mark.parametrize("kind", [0, 1], ids=["streaming", "pull"])
async def test_a_drain_during_the_hold_hands_the_job_back_with_a_draining_nack_and_never_runs_it(
    kind: int, task_group: anyio.abc.TaskGroup, autojump_clock: trio.testing.MockClock
) -> None:
    worker, job, reporter, started = await _one_second_into_a_hold(kind, task_group)
    a = job.assignment
    worker._begin_drain(30.0)
    await anyio.sleep(0.001)
    assert reporter.messages == [JobNack(a.job_id, a.run_id, 1, a.lease_token, reason="DRAINING")]
    assert worker._jobs == {}  # the slot is free: the drain need not wait for it
    await anyio.sleep(5.0)
    assert started == []


@pytest.mark.parametrize("kind", [0, 1], ids=["streaming", "pull"])
async def test_a_job_cancelled_during_its_hold_never_runs_and_reports_nothing(
    kind: int, task_group: anyio.abc.TaskGroup, autojump_clock: trio.testing.MockClock
) -> None:
    worker, job, reporter, started = await _one_second_into_a_hold(kind, task_group)
    job.abandon()  # Cancel from the engine, or a STALE lease status
    await anyio.sleep(5.0)
    assert started == [] and reporter.messages == [] and worker._jobs == {}


@pytest.mark.anyio
async def test_the_streaming_worker_acks_at_once_heartbeats_the_held_job_and_starts_it_after_the_delay(
    task_group: anyio.abc.TaskGroup,
) -> None:
    engine = FakeEngine(heartbeat_interval_ms=20)
    await engine.start(task_group)
    fn, started = _recorder()
    worker = ironflow.StreamingWorker(engine.url, [fn], handle_signals=False, reconnect_delay=0.05)
    await task_group.start(worker.run)
    conn = await engine.accept()
    assert isinstance(conn.register, Register) and conn.register.delayed_start
    a = make_assignment(run_id="r1", start_delay_ms=400)
    sent = anyio.current_time()
    await conn.send(a)
    await conn.recv_until(JobAck)
    assert anyio.current_time() - sent < 0.3  # acked on receipt, not after the hold
    while True:
        hb = await conn.recv()
        if isinstance(hb, Heartbeat) and hb.jobs:
            break
    assert [j.job_id for j in hb.jobs] == [a.job_id] and started == []  # held, its lease kept
    await conn.recv_until(JobCompleted)
    assert started[0] - sent >= 0.4
    worker.stop()


@pytest.mark.parametrize("kind", [0, 1], ids=["streaming", "pull"])
async def test_a_job_that_waited_in_queues_still_starts_at_its_database_time_learnt_from_a_faster_one(
    kind: int, task_group: anyio.abc.TaskGroup, autojump_clock: trio.testing.MockClock
) -> None:
    # The database clock here is 1e9 + the Trio clock (the worker cannot know
    # that). Job A's delay was computed at database time 0 but A reached the
    # worker 0.3 s later (queues, a busy node); job B, computed at 0.35 s, came
    # in 10 ms. Both are due at database time 1.0. From B the worker learns the
    # clock to within 10 ms and starts both then: A does not start 0.3 s late
    # (its delay from receipt), and neither starts before 1.0.
    db = 1e9
    fn, started = _recorder()
    worker = _workers(fn)[kind]
    task_group.start_soon(worker._start_gates.run)
    reporter = ListReporter()
    a = make_assignment(run_id="a", start_delay_ms=1000, db_now=db + 0.0)
    b = make_assignment(run_id="b", start_delay_ms=650, db_now=db + 0.35)
    await anyio.sleep(0.3)
    job_a = JobState(a, worker._start_time(a, anyio.current_time()))
    assert job_a.start_at == pytest.approx(1.3)
    task_group.start_soon(worker._execute, job_a, reporter)
    await anyio.sleep(0.06)
    job_b = JobState(b, worker._start_time(b, anyio.current_time()))
    task_group.start_soon(worker._execute, job_b, reporter)
    await anyio.sleep(2.0)
    assert len(started) == 2
    assert all(1.0 <= t <= 1.0 + 0.012 for t in started), started


def test_the_database_clock_bound_keeps_the_tightest_sample_and_ages_it_by_the_drift_allowance() -> None:
    from ironflow.dbclock import CLOCK_DRIFT, DatabaseClock

    clock = DatabaseClock()
    assert clock.local_time(1000.0) is None  # nothing learnt: the delay from receipt decides
    assert clock.observe(db_now=100.0, received=0.0)  # offset ≥ 100
    assert not clock.observe(db_now=100.0, received=0.5)  # looser (it waited 0.5 s somewhere)
    assert clock.observe(db_now=101.0, received=1.0)  # as tight (100), and fresher
    # Database time 150 is surely reached at Trio time t with t + bound(t) ≥ 150,
    # the bound (100) losing CLOCK_DRIFT per second since its sample at t = 1.
    t = clock.local_time(150.0)
    assert t is not None and t + 100.0 - CLOCK_DRIFT * (t - 1.0) == pytest.approx(150.0)
    assert 50.0 < t < 50.0 + 0.03


def test_the_node_refreshes_a_held_jobs_clock_reading_on_the_wire_without_moving_its_start() -> None:
    """fresh_start: a reading taken at reservation (db 100.000, start 100.900)
    goes out at Trio time 0.5 as the database time the node's bound proves by
    then, in whole milliseconds; the start stays where it was, never later
    than the reading allows, and a job without a reading goes out as it is."""
    from actors.directory import fresh_start
    from ironflow.dbclock import DatabaseClock
    from ironflow.protocol import EventInfo, JobAssignment

    def job(db_now: float | None, delay_ms: int) -> JobAssignment:
        return JobAssignment(
            job_id="j", run_id="r", function_id="f", event=EventInfo(id="e", name="n", data={}, received_at=0.0),
            attempt=1, max_attempts=3, completed_steps=[], execution_seq=2, lease_token="t",
            start_delay_ms=delay_ms, db_now=db_now,
        )

    clock = DatabaseClock()
    held = job(100.0, 900)
    assert fresh_start(held, clock, 0.5) is held  # nothing learnt yet
    clock.observe(db_now=100.0, received=0.1)  # database ≥ Trio + 99.9
    fresh = fresh_start(held, clock, 0.5)
    # by Trio 0.5 the database has surely passed 100.4 (less the drift allowance)
    assert fresh.db_now == pytest.approx(100.399) and fresh.start_delay_ms == 501
    assert fresh.db_now + fresh.start_delay_ms / 1000 == pytest.approx(100.9)
    late = fresh_start(held, clock, 5.0)  # past its start: the delay ends at 0, never below
    assert late.start_delay_ms == 0 and late.db_now == pytest.approx(100.9)
    assert fresh_start(job(None, 0), clock, 0.5).db_now is None
    assert fresh_start(job(100.45, 450), clock, 0.5).db_now == 100.45  # already fresher
