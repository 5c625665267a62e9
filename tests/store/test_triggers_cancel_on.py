"""Trigger filters, expression keys and cancel-on (docs/triggers.md), on both
backends through the ``store`` fixture."""

from __future__ import annotations

import time

import pytest
import trio

from ironflow.protocol import (
    CancelOn,
    Concurrency,
    FunctionDef,
    InvokeYield,
    SleepYield,
    Trigger,
)
from ironflow.store import (
    CancelNotice,
    Fence,
    KeyEvaluationFailed,
    StaleExecution,
    StepResult,
    Store,
)
from tests.store.behaviour import LEASE, emit, fence_of, reserve, worker


def fn(fid: str = "f", *triggers: Trigger, **kw) -> FunctionDef:
    return FunctionDef(id=fid, triggers=list(triggers or (Trigger("order.created"),)), **kw)


async def start(store: Store, session, name: str = "order.created", data=None) -> Fence:
    """Emit one event, reserve and activate its run: the live fence."""
    await emit(store, name, data)
    (res,) = await reserve(store, session, limit=1)
    f = fence_of(res)
    await store.activate_lease(f, lease_expiry_s=LEASE)
    return f


async def subscriptions(store: Store) -> int:
    return await store._transact(  # type: ignore[attr-defined]
        lambda tx: tx.fetchone("SELECT count(*) FROM cancel_subscriptions")[0]
    )


# ── trigger filters ─────────────────────────────────────────────────────────


async def test_a_filter_starts_a_run_only_when_true_and_the_event_says_why_not(store):
    await worker(store, fn("big", Trigger("order.created", "event.data.amount > 100")), fn("all"))
    yes = await emit(store, data={"amount": 150})
    no = await emit(store, data={"amount": 5})
    err = await emit(store, data={"amount": "lots"})
    missing = await emit(store, data={"other": 1})
    runs = {r.id: r.function_id for r in await store.list_runs()}
    assert sorted(runs[r] for r in yes.run_ids) == ["all", "big"]
    assert [runs[r] for r in no.run_ids] == ["all"] == [runs[r] for r in err.run_ids]
    assert (await store.get_event(yes.event_id)).filtered == []
    (false,) = (await store.get_event(no.event_id)).filtered
    assert false.function_id == "big" and not false.error
    assert false.reason == "filter 'event.data.amount > 100' was false"
    (bad,) = (await store.get_event(err.event_id)).filtered
    assert bad.error and "No such overload" in bad.reason
    (gone,) = (await store.get_event(missing.event_id)).filtered
    assert gone.error and "no such key: amount" in gone.reason
    listed = {e.id: e for e in await store.list_events()}
    assert listed[no.event_id].filtered == [false]


async def test_any_trigger_that_covers_the_name_and_passes_starts_the_run(store):
    await worker(store, fn(
        "f", Trigger("order.*", "event.name == 'order.paid'"), Trigger("order.created", "event.data.vip"),
    ))
    assert (await emit(store, "order.paid")).run_ids
    assert (await emit(store, "order.created", {"vip": True})).run_ids
    shipped = await emit(store, "order.shipped", {"vip": True})
    assert not shipped.run_ids
    assert [n.function_id for n in (await store.get_event(shipped.event_id)).filtered] == ["f"]


async def test_a_batch_of_events_is_filtered_one_by_one(store):
    await worker(store, fn("big", Trigger("order.created", "event.data.amount > 100")))
    results = await store.ingest_events(
        [("order.created", {"amount": a}, None) for a in (1, 500, 2, 700)], idempotency_window_s=60
    )
    assert [bool(r.run_ids) for r in results] == [False, True, False, True]
    assert [len((await store.get_event(r.event_id)).filtered) for r in results] == [1, 0, 1, 0]


# ── keys ─────────────────────────────────────────────────────────────────────


async def test_a_key_expression_keys_the_run_and_a_dotted_path_keeps_its_meaning(store):
    await worker(
        store,
        fn("expr", concurrency=Concurrency(1, "event.data.region + ':' + event.data.tier")),
        fn("path", concurrency=Concurrency(1, "customer.id")),
    )
    ok = await emit(store, data={"region": "eu", "tier": "pro", "customer": {"id": 7}})
    keys = {(await store.get_run_record(r)).function_id: (await store.get_run_record(r)).concurrency_key
            for r in ok.run_ids}
    assert keys == {"expr": "eu:pro", "path": "7"}
    # The expression fails on this event: no run of it, and the event says why;
    # the dotted path, missing, is no key, as before.
    failed = await emit(store, data={"region": "eu"})
    assert [(await store.get_run_record(r)).function_id for r in failed.run_ids] == ["path"]
    (note,) = (await store.get_event(failed.event_id)).filtered
    assert note.function_id == "expr" and note.error and note.reason.startswith("concurrency key")


