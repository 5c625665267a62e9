"""An emit that reserves its runs in its own transaction
(``Store.ingest_and_reserve``): the same round a dispatcher would run, in
dispatch order, nothing for an emit that queued nothing (both backends)."""

from __future__ import annotations

import time

from ironflow.protocol import Concurrency, WaitYield
from tests.store.behaviour import RESERVATION, emit, fence_of, fn, reserve, worker


async def step_status(store, run_id: str, step_id: str) -> str | None:
    return next((st.status for st in (await store.get_run(run_id)).steps if st.step_id == step_id), None)


async def ingest_and_reserve(store, session, *names: str, limit: int = 10):
    return await store.ingest_and_reserve(
        [(name, {"n": i}, None) for i, name in enumerate(names or ("order.created",))],
        idempotency_window_s=3600,
        offers={session.session_id: frozenset(session.function_ids)},
        limit=limit,
        reservation_expiry_s=RESERVATION,
    )


async def test_an_emit_reserves_the_run_it_queued_for_a_free_credit(store):
    s = await worker(store, slots=2)
    (result,), reservations = await ingest_and_reserve(store, s)
    assert [r.assignment.run_id for r in reservations] == result.run_ids
    assert reservations[0].session_id == s.session_id and reservations[0].assignment.event.data == {"n": 0}
    assert await reserve(store, s) == []  # nothing left for the dispatcher
    await store.activate_lease(fence_of(reservations[0]), lease_expiry_s=90.0)
    assert (await store.get_run_record(result.run_ids[0])).status == "running"


async def test_an_older_queued_run_is_reserved_first_and_credits_bound_the_round(store):
    s = await worker(store, slots=1)
    older = await emit(store)  # queued, nobody dispatched it
    (newer,), reservations = await ingest_and_reserve(store, s)
    assert [r.assignment.run_id for r in reservations] == older.run_ids
    (left,) = await reserve(store, await worker(store, slots=1))
    assert left.assignment.run_id == newer.run_ids[0]


async def test_no_free_credit_or_a_full_limit_reserves_nothing_and_the_run_waits(store):
    s = await worker(store, fn("f", concurrency=Concurrency(limit=1)), slots=3)
    (first,), taken = await ingest_and_reserve(store, s)
    (second,), none = await ingest_and_reserve(store, s)
    assert len(taken) == 1 and none == []
    assert (await store.get_run_record(second.run_ids[0])).status == "waiting_for_capacity"


async def test_an_emit_that_queues_nothing_reserves_nothing(store):
    s = await worker(store, slots=2)
    await emit(store)  # queued earlier
    (result,), reservations = await ingest_and_reserve(store, s, "nobody.listens")
    assert result.run_ids == [] and reservations == []
    assert len(await reserve(store, s)) == 1  # still there for the dispatcher


async def test_a_wait_on_the_runs_own_event_name_is_not_resolved_by_its_own_trigger(store):
    """The run's first segment reserved in the transaction that ingested its
    event (on PostgreSQL that snapshot does not count its own event as seen):
    the wait it parks on the same name and key waits for the NEXT event."""
    s = await worker(store, fn("f", "order.updated"), slots=2)
    (result,), (reservation,) = await store.ingest_and_reserve(
        [("order.updated", {"order": 7}, None)],
        idempotency_window_s=3600,
        offers={s.session_id: frozenset(s.function_ids)},
        limit=10,
        reservation_expiry_s=RESERVATION,
    )
    fence = fence_of(reservation)
    await store.activate_lease(fence, lease_expiry_s=90.0)
    info = WaitYield(event="order.updated", timeout_at=time.time() + 600, match="data.order", match_value=7)
    await store.yield_job(fence, step_id="w", name="w", info=info)
    assert await step_status(store, fence.run_id, "w") == "waiting"
    await emit(store, "order.updated", {"order": 7})
    assert await step_status(store, fence.run_id, "w") == "completed"
