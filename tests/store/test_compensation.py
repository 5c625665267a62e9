"""Compensation in the store (ironflow/store/compensation.py), once per
backend: a run with undos that fails for good or is cancelled gets a fenced
compensation segment instead of ending, and that segment's JobFailed ends it
with the original error."""

from __future__ import annotations

import pytest

from ironflow.protocol import (
    CancelOn,
    ErrorInfo,
    FunctionDef,
    RetryPolicy,
    Singleton,
    SleepYield,
    Trigger,
    compensation_step_id,
)
from ironflow.store import Conflict, Fence, StaleExecution, Store
from tests.store.test_run_control import session, take

ORIGINAL = ErrorInfo("card declined", "DECLINED", retryable=False)


def fn(max_attempts: int = 2) -> FunctionDef:
    return FunctionDef(
        id="f", triggers=[Trigger("order.created")], retries=RetryPolicy(max_attempts=max_attempts, initial_delay_s=0),
        cancel_on=[CancelOn("order.withdrawn", match="data.order")],
    )


async def running(store: Store, s, *, undos: bool = True) -> Fence:
    """A run that charged (step ``charge``) and, with ``undos``, registered one."""
    await store.ingest_event("order.created", {"order": 7}, None, idempotency_window_s=3600)
    f = await take(store, s)
    await store.record_step(f, step_id="charge", name="charge", status="completed", output={"id": "ch"})
    if undos:
        await store.record_step(
            f, step_id=compensation_step_id(f.run_id, "registered"), name="compensate:registered",
            status="completed",
        )
    return f


def undo(f: Fence, name: str) -> str:
    return f"{f.run_id}:compensate\\:{name}:0"


async def steps(store: Store, run_id: str) -> dict[str, str]:
    return {st.step_id: st.status for st in (await store.get_run(run_id)).steps}


async def compensation_segment(store: Store, s, old: Fence, cause: str, error: ErrorInfo) -> Fence:
    """The queued compensation segment, checked and taken."""
    (queued,) = await store.list_queue()
    assert (queued.run_id, queued.reason, queued.execution_seq) == (old.run_id, "compensate", old.execution_seq + 1)
    detail = await store.get_run(old.run_id)
    assert detail.run.status == "waiting" and detail.run.error == error
    (began,) = [st for st in detail.steps if st.step_id == compensation_step_id(old.run_id, "begin")]
    assert began.status == "completed" and began.name == "compensate:begin"
    assert began.output == {"cause": cause, "error": {
        "message": error.message, "code": error.code, "traceback": None, "retryable": error.retryable,
    }}
    # The old segment is fenced: anything it still sends is refused.
    with pytest.raises(StaleExecution):
        await store.record_step(old, step_id="late", name="late", status="completed")
    (res,) = await store.reserve_segments(
        "n1", {s.session_id: frozenset(s.function_ids)}, 1, reservation_expiry_s=30.0
    )
    memo = {m.step_id for m in res.assignment.completed_steps}
    assert compensation_step_id(old.run_id, "begin") in memo and "charge" in memo
    new = Fence(res.session_id, res.assignment.run_id, res.assignment.execution_seq, res.assignment.lease_token)
    await store.activate_lease(new, lease_expiry_s=90.0)
    return new


async def test_a_final_failure_of_a_run_with_undos_compensates_then_fails_with_the_original_error(store):
    s = await session(store, fn(max_attempts=1))
    ended: list[str] = []
    store.on_runs_ended(ended.extend)
    f = await running(store, s)
    await store.record_step(f, step_id="ship", name="ship", status="failed", error=ORIGINAL)
    out = await store.fail_job(f, ORIGINAL)
    assert (out.status, out.compensating, out.next_execution_seq) == ("waiting", True, f.execution_seq + 1)
    assert ended == []  # not ended: `result()` waiters keep waiting
    g = await compensation_segment(store, s, f, "failure", ORIGINAL)
    await store.record_step(g, step_id=undo(g, "refund"), name="compensate:refund", status="completed")
    await store.record_step(
        g, step_id=undo(g, "release"), name="compensate:release", status="failed", error=ErrorInfo("gone")
    )
    # Whatever the segment reports (retryable here), the run ends: never retried.
    out = await store.fail_job(g, ErrorInfo("card declined", "DECLINED", retryable=True))
    assert out.status == "failed" and ended == [f.run_id]
    run = (await store.get_run(f.run_id)).run
    assert run.status == "failed" and run.error == ORIGINAL and run.attempt == 1
    assert await store.list_queue() == []
    (began,) = await store.list_audit(run_id=f.run_id, type="run.compensating")
    assert began.data == {"cause": "failure", "error": "DECLINED"}
    (audit,) = await store.list_audit(run_id=f.run_id, type="run.compensated")
    assert audit.data == {"cause": "failure", "undos_completed": 1, "undos_failed": 1, "error": "DECLINED"}


async def test_a_retryable_failure_retries_before_it_compensates(store):
    s = await session(store, fn(max_attempts=2))
    f = await running(store, s)
    retry = ErrorInfo("flaky", "ERROR", retryable=True)
    out = await store.fail_job(f, retry)
    assert (out.status, out.compensating, out.attempt) == ("waiting", False, 2)
    (queued,) = await store.list_queue()
    assert queued.reason == "retry"
    f2 = await take(store, s)
    out = await store.fail_job(f2, retry)  # the last attempt's failure is final
    assert (out.status, out.compensating) == ("waiting", True)
    await compensation_segment(store, s, f2, "failure", retry)


