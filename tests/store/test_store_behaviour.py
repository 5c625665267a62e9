"""The store's behaviour, run once per backend through the ``store`` fixture."""

from __future__ import annotations

import hashlib
import time

import pytest
import trio

from ironflow.protocol import (
    ActiveJob,
    Concurrency,
    ErrorInfo,
    InvokeYield,
    RetryPolicy,
    SleepYield,
    Trigger,
    WaitYield,
)
from ironflow.store import (
    Conflict,
    Fence,
    FunctionNotFound,
    LimitExceeded,
    RunNotFound,
    SessionNotFound,
    StaleExecution,
    StepResult,
    Store,
    WakeOutcome,
)
from tests.store.behaviour import (
    ALWAYS_LIVE,
    GRACE,
    LEASE,
    RESERVATION,
    SESSION,
    emit,
    fence_of,
    fn,
    reserve,
    running,
    worker,
)

# ── register_worker ─────────────────────────────────────────────────────────


async def test_register_worker_upserts_functions_and_bumps_version_only_on_change(store):
    s = await worker(store, fn("a"), fn("b"), slots=3)
    assert s.max_concurrent_jobs == 3 and s.function_ids == ["a", "b"]
    await worker(store, fn("a"), fn("b"))
    assert {f.id: f.version for f in await store.list_functions(live_within_s=ALWAYS_LIVE)} == {"a": 1, "b": 1}
    await worker(store, fn("a", "other.event"))
    funcs = {f.id: f for f in await store.list_functions(live_within_s=ALWAYS_LIVE)}
    assert funcs["a"].version == 2 and funcs["a"].definition.triggers == [Trigger("other.event")]
    sessions = await store.list_sessions()
    assert len(sessions) == 3
    first = next(x for x in sessions if x.session_id == s.session_id)
    assert first.max_concurrent_jobs == 3 and first.credits_claimed == 0


async def test_a_function_is_live_while_a_worker_serves_it_and_for_the_window_after(store):
    async def live(within: float) -> dict[str, bool]:
        return {f.id: f.live for f in await store.list_functions(live_within_s=within)}

    await worker(store, fn("old"), fn("kept"))
    await store.advance_clock(SESSION + 10)  # that session expired 10 s ago, not reaped yet
    second = await worker(store, fn("kept"))
    assert await live(5) == {"old": False, "kept": True}
    assert (await live(SESSION))["old"]  # within the window after its session's expiry
    assert await store.expire_sessions() == 1
    funcs = {f.id: f for f in await store.list_functions(live_within_s=5)}
    # Reaped late: last served when its session expired, not when it was reaped.
    assert funcs["kept"].last_seen_at - funcs["old"].last_seen_at >= 10 - 0.5
    assert not funcs["old"].live
    # A closed session: its functions stay live for the window, then not.
    await store.close_session(second.session_id, recover_leases=True, recovery_grace_s=30, recovery_ceiling=10)
    assert (await live(5))["kept"]
    await store.advance_clock(6)
    assert await live(5) == {"old": False, "kept": False}
    assert all((await live(ALWAYS_LIVE)).values())


async def test_pull_session_answers_only_its_own_secret_and_never_a_streaming_session(store):
    pull = await store.register_worker(
        node_id="n1", worker_id="p", mode="pull", max_concurrent_jobs=1, functions=[], session_expiry_s=30
    )
    stream = await worker(store)
    assert pull.secret and stream.secret is None
    assert (await store.pull_session(pull.session_id, pull.secret)).session_id == pull.session_id
    assert await store.pull_session(pull.session_id, pull.secret + "x") is None
    assert await store.pull_session(stream.session_id, pull.secret) is None
    await store.advance_clock(31)
    assert await store.pull_session(pull.session_id, pull.secret) is None


async def test_a_trigger_pattern_shared_past_the_limit_refuses_the_whole_registration(store):
    await worker(store, fn("a", "x.*"), fn("b", "x.*"))
    with pytest.raises(LimitExceeded, match="'x.\\*'"):
        await store.register_worker(
            node_id="n1", worker_id="w", mode="stream", max_concurrent_jobs=1,
            functions=[fn("c", "y.go"), fn("d", "x.*")], session_expiry_s=30, max_functions_per_trigger=2,
        )
    assert {f.id for f in await store.list_functions(live_within_s=ALWAYS_LIVE)} == {"a", "b"}  # nothing was written
    assert len((await emit(store, "y.go")).run_ids) == 0


# ── ingest_event ─────────────────────────────────────────────────────────────


async def test_ingest_matches_exact_and_prefix_triggers(store):
    await worker(store, fn("exact", "order.created"), fn("prefix", "order.*"), fn("other", "x.y"))
    r = await emit(store, "order.created", {"id": 1})
    assert len(r.run_ids) == 2 and not r.duplicate
    runs = {x.function_id: x for x in await store.list_runs()}
    assert set(runs) == {"exact", "prefix"}
    assert all(
        x.status == "waiting_for_capacity" and x.current_execution_seq == 1 for x in runs.values()
    )
    queue = await store.list_queue()
    assert {q.run_id for q in queue} == set(r.run_ids)
    assert all(q.reason == "new" and q.execution_seq == 1 for q in queue)
    nothing = await emit(store, "nobody.listens")
    assert nothing.run_ids == [] and len(await store.list_runs()) == 2


async def test_idempotency_key_returns_first_event_and_creates_nothing(store):
    await worker(store)
    first = await emit(store, key="k1")
    again = await emit(store, key="k1")
    assert again.duplicate and again.event_id == first.event_id and again.run_ids == first.run_ids
    assert len(await store.list_runs()) == 1
    await store.advance_clock(3601)
    later = await emit(store, key="k1")
    assert not later.duplicate and later.event_id != first.event_id
    assert len(await store.list_runs()) == 2


# ── reserve_segments ────────────────────────────────────────────────────────


async def test_reserve_only_offered_functions_and_respects_credits(store):
    s = await worker(store, fn("a", "e"), fn("b", "e"), slots=2)
    for _ in range(3):
        await emit(store, "e")
    got = await store.reserve_segments(
        "n1", {s.session_id: frozenset({"a"})}, 10, reservation_expiry_s=RESERVATION
    )
    assert len(got) == 2 and all(r.assignment.function_id == "a" for r in got)
    assert await reserve(store, s) == []  # no credits left
    sess = (await store.list_sessions())[0]
    assert sess.credits_claimed == 2
    a = got[0].assignment
    assert a.attempt == 1 and a.max_attempts == 3 and a.execution_seq == 1
    assert a.event.name == "e" and a.job_id == f"{a.run_id}/1" and len(a.lease_token) == 32


async def test_reserve_oldest_first_and_not_future_or_reserved_rows(store):
    s = await worker(store, slots=1)
    first = await emit(store)
    second = await emit(store)
    (res,) = await reserve(store, s)
    assert res.assignment.run_id == first.run_ids[0]
    s2 = await worker(store, slots=5)
    got = await reserve(store, s2)
    assert [r.assignment.run_id for r in got] != [first.run_ids[0]] and len(got) == 1
    assert await reserve(store, s2) == []
    # reservation expiry makes both rows reservable again, oldest first
    await store.advance_clock(RESERVATION + 1)
    await store.heartbeat(s2.session_id, None, session_expiry_s=SESSION, lease_expiry_s=LEASE)
    again = await reserve(store, s2)
    assert [r.assignment.run_id for r in again] == first.run_ids + second.run_ids


async def test_reserve_skips_rows_not_yet_eligible(store):
    s = await worker(store)
    f = await running(store, s)
    await store.fail_job(f, ErrorInfo("boom"))
    assert await reserve(store, s) == []
    assert 0 < await store.seconds_until_next_eligible() <= 1.0
    await store.advance_clock(1.5)
    assert len(await reserve(store, s)) == 1


async def test_reserve_respects_global_concurrency_limit(store):
    s = await worker(store, fn(concurrency=Concurrency(limit=1)), slots=5)
    await emit(store)
    await emit(store)
    got = await reserve(store, s)
    assert len(got) == 1
    await store.activate_lease(fence_of(got[0]), lease_expiry_s=LEASE)
    assert await reserve(store, s) == []
    await store.complete_job(fence_of(got[0]), None)
    assert len(await reserve(store, s)) == 1


