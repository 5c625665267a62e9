"""Ingest-side flow control in the store (ironflow/store/flow.py), on both
backends: rate limit, debounce, singleton, event batches — decided by the
database clock (moved with ``advance_clock``), recorded on the event."""

from __future__ import annotations

from ironflow.protocol import Batch, Debounce, FunctionDef, RateLimit, Singleton, Trigger
from ironflow.store import Fence, Store

EVENT = "user.signed_up"


def fn(fid: str, **kw) -> FunctionDef:
    return FunctionDef(id=fid, triggers=[Trigger(EVENT)], **kw)


async def worker(store: Store, *functions: FunctionDef, slots: int = 50):
    return await store.register_worker(
        node_id="n1", worker_id="w1", mode="stream", max_concurrent_jobs=slots,
        functions=list(functions), session_expiry_s=600,
    )


async def emit(store: Store, data, name: str = EVENT):
    return await store.ingest_event(name, data, None, idempotency_window_s=3600)


async def reserve(store: Store, session, limit: int = 50):
    return await store.reserve_segments(
        "n1", {session.session_id: frozenset(session.function_ids)}, limit, reservation_expiry_s=600
    )


async def test_a_rate_limit_starts_one_run_per_key_per_period_and_records_the_others(store):
    await worker(store, fn("welcome", rate_limit=RateLimit(1, 10.0, key="event.data.user")))
    first = await emit(store, {"user": "ann"})
    assert len(first.run_ids) == 1 and first.flow == []
    again = [await emit(store, {"user": "ann"}) for _ in range(5)]
    assert all(r.run_ids == [] for r in again)
    assert all(r.flow[0].outcome == "skipped" and "rate limit" in r.flow[0].reason for r in again)
    other = await emit(store, {"user": "bob"})  # another key has its own window
    assert len(other.run_ids) == 1
    record = await store.get_event(again[0].event_id)
    assert record.run_ids == [] and record.flow[0].outcome == "skipped"
    await store.advance_clock(10.0)  # type: ignore[attr-defined]
    assert len((await emit(store, {"user": "ann"})).run_ids) == 1


async def test_a_rate_limit_of_three_lets_three_pass_at_once_then_one_per_third_of_the_period(store):
    await worker(store, fn("api", rate_limit=RateLimit(3, 9.0)))
    passed = [len((await emit(store, {})).run_ids) for _ in range(5)]
    assert passed == [1, 1, 1, 0, 0]
    await store.advance_clock(3.0)  # type: ignore[attr-defined]
    assert [len((await emit(store, {})).run_ids) for _ in range(2)] == [1, 0]


async def test_a_key_that_fails_to_evaluate_skips_the_event_and_says_why(store):
    await worker(store, fn("keyed", rate_limit=RateLimit(5, 10.0, key="string(event.data.user.id)")))
    result = await emit(store, {"user": 7})
    assert result.run_ids == []
    assert result.flow[0].outcome == "skipped" and result.flow[0].reason.startswith("rate_limit key:")


async def test_a_debounce_keeps_one_pending_run_with_the_last_event_and_moves_its_start(store):
    session = await worker(store, fn("digest", debounce=Debounce(2.0, key="event.data.user")))
    results = [await emit(store, {"user": "ann", "n": i}) for i in range(5)]
    runs = {note.run_id for r in results for note in r.flow}
    assert len(runs) == 1 and all(r.flow[0].outcome == "debounced" for r in results)
    [run_id] = runs
    [pending] = await store.list_debounces()
    assert pending.run_id == run_id and pending.event_id == results[-1].event_id
    assert 1.0 < pending.fire_in_s <= 2.0
    detail = await store.get_run(run_id)
    assert detail.waiting_reason is not None and detail.waiting_reason.startswith("debounced until")
    assert await reserve(store, session) == []  # not due yet
    await store.advance_clock(2.1)  # type: ignore[attr-defined]
    [res] = await reserve(store, session)
    assert res.assignment.run_id == run_id and res.assignment.event.data == {"user": "ann", "n": 4}
    assert await store.list_debounces() == []
    # The run has started: the next event opens the next quiet period's run.
    later = await emit(store, {"user": "ann", "n": 5})
    assert later.flow[0].run_id != run_id