async def test_a_key_reading_the_event_name_gets_the_events_name_on_every_path(store):
    # SQLite's ingest, PostgreSQL's one-statement ingest and a re-run of the
    # event all evaluate the key on the event's own name (not the invoke's).
    await worker(store, fn("named", concurrency=Concurrency(1, "event.name + ':' + string(event.data.n)")))
    ok = await emit(store, data={"n": 1})
    (run_id,) = ok.run_ids
    assert (await store.get_run_record(run_id)).concurrency_key == "order.created:1"
    again, _ = await store.rerun(run_id)
    assert (await store.get_run_record(again)).concurrency_key == "order.created:1"


async def test_an_invocation_whose_key_fails_is_refused_and_starts_nothing(store):
    await worker(store, fn("child", concurrency=Concurrency(1, "string(event.data.region)")), fn("parent"))
    with pytest.raises(KeyEvaluationFailed, match="no such key: region"):
        await store.invoke_function("child", {})
    assert [r.function_id for r in await store.list_runs()] == []
    # step.invoke: the parent's invoke step fails (not retried), no child.
    session = await worker(store, fn("child", concurrency=Concurrency(1, "string(event.data.region)")),
                           fn("parent", Trigger("go")))
    f = await start(store, session, "go")
    await store.yield_job(f, step_id="i", name="i", info=InvokeYield("child", {"x": 1}))
    detail = await store.get_run(f.run_id)
    (step,) = detail.steps
    assert step.status == "failed" and step.error.code == "KEY_EVALUATION_FAILED"
    assert [r.function_id for r in await store.list_runs()] == ["parent"]


# ── cancel on an event ──────────────────────────────────────────────────────

UNSUB = CancelOn("user.unsubscribed", match="data.user_id")


async def test_a_matching_event_cancels_an_unended_run_and_nothing_else(store):
    await worker(store, fn("drip", Trigger("user.created"), cancel_on=[UNSUB], audit=True), fn("other"))
    seven = (await emit(store, "user.created", {"user_id": 7})).run_ids[0]
    eight = (await emit(store, "user.created", {"user_id": 8})).run_ids[0]
    unrelated = (await emit(store, "order.created", {"user_id": 7})).run_ids[0]
    assert await subscriptions(store) == 2
    miss = await emit(store, "user.unsubscribed", {"user_id": 9})
    assert miss.cancelled == []
    hit = await emit(store, "user.unsubscribed", {"user_id": 7.0})  # 7.0 and 7: one JSON number
    assert [o.run_id for o in hit.cancelled] == [seven]
    run = await store.get_run_record(seven)
    assert run.status == "cancelled" and run.error.code == "CANCELLED"
    assert run.error.message == f"cancelled by event {hit.event_id} (user.unsubscribed)"
    assert (await store.get_run_record(eight)).status == "waiting_for_capacity"
    assert (await store.get_run_record(unrelated)).status == "waiting_for_capacity"
    assert (await store.get_event(hit.event_id)).cancelled_run_ids == [seven]
    (audit,) = [a for a in await store.list_audit(run_id=seven) if a.type == "run.cancelled"]
    assert audit.data == {"cause": "cancel-on-event", "event_id": hit.event_id, "event": "user.unsubscribed"}
    assert await subscriptions(store) == 1
    # A second event finds nothing left to cancel.
    assert (await emit(store, "user.unsubscribed", {"user_id": 7})).cancelled == []
    assert {r.id for r in await store.list_runs(status="cancelled")} == {seven}


async def test_an_event_before_the_run_exists_does_not_cancel_it(store):
    await worker(store, fn("drip", Trigger("user.created"), cancel_on=[UNSUB]))
    await emit(store, "user.unsubscribed", {"user_id": 7})
    run_id = (await emit(store, "user.created", {"user_id": 7})).run_ids[0]
    assert (await store.get_run_record(run_id)).status == "waiting_for_capacity"


async def test_an_event_that_starts_a_run_never_cancels_that_run(store):
    await worker(store, fn("f", Trigger("user.updated"), cancel_on=[CancelOn("user.updated", "data.user_id")]))
    first = (await emit(store, "user.updated", {"user_id": 1})).run_ids[0]
    second = await emit(store, "user.updated", {"user_id": 1})
    assert [o.run_id for o in second.cancelled] == [first]  # the newer one replaces it
    assert (await store.get_run_record(second.run_ids[0])).status == "waiting_for_capacity"


