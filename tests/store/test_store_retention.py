"""History retention in the store, run once per backend through the ``store`` fixture.

PostgreSQL's clock keeps moving between transactions, so these tests keep a
margin around the retention; the exact boundary is proven on SQLite's fixed
clock (``test_store_sqlite.py``) and in virtual time (``tests/unit/test_janitor.py``).
"""

from __future__ import annotations

import pytest

from ironflow.protocol import ErrorInfo, FunctionDef, InvokeYield, SleepYield, Trigger
from ironflow.store import Fence, RunNotFound, Store, StoreError

WINDOW = 3600.0
BATCH = 100


def fn(fid: str = "f", *triggers: str, **kw) -> FunctionDef:
    return FunctionDef(id=fid, triggers=[Trigger(t) for t in (triggers or ("order.created",))], **kw)


async def worker(store: Store, *functions: FunctionDef, slots: int = 4):
    return await store.register_worker(
        node_id="n1",
        worker_id="w1",
        mode="stream",
        max_concurrent_jobs=slots,
        functions=list(functions or (fn(),)),
        session_expiry_s=10**6,
    )


async def start_next(store: Store, session) -> Fence:
    """Reserve and activate the oldest queued segment on ``session``."""
    (res,) = await store.reserve_segments(
        "n1", {session.session_id: frozenset(session.function_ids)}, 1, reservation_expiry_s=10**6
    )
    a = res.assignment
    fence = Fence(res.session_id, a.run_id, a.execution_seq, a.lease_token)
    await store.activate_lease(fence, lease_expiry_s=10**6)
    return fence


async def emit(store: Store, name: str = "order.created", key: str | None = None):
    return await store.ingest_event(name, {}, key, idempotency_window_s=WINDOW)


async def purge(store: Store, older_than_s: float, **kw):
    return await store.purge_history(
        older_than_s=older_than_s,
        idempotency_window_s=kw.pop("window", WINDOW),
        batch=kw.pop("batch", BATCH),
        **kw,
    )


async def exists(store: Store, run_id: str) -> bool:
    try:
        await store.get_run(run_id)
    except RunNotFound:
        return False
    return True


async def test_finished_run_past_retention_goes_with_its_steps_audit_rows_and_event(store):
    s = await worker(store, fn(audit=True))
    await emit(store)
    f = await start_next(store, s)
    await store.record_step(f, step_id="s1", name="s1", status="completed", output=1)
    await store.complete_job(f, "done")
    assert await store.list_audit(run_id=f.run_id)
    await store.advance_clock(WINDOW + 100)
    counts = await purge(store, 50)
    assert (counts.runs, counts.steps, counts.events) == (1, 1, 1)
    assert counts.audit == 3  # run.started, step.completed, run.completed
    assert not await exists(store, f.run_id)
    assert await store.list_audit(run_id=f.run_id) == []
    assert (await purge(store, 50)).total == 0


async def test_finished_run_younger_than_retention_stays(store):
    s = await worker(store)
    await emit(store)
    f = await start_next(store, s)
    await store.complete_job(f, None)
    await store.advance_clock(40)
    assert (await purge(store, 50)).runs == 0
    assert await exists(store, f.run_id)


async def test_runs_that_have_not_ended_stay_and_keep_their_events(store):
    s = await worker(store)
    queued = (await emit(store)).run_ids[0]
    await emit(store)
    sleeping = await start_next(store, s)
    now = await store.db_now()
    await store.yield_job(sleeping, step_id="z", name="z", info=SleepYield(until=now + 10**7))
    await emit(store)
    executing = await start_next(store, s)
    await store.advance_clock(10 * WINDOW)
    counts = await purge(store, 1)
    assert counts.total == 0
    for run_id in (queued, sleeping.run_id, executing.run_id):
        assert await exists(store, run_id)
    statuses = {r.status for r in await store.list_runs()}
    assert statuses == {"waiting_for_capacity", "waiting", "running"}


async def test_a_child_stays_while_its_parent_is_kept_and_goes_after_it(store):
    s = await worker(store, fn("parent"), fn("child", "never"))
    await emit(store)
    parent = await start_next(store, s)
    out = await store.yield_job(parent, step_id="i", name="i", info=InvokeYield("child", {}))
    (child_id,) = out.kicked_run_ids
    child = await start_next(store, s)
    assert child.run_id == child_id
    await store.complete_job(child, 42)  # the parent is resumed: queued, not finished
    await store.advance_clock(1000)
    assert (await purge(store, 10)).runs == 0
    assert await exists(store, child_id)
    resumed = await start_next(store, s)
    await store.complete_job(resumed, "parent done")
    await store.advance_clock(1000)
    first = await purge(store, 10)
    assert first.runs == 1 and not await exists(store, parent.run_id)
    assert await exists(store, child_id)  # its parent was still there when the batch chose
    assert (await purge(store, 10)).runs == 1
    assert not await exists(store, child_id)


