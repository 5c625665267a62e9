"""An emit that reserves its runs in its own transaction
(``Store.ingest_and_reserve``): the same round a dispatcher would run, in
dispatch order, nothing for an emit that queued nothing (both backends)."""

from __future__ import annotations

from ironflow.protocol import Concurrency
from tests.store.test_store_behaviour import RESERVATION, emit, fence_of, fn, reserve, worker


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
