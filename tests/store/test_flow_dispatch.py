"""Flow control at dispatch (ironflow/store/flow.py), on both backends:
the round robin across concurrency keys, layered limits, priority, throttle."""

from __future__ import annotations

from ironflow.protocol import Concurrency, Throttle
from tests.store.behaviour import LEASE, RESERVATION, emit, fence_of, fn, reserve, worker


async def emit_many(store, datas, name="order.created"):
    return await store.ingest_events(
        [(name, d, None) for d in datas], idempotency_window_s=3600
    )


def customers(got):
    return sorted(r.assignment.event.data["customer"] for r in got)


async def test_a_small_key_is_reserved_in_the_first_round_behind_a_large_backlog(store):
    s = await worker(store, fn(concurrency=Concurrency(2, key="event.data.customer")), slots=6)
    await emit_many(store, [{"customer": "A"}] * 1000)
    await emit_many(store, [{"customer": "B"}] * 10)
    got = await reserve(store, s, limit=6)
    assert customers(got) == ["A", "A", "B", "B"]
    # the keys are full: nothing more until a slot frees
    assert await reserve(store, s, limit=6) == []


async def test_the_round_robin_visits_every_key_across_rounds(store):
    s = await worker(store, fn(concurrency=Concurrency(1, key="customer")), slots=200)
    await emit_many(store, [{"customer": f"c{i:03d}"} for i in range(150)])
    got = await reserve(store, s, limit=200)
    got += await reserve(store, s, limit=200)
    got += await reserve(store, s, limit=200)
    assert len(set(customers(got))) == 150


async def test_layered_limits_hold_both_the_total_and_the_per_key_limit(store):
    limits = [Concurrency(3), Concurrency(2, key="customer")]
    s = await worker(store, fn(concurrency=limits), slots=10)
    await emit_many(store, [{"customer": c} for c in "AAAABBBBCCCC"])
    got = await reserve(store, s, limit=10)
    assert len(got) == 3 and max(customers(got).count(c) for c in "ABC") <= 2
    for r in got:  # an executing segment still counts
        await store.activate_lease(fence_of(r), lease_expiry_s=LEASE)
    assert await reserve(store, s, limit=10) == []


async def test_a_higher_priority_run_queued_later_starts_first(store):
    s = await worker(store, fn(priority="event.data.plan == 'pro' ? 60 : 0"), slots=1)
    await emit(store, data={"plan": "free", "n": 1})
    await emit(store, data={"plan": "free", "n": 2})
    await emit(store, data={"plan": "pro", "n": 3})
    order = []
    for _ in range(3):
        (r,) = await reserve(store, s, limit=1)
        order.append(r.assignment.event.data["n"])
        await store.release_reservation(r.session_id, r.assignment.run_id, 1)
        await store.cancel_run(r.assignment.run_id, "done")
    assert order == [3, 1, 2]


async def test_a_priority_is_clamped_to_600_seconds(store):
    await worker(store, fn(priority="event.data.p"), slots=1)
    await emit(store, data={"p": -10_000, "n": 1})
    await store.advance_clock(601)
    s = await worker(store, fn(priority="event.data.p"), slots=1)
    await emit(store, data={"p": 0, "n": 2})
    (r,) = await reserve(store, s, limit=1)
    assert r.assignment.event.data["n"] == 1  # 601 s older outweighs -600 s


async def test_throttle_spaces_first_starts_by_the_database_clock(store):
    s = await worker(store, fn(throttle=Throttle(limit=2, period_s=1.0)), slots=10)
    await emit_many(store, [{"n": i} for i in range(5)])
    assert len(await reserve(store, s, limit=10)) == 1
    assert await reserve(store, s, limit=10) == []
    # the others were moved to their start times: the dispatcher sleeps until then
    assert 0 < await store.seconds_until_next_eligible() <= 0.5
    started = 1
    for _ in range(8):
        await store.advance_clock(0.25)
        started += len(await reserve(store, s, limit=10))
    assert started == 5  # 0.5 s apart: 1 at 0, then one per 0.5 s over 2 s


async def test_throttle_is_per_key_and_allows_a_burst(store):
    throttle = Throttle(limit=1, period_s=10.0, key="event.data.user", burst=2)
    s = await worker(store, fn(throttle=throttle), slots=10)
    await emit_many(store, [{"user": u} for u in "aaabbb"])
    got = await reserve(store, s, limit=10)
    assert sorted(r.assignment.event.data["user"] for r in got) == ["a", "a", "b", "b"]
    await store.advance_clock(10.5)
    got = await reserve(store, s, limit=10)
    assert sorted(r.assignment.event.data["user"] for r in got) == ["a", "b"]


