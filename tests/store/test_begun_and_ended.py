"""A segment whose JobAck, step results and job result are applied in one
transaction (``complete_jobs(activate=…)``, a short segment's held ack): it
begins and ends there, fenced on its reservation, with no lease written and
deleted between — and leaves exactly the state an ack alone and then its
results would have left (both backends)."""

from __future__ import annotations

import pytest

from ironflow.store import Fence, StaleExecution, StepResult
from tests.store.behaviour import LEASE, emit, fence_of, fn, reserve, worker

STEPS = [StepResult("s1", "one", "completed", 1), StepResult("s2", "two", "completed", {"x": 2})]


async def reserved(store, session, n: int = 1) -> list[Fence]:
    for _ in range(n):
        await emit(store)
    return sorted((fence_of(r) for r in await reserve(store, session, limit=n)), key=lambda f: f.run_id)


async def begun_and_ended(store, items, activate=None):
    return await store.complete_jobs(
        items,
        activate=frozenset(f.run_id for f, _, _ in items) if activate is None else activate,
        lease_expiry_s=LEASE,
    )


async def state_of(store, run_id: str) -> tuple:
    """What a user (or the next segment) can see of a run: its record, its
    steps and its audit trail, without times and ids."""
    detail = await store.get_run(run_id)
    r = detail.run
    steps = [(s.step_id, s.name, s.kind, s.status, s.output, s.execution_seq) for s in detail.steps]
    audit = [a.type for a in await store.list_audit(run_id=run_id)]  # oldest first
    return (
        (r.status, r.output, r.attempt, r.recovery_count, r.current_execution_seq, r.started_at is not None),
        steps,
        audit,
    )


@pytest.mark.parametrize("audit", [False, True], ids=["quiet", "audited"])
async def test_a_segment_begun_and_ended_together_leaves_the_state_of_an_ack_then_its_results(store, audit):
    s = await worker(store, fn("f", audit=audit), slots=2)
    together, apart = await reserved(store, s, 2)
    await store.activate_lease(apart, lease_expiry_s=LEASE)
    (one,) = await begun_and_ended(store, [(together, "out", STEPS)])
    (two,) = await store.complete_jobs([(apart, "out", STEPS)], lease_expiry_s=LEASE)
    ended = one.unwrap()
    assert ended.status == two.unwrap().status == "completed" and ended.function_id == "f"
    assert await state_of(store, together.run_id) == await state_of(store, apart.run_id)
    if audit:
        assert (await state_of(store, together.run_id))[2][0] == "run.started"
        assert "run.completed" in (await state_of(store, together.run_id))[2]
    assert await store.list_leases() == [] and await store.list_queue() == []
    assert (await store.list_sessions())[0].credits_claimed == 0
    record = await store.get_run_record(together.run_id)
    assert record.started_at is not None and record.ended_at is not None


async def test_a_stale_token_a_gone_session_or_an_ended_run_begins_nothing(store):
    s = await worker(store, slots=3)
    bad_token, cancelled, fine = await reserved(store, s, 3)
    await store.cancel_run(cancelled.run_id, "by hand")
    stale = Fence(bad_token.session_id, bad_token.run_id, bad_token.execution_seq, "0" * 32)
    results = await begun_and_ended(store, [(stale, 1, STEPS), (cancelled, 2, STEPS), (fine, 3, STEPS)])
    for refused in results[:2]:
        with pytest.raises(StaleExecution):
            refused.unwrap()
    assert results[2].unwrap().status == "completed"
    assert (await store.get_run(bad_token.run_id)).steps == []
    assert (await store.get_run_record(bad_token.run_id)).status != "completed"
    assert (await store.get_run(cancelled.run_id)).run.status == "cancelled"
    assert (await store.get_run(cancelled.run_id)).steps == []
    # The stale ack's reservation stands until it expires, as after an ack refused alone.
    assert [q.run_id for q in await store.list_queue()] == [bad_token.run_id]


async def test_an_ack_of_a_closed_session_is_refused_and_its_run_queued_again(store):
    s = await worker(store, slots=1)
    (fence,) = await reserved(store, s)
    await store.close_session(s.session_id, recover_leases=True, recovery_grace_s=0, recovery_ceiling=10)
    (result,) = await begun_and_ended(store, [(fence, "late", STEPS)])
    with pytest.raises(StaleExecution):
        result.unwrap()
    assert (await store.get_run(fence.run_id)).steps == []
    (queued,) = await store.list_queue()
    assert queued.run_id == fence.run_id and queued.reservation_owner is None


