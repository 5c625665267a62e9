"""A full concurrency key's ``on_limit`` (ironflow/store/flow.py ``_on_limit``),
on both backends: ``skip`` starts no run while the key has ``limit`` runs in
flight (holding a slot or queued for one), ``cancel_in_progress`` cancels the
key's oldest so the new run fits; ``queue`` (the default) changes nothing."""

from __future__ import annotations

import time

from ironflow.protocol import Concurrency, FunctionDef, SleepYield, Trigger, compensation_step_id
from ironflow.store import Fence, Store
from tests.store.test_flow_control import EVENT, emit, reserve, worker


def fn(fid: str, concurrency, **kw) -> FunctionDef:
    return FunctionDef(id=fid, triggers=[Trigger(EVENT)], concurrency=concurrency, **kw)


async def running(store: Store, session, limit: int = 50) -> list[Fence]:
    """Reserve and activate what the session can take: leases, as a worker's ack makes."""
    fences = []
    for res in await reserve(store, session, limit):
        a = res.assignment
        fence = Fence(res.session_id, a.run_id, a.execution_seq, a.lease_token)
        await store.activate_lease(fence, lease_expiry_s=600)
        fences.append(fence)
    return fences


async def test_skip_starts_no_run_while_the_key_has_its_limit_in_flight_and_says_so(store):
    session = await worker(store, fn("sync", Concurrency(2, key="event.data.account", on_limit="skip")))
    first = [await emit(store, {"account": 1}) for _ in range(2)]
    assert all(len(r.run_ids) == 1 and r.flow == [] for r in first)
    # Queued runs count: a burst starts `limit` runs, not one per event.
    skipped = await emit(store, {"account": 1})
    assert skipped.run_ids == []
    [note] = skipped.flow
    assert (note.mechanism, note.outcome, note.run_id) == ("concurrency", "skipped", first[0].run_ids[0])
    assert note.reason == "concurrency key event.data.account=1: 2/2 in flight"
    record = await store.get_event(skipped.event_id)
    assert record.run_ids == [] and record.flow == [note]
    assert len((await emit(store, {"account": 2})).run_ids) == 1  # another key has its own slots
    # Holding a lease counts the same; an ended run frees its place.
    fences = [f for f in await running(store, session) if f.run_id in first[0].run_ids]
    assert (await emit(store, {"account": 1})).run_ids == []
    await store.complete_job(fences[0], "done")
    assert len((await emit(store, {"account": 1})).run_ids) == 1


async def test_skip_does_not_count_a_sleeping_run_which_holds_no_slot(store):
    session = await worker(store, fn("sync", Concurrency(1, on_limit="skip")))
    first = await emit(store, {})
    [fence] = await running(store, session)
    await store.yield_job(fence, step_id="nap", name="nap", info=SleepYield(until=time.time() + 3600))
    second = await emit(store, {})
    assert len(second.run_ids) == 1 and second.run_ids != first.run_ids


async def test_cancel_in_progress_cancels_the_oldest_runs_of_the_key_so_the_new_one_fits(store):
    session = await worker(store, fn(
        "render", Concurrency(2, key="event.data.doc", on_limit="cancel_in_progress"), audit=True,
    ))
    old = [(await emit(store, {"doc": "a"})).run_ids[0] for _ in range(2)]
    fences = await running(store, session)
    assert {f.run_id for f in fences} == set(old)
    third = await emit(store, {"doc": "a"})
    assert len(third.run_ids) == 1
    # The oldest went; its worker is told (the outcome names the session and job).
    [cancel] = third.cancelled
    assert cancel.run_id == old[0] and cancel.session_id == session.session_id and cancel.job_id
    assert [(n.mechanism, n.outcome, n.run_id) for n in third.flow] == [("concurrency", "cancelled", old[0])]
    assert (await store.get_run(old[0])).run.status == "cancelled"
    assert (await store.get_run(old[1])).run.status == "running"
    [audit] = await store.list_audit(run_id=old[0], type="run.cancelled")
    assert audit.data["cause"] == "concurrency"
    assert (await store.get_event(third.event_id)).flow == third.flow
    # A queued run in flight is cancelled the same way; another key is untouched.
    assert (await emit(store, {"doc": "b"})).cancelled == []
    fourth = await emit(store, {"doc": "a"})
    assert [o.run_id for o in fourth.cancelled] == [old[1]]
    fifth = await emit(store, {"doc": "a"})
    assert [o.run_id for o in fifth.cancelled] == third.run_ids


