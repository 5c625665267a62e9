"""Cron ticks and function pause/resume in the store (ironflow/store/cron.py),
once per backend; the PostgreSQL interleavings with a second connection."""

from __future__ import annotations

import threading
from datetime import datetime
from zoneinfo import ZoneInfo

import psycopg
import pytest
import trio

from ironflow.protocol import FunctionDef, FunctionSchedule, Trigger
from ironflow.protocol.cron import CRON_EVENT, MAX_CATCHUP_TICKS, next_tick
from ironflow.store import FunctionNotFound, Store
from ironflow.store.core import Tx
from ironflow.store.schema import BACKFILL_TRIGGERS
from tests.clock import SkewedStore, open_test_store
from tests.store.pg_holds import lock_waiters, wait_until

MINUTELY = "0 * * * * *"  # second 0 of every minute
# Late, not missed, below this (the node's default is 1.5 s).
MISSED_AFTER = 1.5
# Liveness is not what most tests here are about: a window no test outlasts.
ALWAYS_LIVE = 10.0**9
# The liveness window of the tests that are about it (limits.function_live_s).
LIVE = 300.0


def cron_fn(fid: str, cron: str = MINUTELY, *, events: tuple[str, ...] = (), **kw) -> FunctionDef:
    return FunctionDef(id=fid, triggers=[Trigger(cron=cron, **kw), *(Trigger(e) for e in events)])


async def register(store: Store, *functions: FunctionDef) -> None:
    await store.register_worker(
        node_id="n1", worker_id="w1", mode="stream", max_concurrent_jobs=2,
        functions=list(functions), session_expiry_s=600,
    )


async def schedules(store: Store) -> dict[str, list[FunctionSchedule]]:
    return {f.id: f.schedules for f in await store.list_functions(live_within_s=ALWAYS_LIVE) if f.schedules}


async def next_at(store: Store, fid: str) -> float:
    return (await schedules(store))[fid][0].next_at


async def advance_to(store: SkewedStore, at: float) -> None:
    """Move the database clock to epoch ``at`` (forward only)."""
    now = await store.db_now()
    assert at >= now
    await store.advance_clock(at - now)


async def fire(store: Store, missed_after_s: float = MISSED_AFTER, live_within_s: float = ALWAYS_LIVE):
    return await store.fire_due_ticks(
        "n1", limit=100, missed_after_s=missed_after_s, live_within_s=live_within_s
    )


async def runs_of(store: Store, fid: str):
    return await store.list_runs(function_id=fid, limit=1000)


async def test_a_tick_fires_once_at_its_time_with_an_ironflow_cron_event(store: SkewedStore) -> None:
    await register(store, cron_fn("nightly", "0 3 * * *", timezone="Europe/Paris"))
    first = await next_at(store, "nightly")
    assert first > await store.db_now()
    assert await fire(store) == []  # not due yet
    await advance_to(store, first + 0.2)
    [fired] = await fire(store)
    assert (fired.function_id, fired.scheduled_at) == ("nightly", first)
    assert await fire(store) == []  # the same tick never twice
    assert await next_at(store, "nightly") == next_tick("0 3 * * *", "Europe/Paris", first)
    detail = await store.get_run(fired.run_id)
    event = await store.get_event(detail.run.event_id)
    assert event.name == CRON_EVENT
    assert event.data["cron"] == "0 3 * * *" and event.data["timezone"] == "Europe/Paris"
    assert event.data["scheduled_at_epoch"] == first
    assert event.data["scheduled_at"].startswith(event.data["scheduled_at"][:10])
    assert event.data["scheduled_at"].endswith(("+01:00", "+02:00"))


