"""A group of job results that reserves the freed credits' next segments in
its own transaction (``Store.complete_jobs_and_reserve``): the same round a
dispatcher would run, after the completions in the same transaction, nothing
for a group that freed nothing (both backends)."""

from __future__ import annotations

import pytest

from ironflow.protocol import Concurrency, InvokeYield
from ironflow.store import Fence, StaleExecution, StepResult
from tests.store.behaviour import (
    LEASE,
    RESERVATION,
    emit,
    fence_of,
    fn,
    reserve,
    running,
    worker,
)


async def complete_and_reserve(store, session, items, limit: int = 10):
    return await store.complete_jobs_and_reserve(
        items,
        offers={session.session_id: frozenset(session.function_ids)},
        limit=limit,
        reservation_expiry_s=RESERVATION,
    )


async def test_a_completion_reserves_the_next_queued_run_for_the_credit_it_freed(store):
    s = await worker(store, slots=1)
    done = await running(store, s)
    queued = await emit(store)  # no credit left for it
    assert await reserve(store, s) == []
    heard = []
    store.on_run_results(heard.extend)
    results, reservations = await complete_and_reserve(
        store, s, [(done, {"ok": 1}, [StepResult("s1", "one", "completed", 7)])]
    )
    assert results[0].unwrap().status == "completed"
    assert [r.assignment.run_id for r in reservations] == queued.run_ids
    assert reservations[0].session_id == s.session_id
    assert [(r.run_id, r.output) for r in heard] == [(done.run_id, {"ok": 1})]
    detail = await store.get_run(done.run_id)
    assert detail.run.output == {"ok": 1} and [x.output for x in detail.steps] == [7]
    assert await reserve(store, s) == []  # nothing left for the dispatcher
    await store.activate_lease(fence_of(reservations[0]), lease_expiry_s=LEASE)
    assert (await store.get_run_record(queued.run_ids[0])).status == "running"


async def test_a_stale_completion_frees_nothing_and_reserves_nothing(store):
    s = await worker(store, slots=1)
    live = await running(store, s)
    queued = await emit(store)
    stale = Fence(live.session_id, live.run_id, live.execution_seq, "0" * 32)
    results, reservations = await complete_and_reserve(store, s, [(stale, "no", [])])
    with pytest.raises(StaleExecution):
        results[0].unwrap()
    assert reservations == []
    assert (await store.get_run_record(live.run_id)).status == "running"
    assert (await store.get_run_record(queued.run_ids[0])).status == "waiting_for_capacity"


async def test_the_round_counts_the_limit_slot_the_completion_freed(store):
    s = await worker(store, fn("f", concurrency=Concurrency(limit=1)), slots=3)
    done = await running(store, s)
    queued = await emit(store)
    assert await reserve(store, s) == []  # the limit is full, credits are not
    (result,), reservations = await complete_and_reserve(store, s, [(done, None, [])])
    assert result.unwrap().status == "completed"
    assert [r.assignment.run_id for r in reservations] == queued.run_ids


async def test_a_parent_resumed_by_its_childs_completion_is_reserved_in_the_same_commit(store):
    s = await worker(store, fn("parent"), fn("child", "never"), slots=2)
    parent = await running(store, s)
    await store.yield_job(parent, step_id="i", name="i", info=InvokeYield("child", {}))
    (res,) = await reserve(store, s)
    child = fence_of(res)
    await store.activate_lease(child, lease_expiry_s=LEASE)
    (result,), reservations = await complete_and_reserve(store, s, [(child, 42, [])])
    assert result.unwrap().kicked_run_ids == [parent.run_id]
    (resumed,) = reservations
    assert resumed.assignment.run_id == parent.run_id and resumed.assignment.execution_seq == 2
    assert [m.output for m in resumed.assignment.completed_steps] == [42]


async def test_duplicate_runs_in_one_group_complete_one_by_one_and_reserve_nothing(store):
    s = await worker(store, slots=2)
    done = await running(store, s)
    await emit(store)
    results, reservations = await complete_and_reserve(store, s, [(done, 1, []), (done, 2, [])])
    assert results[0].unwrap().status == "completed"
    with pytest.raises(StaleExecution):
        results[1].unwrap()
    assert reservations == []
    assert len(await reserve(store, s)) == 1  # the dispatcher's, as before


async def test_an_ack_that_came_with_its_result_is_activated_in_the_same_transaction(store):
    s = await worker(store, slots=2)
    await emit(store)
    await emit(store)
    first, second = (fence_of(r) for r in await reserve(store, s))
    stale_ack = Fence(second.session_id, second.run_id, second.execution_seq, "0" * 32)
    results = await store.complete_jobs(
        [(first, "one", [StepResult("s1", "one", "completed", 1)]), (stale_ack, "two", [])],
        activate=frozenset({first.run_id, second.run_id}),
        lease_expiry_s=LEASE,
    )
    assert results[0].unwrap().status == "completed"
    with pytest.raises(StaleExecution):
        results[1].unwrap()
    detail = await store.get_run(first.run_id)
    assert detail.run.status == "completed" and detail.run.started_at is not None
    assert [x.output for x in detail.steps] == [1]
    assert (await store.get_run_record(second.run_id)).status != "running"
    assert await store.list_leases() == []
    assert (await store.list_sessions())[0].credits_claimed == 1  # the stale ack's reservation


async def test_a_round_gives_a_resumed_segment_its_steps_and_a_first_segment_none(store):
    """A first segment (seq 1) has no steps and its round reads none; a
    resumed one in the same round still gets every recorded step."""
    s = await worker(store, fn("parent"), fn("child", "never"), slots=2)
    parent = await running(store, s)
    await store.record_steps(parent, [StepResult("before", "before", "completed", "b")])
    await store.yield_job(parent, step_id="i", name="i", info=InvokeYield("child", {}))
    (res,) = await reserve(store, s)
    child = fence_of(res)
    await store.activate_lease(child, lease_expiry_s=LEASE)
    fresh = await emit(store)
    (result,), reservations = await complete_and_reserve(store, s, [(child, 42, [])])
    assert result.unwrap().kicked_run_ids == [parent.run_id]
    by_run = {r.assignment.run_id: r.assignment for r in reservations}
    assert set(by_run) == {parent.run_id, *fresh.run_ids}
    assert by_run[parent.run_id].execution_seq == 2
    assert [m.output for m in by_run[parent.run_id].completed_steps] == ["b", 42]
    assert by_run[fresh.run_ids[0]].execution_seq == 1
    assert by_run[fresh.run_ids[0]].completed_steps == []
