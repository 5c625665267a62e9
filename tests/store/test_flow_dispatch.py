"""Flow control at dispatch (issue 24; ironflow/store/flow.py), on both backends:
the round robin across concurrency keys, layered limits, priority, throttle."""

from __future__ import annotations

from ironflow.protocol import Concurrency, Throttle
from tests.store.test_store_behaviour import LEASE, emit, fence_of, fn, reserve, worker


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
    assert 0.4 < await store.seconds_until_next_eligible() <= 0.5
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