async def test_missed_ticks_follow_the_catchup_policy(store: SkewedStore) -> None:
    await register(
        store,
        cron_fn("latest"), cron_fn("none", catchup="none"), cron_fn("all", catchup="all"),
        cron_fn("windowed", catchup="all", catchup_window_s=185.0),
    )
    start = await next_at(store, "latest")
    # Ten ticks pass with no node up (start .. start + 540 s); back 10 s after the last.
    await advance_to(store, start + 550)
    fired = await fire(store)
    by_fn: dict[str, list[float]] = {}
    for f in fired:
        by_fn.setdefault(f.function_id, []).append(f.scheduled_at)
    assert by_fn["latest"] == [start + 540]
    assert "none" not in by_fn
    assert sorted(by_fn["all"]) == [start + 60 * i for i in range(10)]
    assert sorted(by_fn["windowed"]) == [start + 60 * i for i in range(7, 10)]
    for fid in ("latest", "none", "all", "windowed"):
        assert await next_at(store, fid) == start + 600
    assert await fire(store) == []
    missed = await store.list_audit(type="cron.ticks.missed")
    assert {a.function_id for a in missed} == {"latest", "none", "windowed"}


async def test_catchup_all_is_bounded(store: SkewedStore) -> None:
    await register(store, cron_fn("every-second", "* * * * * *", catchup="all"))
    start = await next_at(store, "every-second")
    await advance_to(store, start + MAX_CATCHUP_TICKS + 500)
    fired = await fire(store)
    assert len(fired) == MAX_CATCHUP_TICKS
    assert max(f.scheduled_at for f in fired) == start + MAX_CATCHUP_TICKS + 500


async def test_a_late_tick_is_not_a_missed_one(store: SkewedStore) -> None:
    await register(store, cron_fn("none", "* * * * * *", catchup="none"))
    start = await next_at(store, "none")
    await advance_to(store, start + 1.2)  # two ticks due, both under MISSED_AFTER old
    assert sorted(f.scheduled_at for f in await fire(store)) == [start, start + 1]


async def test_two_passes_at_once_start_one_run_per_tick(store: SkewedStore) -> None:
    await register(store, *(cron_fn(f"f{i}") for i in range(5)))
    await advance_to(store, await next_at(store, "f0") + 0.3)
    results: list[int] = []

    async def one_pass() -> None:
        results.append(len(await fire(store)))

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(one_pass)
    assert sum(results) == 5
    for i in range(5):
        assert len(await runs_of(store, f"f{i}")) == 1


async def test_reregistering_keeps_the_schedule_and_a_changed_cron_replaces_it(store: SkewedStore) -> None:
    await register(store, cron_fn("f"))
    first = await next_at(store, "f")
    await advance_to(store, first + 0.1)
    await register(store, cron_fn("f", catchup="all"))  # same cron: next_at kept, due now
    assert await next_at(store, "f") == first
    assert len(await fire(store)) == 1
    await register(store, cron_fn("f", "*/5 * * * * *"))
    [schedule] = (await schedules(store))["f"]
    assert schedule.cron == "*/5 * * * * *" and schedule.next_at > first
    await register(store, FunctionDef(id="f", triggers=[Trigger("x.y")]))
    assert "f" not in await schedules(store)


async def test_the_trigger_index_ignores_cron_triggers(store: SkewedStore) -> None:
    await register(store, cron_fn("mixed", events=("order.created",)), cron_fn("only-cron"))
    result = await store.ingest_event("order.created", {}, None, idempotency_window_s=60)
    assert [r.function_id for r in [await store.get_run_record(i) for i in result.run_ids]] == ["mixed"]
    dialect = "postgres" if store.shared_by_nodes else "sqlite"

    def backfill(tx: Tx) -> list[tuple]:
        tx.execute("DELETE FROM function_triggers")
        tx.execute(BACKFILL_TRIGGERS[dialect])
        return tx.fetchall("SELECT pattern, function_id FROM function_triggers ORDER BY 1, 2")

    assert await store._transact(backfill) == [("order.created", "mixed")]  # type: ignore[attr-defined]
    listed = {f.id: f for f in await store.list_functions(live_within_s=ALWAYS_LIVE)}
    assert [s.cron for s in listed["only-cron"].schedules] == [MINUTELY]