async def test_runs_get_says_which_key_is_full_and_until_when_a_run_is_throttled(store):
    s = await worker(store, fn(concurrency=Concurrency(1, key="customer")), slots=5)
    first, second = await emit_many(store, [{"customer": "42"}] * 2)
    await reserve(store, s)
    detail = await store.get_run(second.run_ids[0])
    assert detail.waiting_reason == "concurrency key customer=42: 1/1 in use"
    t = await worker(store, fn("t", "thr", throttle=Throttle(limit=1, period_s=60.0)), slots=5)
    _, late = await emit_many(store, [{}, {}], name="thr")
    await reserve(store, t)
    reason = (await store.get_run(late.run_ids[0])).waiting_reason
    assert reason is not None and reason.startswith("throttled until ")


async def test_the_limit_holds_across_two_stores_reserving_at_once(pg_url):
    """Node 1's reservation transaction is held open (after its reads, before
    its commit) while node 2 reserves: node 2 waits on ``conc:<function>``
    (taken at BEGIN) and then counts node 1's reservation."""
    import psycopg

    from ironflow.protocol import FunctionDef, Trigger
    from tests.store.pg_holds import HookedStore, lock_waiters, session_of, wait_until

    fd = FunctionDef(id="racer", triggers=[Trigger("race.start")], concurrency=Concurrency(2))
    one, two = HookedStore(pg_url), HookedStore(pg_url)
    await one.open()
    await two.open()
    try:
        s1 = await session_of(one, [fd])
        s2 = await session_of(two, [fd])
        for i in range(6):
            await one.ingest_event("race.start", {"k": i}, None, idempotency_window_s=60)
        got: dict[str, int] = {}

        def hold() -> None:
            one.after = None
            assert wait_until(lambda: lock_waiters(pg_url) > 0)

        async def reserve_on(store, session_id, name):
            res = await store.reserve_segments(
                "n", {session_id: frozenset({"racer"})}, 10, reservation_expiry_s=600
            )
            got[name] = len(res)

        import trio

        one.after = hold
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reserve_on, one, s1, "one")
            await trio.sleep(0.2)  # let node 1 begin first (the hook makes the rest exact)
            nursery.start_soon(reserve_on, two, s2, "two")
        assert got["one"] + got["two"] == 2
        with psycopg.connect(pg_url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM dispatch_queue WHERE reservation_owner IS NOT NULL"
            ).fetchone()
        assert row is not None and row[0] == 2
    finally:
        await one.close()
        await two.close()


async def test_an_expired_reservation_an_ack_is_activating_still_counts_against_the_limit(pg_url):
    """A reservation past its expiry whose JobAck is in flight (its queue row
    locked by the ack's transaction, held here by a second connection): the
    dispatch's clean-up skips the locked row (``SKIP LOCKED``), so the row stays
    reserved and the ack may yet turn it into a lease. It must hold its slot:
    counted by expiry alone, the slot was given away and, once the ack
    committed, two runs of a limit-1 function ran at once."""
    import psycopg

    from tests.clock import open_test_store

    store = open_test_store(pg_url)
    await store.open()
    try:
        s = await worker(store, fn(concurrency=Concurrency(1)), slots=2)
        await emit_many(store, [{"n": 1}, {"n": 2}])
        (first,) = await reserve(store, s, limit=2)
        await store.advance_clock(RESERVATION + 1)
        holder = psycopg.connect(pg_url)
        try:
            holder.execute(
                "SELECT 1 FROM dispatch_queue WHERE run_id = %s FOR UPDATE",
                (first.assignment.run_id,),
            )
            assert await reserve(store, s, limit=2) == []
        finally:
            holder.rollback()
            holder.close()
        # The ack lands (an expired reservation nobody reclaimed is still its).
        await store.activate_lease(fence_of(first), lease_expiry_s=LEASE)
        assert await reserve(store, s, limit=2) == []
        with psycopg.connect(pg_url) as conn:
            row = conn.execute("SELECT count(*) FROM concurrency_leases").fetchone()
        assert row == (1,)
    finally:
        await store.close()


async def test_a_held_backlog_of_one_function_does_not_stand_in_front_of_another(store):
    """Queue rows a full concurrency limit or a throttle holds fill the first
    candidate read; the round reads on past their functions, so another
    function's runs queued behind them start in the same round."""
    hot = fn("hot", "hot.go", concurrency=Concurrency(1))
    slow = fn("slow", "slow.go", throttle=Throttle(limit=1, period_s=60.0))
    cold = fn("cold", "cold.go")
    s = await worker(store, hot, slow, cold, slots=4)
    await emit_many(store, [{}] * 40, name="hot.go")
    await emit_many(store, [{}] * 40, name="slow.go")
    await emit_many(store, [{}] * 3, name="cold.go")
    got = await reserve(store, s, limit=4)
    assert sorted(r.assignment.function_id for r in got) == ["cold", "cold", "hot", "slow"]