async def test_a_cancel_on_past_its_timeout_no_longer_applies(store):
    spec = CancelOn("user.unsubscribed", match="data.user_id", timeout_s=60)
    await worker(store, fn("drip", Trigger("user.created"), cancel_on=[spec]))
    early = (await emit(store, "user.created", {"user_id": 1})).run_ids[0]
    late = (await emit(store, "user.created", {"user_id": 2})).run_ids[0]
    assert [o.run_id for o in (await emit(store, "user.unsubscribed", {"user_id": 1})).cancelled] == [early]
    await store.advance_clock(61)
    assert (await emit(store, "user.unsubscribed", {"user_id": 2})).cancelled == []
    assert (await store.get_run_record(late)).status == "waiting_for_capacity"
    assert await subscriptions(store) == 0  # the expired one was dropped


async def test_a_cancel_on_expression_sees_both_events(store):
    spec = CancelOn("order.updated", match="data.order_id",
                    expression="async.data.status == 'void' && event.data.total > 10")
    await worker(store, fn("ship", cancel_on=[spec]))
    run_id = (await emit(store, "order.created", {"order_id": "a", "total": 50})).run_ids[0]
    assert (await emit(store, "order.updated", {"order_id": "a", "status": "paid"})).cancelled == []
    assert (await emit(store, "order.updated", {"order_id": "a"})).cancelled == []  # error: no cancel
    void = await emit(store, "order.updated", {"order_id": "a", "status": "void"})
    assert [o.run_id for o in void.cancelled] == [run_id]


async def test_a_run_that_ended_is_not_cancelled_and_its_subscription_goes(store):
    session = await worker(store, fn("drip", Trigger("user.created"), cancel_on=[UNSUB]))
    f = await start(store, session, "user.created", {"user_id": 3})
    await store.complete_job(f, "done")
    assert await subscriptions(store) == 1
    assert (await emit(store, "user.unsubscribed", {"user_id": 3})).cancelled == []
    assert (await store.get_run_record(f.run_id)).status == "completed"
    assert await subscriptions(store) == 0


async def test_a_running_run_is_cancelled_its_worker_told_and_its_writes_refused(store, nursery):
    heard: list[CancelNotice] = []
    store.on_jobs_cancelled(heard.extend)
    if store.shared_by_nodes:  # PostgreSQL: the notice comes by NOTIFY, to every node
        await nursery.start(store.watch_kicks, lambda: None)
    session = await worker(store, fn("drip", Trigger("user.created"), cancel_on=[UNSUB]))
    f = await start(store, session, "user.created", {"user_id": 5})
    hit = await emit(store, "user.unsubscribed", {"user_id": 5})
    (outcome,) = hit.cancelled
    assert outcome.session_id == session.session_id and outcome.job_id == f"{f.run_id}/1"
    with trio.fail_after(10):
        while not heard:
            await trio.sleep(0.01)
    assert heard == [CancelNotice(f.run_id, session.session_id, f"{f.run_id}/1",
                                  f"cancelled by event {hit.event_id}")]
    with pytest.raises(StaleExecution):
        await store.record_steps(f, [StepResult("s", "s", "completed", 1)])
    with pytest.raises(StaleExecution):
        await store.complete_job(f, "late")
    assert (await store.get_run_record(f.run_id)).status == "cancelled"


async def test_a_sleeping_run_and_a_run_waiting_for_its_child_are_cancelled(store):
    session = await worker(
        store, fn("drip", Trigger("user.created"), cancel_on=[UNSUB]), fn("child", Trigger("never")),
        slots=4,
    )
    sleeper = await start(store, session, "user.created", {"user_id": 1})
    await store.yield_job(sleeper, step_id="z", name="nap", info=SleepYield(until=time.time() + 3600))
    parent = await start(store, session, "user.created", {"user_id": 2})
    await store.yield_job(parent, step_id="c", name="c", info=InvokeYield("child"))
    hit = await store.ingest_events(
        [("user.unsubscribed", {"user_id": 1}, None), ("user.unsubscribed", {"user_id": 2}, None)],
        idempotency_window_s=60,
    )
    assert [[o.run_id for o in r.cancelled] for r in hit] == [[sleeper.run_id], [parent.run_id]]
    (nap,) = (await store.get_run(sleeper.run_id)).steps
    assert nap.status == "failed"
    runs = {r.function_id: r.status for r in await store.list_runs()}
    assert runs == {"drip": "cancelled", "child": "waiting_for_capacity"}  # the child is not cancelled


async def test_in_one_batch_a_later_event_cancels_a_run_an_earlier_one_started(store):
    await worker(store, fn("drip", Trigger("user.created"), cancel_on=[UNSUB]))
    created, unsub = await store.ingest_events(
        [("user.created", {"user_id": 4}, None), ("user.unsubscribed", {"user_id": 4}, None)],
        idempotency_window_s=60,
    )
    assert [o.run_id for o in unsub.cancelled] == created.run_ids