async def test_a_paused_function_starts_nothing_and_resume_replays_only_when_asked(
    store: SkewedStore,
) -> None:
    await register(store, cron_fn("f", events=("order.created",)), FunctionDef(id="g", triggers=[Trigger("order.*")]))
    assert await store.pause_function("f", by="k1") is True
    assert await store.pause_function("f", by="k1") is False
    result = await store.ingest_event("order.created", {"n": 1}, None, idempotency_window_s=60)
    assert result.paused_function_ids == ["f"]
    assert [(await store.get_run_record(r)).function_id for r in result.run_ids] == ["g"]
    [batch] = await store.ingest_events([("order.created", {}, None)], idempotency_window_s=60)
    assert batch.paused_function_ids == ["f"]
    listed = {f.id: f for f in await store.list_functions(live_within_s=ALWAYS_LIVE)}
    assert listed["f"].paused_at is not None and listed["g"].paused_at is None

    first = await next_at(store, "f")
    await advance_to(store, first + 60.5)  # two ticks pass while paused
    assert await fire(store) == []
    assert await next_at(store, "f") == first + 120  # skipped, not kept for later
    assert await store.resume_function("f", catchup=False, by="k1", node_id="n1") == (True, None)
    assert await runs_of(store, "f") == []
    assert await store.resume_function("f", catchup=True, by="k1", node_id="n1") == (False, None)

    await store.pause_function("f", by="k1")
    await advance_to(store, first + 180.5)  # the tick at first + 120 (and 180) pass paused
    assert await fire(store) == []
    changed, run_id = await store.resume_function("f", catchup=True, by="k1", node_id="n1")
    assert changed and run_id is not None
    event = await store.get_event((await store.get_run_record(run_id)).event_id)
    assert event.data["scheduled_at_epoch"] == first + 180
    # Resumed: ticks and events start runs again.
    await advance_to(store, first + 240.2)
    assert [f.function_id for f in await fire(store)] == ["f"]
    result = await store.ingest_event("order.created", {}, None, idempotency_window_s=60)
    assert result.paused_function_ids == [] and len(result.run_ids) == 2
    kinds = [a.type for a in await store.list_audit(limit=100) if a.function_id == "f"]
    assert kinds.count("function.paused") == 2 and kinds.count("function.resumed") == 2
    with pytest.raises(FunctionNotFound):
        await store.pause_function("nope", by="k1")
    with pytest.raises(FunctionNotFound):
        await store.resume_function("nope", catchup=False, by="k1", node_id="n1")


# ── schedules bound to a living function (ironflow/store/function_life.py) ──


async def leave(store: Store, session_id: str) -> None:
    """The worker of ``session_id`` disconnects (its session closed)."""
    await store.close_session(session_id, recover_leases=True, recovery_grace_s=30, recovery_ceiling=10)


async def connect(store: Store, *functions: FunctionDef) -> str:
    info = await store.register_worker(
        node_id="n1", worker_id="w1", mode="stream", max_concurrent_jobs=2,
        functions=list(functions), session_expiry_s=600,
    )
    return info.session_id


