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
from ironflow.store.schema import _BACKFILL_TRIGGERS
from tests.clock import SkewedStore, open_test_store
from tests.store.pg_holds import lock_waiters, wait_until

MINUTELY = "0 * * * * *"  # second 0 of every minute
# Late, not missed, below this (the node's default is 1.5 s).
MISSED_AFTER = 1.5


def cron_fn(fid: str, cron: str = MINUTELY, *, events: tuple[str, ...] = (), **kw) -> FunctionDef:
    return FunctionDef(id=fid, triggers=[Trigger(cron=cron, **kw), *(Trigger(e) for e in events)])


async def register(store: Store, *functions: FunctionDef) -> None:
    await store.register_worker(
        node_id="n1", worker_id="w1", mode="stream", max_concurrent_jobs=2,
        functions=list(functions), session_expiry_s=600,
    )


async def schedules(store: Store) -> dict[str, list[FunctionSchedule]]:
    return {f.id: f.schedules for f in await store.list_functions() if f.schedules}


async def next_at(store: Store, fid: str) -> float:
    return (await schedules(store))[fid][0].next_at


async def advance_to(store: SkewedStore, at: float) -> None:
    """Move the database clock to epoch ``at`` (forward only)."""
    now = await store.db_now()
    assert at >= now
    await store.advance_clock(at - now)


async def fire(store: Store, missed_after_s: float = MISSED_AFTER):
    return await store.fire_due_ticks("n1", limit=100, missed_after_s=missed_after_s)


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
        tx.execute(_BACKFILL_TRIGGERS[dialect])
        return tx.fetchall("SELECT pattern, function_id FROM function_triggers ORDER BY 1, 2")

    assert await store._transact(backfill) == [("order.created", "mixed")]  # type: ignore[attr-defined]
    listed = {f.id: f for f in await store.list_functions()}
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
    listed = {f.id: f for f in await store.list_functions()}
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