async def test_reserve_respects_per_key_concurrency_limit(store):
    s = await worker(
        store, fn(concurrency=Concurrency(limit=1, key="event.data.customer")), slots=5
    )
    await emit(store, data={"customer": "a"})
    await emit(store, data={"customer": "a"})
    await emit(store, data={"customer": "b"})
    await emit(store, data={})
    await emit(store, data={})
    got = await reserve(store, s)
    keys = sorted(
        [str((await store.get_run(r.assignment.run_id)).run.concurrency_key) for r in got]
    )
    assert keys == ["None", "a", "b"]


async def test_a_session_that_nacked_draining_gets_nothing_more(store):
    s = await worker(store)
    await emit(store)
    (res,) = await reserve(store, s)
    await store.nack_job(fence_of(res), "DRAINING")  # the worker refuses: it is draining
    await emit(store)
    assert await reserve(store, s) == []


async def test_release_reservation_frees_row_and_credit(store):
    s = await worker(store, slots=1)
    await emit(store)
    (res,) = await reserve(store, s)
    await store.release_reservation(s.session_id, res.assignment.run_id, 1)
    (again,) = await reserve(store, s)
    assert again.assignment.run_id == res.assignment.run_id
    assert again.assignment.lease_token != res.assignment.lease_token


# ── activate_lease ──────────────────────────────────────────────────────────


async def test_activate_lease_happy_path(store):
    s = await worker(store)
    await emit(store)
    (res,) = await reserve(store, s)
    run = await store.activate_lease(fence_of(res), lease_expiry_s=LEASE)
    assert run.status == "running" and run.started_at is not None
    assert await store.list_queue() == []
    (lease,) = await store.list_leases()
    assert lease.run_id == run.id and lease.session_id == s.session_id and lease.node_id == "n1"
    assert 80 < lease.expires_in_s <= LEASE


async def test_activate_lease_refuses_wrong_fences(store):
    s = await worker(store)
    other = await worker(store)
    await emit(store)
    (res,) = await reserve(store, s)
    good = fence_of(res)
    for bad in (
        Fence(good.session_id, good.run_id, good.execution_seq, "0" * 32),
        Fence(good.session_id, good.run_id, good.execution_seq + 1, good.lease_token),
        Fence(other.session_id, good.run_id, good.execution_seq, good.lease_token),
    ):
        with pytest.raises(StaleExecution):
            await store.activate_lease(bad, lease_expiry_s=LEASE)
    await store.cancel_run(good.run_id, "test")
    with pytest.raises(StaleExecution):
        await store.activate_lease(good, lease_expiry_s=LEASE)


async def test_activate_leases_gives_each_ack_its_own_outcome(store):
    """A group of acks (one statement on PostgreSQL): the good ones activated,
    a repeated one answered with its live run, each refused one refused alone."""
    s = await worker(store, slots=6)
    other = await worker(store)
    for _ in range(6):
        await emit(store)
    good, repeated, wrong_token, wrong_session, cancelled, good2 = [
        fence_of(r) for r in await reserve(store, s)
    ]
    await store.activate_lease(repeated, lease_expiry_s=LEASE)
    await store.cancel_run(cancelled.run_id, "test")
    fences = [
        good,
        repeated,
        Fence(wrong_token.session_id, wrong_token.run_id, wrong_token.execution_seq, "0" * 32),
        Fence(other.session_id, wrong_session.run_id, wrong_session.execution_seq, wrong_session.lease_token),
        cancelled,
        good2,
    ]
    results = await store.activate_leases(fences, lease_expiry_s=LEASE)
    runs = [r.unwrap() for r in (results[0], results[1], results[5])]
    assert [(run.id, run.status) for run in runs] == [
        (good.run_id, "running"), (repeated.run_id, "running"), (good2.run_id, "running")
    ]
    for refused in results[2:5]:
        with pytest.raises(StaleExecution):
            refused.unwrap()
    leases = {lease.run_id: lease for lease in await store.list_leases()}
    assert set(leases) == {good.run_id, repeated.run_id, good2.run_id}
    assert all(lease.session_id == s.session_id and 80 < lease.expires_in_s <= LEASE for lease in leases.values())
    queued = {row.run_id for row in await store.list_queue()}
    assert queued == {wrong_token.run_id, wrong_session.run_id}  # still reserved, untouched
    # The refused ones can still be acked with their real fences.
    (again,) = await store.activate_leases([wrong_token], lease_expiry_s=LEASE)
    assert again.unwrap().status == "running"


async def test_activate_leases_of_a_gone_session_are_all_refused(store):
    s = await worker(store, slots=3)
    for _ in range(3):
        await emit(store)
    fences = [fence_of(r) for r in await reserve(store, s)]
    await store.close_session(s.session_id, recover_leases=False, recovery_grace_s=GRACE, recovery_ceiling=3)
    results = await store.activate_leases(fences, lease_expiry_s=LEASE)
    for refused in results:
        with pytest.raises(StaleExecution):
            refused.unwrap()
    assert await store.list_leases() == []


# ── record_step / complete / fail ──────────────────────────────────────────


async def test_record_step_is_idempotent_and_fenced(store):
    f = await running(store)
    await store.record_step(f, step_id="s1", name="one", status="completed", output={"v": 1})
    await store.record_step(f, step_id="s1", name="one", status="completed", output={"v": 2})
    await store.record_step(f, step_id="s2", name="two", status="failed", error=ErrorInfo("x"))
    detail = await store.get_run(f.run_id)
    assert [(s.step_id, s.status, s.output) for s in detail.steps] == [
        ("s1", "completed", {"v": 1}),
        ("s2", "failed", None),
    ]
    stale = Fence(f.session_id, f.run_id, f.execution_seq, "f" * 32)
    with pytest.raises(StaleExecution):
        await store.record_step(stale, step_id="s3", name="three", status="completed")


async def test_complete_job_frees_everything(store):
    s = await worker(store, slots=1)
    f = await running(store, s)
    out = await store.complete_job(f, {"done": True})
    assert out.status == "completed"
    run = (await store.get_run(f.run_id)).run
    assert run.status == "completed" and run.output == {"done": True} and run.ended_at
    assert await store.list_leases() == []
    assert (await store.list_sessions())[0].credits_claimed == 0
    with pytest.raises(StaleExecution):
        await store.complete_job(f, None)


async def test_fail_job_retries_with_backoff_then_fails(store):
    s = await worker(store)
    f = await running(store, s)
    now = await store.db_now()
    out = await store.fail_job(f, ErrorInfo("boom"))
    assert out.status == "waiting" and out.attempt == 2 and out.next_execution_seq == 2
    assert out.eligible_at == pytest.approx(now + 1, abs=0.5)
    detail = await store.get_run(f.run_id)
    assert detail.queue.reason == "retry" and detail.waiting_reason.startswith("retry delay until ")
    await store.advance_clock(1.1)
    (res,) = await reserve(store, s)
    assert res.assignment.attempt == 2
    f2 = fence_of(res)
    await store.activate_lease(f2, lease_expiry_s=LEASE)
    now = await store.db_now()
    out = await store.fail_job(f2, ErrorInfo("boom"))
    assert out.attempt == 3 and out.eligible_at == pytest.approx(now + 2, abs=0.5)
    await store.advance_clock(2.1)
    (res,) = await reserve(store, s)
    f3 = fence_of(res)
    await store.activate_lease(f3, lease_expiry_s=LEASE)
    out = await store.fail_job(f3, ErrorInfo("final", code="E1"))
    run = (await store.get_run(f.run_id)).run
    assert out.status == "failed" and run.status == "failed" and run.error.code == "E1"
    assert await store.list_queue() == []


async def test_non_retryable_failure_fails_at_once(store):
    f = await running(store)
    out = await store.fail_job(f, ErrorInfo("no", retryable=False))
    assert out.status == "failed" and await store.list_queue() == []


# ── nack ─────────────────────────────────────────────────────────────────────