async def test_ticks_of_a_function_no_worker_served_within_the_window_are_skipped_then_caught_up(
    store: SkewedStore,
) -> None:
    fns = [cron_fn("latest"), cron_fn("none", catchup="none"), cron_fn("all", catchup="all")]
    session = await connect(store, *fns)
    start = await next_at(store, "latest")
    await leave(store, session)
    # Within the window after its worker left, a tick still starts a run (queued).
    await advance_to(store, start + 0.2)
    assert sorted(f.function_id for f in await fire(store, live_within_s=LIVE)) == ["all", "latest", "none"]
    # Past it: every tick is skipped, one pass a minute for ten minutes.
    gone_at = start + LIVE + 60
    for minute in range(10):
        await advance_to(store, gone_at + 60 * minute + 0.2)
        assert await fire(store, live_within_s=LIVE) == []
    [schedule] = (await schedules(store))["latest"]
    assert schedule.skip_reason == "NO_LIVE_WORKER" and schedule.skipped_since is not None
    assert schedule.last_tick_at == gone_at + 540
    assert schedule.skipped_ticks == (gone_at + 540 - schedule.skipped_since) / 60 + 1
    listed = {f.id: f for f in await store.list_functions(live_within_s=LIVE)}
    assert not listed["latest"].live
    # One audit record per run of skipped ticks, not one per tick.
    skipped = await store.list_audit(type="cron.ticks.skipped", limit=100)
    assert sorted(a.function_id for a in skipped) == ["all", "latest", "none"]
    assert {a.data["reason"] for a in skipped} == {"NO_LIVE_WORKER"}
    # A worker returns, 10 s after a tick: the schedule is due at once and its
    # catch-up policy decides, as for ticks missed with no node up.
    await advance_to(store, gone_at + 550)
    await connect(store, *fns)
    assert await next_at(store, "latest") <= await store.db_now()
    fired = await fire(store, live_within_s=LIVE)
    by_fn: dict[str, list[float]] = {}
    for f in fired:
        by_fn.setdefault(f.function_id, []).append(f.scheduled_at)
    since = schedule.skipped_since
    assert by_fn["latest"] == [gone_at + 540]
    assert "none" not in by_fn
    assert by_fn["all"] == [t for t in (since + 60 * i for i in range(20)) if t <= gone_at + 540]
    after = (await schedules(store))
    assert after["latest"][0].skip_reason is None and after["latest"][0].skipped_ticks == 0
    assert after["latest"][0].skipped_since is None
    assert after["none"][0].skip_reason == "MISSED" and after["none"][0].skipped_since is None
    # And its ticks start runs again.
    await advance_to(store, gone_at + 600.2)
    assert sorted(f.function_id for f in await fire(store, live_within_s=LIVE)) == ["all", "latest", "none"]


async def test_a_function_whose_worker_stays_connected_is_live_however_long_ago_it_registered(
    store: SkewedStore,
) -> None:
    await connect(store, cron_fn("f"))
    first = await next_at(store, "f")
    await advance_to(store, first + LIVE * 2 + 0.2)  # the session is kept alive (expiry 600 s)
    assert len(await fire(store, live_within_s=LIVE)) == 1


async def test_a_session_that_expired_counts_from_its_expiry_not_from_when_it_was_reaped(
    store: SkewedStore,
) -> None:
    info = await store.register_worker(
        node_id="n1", worker_id="w1", mode="pull", max_concurrent_jobs=1,
        functions=[cron_fn("f")], session_expiry_s=30,
    )
    assert info.secret is not None
    await advance_to(store, await store.db_now() + 30 + LIVE + 60)  # no scanner ran meanwhile
    assert await store.expire_sessions() == 1
    assert not {f.id: f for f in await store.list_functions(live_within_s=LIVE)}["f"].live
    await fire(store, live_within_s=LIVE)
    assert await runs_of(store, "f") == []
    assert (await schedules(store))["f"][0].skip_reason == "NO_LIVE_WORKER"


async def test_a_deleted_function_starts_no_run_and_a_registration_restores_it(store: SkewedStore) -> None:
    fd = cron_fn("f", events=("order.created",))
    session = await connect(store, fd)
    in_flight = await store.ingest_event("order.created", {}, None, idempotency_window_s=60)
    assert await store.delete_function("f", by="k1") is True
    assert await store.delete_function("f", by="k1") is False
    # Emits, ticks, invoke and rerun start nothing.
    assert (await store.ingest_event("order.created", {}, None, idempotency_window_s=60)).run_ids == []
    await advance_to(store, await store.db_now() + 120)
    assert await fire(store) == []
    with pytest.raises(FunctionNotFound, match="deleted"):
        await store.invoke_function("f", {})
    with pytest.raises(FunctionNotFound):
        await store.rerun(in_flight.run_ids[0])
    # Its run in flight is still queued for its worker; its definition is kept.
    [reserved] = await store.reserve_segments("n1", {session: frozenset({"f"})}, 5, reservation_expiry_s=30)
    assert reserved.assignment.run_id == in_flight.run_ids[0]
    everything = {f.id: f for f in await store.list_functions(live_within_s=ALWAYS_LIVE)}
    assert everything["f"].deleted_at is not None and everything["f"].definition == fd
    assert everything["f"].schedules == []
    # A worker registering it again brings it back, audited; no tick replayed.
    before = await store.db_now()
    await connect(store, fd)
    restored = {f.id: f for f in await store.list_functions(live_within_s=ALWAYS_LIVE)}["f"]
    assert restored.deleted_at is None and restored.version == 1
    assert await next_at(store, "f") > before
    assert await fire(store) == []
    assert len((await store.ingest_event("order.created", {}, None, idempotency_window_s=60)).run_ids) == 1
    kinds = [a.type for a in await store.list_audit(limit=100) if a.function_id == "f"]
    assert kinds.count("function.deleted") == 1 and kinds.count("function.restored") == 1
    with pytest.raises(FunctionNotFound):
        await store.delete_function("nope", by="k1")


