"""A segment begun and ended in one transaction (``complete_jobs(activate=…)``)
beside another transaction that holds its reservation's queue row, forced
with a second connection — never a sleep. The DELETE that proves the
reservation is the fence: it waits for the holder and re-checks the row."""

from __future__ import annotations

import psycopg
import pytest

from ironflow.store import StaleExecution, StepResult
from tests.store.behaviour import LEASE, emit, fence_of, reserve, worker
from tests.store.pg_holds import beside_a_holder

STEPS = [StepResult("s1", "one", "completed", 1)]


async def beside_the_queue_row_holder(store, pg_url, fence, holder_sql: str, then: str):
    """Complete ``fence``'s segment (ack and results together) while a second
    connection's transaction has run ``holder_sql`` on its queue row; once the
    completion waits for that row, the holder ends with ``then`` (commit or
    rollback). The completion's outcome and whether it waited."""
    with psycopg.connect(pg_url) as holder:
        holder.execute(holder_sql, (fence.run_id,))
        (result,), waited = await beside_a_holder(pg_url, holder, lambda: store.complete_jobs(
            [(fence, "done", STEPS)], activate=frozenset({fence.run_id}), lease_expiry_s=LEASE
        ), then)
    return result, waited


async def test_a_reservation_freed_while_the_segment_ends_is_not_taken(postgres_store, pg_url):
    """The holder frees the reservation as a session's close (or loop 1's
    expiry) does; the completion's DELETE waits for its row, finds it no
    longer reserved for this session and refuses: no step, no end, the run
    queued for the next dispatch — never a run with neither queue row nor lease."""
    store = postgres_store
    session = await worker(store, slots=1)
    await emit(store)
    (fence,) = (fence_of(r) for r in await reserve(store, session))
    result, waited = await beside_the_queue_row_holder(
        store, pg_url, fence,
        "UPDATE dispatch_queue SET reservation_owner = NULL, reservation_expires_at = NULL,"
        " lease_token_hash = NULL WHERE run_id = %s",
        "commit",
    )
    assert waited, "the completion did not wait for the queue row another transaction held"
    with pytest.raises(StaleExecution):
        result.unwrap()
    detail = await store.get_run(fence.run_id)
    assert detail.run.status != "completed" and detail.steps == []
    (queued,) = await store.list_queue()
    assert queued.run_id == fence.run_id and queued.reservation_owner is None
    assert await store.list_leases() == []


async def test_a_holder_that_rolls_back_leaves_the_segment_to_end(postgres_store, pg_url):
    store = postgres_store
    session = await worker(store, slots=1)
    await emit(store)
    (fence,) = (fence_of(r) for r in await reserve(store, session))
    result, waited = await beside_the_queue_row_holder(
        store, pg_url, fence, "SELECT 1 FROM dispatch_queue WHERE run_id = %s FOR UPDATE", "rollback"
    )
    assert waited
    assert result.unwrap().status == "completed"
    detail = await store.get_run(fence.run_id)
    assert detail.run.status == "completed" and [s.output for s in detail.steps] == [1]
    assert await store.list_queue() == [] and await store.list_leases() == []
    assert (await store.list_sessions())[0].credits_claimed == 0