async def test_nack_draining_requeues_without_attempt_or_grace(store):
    s = await worker(store)
    await emit(store)
    (res,) = await reserve(store, s)
    f = fence_of(res)
    out = await store.nack_job(f, "DRAINING")
    assert out.status == "waiting" and out.next_execution_seq == 2 and out.attempt == 1
    detail = await store.get_run(f.run_id)
    assert detail.run.status == "waiting" and detail.run.recovery_count == 0
    assert detail.queue.reason == "nack" and detail.queue.eligible_in_s <= 0
    assert detail.waiting_reason == "requeued after nack"
    assert (await store.list_sessions())[0].draining
    assert await reserve(store, s) == []
    other = await worker(store)
    (res2,) = await reserve(store, other)
    assert res2.assignment.execution_seq == 2 and res2.assignment.attempt == 1
    with pytest.raises(StaleExecution):
        await store.activate_lease(f, lease_expiry_s=LEASE)


async def test_nack_at_capacity_holds_credit_until_heartbeat_shows_space(store):
    s = await worker(store, slots=1)
    await emit(store)
    (res,) = await reserve(store, s)
    await store.nack_job(fence_of(res), "AT_CAPACITY")
    sess = (await store.list_sessions())[0]
    assert sess.credits_held == 1 and not sess.draining
    assert await reserve(store, s) == []
    busy = [ActiveJob("j", "run_x", 1, "t")]
    await store.heartbeat(s.session_id, busy, session_expiry_s=SESSION, lease_expiry_s=LEASE)
    assert await reserve(store, s) == []
    await store.heartbeat(s.session_id, [], session_expiry_s=SESSION, lease_expiry_s=LEASE)
    (again,) = await reserve(store, s)
    assert again.assignment.execution_seq == 2


async def test_a_heartbeat_showing_k_free_slots_releases_k_held_credits(store):
    s = await worker(store, slots=3)
    for _ in range(3):
        await emit(store)
    for res in await reserve(store, s):
        await store.nack_job(fence_of(res), "AT_CAPACITY")
    assert (await store.list_sessions())[0].credits_held == 3
    two_busy = [ActiveJob("j1", "run_x", 1, "t"), ActiveJob("j2", "run_y", 1, "t")]
    await store.heartbeat(s.session_id, two_busy, session_expiry_s=SESSION, lease_expiry_s=LEASE)
    assert (await store.list_sessions())[0].credits_held == 2
    assert len(await reserve(store, s)) == 1


async def test_a_compatibility_heartbeat_releases_held_credits(store):
    s = await worker(store, slots=2)
    await emit(store)
    (res,) = await reserve(store, s)
    await store.nack_job(fence_of(res), "AT_CAPACITY")
    assert (await store.list_sessions())[0].credits_held == 1
    await store.heartbeat(s.session_id, None, session_expiry_s=SESSION, lease_expiry_s=LEASE)
    assert (await store.list_sessions())[0].credits_held == 0


async def test_every_nack_is_audited_with_reason_run_and_seq(store):
    s = await worker(store, slots=2)
    await emit(store)
    (res,) = await reserve(store, s)
    f = fence_of(res)
    await store.nack_job(f, "AT_CAPACITY")
    (audit,) = await store.list_audit(run_id=f.run_id, type="capacity.job.nacked")
    assert audit.data["reason"] == "AT_CAPACITY"
    assert audit.data["execution_seq"] == 1 and audit.data["next_execution_seq"] == 2
    assert audit.data["session_id"] == s.session_id


async def test_nack_after_activation_releases_lease(store):
    f = await running(store)
    out = await store.nack_job(f, "DRAINING")
    assert out.next_execution_seq == 2 and await store.list_leases() == []
    with pytest.raises(StaleExecution):
        await store.nack_job(f, "DRAINING")


# ── heartbeat ────────────────────────────────────────────────────────────────


async def test_heartbeat_states_and_unreported_lease_expires(store):
    s = await worker(store)
    f1 = await running(store, s)
    f2 = await running(store, s)
    jobs = [
        ActiveJob("j1", f1.run_id, f1.execution_seq, f1.lease_token),
        ActiveJob("j2", f2.run_id, f2.execution_seq + 5, f2.lease_token),
        ActiveJob("j3", "run_unknown", 1, "x"),
    ]
    await store.advance_clock(60)
    states = await store.heartbeat(
        s.session_id, jobs, session_expiry_s=SESSION, lease_expiry_s=LEASE
    )
    assert [(x.job_id, x.state) for x in states] == [
        ("j1", "REFRESHED"),
        ("j2", "STALE"),
        ("j3", "UNKNOWN"),
    ]
    await store.advance_clock(40)
    recovered = await store.expire_leases(recovery_grace_s=GRACE, recovery_ceiling=10)
    assert [r.run_id for r in recovered] == [f2.run_id]
    assert [lease.run_id for lease in await store.list_leases()] == [f1.run_id]


async def test_heartbeat_without_jobs_refreshes_all(store):
    s = await worker(store)
    await running(store, s)
    await running(store, s)
    await store.advance_clock(60)
    assert (
        await store.heartbeat(s.session_id, None, session_expiry_s=SESSION, lease_expiry_s=LEASE)
        == []
    )
    await store.advance_clock(40)
    assert await store.expire_leases(recovery_grace_s=GRACE, recovery_ceiling=10) == []


async def test_heartbeat_unknown_session(store):
    with pytest.raises(SessionNotFound):
        await store.heartbeat("ses_nope", None, session_expiry_s=SESSION, lease_expiry_s=LEASE)
    s = await worker(store)
    await store.advance_clock(SESSION + 1)
    with pytest.raises(SessionNotFound):
        await store.heartbeat(s.session_id, [], session_expiry_s=SESSION, lease_expiry_s=LEASE)


# ── loop 1 ───────────────────────────────────────────────────────────────────


async def test_expire_reservations_frees_credit(store):
    s = await worker(store, slots=1)
    await emit(store)
    await reserve(store, s)
    assert await store.expire_reservations() == 0
    await store.advance_clock(RESERVATION + 1)
    await store.heartbeat(s.session_id, None, session_expiry_s=SESSION, lease_expiry_s=LEASE)
    assert await store.expire_reservations() == 1
    q = (await store.list_queue())[0]
    assert q.reservation_owner is None
    assert (await store.list_sessions())[0].credits_claimed == 0


async def test_expire_leases_fences_and_requeues_with_grace_and_audits(store):
    s = await worker(store)
    f = await running(store, s)
    assert await store.expire_leases(recovery_grace_s=GRACE, recovery_ceiling=10) == []
    await store.advance_clock(LEASE + 1)
    now = await store.db_now()
    (rec,) = await store.expire_leases(recovery_grace_s=GRACE, recovery_ceiling=10)
    assert rec.old_execution_seq == 1 and rec.new_execution_seq == 2 and not rec.exhausted
    assert rec.recovery_count == 1 and rec.session_id == s.session_id
    assert rec.eligible_at == pytest.approx(now + GRACE, abs=1)
    detail = await store.get_run(f.run_id)
    assert detail.run.status == "waiting" and detail.run.current_execution_seq == 2
    assert detail.queue.reason == "recovery" and detail.lease is None
    assert detail.waiting_reason.startswith("recovery grace until ")
    assert (await store.list_sessions())[0].credits_claimed == 0
    with pytest.raises(StaleExecution):
        await store.record_step(f, step_id="s", name="s", status="completed")
    audit = await store.list_audit(run_id=f.run_id)
    assert [a.type for a in audit] == ["capacity.lease.expired", "capacity.segment.recovered"]
    assert audit[1].data["old_execution_seq"] == 1 and audit[1].data["new_execution_seq"] == 2
    assert audit[1].data["recovery_count"] == 1