# ── PostgreSQL: a second connection at the interleaving ─────────────────────


@pytest.fixture
async def pg_store(pg_url: str):
    s = open_test_store(pg_url)
    await s.open()
    try:
        yield s
    finally:
        await s.close()


async def test_pg_a_claim_racing_another_waits_on_the_tick_key_and_starts_nothing(
    pg_store: SkewedStore, pg_url: str
) -> None:
    """Another transaction claimed the tick and has not committed: this pass
    waits on cron_ticks' primary key, then inserts nothing and starts no run."""
    await register(pg_store, cron_fn("f"))
    tick = await next_at(pg_store, "f")
    await advance_to(pg_store, tick + 0.2)
    other = psycopg.connect(pg_url)
    try:
        other.execute(
            "INSERT INTO cron_ticks (function_id, scheduled_at, event_id, node_id, claimed_at)"
            " VALUES ('f', %s, 'evt_other', 'n2', 0)", (tick,),
        )
        committed = threading.Event()

        def commit_once_waited() -> None:
            assert wait_until(lambda: lock_waiters(pg_url) >= 1), "the pass never waited on the claim"
            other.commit()
            committed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, commit_once_waited)
            fired = await fire(pg_store)
        assert committed.is_set() and fired == []
        assert await runs_of(pg_store, "f") == []
        assert await next_at(pg_store, "f") == tick + 60
    finally:
        other.close()


async def test_pg_a_schedule_another_node_is_firing_is_skipped_not_waited_for(
    pg_store: SkewedStore, pg_url: str
) -> None:
    await register(pg_store, cron_fn("f"))
    tick = await next_at(pg_store, "f")
    await advance_to(pg_store, tick + 0.2)
    with psycopg.connect(pg_url) as other:
        other.execute("SELECT 1 FROM cron_schedules WHERE function_id = 'f' FOR UPDATE")
        assert await fire(pg_store) == []  # SKIP LOCKED: returns at once
        assert await next_at(pg_store, "f") == tick
        other.rollback()
    [fired] = await fire(pg_store)
    assert fired.scheduled_at == tick


# ── a DST day, in database time (Europe/Paris, 2027) ────────────────────────

PARIS = ZoneInfo("Europe/Paris")


def paris(*args: int, fold: int = 0) -> float:
    return datetime(*args, tzinfo=PARIS, fold=fold).timestamp()  # type: ignore[misc]


async def test_a_dst_day_fires_a_skipped_time_once_and_a_repeated_time_once(store: SkewedStore) -> None:
    """02:30 does not exist on 28 March 2027 (02:00 → 03:00): it fires once, at
    03:00. It exists twice on 31 October 2027 (03:00 → 02:00): it fires once."""
    await register(store, cron_fn("dst", "30 2 * * *", timezone="Europe/Paris", catchup="none"))
    await advance_to(store, paris(2027, 3, 28, 1, 0))
    await fire(store)  # the ticks missed to here: none, by the policy
    spring = paris(2027, 3, 28, 3, 0)
    assert await next_at(store, "dst") == spring
    await advance_to(store, spring + 0.5)
    assert [f.scheduled_at for f in await fire(store)] == [spring]
    assert await next_at(store, "dst") == paris(2027, 3, 29, 2, 30)

    await advance_to(store, paris(2027, 10, 31, 1, 0))
    await fire(store)
    first_pass = paris(2027, 10, 31, 2, 30)  # 02:30 CEST (+02:00)
    second_pass = paris(2027, 10, 31, 2, 30, fold=1)  # 02:30 CET (+01:00), an hour later
    assert second_pass - first_pass == 3600
    assert await next_at(store, "dst") == first_pass
    await advance_to(store, first_pass + 0.5)
    [fired] = await fire(store)
    assert fired.scheduled_at == first_pass
    assert await next_at(store, "dst") == paris(2027, 11, 1, 2, 30)
    await advance_to(store, second_pass + 0.5)
    assert await fire(store) == []
    event = await store.get_event((await store.get_run_record(fired.run_id)).event_id)
    assert event.data["scheduled_at"] == "2027-10-31T02:30:00+02:00"


