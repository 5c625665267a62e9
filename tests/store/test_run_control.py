"""Run control (ironflow/store/run_control.py), once per backend:
resume a failed run from its failed step, resume many, pause and resume."""

from __future__ import annotations

import pytest

from ironflow.protocol import ErrorInfo, FunctionDef, RetryPolicy, SleepYield, Trigger, WaitYield
from ironflow.store import Conflict, Fence, NotFound, RunNotFound, StaleExecution, Store

LEASE = 90.0


def fn(fid: str = "f", event: str = "order.created") -> FunctionDef:
    return FunctionDef(id=fid, triggers=[Trigger(event)], retries=RetryPolicy(max_attempts=3))


async def session(store: Store, *fds: FunctionDef):
    return await store.register_worker(
        node_id="n1", worker_id="w1", mode="stream", max_concurrent_jobs=5,
        functions=list(fds or (fn(),)), session_expiry_s=90.0,
    )


async def take(store: Store, s) -> Fence:
    (res,) = await store.reserve_segments(
        "n1", {s.session_id: frozenset(s.function_ids)}, 1, reservation_expiry_s=30.0
    )
    a = res.assignment
    fence = Fence(res.session_id, a.run_id, a.execution_seq, a.lease_token)
    await store.activate_lease(fence, lease_expiry_s=LEASE)
    return fence


async def failed_run(store: Store, s) -> Fence:
    """A run whose steps one, two completed, three failed non-retryably: failed."""
    await store.ingest_event("order.created", {}, None, idempotency_window_s=3600)
    f = await take(store, s)
    await store.record_step(f, step_id="one", name="one", status="completed", output=1)
    await store.record_step(f, step_id="two", name="two", status="completed", output=2)
    await store.record_step(f, step_id="three", name="three", status="failed", error=ErrorInfo("x"))
    await store.fail_job(f, ErrorInfo("x", retryable=False))
    return f


async def steps(store: Store, run_id: str) -> list[tuple[str, str]]:
    return [(st.step_id, st.status) for st in (await store.get_run(run_id)).steps]


async def test_resume_a_failed_run_from_its_failed_step(store):
    s = await session(store)
    f = await failed_run(store, s)
    out = await store.resume_run(f.run_id)
    assert (out.run_id, out.from_step, out.steps_deleted, out.resumed_from) == (
        f.run_id, "three", 1, "failed"
    )
    assert await steps(store, f.run_id) == [("one", "completed"), ("two", "completed")]
    run = (await store.get_run(f.run_id)).run
    assert run.status == "waiting_for_capacity" and run.attempt == 1
    assert run.error is None and run.ended_at is None
    assert run.current_execution_seq == out.execution_seq == f.execution_seq + 1
    (queued,) = await store.list_queue()
    assert (queued.run_id, queued.reason, queued.execution_seq) == (f.run_id, "resume", out.execution_seq)
    # The old segment stays fenced; the resumed one replays one, two and completes.
    with pytest.raises(StaleExecution):
        await store.complete_job(f, None)
    f2 = await take(store, s)
    assert f2.run_id == f.run_id
    assert (await store.complete_job(f2, {"ok": True})).status == "completed"
    (audit,) = await store.list_audit(run_id=f.run_id, type="run.resumed")
    assert audit.data["from_step"] == "three" and audit.data["steps_deleted"] == 1


async def test_resume_from_a_named_step_reruns_it_and_every_later_one(store):
    s = await session(store)
    f = await failed_run(store, s)
    out = await store.resume_run(f.run_id, from_step="two")
    assert out.from_step == "two" and out.steps_deleted == 2
    assert await steps(store, f.run_id) == [("one", "completed")]


async def test_a_fresh_attempt_budget_after_retries_were_spent(store):
    s = await session(store)
    await store.ingest_event("order.created", {}, None, idempotency_window_s=3600)
    for _ in range(3):
        await store.advance_clock(10)
        f = await take(store, s)
        await store.fail_job(f, ErrorInfo("boom"))
    assert (await store.get_run(f.run_id)).run.status == "failed"
    await store.resume_run(f.run_id)
    f = await take(store, s)
    assert (await store.fail_job(f, ErrorInfo("boom"))).status == "waiting"  # attempt 1 of 3 again
    assert (await store.get_run(f.run_id)).run.attempt == 2


