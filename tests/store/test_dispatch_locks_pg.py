"""Which ``conc:<function>`` named locks a reservation round takes on
PostgreSQL (store/dispatch.py): a function with a concurrency limit is
counted under its lock; one without is not, even when the round never sees
a run of it. Forced with a second connection holding the lock, never a sleep."""

from __future__ import annotations

import psycopg
import trio

from ironflow.protocol import Concurrency
from ironflow.store.core import lock_id
from ironflow.store.dispatch_flow import conc_lock
from ironflow.store.postgres import PostgresStore
from tests.store.behaviour import emit, fn, reserve, worker
from tests.store.pg_holds import beside_a_holder, lock_waiters, wait_until


def hold(pg_url: str, name: str) -> psycopg.Connection:
    """A second connection inside a transaction holding named lock ``name``."""
    conn = psycopg.connect(pg_url)
    conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_id(name),))
    return conn


async def test_an_unlimited_function_never_dispatched_is_not_locked_after_one_round(
    postgres_store: PostgresStore, pg_url: str
) -> None:
    store = postgres_store
    # "idle" is offered by the worker but no event ever starts it: the round
    # never reads a candidate of it. It used to stay "unknown, so locked" for
    # the node's life: every round and every emit's reservation took its lock
    # exclusively, one after another (bench.py on PostgreSQL: 201 of 242
    # transactions took it, 686 ms of waiting in a 2.5 s trial).
    session = await worker(store, fn("busy"), fn("idle", "never.emitted"), slots=4)
    await emit(store)
    assert len(await reserve(store, session)) == 1  # learns both definitions
    assert not await round_beside(store, session, pg_url, conc_lock("idle"))


async def round_beside(store: PostgresStore, session, pg_url: str, name: str) -> bool:
    """One more run emitted and a reservation round run while a second
    connection holds named lock ``name``; whether the round waited for it.
    The lock is let go either way and the round must reserve the run."""
    conn = hold(pg_url, name)
    done = trio.Event()
    got: list[int] = []

    async def round_() -> None:
        got.append(len(await reserve(store, session)))
        done.set()

    try:
        await emit(store)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(round_)
            ended = await trio.to_thread.run_sync(
                wait_until, lambda: done.is_set() or lock_waiters(pg_url) >= 1
            )
            waited = ended and not done.is_set()
            conn.rollback()
        assert got == [1]
        return waited
    finally:
        conn.close()


async def test_a_limited_function_is_counted_under_its_lock_even_unseen(
    postgres_store: PostgresStore, pg_url: str
) -> None:
    store = postgres_store
    session = await worker(
        store, fn("busy"), fn("limited", "never.emitted", concurrency=Concurrency(1)), slots=4
    )
    await emit(store)
    assert len(await reserve(store, session)) == 1
    assert await round_beside(store, session, pg_url, conc_lock("limited"))


async def _reserve_beside_a_session_holder(store: PostgresStore, pg_url: str, session, then: str):
    """A reservation round while a second connection's transaction holds the
    session row as a DRAINING nack does (draining set); once the round waits
    for that row, the holder ends with ``then``. The round's reservations and
    whether it waited."""
    with psycopg.connect(pg_url) as holder:
        holder.execute("UPDATE worker_sessions SET draining = 1 WHERE id = %s", (session.session_id,))
        return await beside_a_holder(pg_url, holder, lambda: reserve(store, session), then)


async def test_a_round_waits_for_a_draining_session_row_and_then_offers_it_nothing(
    postgres_store: PostgresStore, pg_url: str
) -> None:
    """The credits are read with their session rows share-locked (the
    candidates in the same statement): a drain committed while the round
    waited is seen, and the session gets nothing more."""
    store = postgres_store
    session = await worker(store, slots=2)
    await emit(store)
    made, waited = await _reserve_beside_a_session_holder(store, pg_url, session, "commit")
    assert waited, "the round did not wait for the session row another transaction held"
    assert made == []
    assert [q.reservation_owner for q in await store.list_queue()] == [None]


async def test_a_round_beside_a_drain_rolled_back_reserves(
    postgres_store: PostgresStore, pg_url: str
) -> None:
    store = postgres_store
    session = await worker(store, slots=2)
    queued = await emit(store)
    made, waited = await _reserve_beside_a_session_holder(store, pg_url, session, "rollback")
    assert waited
    assert [r.assignment.run_id for r in made] == queued.run_ids