async def test_on_limit_on_one_of_two_layered_constraints_counts_that_constraint(store):
    await worker(store, fn("sync", [
        Concurrency(100), Concurrency(1, key="event.data.account", on_limit="skip"),
    ]))
    assert len((await emit(store, {"account": 1})).run_ids) == 1
    assert (await emit(store, {"account": 1})).flow[0].outcome == "skipped"
    assert len((await emit(store, {"account": 2})).run_ids) == 1


async def test_queue_the_default_starts_every_run(store):
    await worker(store, fn("sync", Concurrency(1, key="event.data.account")))
    results = [await emit(store, {"account": 1}) for _ in range(3)]
    assert all(len(r.run_ids) == 1 and r.flow == [] for r in results)


async def test_a_group_of_events_of_one_key_skips_past_the_limit_within_the_group(store):
    await worker(store, fn("sync", Concurrency(2, on_limit="skip")))
    results = await store.ingest_events([(EVENT, {"n": i}, None) for i in range(4)], idempotency_window_s=60)
    assert [len(r.run_ids) for r in results] == [1, 1, 0, 0]


async def test_a_group_of_emits_counts_runs_from_before_and_its_own_per_key(store):
    await worker(store, fn("sync", Concurrency(2, key="event.data.account", on_limit="skip")))
    before = [await emit(store, {"account": 1}), await emit(store, {"account": None})]
    results = await store.ingest_events(
        [(EVENT, d, None) for d in [{"account": 1}, {"account": 2}, {"account": 1}, {"account": None},
                                     {"account": None}, {"account": 2}]],
        idempotency_window_s=60,
    )
    assert [len(r.run_ids) for r in results] == [1, 1, 0, 1, 0, 1]
    assert results[2].flow[0].reason.endswith("2/2 in flight")
    assert results[4].flow[0].run_id == before[1].run_ids[0]


async def test_a_group_of_emits_cancels_in_progress_runs_in_turn(store):
    session = await worker(store, fn("render", Concurrency(1, on_limit="cancel_in_progress")))
    [old] = (await emit(store, {})).run_ids
    await running(store, session)
    first, second = await store.ingest_events([(EVENT, {}, None)] * 2, idempotency_window_s=60)
    assert [o.run_id for o in first.cancelled] == [old]
    assert [o.run_id for o in second.cancelled] == first.run_ids
    assert (await store.get_run(second.run_ids[0])).run.status != "cancelled"


async def test_cancel_in_progress_lets_a_run_with_undos_compensate_and_counts_it_meanwhile(store):
    session = await worker(store, fn("render", Concurrency(1, on_limit="cancel_in_progress")))
    [old] = (await emit(store, {})).run_ids
    [fence] = await running(store, session)
    await store.record_step(
        fence, step_id=compensation_step_id(old, "registered"), name="compensate:registered", status="completed",
    )
    second = await emit(store, {})
    [cancel] = second.cancelled
    assert cancel.run_id == old and cancel.compensating and cancel.session_id == session.session_id
    assert (await store.get_run(old)).run.status not in ("cancelled", "completed", "failed")
    # Compensating, it is still in flight: the next event cancels the newer run, not it again.
    third = await emit(store, {})
    assert [o.run_id for o in third.cancelled] == second.run_ids and len(third.run_ids) == 1
