"""PostgreSQL-only behaviour: several nodes claiming from one database."""

from __future__ import annotations

import pytest
import trio

from ironflow.protocol import Concurrency, FunctionDef, Trigger
from ironflow.store import Reservation, open_store
from ironflow.store.core import JANITOR_LOCK
from tests.clock import open_test_store


async def test_concurrent_reservations_from_two_nodes_never_share_a_row(pg_url):
    nodes = [open_store(pg_url), open_store(pg_url)]
    for s in nodes:
        await s.open()
    try:
        fd = FunctionDef(id="f", triggers=[Trigger("e")])
        sessions = [
            await s.register_worker(
                node_id=f"n{i}",
                worker_id=f"w{i}",
                mode="stream",
                max_concurrent_jobs=200,
                functions=[fd],
                session_expiry_s=300,
            )
            for i, s in enumerate(nodes)
        ]
        for _ in range(150):
            await nodes[0].ingest_event("e", {}, None, idempotency_window_s=1)
        got: list[list[Reservation]] = [[], []]

        async def claim(i: int) -> None:
            offer = {sessions[i].session_id: frozenset({"f"})}
            for _ in range(20):
                got[i].extend(
                    await nodes[i].reserve_segments(f"n{i}", offer, 5, reservation_expiry_s=60)
                )

        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(claim, i)
        run_ids = [r.assignment.run_id for r in got[0] + got[1]]
        assert len(run_ids) == len(set(run_ids)) == 150
        assert got[0] and got[1]
        queue = await nodes[0].list_queue()
        owners = {q.run_id: q.reservation_owner for q in queue}
        for i in range(2):
            assert all(owners[r.assignment.run_id] == sessions[i].session_id for r in got[i])
    finally:
        for s in nodes:
            await s.close()


async def test_concurrency_limit_holds_across_two_nodes(pg_url):
    nodes = [open_store(pg_url), open_store(pg_url)]
    for s in nodes:
        await s.open()
    try:
        fd = FunctionDef(id="f", triggers=[Trigger("e")], concurrency=Concurrency(limit=3))
        sessions = [
            await s.register_worker(
                node_id=f"n{i}",
                worker_id=f"w{i}",
                mode="stream",
                max_concurrent_jobs=50,
                functions=[fd],
                session_expiry_s=300,
            )
            for i, s in enumerate(nodes)
        ]
        for _ in range(20):
            await nodes[0].ingest_event("e", {}, None, idempotency_window_s=1)
        got: list[Reservation] = []

        async def claim(i: int) -> None:
            offer = {sessions[i].session_id: frozenset({"f"})}
            for _ in range(5):
                got.extend(
                    await nodes[i].reserve_segments(f"n{i}", offer, 10, reservation_expiry_s=60)
                )

        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(claim, i)
        assert len(got) == 3
    finally:
        for s in nodes:
            await s.close()


async def test_cancelled_caller_leaves_the_pool_usable(pg_url):
    store = open_store(pg_url)
    await store.open()
    try:
        for _ in range(20):
            with trio.move_on_after(0.0005):
                await store.ingest_event("e", {}, None, idempotency_window_s=1)
        assert await store.db_now() > 1e9
        assert len(await store.list_runs()) == 0
    finally:
        await store.close()


async def test_a_node_finds_the_janitor_lock_taken_and_deletes_nothing(pg_url):
    import psycopg

    store = open_test_store(pg_url)
    await store.open()
    try:
        await store.ingest_event("nobody.listens", {}, None, idempotency_window_s=1)
        await store.advance_clock(10)
        with psycopg.connect(pg_url) as other_node, other_node.transaction():
            other_node.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (JANITOR_LOCK,))
            counts = await store.purge_history(older_than_s=1, idempotency_window_s=1, batch=10)
            assert counts.locked_out and counts.total == 0
        counts = await store.purge_history(older_than_s=1, idempotency_window_s=1, batch=10)
        assert not counts.locked_out and counts.events == 1
    finally:
        await store.close()


async def test_an_operator_purge_waits_for_the_other_nodes_batch(pg_url):
    import psycopg

    store = open_test_store(pg_url)
    await store.open()
    try:
        await store.ingest_event("nobody.listens", {}, None, idempotency_window_s=1)
        await store.advance_clock(10)
        done: list[int] = []

        async def operator_purge() -> None:
            counts = await store.purge_history(
                older_than_s=1, idempotency_window_s=1, batch=10, wait_for_lock=True
            )
            done.append(counts.events)

        other_node = psycopg.connect(pg_url)
        try:
            other_node.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (JANITOR_LOCK,))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(operator_purge)
                await trio.sleep(0.3)
                assert done == []  # still waiting for the lock
                other_node.commit()
        finally:
            other_node.close()
        assert done == [1]
    finally:
        await store.close()


