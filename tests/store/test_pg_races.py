"""The PostgreSQL races of docs/isolation.md, one regression test each, every
interleaving forced — a second connection holding a row or lock, or a hook
run inside the transaction between two of its statements — never a sleep.

Each was seen failing on the code before its fix (``4a4dd38``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
import trio

from ironflow.protocol import ActiveJob, FunctionDef, SleepYield, Trigger
from ironflow.store import StaleExecution, StepResult
from ironflow.store.postgres import PostgresStore
from tests.store.pg_holds import (
    FUNCTION,
    HOOK_WAIT_S,
    HookedStore,
    beside_a_holder,
    lock_waiters,
    reserved,
    running,
    session_of,
    step_status,
    wait_for,
    wait_until,
)
from tests.store.pg_holds import store as store  # the HookedStore fixture


async def test_an_ack_of_a_removed_session_leaves_its_run_recoverable(store, pg_url):
    """The session expired (its row deleted, as ``expire_sessions`` does, its
    reservations left to expire) between the reservation and the ack; the ack
    arrives in a burst with another session's (the one-statement form). It
    must be refused and must not take the queue row: a run with neither queue
    row nor lease is found by no scanner."""
    gone = await session_of(store, [FUNCTION])
    other = await session_of(store, [FUNCTION])
    [stranded] = await reserved(store, gone, 1)
    [fine] = await reserved(store, other, 1)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("DELETE FROM worker_credits WHERE session_id = %s", (gone,))
        conn.execute("DELETE FROM worker_sessions WHERE id = %s", (gone,))
    results = await store.activate_leases([stranded, fine], lease_expiry_s=600)
    assert isinstance(results[0].error, StaleExecution)  # type: ignore[union-attr]
    assert results[1].unwrap().status == "running"
    queued = {q.run_id for q in await store.list_queue()}
    leased = {lease.run_id for lease in await store.list_leases()}
    assert stranded.run_id in queued | leased, "run stranded: neither queued nor leased"


# ── race 2: a matching event skips a wait row another transaction holds ────

async def test_a_matching_event_waits_for_a_wait_row_held_by_another_transaction(store, pg_url):
    [fence] = await running(store, 1)
    await store.yield_job(fence, step_id="w", name="w", info=wait_for(7))
    holder = psycopg.connect(pg_url)  # a concurrent timeout/cancel/ingest holding the row
    try:
        holder.execute("SELECT 1 FROM steps WHERE run_id = %s FOR UPDATE", (fence.run_id,))
        result: list[Any] = []

        async def emit() -> None:
            result.append(
                await store.ingest_event("race.go", {"k": 7}, None, idempotency_window_s=60)
            )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(emit)
            # Either the ingest waits for the held row, or it finished without it.
            blocked = await trio.to_thread.run_sync(
                lambda: wait_until(lambda: bool(result) or lock_waiters(pg_url) > 0)
            )
            assert blocked
            finished_while_held = bool(result)
            holder.commit()  # the holder changed nothing
        assert not finished_while_held, "the ingest passed a wait row it could not lock"
        assert result[0].resumed_run_ids == [fence.run_id]
        assert await step_status(store, fence.run_id, "w") == "completed"
    finally:
        holder.close()


async def test_an_ingest_does_not_touch_the_waits_its_event_does_not_match(store, pg_url):
    """Key 7's event never waits for (or locks) key 8's wait."""
    fences = await running(store, 2)
    await store.yield_job(fences[0], step_id="w", name="w", info=wait_for(7))
    await store.yield_job(fences[1], step_id="w", name="w", info=wait_for(8))
    holder = psycopg.connect(pg_url)
    try:
        holder.execute("SELECT 1 FROM steps WHERE run_id = %s FOR UPDATE", (fences[1].run_id,))
        with trio.fail_after(HOOK_WAIT_S):
            done = await store.ingest_event("race.go", {"k": 7}, None, idempotency_window_s=60)
        assert done.resumed_run_ids == [fences[0].run_id]
    finally:
        holder.close()
    assert await step_status(store, fences[1].run_id, "w") == "waiting"


# ── race 3: a park and a concurrent ingest of its event miss each other ────

async def test_a_wait_parked_while_its_event_is_ingested_receives_it(store, pg_url):
    """The ingest has read the parked waits (none yet) and not committed when
    the park inserts its wait and looks back: each must see the other."""
    [fence] = await running(store, 1)
    ingest_read = threading.Event()
    park_done = threading.Event()
    outcome: dict[str, Any] = {}

    def before(sql: str) -> None:
        # The ingest's last statement is its events INSERT (after it read the
        # waits); hold its transaction open there until the park is done or waits.
        if "INSERT INTO events" in sql and not ingest_read.is_set():
            ingest_read.set()
            outcome["park_waited"] = wait_until(
                lambda: park_done.is_set() or lock_waiters(pg_url) > 0
            ) and not park_done.is_set()

    async def emit() -> None:
        outcome["ingest"] = await store.ingest_event(
            "race.go", {"k": 7}, None, idempotency_window_s=60
        )

    async def park() -> None:
        await trio.to_thread.run_sync(ingest_read.wait, HOOK_WAIT_S)
        store.before = None
        outcome["park"] = await store.yield_job(fence, step_id="w", name="w", info=wait_for(7))
        park_done.set()

    store.before = before
    async with trio.open_nursery() as nursery:
        nursery.start_soon(emit)
        nursery.start_soon(park)
    assert ingest_read.is_set()
    assert await step_status(store, fence.run_id, "w") == "completed", (
        f"the event was lost for the wait (park waited for the ingest: {outcome.get('park_waited')})"
    )


async def test_an_event_received_before_the_segment_began_and_committed_after_it_resolves_its_wait(
    store, pg_url
):
    """The ingest began (its ``received_at``) before the segment's activation
    and committed after it: by commit order it came while the segment ran, so
    the wait the segment parks receives it."""
    session_id = await session_of(store, [FUNCTION])
    [fence] = await reserved(store, session_id, 1)
    ingest_open = threading.Event()
    activated = threading.Event()

    def before(sql: str) -> None:
        if "INSERT INTO events" in sql and not ingest_open.is_set():
            ingest_open.set()
            activated.wait(HOOK_WAIT_S)

    async def emit() -> None:
        await store.ingest_event("race.go", {"k": 7}, None, idempotency_window_s=60)

    async def activate() -> None:
        await trio.to_thread.run_sync(ingest_open.wait, HOOK_WAIT_S)
        store.before = None
        await store.activate_lease(fence, lease_expiry_s=600)
        activated.set()

    store.before = before
    async with trio.open_nursery() as nursery:
        nursery.start_soon(emit)
        nursery.start_soon(activate)
    await store.yield_job(fence, step_id="w", name="w", info=wait_for(7))
    assert await step_status(store, fence.run_id, "w") == "completed"


async def test_the_look_back_finds_a_match_behind_more_non_matching_events_than_a_page(store):
    [fence] = await running(store, 1)
    # A segment long enough for 250 other keys' events before its own.
    for k in range(250):
        await store.ingest_event("race.go", {"k": 1000 + k}, None, idempotency_window_s=60)
    await store.ingest_event("race.go", {"k": 7}, None, idempotency_window_s=60)
    await store.yield_job(fence, step_id="w", name="w", info=wait_for(7))
    assert await step_status(store, fence.run_id, "w") == "completed"


# ── race 4: a many-segment step write reported stale after it was written ──

def _kill_lease_now(url: str, run_id: str) -> bool:
    """Delete ``run_id``'s lease from another connection unless a transaction
    holds it (NOWAIT): what a cancel or loop 1 does. Whether it was deleted."""
    with psycopg.connect(url, autocommit=True) as conn:
        try:
            conn.execute(
                "DELETE FROM concurrency_leases WHERE run_id IN (SELECT run_id FROM"
                " concurrency_leases WHERE run_id = %s FOR UPDATE NOWAIT)",
                (run_id,),
            )
            return True
        except psycopg.errors.LockNotAvailable:
            return False


async def test_a_step_write_told_stale_wrote_nothing(store, pg_url):
    """Two segments' step results in one call, one of them partly a replay (so
    fewer rows are written than sent); the first segment's lease is deleted by
    another connection right after the INSERT, before the commit. Whatever the
    verdict, it must agree with the rows: stale means nothing written."""
    fences = await running(store, 2)
    await store.record_steps(fences[0], [StepResult("s1", "one", "completed", 1)])
    kills: list[bool] = []
    inserted: list[bool] = []

    def kill_once() -> None:
        if inserted and not kills:
            kills.append(_kill_lease_now(pg_url, fences[0].run_id))

    def before(sql: str) -> None:
        kill_once()  # ahead of whatever statement follows the INSERT
        if "INSERT INTO steps" in sql:
            inserted.append(True)

    store.before, store.after = before, kill_once
    results = await store.record_steps_many([
        (fences[0], [StepResult("s1", "one", "completed", 1), StepResult("s2", "two", "completed", 2)]),
        (fences[1], [StepResult("s1", "one", "completed", 1)]),
    ])
    store.before = store.after = None
    assert kills, "the interleaving did not happen"
    written = await step_status(store, fences[0].run_id, "s2")
    if isinstance(results[0], type(results[1])):  # a Value: accepted
        assert written == "completed"
    else:
        assert written is None, "told stale, yet its step row was written"
    assert results[1].unwrap() is None


# ── race 5: a fenced write commits after its run's cancel ──────────────────

async def test_a_cancel_waits_for_a_step_write_whose_fence_check_passed(store, pg_url):
    """Another node cancels the run while a step write whose fence check
    passed has not committed: the cancel must wait for that commit (or the
    write must fail), never commit first and leave the row to land after."""
    [fence] = await running(store, 1)
    other = PostgresStore(pg_url)  # another node
    await other.open()
    written = threading.Event()
    cancel_done = threading.Event()
    seen: dict[str, bool] = {}

    def hold() -> None:
        written.set()
        seen["cancel_committed_first"] = wait_until(
            lambda: cancel_done.is_set() or lock_waiters(pg_url) > 0
        ) and cancel_done.is_set()

    async def write() -> None:
        await store.record_steps(fence, [StepResult("last", "last", "completed", 1)])

    async def cancel() -> None:
        await trio.to_thread.run_sync(written.wait, HOOK_WAIT_S)
        store.after = None
        await other.cancel_run(fence.run_id, "at the last step")
        cancel_done.set()

    try:
        store.after = hold
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write)
            nursery.start_soon(cancel)
        assert written.is_set()
        assert not seen["cancel_committed_first"], "a step row committed after its run's cancel"
        assert (await store.get_run(fence.run_id)).run.status == "cancelled"
    finally:
        await other.close()


# ── race 6: grouped ingests with idempotency keys deadlock ─────────────────

def _deadlocks(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        return int(row[0]) if row else 0


async def test_two_nodes_ingesting_keys_in_opposite_orders_do_not_deadlock(pg_url):
    nodes = [HookedStore(pg_url), HookedStore(pg_url)]
    for node in nodes:
        await node.open()
    try:
        at_first_key = threading.Barrier(2, timeout=2.0)
        passed: list[bool] = []

        def hook(sql: str) -> None:
            # Each call, having taken its first key's lock, waits for the other to
            # take its own: the interleaving that deadlocks when locks are taken
            # as each event is ingested.
            if "idempotency_key = ?" in sql and len(passed) < 2:
                try:
                    at_first_key.wait()
                    passed.append(True)
                except threading.BrokenBarrierError:
                    passed.append(False)

        for node in nodes:
            node.before = hook
        before = _deadlocks(pg_url)
        results: list[Any] = [None, None]

        async def emit(i: int, keys: list[str]) -> None:
            results[i] = await nodes[i].ingest_events(
                [("race.keyed", {"key": key}, key) for key in keys], idempotency_window_s=60
            )

        # pg_stat_database counts a deadlock when PostgreSQL breaks it
        # (deadlock_timeout, 1 s): both calls finish either way, retried.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(emit, 0, ["K1", "K2"])
            nursery.start_soon(emit, 1, ["K2", "K1"])
        # The statistics collector reports at its next flush.
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute("SELECT pg_stat_force_next_flush()")
        assert _deadlocks(pg_url) == before, "the two groups deadlocked on idempotency locks"
        ids = {results[0][0].event_id, results[0][1].event_id}
        assert {r.event_id for r in results[1]} == ids  # one event per key, found by the other
    finally:
        for node in nodes:
            await node.close()


# ── the bind-parameter limit ───────────────────────────────────────────────

async def test_a_batch_of_7000_step_results_goes_through_in_chunks(store):
    fences = await running(store, 2)
    many = [StepResult(f"s{i}", f"s{i}", "completed", i) for i in range(3500)]
    results = await store.record_steps_many([(fence, many) for fence in fences])
    assert all(r.unwrap() is None for r in results)
    for fence in fences:
        assert len((await store.get_run(fence.run_id)).steps) == 3500


async def test_a_sleep_parked_beside_waits_is_unaffected(store):
    fences = await running(store, 2)
    await store.yield_job(fences[0], step_id="w", name="w", info=wait_for(7))
    await store.yield_job(fences[1], step_id="z", name="z", info=SleepYield(until=time.time() + 600))
    done = await store.ingest_event("race.go", {"k": 7}, None, idempotency_window_s=60)
    assert done.resumed_run_ids == [fences[0].run_id]
    assert await step_status(store, fences[1].run_id, "z") == "sleeping"


# ── the name lock: only a park of the same name holds an ingest back ──────

@pytest.mark.parametrize(
    ("held", "exclusive", "blocks"),
    [
        ("wait:race.go", False, False),  # another ingest of the name: never waited for
        ("wait:other.name", True, False),  # a park on another name
        ("wait:race.go", True, True),  # a park on this name: the ingest starts after it
    ],
)
async def test_an_ingest_waits_only_for_a_park_of_its_own_event_name(store, pg_url, held, exclusive, blocks):
    from ironflow.store.core import lock_id

    holder = psycopg.connect(pg_url)
    try:
        holder.execute(
            f"SELECT pg_advisory_xact_lock{'' if exclusive else '_shared'}(%s)", (lock_id(held),)
        )
        done: list[Any] = []

        async def emit() -> None:
            done.append(await store.ingest_event("race.go", {"k": 1}, None, idempotency_window_s=60))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(emit)
            settled = await trio.to_thread.run_sync(
                lambda: wait_until(lambda: bool(done) or lock_waiters(pg_url) > 0)
            )
            assert settled
            waited = not done
            holder.commit()
        assert waited is blocks
    finally:
        holder.close()


async def test_a_group_of_emits_whose_runs_exceed_one_statements_parameters_goes_through(store):
    """300 events each starting 12 runs: 33,900 parameters in one INSERT would
    pass the chunk bound; written in halves, every run is created once."""
    functions = [FunctionDef(id=f"fan{i}", triggers=[Trigger("fan.out")]) for i in range(12)]
    await session_of(store, functions)
    results = await store.ingest_events(
        [("fan.out", {"n": i}, None) for i in range(300)], idempotency_window_s=60
    )
    assert [len(r.run_ids) for r in results] == [12] * 300
    assert len({run_id for r in results for run_id in r.run_ids}) == 3600
    assert len(await store.list_queue()) == 3600


async def test_two_nodes_giving_back_one_outages_blind_time_take_turns(store, pg_url):
    """Another node is giving back the same outage (its transaction holds the
    blind_time row, has recorded how far it gave back, and has not committed):
    this node's give-back waits for it and then extends nothing twice."""
    [fence] = await running(store, 1)
    before = next(lease.expires_at for lease in await store.list_leases() if lease.run_id == fence.run_id)
    other = psycopg.connect(pg_url)
    try:
        other.execute("SELECT given_until FROM blind_time WHERE id = 1 FOR UPDATE")
        other.execute("UPDATE blind_time SET given_until = ironflow_now() WHERE id = 1")
        other.execute("UPDATE concurrency_leases SET expires_at = expires_at + 10")
        done: list[int] = []

        async def give_back() -> None:
            done.append(await store.give_back_blind_time("n-late", 10.0))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(give_back)
            settled = await trio.to_thread.run_sync(
                lambda: wait_until(lambda: bool(done) or lock_waiters(pg_url) > 0)
            )
            assert settled and not done, "the give-back did not wait for the other node's"
            other.commit()
    finally:
        other.close()
    after = next(lease.expires_at for lease in await store.list_leases() if lease.run_id == fence.run_id)
    assert after - before == pytest.approx(10.0, abs=0.5)  # the other node's 10 s, not 20