async def test_recovery_ceiling_fails_run_with_recovery_exhausted(store):
    s = await worker(store, slots=1)
    await store.heartbeat(s.session_id, [], session_expiry_s=10_000, lease_expiry_s=LEASE)
    await emit(store)
    ceiling = 2
    for i in range(ceiling + 1):
        await store.advance_clock(GRACE + 1)
        await store.heartbeat(s.session_id, None, session_expiry_s=10_000, lease_expiry_s=LEASE)
        (res,) = await reserve(store, s)
        f = fence_of(res)
        await store.activate_lease(f, lease_expiry_s=LEASE)
        if i == 0:
            await store.record_step(f, step_id="s", name="s", status="completed")
        await store.advance_clock(LEASE + 1)
        await store.heartbeat(s.session_id, [], session_expiry_s=10_000, lease_expiry_s=LEASE)
        (rec,) = await store.expire_leases(recovery_grace_s=GRACE, recovery_ceiling=ceiling)
    # `ceiling` recoveries were permitted; the next lease loss failed the run.
    assert rec.exhausted and rec.new_execution_seq is None and rec.recovery_count == ceiling
    run = (await store.get_run(f.run_id)).run
    assert run.status == "failed" and run.error.code == "EXECUTION_RECOVERY_EXHAUSTED"
    assert run.recovery_count == ceiling
    # The audit trail agrees with the run: its last lease loss reports the same count.
    expired = [a for a in await store.list_audit(run_id=f.run_id) if a.type == "capacity.lease.expired"]
    assert [a.data["recovery_count"] for a in expired] == [1, 2, ceiling]
    assert [a.data["ceiling_reached"] for a in expired] == [False, False, True]


async def test_accepted_yield_resets_recovery_count(store):
    s = await worker(store, slots=1)
    await store.heartbeat(s.session_id, [], session_expiry_s=10_000, lease_expiry_s=LEASE)
    f = await running(store, s)
    await store.advance_clock(LEASE + 1)
    await store.heartbeat(s.session_id, [], session_expiry_s=10_000, lease_expiry_s=LEASE)
    await store.expire_leases(recovery_grace_s=0, recovery_ceiling=10)
    (res,) = await reserve(store, s)
    f = fence_of(res)
    await store.activate_lease(f, lease_expiry_s=LEASE)
    assert (await store.get_run(f.run_id)).run.recovery_count == 1
    now = await store.db_now()
    await store.yield_job(f, step_id="z", name="nap", info=SleepYield(until=now + 100))
    detail = await store.get_run(f.run_id)
    assert detail.run.recovery_count == 0 and detail.run.status == "waiting"
    assert detail.waiting_reason.startswith("sleeping until ")


async def test_expire_sessions_cascades_credits_but_keeps_leases(store):
    s = await worker(store)
    await running(store, s)
    assert await store.expire_sessions() == 0
    await store.advance_clock(SESSION + 1)
    assert await store.expire_sessions() == 1
    assert await store.list_sessions() == []
    assert len(await store.list_leases(include_expired=True)) == 1  # expired, left to loop 1
    assert await store.seconds_until_next_capacity_expiry() == 0


async def test_close_session_recovers_leases_first_without_grace(store):
    s = await worker(store, slots=1)
    f = await running(store, s)
    (rec,) = await store.close_session(
        s.session_id, recover_leases=True, recovery_grace_s=GRACE, recovery_ceiling=10
    )
    assert rec.recovery_count == 1 and rec.new_execution_seq == 2
    assert (await store.get_run(f.run_id)).queue.eligible_in_s <= 0
    assert await store.list_sessions() == []
    s2 = await worker(store, slots=1)
    (res,) = await reserve(store, s2)
    await store.activate_lease(fence_of(res), lease_expiry_s=LEASE)
    (rec2,) = await store.close_session(
        s2.session_id, recover_leases=True, recovery_grace_s=GRACE, recovery_ceiling=10
    )
    assert rec2.recovery_count == 2
    assert (await store.get_run(f.run_id)).queue.eligible_in_s > GRACE - 2
    types = [a.type for a in await store.list_audit(run_id=f.run_id)]
    assert types.count("capacity.segment.recovered") == 2


async def test_close_session_without_recovery_releases_reservations(store):
    s = await worker(store, slots=1)
    await emit(store)
    await reserve(store, s)
    assert (
        await store.close_session(
            s.session_id, recover_leases=False, recovery_grace_s=GRACE, recovery_ceiling=10
        )
        == []
    )
    assert (await store.list_queue())[0].reservation_owner is None


# ── cancel ───────────────────────────────────────────────────────────────────


async def test_cancel_run_fences_and_names_holder(store):
    s = await worker(store, slots=1)
    f = await running(store, s)
    out = await store.cancel_run(f.run_id, "user")
    assert out.session_id == s.session_id and out.node_id == "n1" and out.job_id == f"{f.run_id}/1"
    assert (await store.get_run(f.run_id)).run.status == "cancelled"
    with pytest.raises(StaleExecution):
        await store.complete_job(f, None)
    with pytest.raises(Conflict):
        await store.cancel_run(f.run_id, "again")
    with pytest.raises(RunNotFound):
        await store.cancel_run("run_nope", "x")
    assert (await store.list_sessions())[0].credits_claimed == 0


# ── yields, waits, invokes, waker ────────────────────────────────────────────


async def test_sleep_is_claimed_and_resumed(store):
    s = await worker(store, slots=1)
    f = await running(store, s)
    now = await store.db_now()
    await store.yield_job(f, step_id="z", name="nap", info=SleepYield(until=now + 10))
    assert await store.claim_elapsed_steps("n1", 10) == []
    assert 8 < await store.seconds_until_next_wake() <= 10
    await store.advance_clock(11)
    assert await store.claim_elapsed_steps("n1", 10) == [(f.run_id, "z")]
    assert await store.claim_elapsed_steps("n1", 10) == []
    out = await store.resume_claimed_steps("n1", [(f.run_id, "z")])
    assert out.resumed == [f.run_id] and out.lost == []
    assert (await store.get_run(f.run_id)).run.current_execution_seq == 2
    await store.heartbeat(s.session_id, None, session_expiry_s=SESSION, lease_expiry_s=LEASE)
    (res,) = await reserve(store, s)
    memo = res.assignment.completed_steps
    assert [(m.step_id, m.kind, m.status) for m in memo] == [("z", "sleep", "completed")]
    # Claimed after its wake time: it may start at once, ~1 s late.
    assert res.assignment.start_delay_ms == 0
    assert res.wake_lateness_s is not None and 0.9 < res.wake_lateness_s < 2.5


async def test_a_sleep_is_claimed_ahead_within_the_lookahead_and_its_run_carries_the_wake_time(store):
    s = await worker(store, slots=2)
    f = await running(store, s)
    now = await store.db_now()
    await store.yield_job(f, step_id="z", name="nap", info=SleepYield(until=now + 10))
    assert await store.claim_elapsed_steps("n1", 10, lookahead_s=5) == []
    assert 3 < await store.seconds_until_next_wake(5) <= 5
    await store.advance_clock(6)  # 4 s before the wake time
    assert await store.seconds_until_next_wake(5) == 0
    assert await store.claim_elapsed_steps("n1", 10, lookahead_s=5) == [(f.run_id, "z")]
    assert (await store.resume_claimed_steps("n1", [(f.run_id, "z")])).resumed == [f.run_id]
    (res,) = await reserve(store, s)
    # Queued and reserved now, to start at the wake time (database clock).
    assert 3000 < res.assignment.start_delay_ms <= 4000
    assert res.wake_lateness_s is not None and -4 <= res.wake_lateness_s < -3
    # Every later dispatch of that segment honours it: a nack re-queues it ...
    nacked = await store.nack_job(fence_of(res), "DRAINING")
    (again,) = await reserve(store, await worker(store, slots=1))
    assert again.assignment.execution_seq == nacked.next_execution_seq
    assert 3000 < again.assignment.start_delay_ms <= 4000
    assert again.wake_lateness_s is None  # a re-delivery is not a wake
    # ... and the run resumed by anything else later may start at once.
    await store.activate_lease(fence_of(again), lease_expiry_s=LEASE)
    await store.advance_clock(5)
    await store.yield_job(fence_of(again), step_id="i", name="i", info=InvokeYield("missing"))
    (after,) = await reserve(store, await worker(store, slots=1))
    assert after.assignment.start_delay_ms == 0 and after.wake_lateness_s is None