async def test_a_run_without_undos_fails_at_once(store):
    s = await session(store, fn(max_attempts=1))
    f = await running(store, s, undos=False)
    out = await store.fail_job(f, ORIGINAL)
    assert (out.status, out.compensating) == ("failed", False)
    assert compensation_step_id(f.run_id, "begin") not in await steps(store, f.run_id)
    assert await store.list_audit(run_id=f.run_id, type="run.compensating") == []


async def test_a_cancel_of_a_run_with_undos_compensates_then_ends_cancelled(store):
    s = await session(store, fn())
    ended: list[str] = []
    store.on_runs_ended(ended.extend)
    f = await running(store, s)
    out = await store.cancel_run(f.run_id, "customer asked")
    # Its worker is named, to be sent Cancel; the run has not ended.
    assert out.compensating and (out.session_id, out.job_id) == (s.session_id, f"{f.run_id}/{f.execution_seq}")
    assert ended == []
    cancelled = ErrorInfo("customer asked", "CANCELLED", retryable=False)
    g = await compensation_segment(store, s, f, "cancel", cancelled)
    # A second cancel while it compensates: refused, nothing changed.
    with pytest.raises(Conflict, match="compensating"):
        await store.cancel_run(f.run_id, "again")
    await store.record_step(g, step_id=undo(g, "refund"), name="compensate:refund", status="completed")
    out2 = await store.fail_job(g, cancelled)
    assert out2.status == "cancelled" and ended == [f.run_id]
    run = (await store.get_run(f.run_id)).run
    assert run.status == "cancelled" and run.error == cancelled and run.ended_at is not None
    (audit,) = await store.list_audit(run_id=f.run_id, type="run.compensated")
    assert audit.data == {"cause": "cancel", "undos_completed": 1, "undos_failed": 0, "error": "CANCELLED"}


async def test_a_cancelled_sleeping_run_compensates_and_its_sleep_is_failed(store):
    s = await session(store, fn())
    f = await running(store, s)
    await store.yield_job(f, step_id="nap", name="nap", info=SleepYield(until=4_000_000_000.0))
    out = await store.cancel_run(f.run_id, "stop")
    assert out.compensating and out.session_id is None  # nobody held it
    assert (await steps(store, f.run_id))["nap"] == "failed"  # the waker never resumes it
    (queued,) = await store.list_queue()
    assert queued.reason == "compensate"


async def test_a_cancel_on_event_compensates_a_run_with_undos(store):
    s = await session(store, fn())
    f = await running(store, s)
    result = await store.ingest_event("order.withdrawn", {"order": 7}, None, idempotency_window_s=3600)
    (cancelled,) = result.cancelled
    assert cancelled.run_id == f.run_id and cancelled.compensating
    g = await compensation_segment(
        store, s, f, "cancel",
        ErrorInfo(f"cancelled by event {result.event_id} (order.withdrawn)", "CANCELLED", retryable=False),
    )
    assert (await store.fail_job(g, ORIGINAL)).status == "cancelled"


async def test_a_compensated_run_is_not_resumed_but_a_paused_compensation_is(store):
    s = await session(store, fn(max_attempts=1))
    f = await running(store, s)
    await store.fail_job(f, ORIGINAL)
    g = await compensation_segment(store, s, f, "failure", ORIGINAL)
    # Paused mid-compensation: resume carries the compensation on.
    await store.pause_run(f.run_id)
    await store.resume_run(f.run_id)
    (res,) = await store.reserve_segments(
        "n1", {s.session_id: frozenset(s.function_ids)}, 1, reservation_expiry_s=30.0
    )
    assert compensation_step_id(f.run_id, "begin") in {m.step_id for m in res.assignment.completed_steps}
    h = Fence(res.session_id, f.run_id, res.assignment.execution_seq, res.assignment.lease_token)
    await store.activate_lease(h, lease_expiry_s=90.0)
    assert (await store.fail_job(h, ORIGINAL)).status == "failed"
    with pytest.raises(StaleExecution):
        await store.fail_job(g, ORIGINAL)
    with pytest.raises(Conflict, match="compensated"):
        await store.resume_run(f.run_id)
    assert (await store.get_run(f.run_id)).run.status == "failed"


async def test_a_singleton_cancel_compensates_the_run_it_replaces(store):
    single = FunctionDef(id="f", triggers=[Trigger("order.created")], singleton=Singleton(mode="cancel"))
    s = await session(store, single)
    ended: list[str] = []
    store.on_runs_ended(ended.extend)
    f = await running(store, s)
    second = await store.ingest_event("order.created", {"order": 8}, None, idempotency_window_s=3600)
    (cancelled,) = second.cancelled
    assert cancelled.run_id == f.run_id and cancelled.compensating and ended == []
    assert (await store.get_run(f.run_id)).run.status == "waiting"
    assert compensation_step_id(f.run_id, "begin") in await steps(store, f.run_id)


async def test_a_run_timeout_is_not_a_cancel_it_ends_a_run_with_undos_at_once(store):
    timed = FunctionDef(id="f", triggers=[Trigger("order.created")], timeout_s=10.0)
    s = await session(store, timed)
    await store.heartbeat(s.session_id, [], session_expiry_s=10_000, lease_expiry_s=10_000)
    f = await running(store, s)
    await store.advance_clock(11)
    (out,) = await store.expire_run_deadlines()
    assert out.run_id == f.run_id and not out.compensating
    run = (await store.get_run(f.run_id)).run
    assert run.status == "failed" and run.error.code == "FUNCTION_TIMEOUT"
    assert await store.list_queue() == []
    assert compensation_step_id(f.run_id, "begin") not in await steps(store, f.run_id)