async def test_pg_a_registration_racing_a_pass_that_skipped_its_ticks_makes_the_schedule_due(
    pg_store: SkewedStore, pg_url: str
) -> None:
    """A pass judged the function not live (another node's registration had
    not committed) and holds its schedule row: the registration waits on that
    row, then finds ``skipped_since`` set and makes the schedule due, so the
    catch-up is not left for the next tick."""
    session = await connect(pg_store, cron_fn("f"))
    await leave(pg_store, session)
    tick = await next_at(pg_store, "f")
    await advance_to(pg_store, tick + 0.2)
    other = psycopg.connect(pg_url)
    try:
        # What the pass writes: the tick skipped, next_at past it, uncommitted.
        other.execute(
            "UPDATE cron_schedules SET skipped_since = %s, next_at = %s, skip_reason = 'NO_LIVE_WORKER'"
            " WHERE function_id = 'f'", (tick, tick + 60),
        )
        committed = threading.Event()

        def commit_once_waited() -> None:
            assert wait_until(lambda: lock_waiters(pg_url) >= 1), "the registration never waited"
            other.commit()
            committed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, commit_once_waited)
            await connect(pg_store, cron_fn("f"))
        assert committed.is_set()
        assert await next_at(pg_store, "f") <= await pg_store.db_now()
        [fired] = await fire(pg_store, live_within_s=LIVE)
        assert fired.scheduled_at == tick
    finally:
        other.close()


async def test_pg_a_delete_waits_for_a_pass_firing_the_schedule_and_then_removes_it(
    pg_store: SkewedStore, pg_url: str
) -> None:
    await connect(pg_store, cron_fn("f"))
    tick = await next_at(pg_store, "f")
    await advance_to(pg_store, tick + 0.2)
    other = psycopg.connect(pg_url)
    try:
        other.execute("SELECT 1 FROM cron_schedules WHERE function_id = 'f' FOR UPDATE")  # a pass
        released = threading.Event()

        def release_once_waited() -> None:
            assert wait_until(lambda: lock_waiters(pg_url) >= 1), "the delete never waited"
            other.rollback()
            released.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, release_once_waited)
            assert await pg_store.delete_function("f", by="k1") is True
        assert released.is_set()
        assert await fire(pg_store) == [] and await runs_of(pg_store, "f") == []
    finally:
        other.close()


async def test_pg_two_nodes_agree_a_function_whose_worker_left_through_the_other_is_not_live(
    pg_store: SkewedStore, pg_url: str
) -> None:
    """The worker registered and left through node A; node B's passes skip the
    ticks once the window has passed, and catch up when it registers through A
    again: the decision reads only rows, never a node's memory."""
    node_b = open_test_store(pg_url)
    await node_b.open()
    try:
        session = await connect(pg_store, cron_fn("f"))
        start = await next_at(pg_store, "f")
        await leave(pg_store, session)
        await advance_to(pg_store, start + LIVE + 60.2)
        assert await fire(node_b, live_within_s=LIVE) == []
        assert (await schedules(node_b))["f"][0].skip_reason == "NO_LIVE_WORKER"
        await connect(pg_store, cron_fn("f"))
        [caught_up] = await fire(node_b, live_within_s=LIVE)
        assert caught_up.scheduled_at == start + LIVE + 60  # catchup="latest"
    finally:
        await node_b.close()