async def test_lookahead_claims_sleeps_early_but_waits_and_invokes_only_at_their_timeout(store):
    s = await worker(store, fn("f", "order.created"), fn("child", "never"), slots=3)
    sleeper, waiter, invoker = [await running(store, s) for _ in range(3)]
    now = await store.db_now()
    await store.yield_job(sleeper, step_id="z", name="z", info=SleepYield(until=now + 3))
    await store.yield_job(waiter, step_id="w", name="w", info=WaitYield(event="e", timeout_at=now + 3))
    await store.yield_job(
        invoker, step_id="i", name="i", info=InvokeYield("child", None, timeout_at=now + 3)
    )
    assert await store.claim_elapsed_steps("n1", 10, lookahead_s=10) == [(sleeper.run_id, "z")]
    # The wait and the invoke are claimable at their timeout, not before.
    assert 1 < await store.seconds_until_next_wake(10) <= 3
    assert await store.claim_elapsed_steps("n1", 10, lookahead_s=10) == []
    await store.advance_clock(3.5)
    assert sorted(await store.claim_elapsed_steps("n1", 10, lookahead_s=10)) == sorted(
        [(waiter.run_id, "w"), (invoker.run_id, "i")]
    )


async def test_one_resume_settles_a_whole_batch_and_skips_a_claim_taken_away(store):
    s = await worker(store, fn("f", "order.created"), fn("child", "never"), slots=4)
    fences = [await running(store, s) for _ in range(4)]
    sleeper, waiter, invoker, cancelled = fences
    now = await store.db_now()
    await store.yield_job(sleeper, step_id="z", name="z", info=SleepYield(until=now + 1))
    await store.yield_job(waiter, step_id="w", name="w", info=WaitYield(event="e", timeout_at=now + 1))
    out = await store.yield_job(
        invoker, step_id="i", name="i", info=InvokeYield("child", None, timeout_at=now + 1)
    )
    (child,) = out.kicked_run_ids
    await store.yield_job(cancelled, step_id="z", name="z", info=SleepYield(until=now + 1))
    await store.advance_clock(2)
    claimed = await store.claim_elapsed_steps("n1", 10)
    assert len(claimed) == 4
    await store.cancel_run(cancelled.run_id, "user")  # between claim and resume
    outcome = await store.resume_claimed_steps("n1", claimed)
    assert sorted(outcome.resumed) == sorted([sleeper.run_id, waiter.run_id, invoker.run_id])
    assert outcome.lost == [(cancelled.run_id, "z")]
    steps = {f.run_id: (await store.get_run(f.run_id)).steps[0] for f in fences}
    assert steps[sleeper.run_id].status == "completed"
    assert steps[waiter.run_id].status == "timed_out" and steps[waiter.run_id].output is None
    assert steps[invoker.run_id].status == "failed"
    assert steps[invoker.run_id].error.code == "INVOKE_TIMEOUT" and child in steps[invoker.run_id].error.message
    assert steps[cancelled.run_id].status == "failed"
    for f in (sleeper, waiter, invoker):
        detail = await store.get_run(f.run_id)
        assert detail.queue.reason == "resume" and detail.queue.execution_seq == 2
        assert await step_claim(store, f.run_id, steps[f.run_id].step_id) == (
            steps[f.run_id].status, None, None, None
        )
    # Resuming the same claims again finds none of them: nothing happens twice.
    again = await store.resume_claimed_steps("n1", claimed)
    assert again.resumed == [] and sorted(again.lost) == sorted(claimed)
    assert await store.resume_claimed_steps("n1", []) == WakeOutcome([], [])


async def test_wait_for_event_resolved_by_matching_event(store):
    s = await worker(store, slots=1)
    f = await running(store, s)
    now = await store.db_now()
    info = WaitYield(event="payment.done", timeout_at=now + 100, match="data.order", match_value=7)
    await store.yield_job(f, step_id="w", name="w", info=info)
    assert (await store.get_run(f.run_id)).waiting_reason.startswith(
        "waiting for event payment.done"
    )
    await store.ingest_event("payment.done", {"order": 8}, None, idempotency_window_s=1)
    assert (await store.get_run(f.run_id)).queue is None
    r = await store.ingest_event("payment.done", {"order": 7}, None, idempotency_window_s=1)
    assert r.resumed_run_ids == [f.run_id]
    detail = await store.get_run(f.run_id)
    assert detail.queue.reason == "resume" and detail.steps[0].output["data"] == {"order": 7}


async def test_a_wait_receives_an_event_committed_between_its_segments_reservation_and_ack(store):
    """The worker may start the handler once it has the assignment, before its
    JobAck commits: an event its first step caused, committed before the ack,
    came while the segment ran, and the wait the segment parks receives it."""
    s = await worker(store, fn("f", "order.created"), slots=1)
    await emit(store)
    (res,) = await reserve(store, s, limit=1)
    await store.ingest_event("payment.done", {"order": 7}, None, idempotency_window_s=1)
    f = fence_of(res)
    await store.activate_lease(f, lease_expiry_s=LEASE)
    now = await store.db_now()
    info = WaitYield(event="payment.done", timeout_at=now + 100, match="data.order", match_value=7)
    await store.yield_job(f, step_id="w", name="w", info=info)
    detail = await store.get_run(f.run_id)
    assert detail.steps[0].status == "completed" and detail.steps[0].output["data"] == {"order": 7}


async def test_a_wait_does_not_receive_an_event_committed_before_its_segment_was_reserved(store):
    s = await worker(store, fn("f", "order.created"), slots=1)
    await emit(store)
    await store.ingest_event("payment.done", {"order": 7}, None, idempotency_window_s=1)
    (res,) = await reserve(store, s, limit=1)
    f = fence_of(res)
    await store.activate_lease(f, lease_expiry_s=LEASE)
    now = await store.db_now()
    info = WaitYield(event="payment.done", timeout_at=now + 100, match="data.order", match_value=7)
    await store.yield_job(f, step_id="w", name="w", info=info)
    assert (await store.get_run(f.run_id)).steps[0].status == "waiting"


async def test_ingest_events_creates_each_events_runs_in_order_and_resolves_parked_waits(store):
    """Several events without keys at once (two statements on PostgreSQL, however
    many): each gets the runs of the functions its name triggers, in order; an
    event nobody listens to is recorded with none; a parked wait is resolved by
    the first matching event of the batch only."""
    s = await worker(store, fn("orders", "order.*"), fn("created", "order.created"), fn("payments", "payment.done"), slots=2)
    f = await running(store, s, name="order.created")
    now = await store.db_now()
    info = WaitYield(event="payment.done", timeout_at=now + 100, match="data.order", match_value=7)
    await store.yield_job(f, step_id="w", name="w", info=info)
    results = await store.ingest_events(
        [
            ("order.created", {"n": 1}, None),
            ("payment.done", {"order": 8}, None),
            ("payment.done", {"order": 7}, None),
            ("payment.done", {"order": 7}, None),
            ("order.paid", {"n": 2}, None),
        ],
        idempotency_window_s=60,
    )
    assert [r.duplicate for r in results] == [False] * 5
    assert len({r.event_id for r in results}) == 5
    functions = []
    for r in results:
        functions.append(sorted([(await store.get_run(run_id)).run.function_id for run_id in r.run_ids]))
    assert functions == [["created", "orders"], ["payments"], ["payments"], ["payments"], ["orders"]]
    assert [r.resumed_run_ids for r in results] == [[], [], [f.run_id], [], []]
    detail = await store.get_run(f.run_id)
    assert detail.queue.reason == "resume" and detail.steps[0].output["id"] == results[2].event_id
    for r in results:
        for run_id in r.run_ids:
            run = (await store.get_run(run_id)).run
            assert run.event_id == r.event_id and run.status == "waiting_for_capacity"
    assert (await store.ingest_events([("nobody.listens", {}, None)] * 3, idempotency_window_s=60))[2].run_ids == []