async def test_bad_resumes_change_nothing(store):
    s = await session(store)
    f = await failed_run(store, s)
    with pytest.raises(RunNotFound):
        await store.resume_run("run_nope")
    with pytest.raises(NotFound):
        await store.resume_run(f.run_id, from_step="nine")
    assert (await store.get_run(f.run_id)).run.status == "failed"
    assert len(await steps(store, f.run_id)) == 3
    await store.resume_run(f.run_id)
    with pytest.raises(Conflict):  # a second resume while the first is queued
        await store.resume_run(f.run_id)
    f2 = await take(store, s)
    with pytest.raises(Conflict):  # ... or running
        await store.resume_run(f.run_id)
    await store.complete_job(f2, None)
    done = await store.get_run(f.run_id)
    with pytest.raises(Conflict):  # a completed run
        await store.resume_run(f.run_id)
    with pytest.raises(Conflict):  # ... even from a named step
        await store.resume_run(f.run_id, from_step="one")
    after = await store.get_run(f.run_id)
    assert (after.run, after.steps) == (done.run, done.steps)  # status, execution_seq, steps as they were
    assert await store.list_queue() == []
    assert len(await store.list_audit(run_id=f.run_id, type="run.resumed")) == 1


async def test_bulk_resume_pages_through_one_functions_recent_failures(store):
    s = await session(store, fn("f"), fn("g", "other.event"))
    failed = [(await failed_run(store, s)).run_id for _ in range(5)]
    out, cursor = await store.resume_failed_runs(function_id="g", since_s=3600, limit=10, cursor=None)
    assert out == [] and cursor is None
    out, cursor = await store.resume_failed_runs(function_id="f", since_s=3600, limit=2, cursor=None)
    assert len(out) == 2
    seen = [o.run_id for o in out]
    while cursor is not None:
        out, cursor = await store.resume_failed_runs(function_id="f", since_s=3600, limit=2, cursor=cursor)
        seen += [o.run_id for o in out]
    assert sorted(seen) == sorted(failed)
    assert {r.status for r in await store.list_runs()} == {"waiting_for_capacity"}
    await store.advance_clock(7200)
    out, _ = await store.resume_failed_runs(function_id=None, since_s=60, limit=10, cursor=None)
    assert out == []


async def test_pause_a_queued_run_and_resume_it(store):
    s = await session(store)
    await store.ingest_event("order.created", {}, None, idempotency_window_s=3600)
    (run,) = await store.list_runs()
    await store.pause_run(run.id)
    assert (await store.get_run(run.id)).run.status == "paused"
    assert await store.list_queue() == []
    with pytest.raises(Conflict):
        await store.pause_run(run.id)
    out = await store.resume_run(run.id)
    assert out.resumed_from == "paused" and out.steps_deleted == 0
    f = await take(store, s)
    assert (await store.complete_job(f, None)).status == "completed"
    assert [a.type for a in await store.list_audit(run_id=run.id)][-2:] in (
        ["run.paused", "run.resumed"], ["run.resumed", "run.paused"],
    )


async def test_pause_a_running_run_fences_its_worker_and_keeps_recorded_steps(store):
    s = await session(store)
    await store.ingest_event("order.created", {}, None, idempotency_window_s=3600)
    f = await take(store, s)
    await store.record_step(f, step_id="one", name="one", status="completed", output=1)
    out = await store.pause_run(f.run_id)
    assert out.session_id == s.session_id and out.job_id == f"{f.run_id}/{f.execution_seq}"
    assert await store.list_leases() == []
    assert (await store.list_sessions())[0].credits_claimed == 0
    with pytest.raises(StaleExecution):  # the step after the boundary is refused
        await store.record_step(f, step_id="two", name="two", status="completed")
    await store.resume_run(f.run_id)
    f2 = await take(store, s)
    assert await steps(store, f.run_id) == [("one", "completed")]
    await store.complete_job(f2, None)
    with pytest.raises(Conflict):
        await store.pause_run(f.run_id)


async def test_a_paused_run_stays_paused_when_its_sleep_ends_or_its_event_comes(store):
    s = await session(store, fn("f"), fn("g", "other.event"))
    await store.ingest_event("order.created", {}, None, idempotency_window_s=3600)
    f = await take(store, s)
    now = await store.db_now()
    await store.yield_job(f, step_id="nap", name="nap", info=SleepYield(until=now + 5))
    await store.pause_run(f.run_id)
    await store.advance_clock(6)
    claimed = await store.claim_elapsed_steps("n1", 10)
    assert claimed == [(f.run_id, "nap")]
    out = await store.resume_claimed_steps("n1", claimed)
    assert out.resumed == []
    assert (await store.get_run(f.run_id)).run.status == "paused" and await store.list_queue() == []
    await store.ingest_event("other.event", {}, None, idempotency_window_s=3600)
    g = await take(store, s)
    await store.yield_job(
        g, step_id="w", name="w", info=WaitYield(event="go", timeout_at=now + 600)
    )
    await store.pause_run(g.run_id)
    got = await store.ingest_event("go", {}, None, idempotency_window_s=3600)
    assert got.resumed_run_ids == []
    assert await steps(store, g.run_id) == [("w", "completed")]
    assert await store.list_queue() == []
    for run_id in (f.run_id, g.run_id):
        await store.resume_run(run_id)
    assert {q.run_id for q in await store.list_queue()} == {f.run_id, g.run_id}
    memo = {}
    for _ in range(2):
        h = await take(store, s)
        memo[h.run_id] = await steps(store, h.run_id)
    assert memo == {f.run_id: [("nap", "completed")], g.run_id: [("w", "completed")]}