async def test_a_repeated_ack_goes_on_under_the_lease_it_activated(store):
    """The ack was applied alone before (its hold ran out), then sent again
    with the results: the reservation is gone, the lease is the fence."""
    s = await worker(store, slots=2)
    leased, fresh = await reserved(store, s, 2)
    await store.activate_lease(leased, lease_expiry_s=LEASE)
    results = await begun_and_ended(store, [(leased, "a", STEPS), (fresh, "b", STEPS[:1])])
    assert [r.unwrap().status for r in results] == ["completed", "completed"]
    assert [x.output for x in (await store.get_run(leased.run_id)).steps] == [1, {"x": 2}]
    assert [x.output for x in (await store.get_run(fresh.run_id)).steps] == [1]
    assert await store.list_leases() == [] and await store.list_queue() == []
    assert (await store.list_sessions())[0].credits_claimed == 0


async def test_a_completed_step_replayed_in_a_begun_segment_keeps_its_first_output(store):
    """A retry's segment re-sends a step the run completed before: the first
    output stands (the same upsert as a step written under a lease)."""
    s = await worker(store, slots=1)
    (first,) = await reserved(store, s)
    await store.activate_lease(first, lease_expiry_s=LEASE)
    await store.record_steps(first, STEPS[:1])
    await store.nack_job(first, reason="DRAINING")  # this session gets nothing more
    (again,) = (fence_of(r) for r in await reserve(store, await worker(store, slots=1)))
    assert again.execution_seq == first.execution_seq + 1
    (result,) = await begun_and_ended(store, [(again, "done", [StepResult("s1", "one", "completed", 99), *STEPS[1:]])])
    assert result.unwrap().status == "completed"
    steps = {x.step_id: (x.output, x.execution_seq) for x in (await store.get_run(first.run_id)).steps}
    assert steps == {"s1": (1, first.execution_seq), "s2": ({"x": 2}, again.execution_seq)}


async def test_audited_and_quiet_functions_begun_together_each_leave_their_own_state(store):
    """One group, a function that audits and one that does not: each run's
    steps and audit trail are what its ack then its results would leave
    (PostgreSQL writes the quiet one's steps in the completion's statement)."""
    s = await worker(store, fn("loud", "order.created", audit=True), fn("quiet", "order.created"), slots=4)
    await emit(store)
    await emit(store)
    fences = sorted((fence_of(r) for r in await reserve(store, s, limit=4)), key=lambda f: f.run_id)
    kinds = {f.run_id: (await store.get_run_record(f.run_id)).function_id for f in fences}
    by_fn: dict[str, list[Fence]] = {}
    for f in fences:
        by_fn.setdefault(kinds[f.run_id], []).append(f)
    together = [by_fn["loud"][0], by_fn["quiet"][0]]
    apart = [by_fn["loud"][1], by_fn["quiet"][1]]
    for f in apart:
        await store.activate_lease(f, lease_expiry_s=LEASE)
    results = await begun_and_ended(store, [(f, "out", STEPS) for f in together])
    assert [r.unwrap().status for r in results] == ["completed", "completed"]
    for f in apart:
        (r,) = await store.complete_jobs([(f, "out", STEPS)], lease_expiry_s=LEASE)
        r.unwrap()
    for t, a in zip(together, apart, strict=True):
        assert await state_of(store, t.run_id) == await state_of(store, a.run_id)
    assert "step.completed" in (await state_of(store, together[0].run_id))[2]


async def test_a_step_sent_twice_in_one_segment_keeps_its_first_result(store):
    """The same step id twice in one segment's results (an upsert may change
    a row once per statement): written one after the other, the first
    completed result stands."""
    s = await worker(store, slots=1)
    (fence,) = await reserved(store, s)
    twice = [StepResult("s1", "one", "completed", 1), StepResult("s1", "one", "completed", 2)]
    (result,) = await begun_and_ended(store, [(fence, "done", twice)])
    assert result.unwrap().status == "completed"
    assert [(x.step_id, x.output) for x in (await store.get_run(fence.run_id)).steps] == [("s1", 1)]