async def test_wait_times_out_via_waker(store):
    f = await running(store)
    now = await store.db_now()
    await store.yield_job(f, step_id="w", name="w", info=WaitYield(event="e", timeout_at=now + 5))
    await store.advance_clock(6)
    assert await store.claim_elapsed_steps("n1", 10) == [(f.run_id, "w")]
    await store.resume_claimed_steps("n1", [(f.run_id, "w")])
    assert (await store.get_run(f.run_id)).steps[0].status == "timed_out"


async def test_invoke_child_completion_resumes_parent(store):
    s = await worker(store, fn("parent"), fn("child", "never"), slots=2)
    f = await running(store, s)
    out = await store.yield_job(f, step_id="i", name="i", info=InvokeYield("child", {"x": 1}))
    (child_id,) = out.kicked_run_ids
    assert (await store.get_run(f.run_id)).waiting_reason == f"waiting for invoked run {child_id}"
    (res,) = await reserve(store, s)
    assert res.assignment.run_id == child_id and res.assignment.event.data == {"x": 1}
    cf = fence_of(res)
    await store.activate_lease(cf, lease_expiry_s=LEASE)
    done = await store.complete_job(cf, 42)
    assert done.kicked_run_ids == [f.run_id]
    detail = await store.get_run(f.run_id)
    assert detail.steps[0].status == "completed" and detail.steps[0].output == 42
    assert detail.queue.reason == "resume"


async def test_record_steps_many_writes_each_segment_under_its_own_fence(store):
    """Several runs' step results at once (one statement on PostgreSQL): each
    segment's rows under its own fence, a stale one refused alone, a replayed
    completed step left as it was, the order within a segment kept."""
    s = await worker(store, slots=4)
    a, b, stale, replay = [await running(store, s) for _ in range(4)]
    await store.record_step(replay, step_id="r1", name="one", status="completed", output="first")
    results = await store.record_steps_many([
        (a, [StepResult("a1", "one", "completed", {"v": 1}), StepResult("a2", "two", "failed", None, ErrorInfo("boom"))]),
        (Fence(stale.session_id, stale.run_id, stale.execution_seq, "0" * 32), [StepResult("s1", "one", "completed", 1)]),
        (b, [StepResult("b1", "one", "completed", [1, 2])]),
        (replay, [StepResult("r1", "one", "completed", "second"), StepResult("r2", "two", "completed", 2)]),
    ])
    results[0].unwrap(), results[2].unwrap(), results[3].unwrap()
    with pytest.raises(StaleExecution):
        results[1].unwrap()
    steps = {f.run_id: [(x.step_id, x.status, x.output) for x in (await store.get_run(f.run_id)).steps]
             for f in (a, b, stale, replay)}
    assert steps[a.run_id] == [("a1", "completed", {"v": 1}), ("a2", "failed", None)]
    assert steps[b.run_id] == [("b1", "completed", [1, 2])]
    assert steps[stale.run_id] == []
    assert steps[replay.run_id] == [("r1", "completed", "first"), ("r2", "completed", 2)]


async def test_complete_jobs_completes_each_run_under_its_own_fence(store):
    """Several runs completed at once, each with the step results sent with its
    job's result (two statements on PostgreSQL): steps recorded first, leases
    out, credits freed, an invoked child's completion resumes its parent, a
    stale one refused alone (its run, steps, lease and credit untouched)."""
    s = await worker(store, fn("parent"), fn("child", "never"), slots=4)
    plain = await running(store, s)
    parent = await running(store, s)
    stale = await running(store, s)
    (child_id,) = (
        await store.yield_job(parent, step_id="i", name="i", info=InvokeYield("child", {"x": 1}))
    ).kicked_run_ids
    (res,) = await reserve(store, s)
    child = fence_of(res)
    await store.activate_lease(child, lease_expiry_s=LEASE)
    results = await store.complete_jobs([
        (plain, {"done": 1}, [StepResult("p1", "one", "completed", 1), StepResult("p2", "two", "completed", 2)]),
        (Fence(stale.session_id, stale.run_id, stale.execution_seq, "0" * 32), "no",
         [StepResult("x1", "one", "completed", 1)]),
        (child, 42, []),
    ])
    done_plain, done_child = results[0].unwrap(), results[2].unwrap()
    with pytest.raises(StaleExecution):
        results[1].unwrap()
    assert done_plain.status == "completed" and done_plain.function_id == "parent"
    assert done_child.kicked_run_ids == [parent.run_id]
    plain_detail = await store.get_run(plain.run_id)
    assert plain_detail.run.output == {"done": 1}
    assert [(x.step_id, x.output) for x in plain_detail.steps] == [("p1", 1), ("p2", 2)]
    assert (await store.get_run(stale.run_id)).steps == []
    assert (await store.get_run(child_id)).run.status == "completed"
    assert (await store.get_run(parent.run_id)).steps[0].output == 42
    assert (await store.get_run(stale.run_id)).run.status == "running"
    assert [lease.run_id for lease in await store.list_leases()] == [stale.run_id]
    assert (await store.list_sessions())[0].credits_claimed == 1  # the stale run's only


async def test_invoke_unknown_function_fails_step_and_resumes(store):
    f = await running(store)
    out = await store.yield_job(f, step_id="i", name="i", info=InvokeYield("missing"))
    assert out.next_execution_seq == 2
    step = (await store.get_run(f.run_id)).steps[0]
    assert step.status == "failed" and step.error.code == FunctionNotFound.code


async def plant_queue_row(store: Store, run_id: str) -> None:
    """Queue ``run_id``'s current segment by hand.

    No public path leaves a step ``waking`` while its run is queued or leased
    (resume completes the step and queues the run in one transaction), so the
    loop-2 guards are defence in depth; the test builds that state directly.
    """

    def work(tx) -> None:
        tx.execute(
            "INSERT INTO dispatch_queue (run_id, execution_seq, function_id, concurrency_key,"
            " eligible_at, reason, enqueued_at) SELECT id, current_execution_seq, function_id,"
            " concurrency_key, ironflow_now(), 'resume', ironflow_now() FROM runs WHERE id = ?",
            (run_id,),
        )

    await store._transact(work)  # type: ignore[attr-defined]


async def step_claim(store: Store, run_id: str, step_id: str) -> tuple[str, str | None, float | None, str | None]:
    """(status, claimed_by, claimed_at, pre_claim_status): the claim columns no record carries."""

    def work(tx):
        return tx.fetchone(
            "SELECT status, claimed_by, claimed_at, pre_claim_status FROM steps"
            " WHERE run_id = ? AND step_id = ?",
            (run_id, step_id),
        )

    return tuple(await store._transact(work))  # type: ignore[attr-defined]


async def test_reset_stale_claims_only_without_lease_or_queue(store):
    s = await worker(store, slots=3)
    fences = [await running(store, s) for _ in range(3)]
    leased, queued, free = (f.run_id for f in fences)
    now = await store.db_now()
    for f in fences:
        await store.yield_job(f, step_id="z", name="z", info=SleepYield(until=now + 1))
    await store.advance_clock(2)
    assert len(await store.claim_elapsed_steps("dead-node", 10)) == 3
    # The run `leased` holds a concurrency lease (and no queue row) ...
    await plant_queue_row(store, leased)
    (res,) = await reserve(store, s)
    await store.activate_lease(fence_of(res), lease_expiry_s=10_000)
    # ... the run `queued` a dispatch-queue row (and no lease), `free` neither.
    await plant_queue_row(store, queued)
    detail = {r: await store.get_run(r) for r in (leased, queued, free)}
    assert detail[leased].lease is not None and detail[leased].queue is None
    assert detail[queued].lease is None and detail[queued].queue is not None
    assert detail[free].lease is None and detail[free].queue is None

    assert await store.reset_stale_claims(120) == 0  # every claim is younger than the threshold
    await store.advance_clock(121)
    assert await store.reset_stale_claims(120) == 1
    assert await step_claim(store, free, "z") == ("sleeping", None, None, None)
    for guarded in (leased, queued):
        status, by, _, pre = await step_claim(store, guarded, "z")
        assert (status, by, pre) == ("waking", "dead-node", "sleeping")
    # Restored, the step is claimable again.
    assert await store.claim_elapsed_steps("n1", 10) == [(free, "z")]


# ── misc reads, keys, functions ──────────────────────────────────────────────