async def test_a_debounce_fires_by_max_wait_under_a_steady_stream(store):
    session = await worker(store, fn("digest", debounce=Debounce(2.0, max_wait_s=3.0)))
    first = await emit(store, {"n": 0})
    later = []
    for i in range(1, 5):  # one every 0.9 s: the 2 s period never elapses
        await store.advance_clock(0.9)  # type: ignore[attr-defined]
        later.append(await emit(store, {"n": i}))
    # The first three joined; the bound (3 s after the first) made the run due
    # before the fourth (3.6 s), which opened the next period.
    assert [r.flow[0].run_id == first.flow[0].run_id for r in later] == [True, True, True, False]
    [res] = await reserve(store, session)
    assert res.assignment.run_id == first.flow[0].run_id
    assert res.assignment.event.data == {"n": 3}


async def test_a_singleton_skips_while_its_run_is_in_flight_and_starts_once_it_ended(store):
    session = await worker(store, fn("sync", singleton=Singleton(key="event.data.account")))
    first = await emit(store, {"account": 1})
    [run_id] = first.run_ids
    skipped = await emit(store, {"account": 1})
    assert skipped.run_ids == [] and skipped.flow[0].outcome == "skipped"
    assert skipped.flow[0].run_id == run_id
    assert len((await emit(store, {"account": 2})).run_ids) == 1  # another key
    await store.cancel_run(run_id, "done with it")
    assert len((await emit(store, {"account": 1})).run_ids) == 1
    assert len(await reserve(store, session)) == 2


async def test_a_singleton_in_cancel_mode_cancels_the_running_run_for_the_new_one(store):
    session = await worker(store, fn("sync", singleton=Singleton(mode="cancel")))
    first = await emit(store, {})
    [res] = await reserve(store, session)
    await store.activate_lease(
        Fence(
            res.session_id, res.assignment.run_id, res.assignment.execution_seq, res.assignment.lease_token
        ),
        lease_expiry_s=600,
    )
    second = await emit(store, {})
    assert len(second.run_ids) == 1 and second.run_ids != first.run_ids
    [cancel] = second.cancelled
    assert cancel.run_id == first.run_ids[0] and cancel.session_id == session.session_id
    assert (await store.get_run(first.run_ids[0])).run.status == "cancelled"
    assert [n.outcome for n in second.flow] == ["cancelled"]


async def test_a_batch_collects_events_up_to_its_size_and_the_rest_after_the_timeout(store):
    session = await worker(store, fn("ingest", batch=Batch(max_size=3, timeout_s=5.0)))
    results = [await emit(store, {"n": i}) for i in range(7)]
    assert all(r.run_ids == [] and r.flow[0].outcome == "batched" for r in results)
    batches = [r.flow[0].run_id for r in results]
    assert batches[0] == batches[1] == batches[2] != batches[3] == batches[4] == batches[5] != batches[6]
    reserved = await reserve(store, session)  # the two full batches are due at once
    assert sorted(len(r.assignment.events or []) for r in reserved) == [3, 3]
    for r in reserved:
        events = r.assignment.events or []
        assert r.assignment.event.id == events[0].id
    assert [e.data["n"] for r in reserved for e in (r.assignment.events or [])] in (
        [0, 1, 2, 3, 4, 5], [3, 4, 5, 0, 1, 2],
    )
    await store.advance_clock(5.1)  # type: ignore[attr-defined]
    [last] = await reserve(store, session)
    assert [e.data for e in last.assignment.events or []] == [{"n": 6}]
    record = await store.get_event(results[6].event_id)
    assert record.flow[0].run_id == batches[6]


async def test_functions_without_flow_control_beside_one_with_it_are_started_as_usual(store):
    await worker(store, fn("plain"), fn("limited", rate_limit=RateLimit(1, 60.0)))
    first = await store.ingest_events([(EVENT, {}, None), (EVENT, {}, None)], idempotency_window_s=60)
    assert [len(r.run_ids) for r in first] == [2, 1]
    assert first[1].flow[0].function_id == "limited"