# ── a heartbeat never waits for a lease while holding others ───────────────

def _lease_expiry(url: str, run_id: str) -> float:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT expires_at FROM concurrency_leases WHERE run_id = %s", (run_id,)).fetchone()
        assert row is not None
        return float(row[0])


@pytest.mark.parametrize("with_jobs", [True, False], ids=["job-list", "no-job-list"])
async def test_a_heartbeat_skips_a_lease_another_transaction_is_deleting(store, pg_url, with_jobs):
    """A second connection holds the first lease locked as a job result's
    DELETE does, then wants the second one (a group whose calls come in the
    other order). The heartbeat must not wait for the first while it holds the
    second: it renews the free lease, reports the locked one REFRESHED (it is
    live), and commits with the lock still held. Waiting, it was a deadlock."""
    first, second = await running(store, 2)
    jobs = [
        ActiveJob(job_id=f"j{i}", run_id=f.run_id, execution_seq=f.execution_seq, lease_token=f.lease_token)
        for i, f in enumerate([second, first])  # the worker's order, not the run ids'
    ]
    before = _lease_expiry(pg_url, second.run_id)
    with psycopg.connect(pg_url) as holder:
        held = holder.execute(
            "SELECT expires_at FROM concurrency_leases WHERE run_id = %s FOR UPDATE", (first.run_id,)
        ).fetchone()
        assert held is not None
        states, waited = await beside_a_holder(pg_url, holder, lambda: store.heartbeat(
            second.session_id, jobs if with_jobs else None, session_expiry_s=600, lease_expiry_s=900
        ))
        assert not waited, "the heartbeat waited for a lease another transaction holds"
        # Committed while the first lease is still locked: the holder takes
        # the second without waiting for anyone.
        holder.execute("SET lock_timeout = '1s'")
        holder.execute("SELECT 1 FROM concurrency_leases WHERE run_id = %s FOR UPDATE", (second.run_id,))
        assert _lease_expiry(pg_url, first.run_id) == float(held[0]), "a locked lease was renewed"
        holder.rollback()
    assert _lease_expiry(pg_url, second.run_id) > before
    if with_jobs:
        assert [(s.run_id, s.state) for s in states] == [
            (second.run_id, "REFRESHED"), (first.run_id, "REFRESHED")
        ]


async def test_a_heartbeat_renews_a_lease_a_step_write_holds(store, pg_url):
    """A step write holds its lease ``FOR KEY SHARE`` until it commits: that
    is no reason to skip the lease (a long step streak would starve it)."""
    [fence] = await running(store, 1)
    job = ActiveJob(job_id="j", run_id=fence.run_id, execution_seq=fence.execution_seq, lease_token=fence.lease_token)
    before = _lease_expiry(pg_url, fence.run_id)
    with psycopg.connect(pg_url) as holder:
        holder.execute("SELECT 1 FROM concurrency_leases WHERE run_id = %s FOR KEY SHARE", (fence.run_id,))
        [state], waited = await beside_a_holder(pg_url, holder, lambda: store.heartbeat(
            fence.session_id, [job], session_expiry_s=600, lease_expiry_s=900
        ))
        holder.rollback()
    assert not waited, "the heartbeat waited for a step write's key share lock"
    assert state.state == "REFRESHED"
    assert _lease_expiry(pg_url, fence.run_id) > before