async def _park_sleeps(store, n: int, until: float) -> list[str]:
    """``n`` runs, each parked in a sleep step due at ``until``; their run ids."""
    from ironflow.protocol import SleepYield
    from ironflow.store import Fence

    fd = FunctionDef(id="sleeper", triggers=[Trigger("nap")])
    session = await store.register_worker(
        node_id="n0", worker_id="w", mode="stream", max_concurrent_jobs=n, functions=[fd], session_expiry_s=600
    )
    for _ in range(n):
        await store.ingest_event("nap", {}, None, idempotency_window_s=1)
    run_ids = []
    offer = {session.session_id: frozenset({"sleeper"})}
    while len(run_ids) < n:
        for res in await store.reserve_segments("n0", offer, 100, reservation_expiry_s=60):
            a = res.assignment
            fence = Fence(session.session_id, a.run_id, a.execution_seq, a.lease_token)
            await store.activate_lease(fence, lease_expiry_s=600)
            await store.yield_job(fence, step_id="nap", name="nap", info=SleepYield(until=until))
            run_ids.append(a.run_id)
    return run_ids


@pytest.mark.parametrize("lookahead_s", [0.0, 60.0])
async def test_two_nodes_wakers_racing_claim_and_resume_each_sleep_exactly_once(pg_url, lookahead_s):
    nodes = [open_store(pg_url), open_store(pg_url)]
    for s in nodes:
        await s.open()
        await s.db_now()  # connected: neither waker's first claim waits for its connection
    try:
        now = await nodes[0].db_now()
        # All due at once: already, or (look-ahead) within the next 30 s.
        run_ids = await _park_sleeps(nodes[0], 300, now - 1 if not lookahead_s else now + 30)
        claimed: list[list[tuple[str, str]]] = [[], []]
        resumed: list[str] = []

        async def waker(i: int) -> None:
            while True:
                batch = await nodes[i].claim_elapsed_steps(f"n{i}", 25, lookahead_s=lookahead_s)
                if not batch:
                    return
                claimed[i].extend(batch)
                outcome = await nodes[i].resume_claimed_steps(f"n{i}", batch)
                assert outcome.lost == []
                resumed.extend(outcome.resumed)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waker, 0)
            nursery.start_soon(waker, 1)
        both = claimed[0] + claimed[1]
        assert len(both) == len(set(both)) == 300  # each claimed by exactly one node
        assert sorted(resumed) == sorted(run_ids)  # and resumed once
        assert claimed[0] and claimed[1]  # and both really raced
        for run_id in run_ids:
            detail = await nodes[0].get_run(run_id)
            (nap,) = [s for s in detail.steps if s.step_id == "nap"]
            assert nap.status == "completed"
            assert detail.queue is not None and detail.queue.reason == "resume"
    finally:
        for s in nodes:
            await s.close()


async def test_a_claim_left_by_a_dead_node_is_restored_and_resumed_once_by_another(pg_url):
    dead, survivor = open_store(pg_url), open_test_store(pg_url)
    for s in (dead, survivor):
        await s.open()
    try:
        now = await dead.db_now()
        (run_id,) = await _park_sleeps(dead, 1, now - 1)
        assert await dead.claim_elapsed_steps("dead-node", 10) == [(run_id, "nap")]
        # The dead node never resumes. Before the threshold nothing moves...
        assert await survivor.reset_stale_claims(threshold_s=60) == 0
        assert await survivor.claim_elapsed_steps("survivor", 10) == []
        await survivor.advance_clock(61)
        # ...after it, loop 2 restores the step and the survivor's waker takes it.
        assert await survivor.reset_stale_claims(threshold_s=60) == 1
        assert await survivor.claim_elapsed_steps("survivor", 10) == [(run_id, "nap")]
        assert (await survivor.resume_claimed_steps("survivor", [(run_id, "nap")])).resumed == [run_id]
        detail = await survivor.get_run(run_id)
        assert detail.queue is not None and detail.queue.reason == "resume"
        assert await survivor.claim_elapsed_steps("survivor", 10) == []  # resumed once
    finally:
        for s in (dead, survivor):
            await s.close()


def test_a_node_restarting_beside_running_ones_takes_no_table_lock(pg_url):
    """Found by scripts/chaos.py: a node restarted while another one wrote to
    the database died at start with ``deadlock detected``: its schema
    transaction took table locks (CREATE INDEX, ALTER TABLE) one after another
    while the running node's transactions held some and waited for others. A
    schema that is already current is now left alone, so a running node's open
    transaction cannot block a restart, let alone deadlock with it."""
    import threading

    import psycopg

    first = open_store(pg_url)
    trio.run(first.open)
    trio.run(first.close)
    # A running node's write transaction, left open: it holds ROW EXCLUSIVE on runs.
    with psycopg.connect(pg_url) as busy:
        busy.execute("UPDATE runs SET updated_at = updated_at WHERE id = 'none'")
        restarted = open_store(pg_url)
        opened = threading.Event()

        def restart() -> None:
            trio.run(restarted.open)
            opened.set()

        thread = threading.Thread(target=restart, daemon=True)
        thread.start()
        try:
            assert opened.wait(5.0), "the restarting node waited on a running node's lock"
        finally:
            busy.rollback()
            thread.join(10.0)
    trio.run(restarted.close)
