"""Flow control's PostgreSQL interleavings (ironflow/store/flow.py, dispatch_flow.py):
two nodes ingesting the same key at once, forced — one ingest held inside
its transaction (after its last statement, before its commit) while a
second store's ingest runs into the row lock it holds — never a sleep."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
import trio

from ironflow.protocol import (
    Batch,
    Concurrency,
    Debounce,
    FunctionDef,
    RateLimit,
    Singleton,
    Throttle,
    Trigger,
)
from ironflow.store.postgres import PostgresStore
from tests.store.behaviour import reserve, worker
from tests.store.pg_holds import HookedStore, lock_waiters, race_calls, wait_until

EVENT = "race.flow"



async def register(store: PostgresStore, fd: FunctionDef) -> None:
    await store.register_worker(
        node_id="n0", worker_id="w", mode="stream", max_concurrent_jobs=10,
        functions=[fd], session_expiry_s=600,
    )


async def emit(store: PostgresStore, data: Any) -> Any:
    return await store.ingest_event(EVENT, data, None, idempotency_window_s=60)


async def emit_group(store: PostgresStore, datas: list[Any]) -> Any:
    """A group of emits in one transaction (``ingest_events``): its singleton
    and batch keys upserted in one statement (store/flow.py ``_claim_keys``)."""
    return await store.ingest_events([(EVENT, d, None) for d in datas], idempotency_window_s=60)


async def race(
    a: HookedStore, b: PostgresStore, pg_url: str, data: Any, send: Any = emit
) -> tuple[Any, Any, bool]:
    """Ingest ``data`` on ``a``, held before its commit, and on ``b`` meanwhile.

    Returns both results and whether ``b`` finished while ``a`` was held
    (it must not: it waits for ``a``'s row lock, then reads ``a``'s row)."""
    return await race_calls(a, pg_url, lambda: send(a, data), lambda: send(b, data))



@pytest.mark.parametrize("earlier", [0, 1], ids=["first-event-of-the-key", "row-exists"])
async def test_two_nodes_ingesting_one_key_at_once_pass_a_rate_limit_once(stores, pg_url, earlier):
    """The first event of a key: the second insert waits on the primary key;
    later ones: the UPDATE waits on the row lock and re-checks the bucket."""
    a, b = stores
    await register(a, FunctionDef(
        id="limited", triggers=[Trigger(EVENT)], rate_limit=RateLimit(earlier + 1, 600.0, key="k"),
    ))
    for _ in range(earlier):
        assert (await emit(b, {"k": 1})).run_ids
    first, second, raced = await race(a, b, pg_url, {"k": 1})
    assert not raced, "the second ingest passed the rate limit's row lock"
    assert len(first.run_ids) == 1 and second.run_ids == []
    assert second.flow[0].mechanism == "rate_limit"


@pytest.mark.parametrize("earlier", [False, True], ids=["first-event-of-the-key", "its-run-ended"])
async def test_two_nodes_ingesting_one_singleton_key_at_once_start_one_run(stores, pg_url, earlier):
    """The upsert names the new run at once when the key is new or its run is
    seen ended; the second node's upsert waits for the first's and, not seeing
    the first's run in its snapshot, reads it afresh: in flight, skipped."""
    a, b = stores
    await register(a, FunctionDef(id="single", triggers=[Trigger(EVENT)], singleton=Singleton(key="k")))
    if earlier:
        [ended] = (await emit(b, {"k": 1})).run_ids
        await b.cancel_run(ended, "over")
    first, second, raced = await race(a, b, pg_url, {"k": 1})
    assert not raced
    assert len(first.run_ids) == 1 and second.run_ids == []
    assert second.flow[0].outcome == "skipped" and second.flow[0].run_id == first.run_ids[0]


@pytest.mark.parametrize("kind", ["singleton", "on_limit"])
async def test_two_nodes_ingesting_groups_that_share_a_key_start_one_run_of_it(stores, pg_url, kind):
    """Each group upserts its keys in one statement, in key order (on_limit:
    then counts them): the second waits on the shared key's row, then finds
    the first's run in flight."""
    a, b = stores
    flow: dict[str, Any] = (
        {"singleton": Singleton(key="k")} if kind == "singleton"
        else {"concurrency": Concurrency(1, key="k", on_limit="skip")}
    )
    await register(a, FunctionDef(id="single", triggers=[Trigger(EVENT)], **flow))
    first, second, raced = await race(a, b, pg_url, [{"k": 2}, {"k": 1}], emit_group)
    assert not raced
    assert [len(r.run_ids) for r in first] == [1, 1]
    assert [len(r.run_ids) for r in second] == [0, 0]
    assert second[1].flow[0].run_id == first[1].run_ids[0]


