"""Cancel-on interleavings on PostgreSQL (ironflow/store/cancel_on.py), each
forced with a transaction held open inside the store (the ``after`` hook of
tests/store/test_pg_races.py) while the other side runs: never a sleep."""

from __future__ import annotations

from typing import Any

import trio

from ironflow.protocol import CancelOn, FunctionDef, Trigger
from ironflow.store import Fence, StaleExecution
from tests.store.pg_holds import HOOK_WAIT_S, HookedStore, held_open, lock_waiters, wait_until
from tests.store.pg_holds import store as store  # the HookedStore fixture

DRIP = FunctionDef(
    id="drip", triggers=[Trigger("user.created")],
    cancel_on=[CancelOn("user.unsubscribed", match="data.user_id")],
)


async def running(store: HookedStore, user_id: int) -> Fence:
    session = await store.register_worker(
        node_id="n0", worker_id="w", mode="stream", max_concurrent_jobs=4,
        functions=[DRIP], session_expiry_s=600,
    )
    await store.ingest_event("user.created", {"user_id": user_id}, None, idempotency_window_s=60)
    (res,) = await store.reserve_segments(
        "n0", {session.session_id: frozenset({"drip"})}, 1, reservation_expiry_s=600
    )
    a = res.assignment
    fence = Fence(session.session_id, a.run_id, a.execution_seq, a.lease_token)
    await store.activate_lease(fence, lease_expiry_s=600)
    return fence



async def unsubscribe(store: HookedStore, user_id: int, into: list[Any]) -> None:
    into.append(await store.ingest_event("user.unsubscribed", {"user_id": user_id}, None, idempotency_window_s=60))


async def test_a_completion_committing_first_wins_and_the_cancel_finds_the_run_ended(store, pg_url):
    fence = await running(store, 1)
    paused, release = held_open(store)
    results: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(store.complete_job, fence, "done")
        assert await trio.to_thread.run_sync(paused.wait, HOOK_WAIT_S)
        nursery.start_soon(unsubscribe, store, 1, results)
        # The cancel waits for the completion's locks (lease, then run).
        assert await trio.to_thread.run_sync(lambda: wait_until(lambda: lock_waiters(pg_url) > 0))
        release.set()
    assert results[0].cancelled == []
    run = await store.get_run_record(fence.run_id)
    assert run.status == "completed" and run.output == "done" and run.error is None


async def test_a_cancel_committing_first_wins_and_the_late_completion_is_refused(store, pg_url):
    fence = await running(store, 2)
    paused, release = held_open(store)
    results: list[Any] = []
    refused: list[BaseException] = []

    async def complete() -> None:
        try:
            await store.complete_job(fence, "late")
        except StaleExecution as exc:
            refused.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(unsubscribe, store, 2, results)
        assert await trio.to_thread.run_sync(paused.wait, HOOK_WAIT_S)
        nursery.start_soon(complete)
        # The completion waits for the cancel's lock on the lease row.
        assert await trio.to_thread.run_sync(lambda: wait_until(lambda: lock_waiters(pg_url) > 0))
        release.set()
    assert [o.run_id for o in results[0].cancelled] == [fence.run_id]
    assert refused, "the completion behind the cancel was accepted"
    run = await store.get_run_record(fence.run_id)
    assert run.status == "cancelled" and run.output is None


async def test_a_run_committed_after_the_cancel_event_read_is_not_cancelled(store):
    """Node A creates the run while node B ingests the cancelling event: B's
    lookup ran before A committed, so by commit order the event came first."""
    await store.register_worker(
        node_id="n0", worker_id="w", mode="stream", max_concurrent_jobs=1,
        functions=[DRIP], session_expiry_s=600,
    )
    paused, release = held_open(store)
    created: list[Any] = []
    results: list[Any] = []

    async def create() -> None:
        created.append(await store.ingest_event("user.created", {"user_id": 3}, None, idempotency_window_s=60))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(create)
        assert await trio.to_thread.run_sync(paused.wait, HOOK_WAIT_S)
        with trio.fail_after(HOOK_WAIT_S):  # the lookup locks nothing: it never waits for A
            await unsubscribe(store, 3, results)
        release.set()
    assert results[0].cancelled == []
    (run_id,) = created[0].run_ids
    assert (await store.get_run_record(run_id)).status == "waiting_for_capacity"
    # Once A's commit is seen, the next event cancels it.
    await unsubscribe(store, 3, results)
    assert [o.run_id for o in results[1].cancelled] == [run_id]
