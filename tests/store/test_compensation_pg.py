"""Compensation interleavings on PostgreSQL (ironflow/store/compensation.py,
docs/isolation.md), each forced with a transaction held open inside the store
before its commit while the other side runs: never a sleep.

The registration (a step write, holding the lease ``FOR KEY SHARE``) against
a cancel (which locks the lease ``FOR UPDATE`` and deletes it before it reads
the registration), and a final failure that begins compensation against a
cancel: whichever commits first decides, the other sees it."""

from __future__ import annotations

from typing import Any

import trio

from ironflow.protocol import ErrorInfo, FunctionDef, RetryPolicy, Trigger, compensation_step_id
from ironflow.store import Conflict, Fence, StaleExecution
from tests.store.behaviour import running as shared_running
from tests.store.behaviour import worker
from tests.store.pg_holds import HOOK_WAIT_S, HookedStore, held_open, lock_waiters, wait_until
from tests.store.pg_holds import store as store  # the HookedStore fixture

FN = FunctionDef(id="saga", triggers=[Trigger("saga.go")], retries=RetryPolicy(max_attempts=1))
ORIGINAL = ErrorInfo("card declined", "DECLINED", retryable=False)


async def running(store: HookedStore) -> Fence:
    """One run of ``saga`` taken to 'running': its live fence."""
    return await shared_running(store, await worker(store, FN, slots=4), name="saga.go")


async def register(store: HookedStore, fence: Fence, refused: list[BaseException]) -> None:
    try:
        await store.record_step(
            fence, step_id=compensation_step_id(fence.run_id, "registered"),
            name="compensate:registered", status="completed",
        )
    except StaleExecution as exc:
        refused.append(exc)


async def cancel(store: HookedStore, run_id: str, into: list[Any]) -> None:
    try:
        into.append(await store.cancel_run(run_id, "stop"))
    except Conflict as exc:
        into.append(exc)


async def queue_reason(store: HookedStore) -> str | None:
    rows = await store.list_queue()
    return rows[0].reason if rows else None


async def test_a_registration_committing_first_makes_the_cancel_compensate(store, pg_url):
    fence = await running(store)
    paused, release = held_open(store)
    refused: list[BaseException] = []
    cancelled: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(register, store, fence, refused)
        assert await trio.to_thread.run_sync(paused.wait, HOOK_WAIT_S)
        nursery.start_soon(cancel, store, fence.run_id, cancelled)
        # The cancel waits for the registration's KEY SHARE lock on the lease.
        assert await trio.to_thread.run_sync(lambda: wait_until(lambda: lock_waiters(pg_url) > 0))
        release.set()
    assert refused == []
    assert cancelled[0].compensating
    assert (await store.get_run_record(fence.run_id)).status == "waiting"
    assert await queue_reason(store) == "compensate"


async def test_a_cancel_committing_first_refuses_the_late_registration(store, pg_url):
    fence = await running(store)
    paused, release = held_open(store)
    refused: list[BaseException] = []
    cancelled: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(cancel, store, fence.run_id, cancelled)
        assert await trio.to_thread.run_sync(paused.wait, HOOK_WAIT_S)
        nursery.start_soon(register, store, fence, refused)
        # The registration waits for the cancel's lock on the lease, then finds it gone.
        assert await trio.to_thread.run_sync(lambda: wait_until(lambda: lock_waiters(pg_url) > 0))
        release.set()
    assert refused, "a registration behind the cancel was written"
    assert not cancelled[0].compensating
    assert (await store.get_run_record(fence.run_id)).status == "cancelled"
    assert await queue_reason(store) is None


async def test_a_final_failure_committing_first_leaves_the_cancel_a_conflict(store, pg_url):
    fence = await running(store)
    await register(store, fence, [])
    paused, release = held_open(store)
    cancelled: list[Any] = []
    outcomes: list[Any] = []

    async def fail() -> None:
        outcomes.append(await store.fail_job(fence, ORIGINAL))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(fail)
        assert await trio.to_thread.run_sync(paused.wait, HOOK_WAIT_S)
        nursery.start_soon(cancel, store, fence.run_id, cancelled)
        assert await trio.to_thread.run_sync(lambda: wait_until(lambda: lock_waiters(pg_url) > 0))
        release.set()
    assert outcomes[0].compensating
    # The cancel read the run after the failure's commit: it is compensating.
    assert isinstance(cancelled[0], Conflict) and "compensating" in str(cancelled[0])
    run = await store.get_run_record(fence.run_id)
    assert run.status == "waiting" and run.error == ORIGINAL
    assert await queue_reason(store) == "compensate"


async def test_a_cancel_committing_first_refuses_the_late_failure_and_compensates_for_itself(store, pg_url):
    fence = await running(store)
    await register(store, fence, [])
    paused, release = held_open(store)
    cancelled: list[Any] = []
    refused: list[BaseException] = []

    async def fail() -> None:
        try:
            await store.fail_job(fence, ORIGINAL)
        except StaleExecution as exc:
            refused.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cancel, store, fence.run_id, cancelled)
        assert await trio.to_thread.run_sync(paused.wait, HOOK_WAIT_S)
        nursery.start_soon(fail)
        assert await trio.to_thread.run_sync(lambda: wait_until(lambda: lock_waiters(pg_url) > 0))
        release.set()
    assert refused and cancelled[0].compensating
    run = await store.get_run_record(fence.run_id)
    assert run.status == "waiting" and run.error is not None and run.error.code == "CANCELLED"