async def test_invoke_function_and_not_found(store):
    await worker(store, fn("a", "never"))
    run_id = await store.invoke_function("a", {"k": 1})
    detail = await store.get_run(run_id)
    assert detail.run.function_id == "a" and detail.waiting_reason == "waiting for capacity"
    with pytest.raises(FunctionNotFound):
        await store.invoke_function("zzz", {})
    with pytest.raises(RunNotFound):
        await store.get_run("run_missing")


async def test_list_runs_filters(store):
    await worker(store, fn("a", "e"), fn("b", "e"))
    await emit(store, "e")
    assert len(await store.list_runs()) == 2
    assert [r.function_id for r in await store.list_runs(function_id="a")] == ["a"]
    assert await store.list_runs(status="completed") == []
    assert len(await store.list_runs(limit=1)) == 1


async def test_audit_toggle_records_ordinary_events(store):
    s = await worker(store, fn(audit=True))
    f = await running(store, s)
    await store.record_step(f, step_id="s", name="s", status="completed")
    await store.complete_job(f, 1)
    types = [a.type for a in await store.list_audit(run_id=f.run_id)]
    assert types == ["run.started", "step.completed", "run.completed"]


async def test_a_retried_failure_is_audited_with_its_attempt(store):
    """Without it a run's attempt could not be told from its audit trail (the
    simulator checks that the two agree)."""
    s = await worker(store, fn(audit=True))
    f = await running(store, s)
    out = await store.fail_job(f, ErrorInfo("boom", code="E1"))
    assert out.status == "waiting" and out.attempt == 2
    retried = [a for a in await store.list_audit(run_id=f.run_id) if a.type == "run.attempt.failed"]
    assert [a.data for a in retried] == [{"attempt": 1, "next_attempt": 2, "error": "E1"}]


async def test_api_keys_hashed_and_authenticated(store):
    key_id, key = await store.create_api_key("org")
    assert key.startswith("ifkey_") and len(key) == len("ifkey_") + 32
    pid, pkey = await store.create_api_key("platform", role="ops")
    assert pkey.startswith("ifplatform_")
    p = await store.authenticate(pkey)
    assert p.key_id == pid and p.kind == "platform" and p.role == "ops"
    assert (await store.authenticate(key)).kind == "org"
    assert await store.authenticate("ifkey_wrong") is None
    fixed_id, fixed = await store.create_api_key("org", key="ifkey_" + "a" * 32)
    assert fixed == "ifkey_" + "a" * 32 and (await store.authenticate(fixed)).key_id == fixed_id
    assert hashlib.sha256(key.encode()).hexdigest()  # only the hash is stored (see schema)


async def test_seconds_until_helpers(store):
    assert await store.seconds_until_next_eligible() is None
    assert await store.seconds_until_next_capacity_expiry() is None
    assert await store.seconds_until_next_wake() is None
    s = await worker(store)
    await emit(store)
    assert await store.seconds_until_next_eligible() == 0
    assert 80 < await store.seconds_until_next_capacity_expiry() <= SESSION
    await reserve(store, s)
    assert await store.seconds_until_next_eligible() is None
    assert RESERVATION - 5 < await store.seconds_until_next_capacity_expiry() <= RESERVATION


async def node_rows(store: Store) -> dict[str, tuple[float, float]]:
    """node id → (started_at, heartbeat_at); no public read exposes the nodes table."""

    def work(tx) -> dict[str, tuple[float, float]]:
        rows = tx.fetchall("SELECT id, started_at, heartbeat_at FROM nodes")
        return {r[0]: (float(r[1]), float(r[2])) for r in rows}

    return await store._transact(work)  # type: ignore[attr-defined]


async def test_node_heartbeat_moves_heartbeat_at_and_registers_an_unknown_node(store):
    await store.register_node("n1")
    t0 = await store.db_now()
    started, beat = (await node_rows(store))["n1"]
    assert t0 - 1 < started <= beat <= t0 and beat - started < 0.1
    await store.advance_clock(5)
    await store.node_heartbeat("n1")
    await store.node_heartbeat("n2")  # e.g. its row was purged: the heartbeat re-creates it
    rows = await node_rows(store)
    assert rows["n1"][0] == started
    assert rows["n1"][1] - beat == pytest.approx(5, abs=1)
    n2_started, n2_beat = rows["n2"]
    assert n2_started == pytest.approx(n2_beat, abs=0.1)
    assert n2_beat == pytest.approx(rows["n1"][1], abs=1)


async def test_database_clock_tracks_the_wall_clock_and_advance_clock_moves_it_by_exactly_that(store):
    wall_before = time.time()
    first = await store.db_now()
    wall_after = time.time()
    assert wall_before - 1 < first < wall_after + 1
    await store.advance_clock(3600)
    second = await store.db_now()
    elapsed = time.time() - wall_before
    # Exactly the hour, plus at most the real time that passed between the reads.
    assert 3600 - 1e-3 <= second - first <= 3600 + elapsed + 1e-3
    await store.advance_clock(0.25)
    assert 0.25 - 1e-3 <= await store.db_now() - second <= 0.25 + (time.time() - wall_before) + 1e-3


async def test_retry_policy_from_function_definition(store):
    s = await worker(store, fn(retries=RetryPolicy(max_attempts=1)))
    f = await running(store, s)
    out = await store.fail_job(f, ErrorInfo("x"))
    assert out.status == "failed"


async def test_watch_kicks_stops_promptly_when_cancelled_at_any_moment(store):
    for delay in (0.0, 0.001, 0.05, 0.3):
        with trio.fail_after(5):  # a listener that never stops hangs here (the watchdog ends the run)
            with trio.move_on_after(delay):
                await store.watch_kicks(lambda: None)


async def test_watch_kicks_hears_work_committed_by_another_store(store, store_url):
    if not store_url.startswith("postgresql"):
        pytest.skip("PostgreSQL only: one node per SQLite file, so no other node to hear")
    from ironflow.store import open_store

    heard = trio.Event()
    other = open_store(store_url)
    await other.open()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: store.watch_kicks(heard.set, task_status=task_status))
            s = await worker(other, slots=1)
            assert s.session_id
            await emit(other)
            with trio.fail_after(5):
                await heard.wait()
            nursery.cancel_scope.cancel()
    finally:
        await other.close()


async def test_heartbeat_does_not_revive_an_expired_lease_the_scanner_has_not_reaped_yet(store):
    s = await worker(store, slots=1)
    f = await running(store, s)
    job = ActiveJob("j", f.run_id, f.execution_seq, f.lease_token)
    await store.heartbeat(s.session_id, [], session_expiry_s=10_000, lease_expiry_s=LEASE)
    await store.advance_clock(LEASE + 1)
    # Both heartbeat forms leave it expired; the per-job answer says STALE.
    await store.heartbeat(s.session_id, None, session_expiry_s=10_000, lease_expiry_s=LEASE)
    (status,) = await store.heartbeat(s.session_id, [job], session_expiry_s=10_000, lease_expiry_s=LEASE)
    assert status.state == "STALE"
    (rec,) = await store.expire_leases(recovery_grace_s=GRACE, recovery_ceiling=10)
    assert rec.run_id == f.run_id and rec.new_execution_seq == f.execution_seq + 1


async def test_list_leases_shows_active_leases_and_expired_unreaped_ones_only_on_request(store):
    s = await worker(store, slots=2)
    await store.heartbeat(s.session_id, [], session_expiry_s=10_000, lease_expiry_s=LEASE)
    old = await running(store, s)
    await store.advance_clock(LEASE / 2)
    fresh = await running(store, s)
    await store.advance_clock(LEASE / 2 + 1)  # old expired by database time, fresh not
    active = await store.list_leases()
    assert [lease.run_id for lease in active] == [fresh.run_id] and not active[0].expired
    everything = {lease.run_id: lease for lease in await store.list_leases(include_expired=True)}
    assert everything[old.run_id].expired and everything[old.run_id].expires_in_s < 0
    assert not everything[fresh.run_id].expired