async def test_events_inside_the_idempotency_window_stay_and_duplicates_are_still_refused(store):
    first = await emit(store, "nobody.listens", key="k1")
    await store.advance_clock(WINDOW - 100)
    assert (await purge(store, 1)).events == 0
    again = await emit(store, "nobody.listens", key="k1")
    assert again.duplicate and again.event_id == first.event_id
    await store.advance_clock(200)
    assert (await purge(store, 1)).events == 1
    later = await emit(store, "nobody.listens", key="k1")
    assert not later.duplicate and later.event_id != first.event_id


async def test_event_past_the_window_stays_while_a_kept_run_references_it(store):
    s = await worker(store)
    await emit(store)
    f = await start_next(store, s)
    await store.complete_job(f, None)
    await store.advance_clock(WINDOW + 100)
    counts = await purge(store, 10 * WINDOW)  # the run is kept: its event must be too
    assert (counts.runs, counts.events) == (0, 0)
    assert (await store.get_run(f.run_id)).run.event_id is not None
    assert (await purge(store, 50)).events == 1


async def test_purge_takes_only_the_chosen_finished_statuses(store):
    s = await worker(store)
    await emit(store)
    await emit(store)
    ok = await start_next(store, s)
    await store.complete_job(ok, None)
    bad = await start_next(store, s)
    await store.fail_job(bad, ErrorInfo(message="no", retryable=False))
    await store.advance_clock(100)
    counts = await purge(store, 10, statuses=frozenset({"completed"}))
    assert counts.runs == 1
    assert not await exists(store, ok.run_id) and await exists(store, bad.run_id)
    with pytest.raises(StoreError, match="only finished runs"):
        await purge(store, 10, statuses=frozenset({"running"}))


async def test_batches_are_bounded(store):
    s = await worker(store)
    for _ in range(5):
        await emit(store)
        await store.complete_job(await start_next(store, s), None)
    await store.advance_clock(100)
    assert [(await purge(store, 10, batch=2)).runs for _ in range(4)] == [2, 2, 1, 0]


async def test_record_purge_audits_the_pass_with_its_counts(store):
    s = await worker(store)
    await emit(store)
    await store.complete_job(await start_next(store, s), None)
    await store.advance_clock(WINDOW + 100)
    counts = await purge(store, 10)
    await store.record_purge(counts, by="janitor:n1", older_than_s=10)
    (entry,) = await store.list_audit(type="history.purged")
    assert entry.run_id is None
    assert entry.data == {
        "runs": 1, "steps": 0, "audit": 0, "events": 1, "older_than_s": 10, "by": "janitor:n1"
    }


async def test_oldest_finished_run_age_is_measured_on_the_database_clock(store):
    s = await worker(store)
    assert await store.oldest_finished_run_age() is None
    await emit(store)
    await store.complete_job(await start_next(store, s), None)
    await store.advance_clock(100)
    assert 100 <= await store.oldest_finished_run_age() < 110


async def test_audit_rows_of_no_run_go_by_age_alone_in_bounded_batches(store):
    for n in range(3):
        await store.record_node_drain("node.drain.started", {"n": n})
    s = await worker(store, fn(audit=True))
    await emit(store)
    kept = await start_next(store, s)  # a run that has not ended keeps its (old) audit rows
    await store.advance_clock(100)
    await store.record_node_drain("node.drain.completed", {"n": 3})  # younger than 50 s
    first = await purge(store, 50, batch=2)
    assert (first.runs, first.audit, first.more) == (0, 2, True)
    second = await purge(store, 50, batch=2)
    assert (second.audit, second.more) == (1, False)
    assert [a.data for a in await store.list_audit(type="node.drain.completed")] == [{"n": 3}]
    assert await store.list_audit(type="node.drain.started") == []
    assert await store.list_audit(run_id=kept.run_id)
    assert (await purge(store, 50)).total == 0


async def test_a_purge_of_some_statuses_leaves_audit_rows_of_no_run(store):
    await store.record_node_drain("node.drain.started", {})
    await store.advance_clock(100)
    assert (await purge(store, 10, statuses=frozenset({"completed"}))).audit == 0
    assert (await purge(store, 10)).audit == 1
    assert await store.list_audit(type="node.drain.started") == []