async def test_retention_keeps_the_events_of_a_kept_batch_run_and_purges_them_with_it(store):
    session = await worker(store, fn("ingest", batch=Batch(max_size=2, timeout_s=5.0)))
    results = [await emit(store, {"n": i}) for i in range(2)]
    [res] = await reserve(store, session)
    await store.advance_clock(7200)  # type: ignore[attr-defined]
    # Past the idempotency window, the run not ended: both events stay.
    await store.purge_history(older_than_s=60, idempotency_window_s=60, batch=100)
    for r in results:
        await store.get_event(r.event_id)
    await store.cancel_run(res.assignment.run_id, "done")
    await store.advance_clock(7200)  # type: ignore[attr-defined]
    counts = await store.purge_history(older_than_s=60, idempotency_window_s=60, batch=100)
    assert counts.runs == 1 and counts.events == 2


# A group of emits (``ingest_events``; on PostgreSQL one combined statement
# for the group's runs and events): flow control decides event by event, and a
# key decided again in the group sees the runs the group planned for it.


async def emit_group(store: Store, datas: list) -> list:
    return await store.ingest_events([(EVENT, d, None) for d in datas], idempotency_window_s=60)


async def test_a_group_of_emits_decides_a_singleton_key_event_by_event(store):
    await worker(store, fn("sync", singleton=Singleton(key="event.data.account")))
    results = await emit_group(store, [{"account": 1}, {"account": 1}, {"account": 2}, {"account": 1}])
    assert [len(r.run_ids) for r in results] == [1, 0, 1, 0]
    assert {r.flow[0].run_id for r in (results[1], results[3])} == set(results[0].run_ids)
    assert (await store.get_event(results[1].event_id)).flow == results[1].flow


async def test_a_group_of_emits_replaces_a_singleton_run_it_started_itself(store):
    await worker(store, fn("sync", singleton=Singleton(mode="cancel")))
    first, second = await emit_group(store, [{}, {}])
    assert [o.run_id for o in second.cancelled] == first.run_ids
    assert (await store.get_run(first.run_ids[0])).run.status == "cancelled"
    assert (await store.get_run(second.run_ids[0])).run.status != "cancelled"


async def test_a_group_of_emits_fills_batches_in_arrival_order(store):
    session = await worker(store, fn("ingest", batch=Batch(max_size=2, timeout_s=5.0, key="event.data.k")))
    results = await emit_group(store, [{"k": 1, "n": n} for n in range(5)] + [{"k": 2, "n": 5}])
    assert all(r.run_ids == [] and r.flow[0].outcome == "batched" for r in results)
    runs = [r.flow[0].run_id for r in results]
    assert runs[0] == runs[1] != runs[2] == runs[3] != runs[4] != runs[5]
    assert [r.flow[0].size for r in results] == [1, 2, 1, 2, 1, 1]
    reserved = await reserve(store, session)  # the two full batches
    assert sorted([e.data["n"] for e in r.assignment.events or []] for r in reserved) == [[0, 1], [2, 3]]
    await store.advance_clock(5.1)  # type: ignore[attr-defined]
    late = await reserve(store, session)
    assert sorted([e.data["n"] for e in r.assignment.events or []] for r in late) == [[4], [5]]


async def test_a_group_of_emits_keeps_one_pending_debounce_with_its_last_event(store):
    session = await worker(store, fn("digest", debounce=Debounce(2.0)))
    results = await emit_group(store, [{"n": n} for n in range(3)])
    assert len({r.flow[0].run_id for r in results}) == 1
    await store.advance_clock(2.1)  # type: ignore[attr-defined]
    [res] = await reserve(store, session)
    assert res.assignment.event.data == {"n": 2}


async def test_a_group_of_emits_finds_a_singleton_run_and_a_filling_batch_from_before(store):
    await worker(
        store, fn("sync", singleton=Singleton(key="event.data.k")),
        fn("ingest", batch=Batch(max_size=3, timeout_s=5.0, key="event.data.k")),
    )
    before = await emit(store, {"k": 1})
    [run_id] = before.run_ids
    filling = next(n.run_id for n in before.flow if n.function_id == "ingest")
    results = await emit_group(store, [{"k": 1}, {"k": 2}])
    assert [r.run_ids for r in results][0] == [] and len(results[1].run_ids) == 1
    notes = {(n.function_id, n.outcome): n for n in results[0].flow}
    assert notes[("sync", "skipped")].run_id == run_id
    assert notes[("ingest", "batched")].run_id == filling and notes[("ingest", "batched")].size == 2