async def test_a_paused_run_can_be_cancelled_and_then_not_resumed(store):
    await session(store)
    await store.ingest_event("order.created", {}, None, idempotency_window_s=3600)
    (run,) = await store.list_runs()
    await store.pause_run(run.id)
    await store.cancel_run(run.id, "no longer wanted")
    assert (await store.get_run(run.id)).run.status == "cancelled"
    with pytest.raises(Conflict):
        await store.resume_run(run.id)
    assert await store.list_queue() == []


async def paused_asleep(store: Store, s, seconds: float) -> tuple[Fence, float]:
    """A run asleep in step ``nap`` for ``seconds``, then paused; its wake time."""
    await store.ingest_event("order.created", {}, None, idempotency_window_s=3600)
    f = await take(store, s)
    wake = await store.db_now() + seconds
    await store.yield_job(f, step_id="nap", name="nap", info=SleepYield(until=wake))
    await store.pause_run(f.run_id)
    return f, wake


async def test_a_paused_run_resumed_before_its_sleep_ends_waits_for_the_same_wake_time(store):
    s = await session(store)
    f, wake = await paused_asleep(store, s, 60)
    out = await store.resume_run(f.run_id)
    # Back on its sleep, not on the queue: a replay would park it again from now.
    assert (out.status, out.resumed_from) == ("waiting", "paused")
    assert (await store.get_run(f.run_id)).run.status == "waiting" and await store.list_queue() == []
    (nap,) = (await store.get_run(f.run_id)).steps
    assert (nap.status, nap.wake_at) == ("sleeping", pytest.approx(wake))
    (audit,) = await store.list_audit(run_id=f.run_id, type="run.resumed")
    assert audit.data["parked"] is True
    await store.advance_clock(61)
    claimed = await store.claim_elapsed_steps("n1", 10)
    assert [r for r, _ in claimed] == [f.run_id]
    assert (await store.resume_claimed_steps("n1", claimed)).resumed != []
    f2 = await take(store, s)
    assert await steps(store, f2.run_id) == [("nap", "completed")]


async def test_a_paused_run_resumed_before_its_event_comes_is_resumed_by_the_event(store):
    s = await session(store)
    await store.ingest_event("order.created", {}, None, idempotency_window_s=3600)
    f = await take(store, s)
    now = await store.db_now()
    await store.yield_job(f, step_id="w", name="w", info=WaitYield(event="go", timeout_at=now + 600))
    await store.pause_run(f.run_id)
    assert (await store.resume_run(f.run_id)).status == "waiting"
    assert await store.list_queue() == []
    got = await store.ingest_event("go", {"k": 1}, None, idempotency_window_s=3600)
    assert got.resumed_run_ids == [f.run_id]
    assert [q.run_id for q in await store.list_queue()] == [f.run_id]


async def test_a_sleep_the_waker_is_settling_holds_the_resumed_run_and_a_replay_parking_it_again_goes_on(store):
    """The waker claimed the sleep (up to its look-ahead early) while the run was
    paused: the resumed run is queued, held until the wake time. A replay that
    reads the step before the waker settles it parks it again after: the run
    goes on instead of waiting on a step nothing will settle."""
    s = await session(store)
    f, wake = await paused_asleep(store, s, 5)
    claimed = await store.claim_elapsed_steps("n1", 10, lookahead_s=10)
    assert [r for r, _ in claimed] == [f.run_id]
    out = await store.resume_run(f.run_id)
    assert out.status == "waiting_for_capacity"
    (queued,) = await store.list_queue()
    assert queued.eligible_at == pytest.approx(wake)  # not before the sleep's end
    await store.advance_clock(6)
    f2 = await take(store, s)  # its replay sees the nap still 'waking'
    await store.resume_claimed_steps("n1", claimed)  # the waker settles it now
    assert await steps(store, f.run_id) == [("nap", "completed")]
    parked = await store.yield_job(f2, step_id="nap", name="nap", info=SleepYield(until=wake + 6))
    assert parked.next_execution_seq == f2.execution_seq + 1, "the run was left waiting on a settled step"
    f3 = await take(store, s)
    assert await steps(store, f3.run_id) == [("nap", "completed")]
    assert (await store.complete_job(f3, None)).status == "completed"