@pytest.mark.parametrize("kind", ["debounce", "batch"])
async def test_two_nodes_ingesting_one_key_at_once_share_one_pending_run(stores, pg_url, kind):
    a, b = stores
    flow = {"debounce": Debounce(60.0, key="k")} if kind == "debounce" else {"batch": Batch(10, 60.0, key="k")}
    await register(a, FunctionDef(id="held", triggers=[Trigger(EVENT)], **flow))
    first, second, raced = await race(a, b, pg_url, {"k": 1})
    assert not raced
    assert first.flow[0].run_id == second.flow[0].run_id
    with psycopg.connect(pg_url) as conn:
        runs = conn.execute("SELECT count(*) FROM runs WHERE function_id = 'held'").fetchone()
    assert runs == (1,)


@pytest.mark.parametrize("kind", ["debounce", "batch"])
async def test_an_event_never_joins_a_held_run_whose_reservation_commits_meanwhile(stores, pg_url, kind):
    """A dispatcher reserving the pending run holds its queue row; the event's
    UPDATE of that row waits, re-checks, finds it reserved and starts the
    next run instead of changing one a worker may already hold."""
    a, _ = stores
    flow = {"debounce": Debounce(60.0)} if kind == "debounce" else {"batch": Batch(10, 60.0)}
    await register(a, FunctionDef(id="held", triggers=[Trigger(EVENT)], **flow))
    pending = (await emit(a, {"n": 0})).flow[0].run_id
    holder = psycopg.connect(pg_url)
    try:
        holder.execute(
            "UPDATE dispatch_queue SET reservation_owner = 'sess', eligible_at = ironflow_now()"
            " WHERE run_id = %s", (pending,),
        )
        result: list[Any] = []

        async def on_emit() -> None:
            result.append(await emit(a, {"n": 1}))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(on_emit)
            assert await trio.to_thread.run_sync(
                lambda: wait_until(lambda: bool(result) or lock_waiters(pg_url) > 0)
            )
            finished_while_held = bool(result)
            holder.commit()
        assert not finished_while_held, "the ingest passed a queue row it could not lock"
        assert result[0].flow[0].run_id != pending
    finally:
        holder.close()
    detail = await a.get_run(pending)
    assert detail.run.event_id != result[0].event_id  # the reserved run kept its event


async def test_two_nodes_reserving_one_throttle_key_at_once_start_one_run(stores, pg_url):
    """Dispatch side: node a's reservation round holds the throttle key's
    ``flow_throttle`` row until its commit (locked ``FOR UPDATE``, then updated);
    node b's round, reading another queue row of the same key meanwhile, waits
    for that row (its ``INSERT … ON CONFLICT DO NOTHING`` already waits on a's
    update, its locking read would wait on the lock) and then sees a's start:
    throttled, not a third start inside the burst's period."""
    a, b = stores
    throttle = Throttle(limit=1, period_s=60.0, key="event.data.user", burst=2)
    fd = FunctionDef(id="thr", triggers=[Trigger(EVENT)], throttle=throttle)
    sa = await worker(a, fd, slots=1, node="na")
    sb = await worker(b, fd, slots=1, node="nb")
    # The key's row exists (a first start took one of the burst's two tokens),
    # so the rounds meet on its row lock, not on the insert of a new key.
    await emit(b, {"user": "u", "n": -1})
    assert len(await reserve(b, await worker(b, fd, slots=1, node="nc"), limit=1, node="nc")) == 1
    # a's round reads (and SKIP-locks) 4 queue rows: b's reads the 5th.
    for n in range(5):
        await emit(b, {"user": "u", "n": n})
    got_a, got_b, raced = await race_calls(
        a, pg_url,
        lambda: reserve(a, sa, limit=1, node="na"), lambda: reserve(b, sb, limit=1, node="nb"),
    )
    assert not raced, "b's round passed the throttle row a holds"
    assert len(got_a) == 1
    assert got_b == [], "a third start of one throttle key inside its burst's period"


@pytest.mark.parametrize("on_limit", ["skip", "cancel_in_progress"])
async def test_two_nodes_ingesting_one_full_key_at_once_leave_the_limit_in_flight(stores, pg_url, on_limit):
    """The second ingest waits on the ``on_limit_keys`` row lock the first
    holds, then counts the first's run: never both started past the limit
    (skip), never both cancelling the same run and starting (cancel)."""
    a, b = stores
    await register(a, FunctionDef(
        id="gated", triggers=[Trigger(EVENT)],
        concurrency=Concurrency(1, key="event.data.k", on_limit=on_limit),
    ))
    first, second, raced = await race(a, b, pg_url, {"k": 1})
    assert not raced, "the second ingest counted the key without waiting for the first"
    assert len(first.run_ids) == 1
    if on_limit == "skip":
        assert second.run_ids == [] and second.flow[0].run_id == first.run_ids[0]
    else:
        assert len(second.run_ids) == 1 and [o.run_id for o in second.cancelled] == first.run_ids
    with psycopg.connect(pg_url) as conn:
        live = conn.execute(
            "SELECT count(*) FROM runs WHERE function_id = 'gated' AND status <> 'cancelled'"
        ).fetchone()
    assert live == (1,)