async def test_a_run_past_its_function_timeout_fails_and_its_worker_is_fenced(store):
    s = await worker(store, fn("f", timeout_s=10.0), slots=1)
    await store.heartbeat(s.session_id, [], session_expiry_s=10_000, lease_expiry_s=LEASE)
    f = await running(store, s)
    assert await store.expire_run_deadlines() == []  # not yet
    await store.advance_clock(9)
    await store.heartbeat(s.session_id, None, session_expiry_s=10_000, lease_expiry_s=LEASE)
    assert await store.expire_run_deadlines() == []
    assert 0 < await store.seconds_until_next_capacity_expiry() <= 1.0
    await store.advance_clock(1.5)
    (ended,) = await store.expire_run_deadlines()
    assert ended.run_id == f.run_id and ended.session_id == s.session_id
    detail = await store.get_run(f.run_id)
    assert detail.run.status == "failed" and detail.run.error.code == "FUNCTION_TIMEOUT"
    assert detail.lease is None and detail.queue is None
    with pytest.raises(StaleExecution):
        await store.complete_job(f, "too late")
    assert await store.expire_run_deadlines() == []  # ended once


async def test_the_function_timeout_counts_from_the_first_start_not_from_the_emit(store):
    s = await worker(store, fn("f", timeout_s=10.0), slots=1)
    await emit(store)
    await store.advance_clock(60)  # queued for a minute: no deadline yet
    assert await store.expire_run_deadlines() == []
    await store.heartbeat(s.session_id, [], session_expiry_s=10_000, lease_expiry_s=LEASE)
    (res,) = await reserve(store, s)
    await store.activate_lease(fence_of(res), lease_expiry_s=LEASE)
    await store.advance_clock(5)
    assert await store.expire_run_deadlines() == []


async def test_an_event_that_arrives_while_the_waiting_segment_runs_completes_the_wait(store):
    s = await worker(store, fn("f"), fn("g", "approved"), slots=1)
    f = await running(store, s)
    await emit(store, "approved", data={"k": 1})  # before the wait is parked
    await emit(store, "approved", data={"k": 2})
    await store.yield_job(
        f, step_id="w", name="w",
        info=WaitYield(event="approved", timeout_at=time.time() + 60, match="data.k", match_value=2),
    )
    detail = await store.get_run(f.run_id)
    (step,) = [st for st in detail.steps if st.step_id == "w"]
    assert step.status == "completed" and step.output["data"] == {"k": 2}
    assert detail.queue is not None and detail.queue.reason == "resume"


async def test_an_event_from_before_the_segment_started_does_not_complete_a_wait(store):
    s = await worker(store, fn("f"), fn("g", "approved"), slots=1)
    await emit(store, "approved", data={"k": 1})
    await store.advance_clock(1)
    f = await running(store, s)
    await store.yield_job(
        f, step_id="w", name="w", info=WaitYield(event="approved", timeout_at=time.time() + 60)
    )
    (step,) = [st for st in (await store.get_run(f.run_id)).steps if st.step_id == "w"]
    assert step.status == "waiting"


# ── in_order: a run's messages chained into one group commit ────────────────


async def test_calls_in_order_see_each_others_writes_and_fail_only_alone(store):
    s = await worker(store, slots=1)
    await emit(store)
    (res,) = await reserve(store, s)
    f = fence_of(res)
    stale = Fence(f.session_id, f.run_id, f.execution_seq, "f" * 32)
    outcomes = await store.in_order([
        # Activation, then a step under the lease it creates (same group).
        lambda: store.activate_lease(f, lease_expiry_s=LEASE),
        lambda: store.record_step(f, step_id="s1", name="one", status="completed", output=1),
        # A forged token: refused on its own, nothing else undone.
        lambda: store.record_step(stale, step_id="s2", name="two", status="completed"),
        lambda: store.record_step(f, step_id="s3", name="three", status="completed", output=3),
        lambda: store.complete_job(f, {"done": True}),
        # After the completion the fence is spent.
        lambda: store.record_step(f, step_id="s4", name="four", status="completed"),
    ])
    assert outcomes[0].unwrap().status == "running"
    assert outcomes[1].unwrap() is None and outcomes[3].unwrap() is None
    for refused in (outcomes[2], outcomes[5]):
        with pytest.raises(StaleExecution):
            refused.unwrap()
    assert outcomes[4].unwrap().status == "completed"
    detail = await store.get_run(f.run_id)
    assert detail.run.status == "completed" and detail.run.output == {"done": True}
    assert [(st.step_id, st.output) for st in detail.steps] == [("s1", 1), ("s3", 3)]
    assert await store.list_leases() == [] and (await store.list_sessions())[0].credits_claimed == 0


async def test_calls_in_order_that_need_no_transaction_or_fail_early_do_not_hold_the_rest(store):
    f = await running(store)

    async def no_store_call() -> str:
        await trio.sleep(0)
        return "nothing"

    async def fails_before_its_transaction() -> None:
        raise ValueError("bad input")

    outcomes = await store.in_order([
        no_store_call,
        fails_before_its_transaction,
        lambda: store.record_step(f, step_id="s1", name="one", status="completed", output=1),
    ])
    assert outcomes[0].unwrap() == "nothing"
    with pytest.raises(ValueError, match="bad input"):
        outcomes[1].unwrap()
    assert outcomes[2].unwrap() is None
    assert [st.step_id for st in (await store.get_run(f.run_id)).steps] == ["s1"]


async def test_record_steps_writes_several_results_in_order_or_none_when_stale(store):
    f = await running(store)
    await store.record_step(f, step_id="s1", name="one", status="completed", output={"v": 1})
    await store.record_steps(f, [
        StepResult("s1", "one", "completed", {"v": "replayed"}),  # completed: kept as it was
        StepResult("s2", "two", "failed", error=ErrorInfo("boom", code="E")),
        StepResult("s3", "three", "completed", [3], duration_ms=1.5),
        StepResult("s2", "two", "completed", "second try"),  # the same id twice in one call
    ])
    detail = await store.get_run(f.run_id)
    assert [(s.step_id, s.status, s.output) for s in detail.steps] == [
        ("s1", "completed", {"v": 1}),
        ("s2", "completed", "second try"),
        ("s3", "completed", [3]),
    ]
    stale = Fence(f.session_id, f.run_id, f.execution_seq, "f" * 32)
    with pytest.raises(StaleExecution):
        await store.record_steps(stale, [StepResult("s4", "four", "completed"), StepResult("s5", "five", "completed")])
    await store.record_steps(f, [StepResult("s6", "six", "completed", 6), StepResult("s7", "seven", "completed", 7)])
    await store.complete_job(f, None)
    with pytest.raises(StaleExecution):
        await store.record_steps(f, [StepResult("s8", "eight", "completed"), StepResult("s9", "nine", "completed")])
    assert [s.step_id for s in (await store.get_run(f.run_id)).steps] == ["s1", "s2", "s3", "s6", "s7"]


async def test_a_give_back_after_an_outage_extends_every_nodes_leases_once(store):
    """Two nodes blind through one outage: the first back extends the second's
    leases too (its scanner must not expire them while the second reconnects),
    and the second, back just after, extends only what was not given back."""
    s1 = await worker(store, fn("f", "order.created"), slots=1, node="n1")
    s2 = await worker(store, fn("f", "order.created"), slots=1, node="n2")
    f1 = await running(store, s1)
    f2 = await running(store, s2)

    async def expiry(run_id: str) -> float:
        return next(lease.expires_at for lease in await store.list_leases() if lease.run_id == run_id)

    before = {r: await expiry(r) for r in (f1.run_id, f2.run_id)}
    extended = await store.give_back_blind_time("n1", 10.0)
    assert extended == 2  # node n2's lease too
    first = {r: await expiry(r) for r in before}
    assert all(first[r] - before[r] == pytest.approx(10.0, abs=0.5) for r in before)
    await store.give_back_blind_time("n2", 10.0)  # the same outage, seen from n2
    second = {r: await expiry(r) for r in before}
    assert all(second[r] - first[r] < 0.5 for r in before)  # not given twice
    audit = [a for a in await store.list_audit(type="store.outage.blind_time_given_back")]
    assert [a.data["node_id"] for a in audit].count("n1") == 1
