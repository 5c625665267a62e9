"""The janitor in virtual time, on a real SQLite store running inline.

``ironflow_now()`` is ``BASE + trio.current_time()`` under
``MockClock(autojump_threshold=0)``, so a one-hour retention and a one-minute
janitor interval are exact: the test can say at which tick a run goes.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from actors import janitor
from ironflow.config import NodeConfig, Timings
from ironflow.engine import metrics
from ironflow.protocol import FunctionDef, SleepYield, Trigger
from ironflow.store import Fence, RunNotFound, Store
from tests.unit.virtual_time import BASE

HOUR = 3600.0
FN = FunctionDef(id="fn", triggers=[Trigger("go")])


# The test itself must take ``autojump_clock`` too: pytest-trio only runs a
# test on the clock when the test asks for it.


def config(**timings: Any) -> NodeConfig:
    window = timings.pop("idempotency_window_s", 2 * HOUR)
    return NodeConfig(
        idempotency_window_s=window,
        timings=Timings(**{"history_retention_s": HOUR, "janitor_interval_s": 60.0, **timings}),
    )


async def start_run(store: Store, session_id: str) -> Fence:
    await store.ingest_event("go", {}, None, idempotency_window_s=2 * HOUR)
    (res,) = await store.reserve_segments(
        "n1", {session_id: frozenset({"fn"})}, 1, reservation_expiry_s=10**6
    )
    a = res.assignment
    fence = Fence(session_id, a.run_id, a.execution_seq, a.lease_token)
    await store.activate_lease(fence, lease_expiry_s=10**6)
    return fence


async def register(store: Store) -> str:
    info = await store.register_worker(
        node_id="n1", worker_id="w", mode="stream", max_concurrent_jobs=2, functions=[FN],
        session_expiry_s=10**6,
    )
    return info.session_id


def deleted(kind: str) -> float:
    """This process's ``ironflow_history_rows_deleted_total{kind}`` so far."""
    value = metrics.REGISTRY.get_sample_value("ironflow_history_rows_deleted_total", {"kind": kind})
    return value or 0.0


async def gone(store: Store, run_id: str) -> bool:
    try:
        await store.get_run(run_id)
    except RunNotFound:
        return True
    return False


async def test_finished_run_goes_at_the_first_tick_strictly_past_retention_and_waiting_runs_stay(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    session_id = await register(store)
    done = await start_run(store, session_id)
    await store.complete_job(done, "ok")  # ended at virtual time 0
    parked = await start_run(store, session_id)
    await store.yield_job(parked, step_id="z", name="z", info=SleepYield(until=BASE + 10 * HOUR))
    await nursery.start(janitor.run, store, config(), "n1")
    runs_deleted_before = deleted("runs")

    await trio.sleep(HOUR + 1)  # the tick at exactly one hour has run: the boundary stays
    assert not await gone(store, done.run_id)
    await trio.sleep(60)  # the tick at 3660 s
    assert await gone(store, done.run_id)
    assert not await gone(store, parked.run_id)
    (audit,) = await store.list_audit(type="history.purged")
    assert audit.at == BASE + HOUR + 60
    assert audit.data["runs"] == 1 and audit.data["by"] == "janitor:n1"
    assert deleted("runs") - runs_deleted_before == 1


async def test_duplicate_emit_is_refused_after_a_pass_inside_the_window_and_accepted_outside(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    cfg = config(idempotency_window_s=2 * HOUR)
    first = await store.ingest_event("nobody.listens", {}, "k", idempotency_window_s=2 * HOUR)
    await nursery.start(janitor.run, store, cfg, "n1")
    await trio.sleep(2 * HOUR - 30)  # many passes, the last at 7140 s
    again = await store.ingest_event("nobody.listens", {}, "k", idempotency_window_s=2 * HOUR)
    assert again.duplicate and again.event_id == first.event_id
    assert await store.list_audit(type="history.purged") == []
    await trio.sleep(60)  # the tick at 7200 s: exactly at the window, still kept; 7260 s deletes it
    await trio.sleep(60)
    (audit,) = await store.list_audit(type="history.purged")
    assert audit.data["events"] == 1 and audit.at == BASE + 2 * HOUR + 60
    later = await store.ingest_event("nobody.listens", {}, "k", idempotency_window_s=2 * HOUR)
    assert not later.duplicate and later.event_id != first.event_id


async def test_zero_retention_keeps_everything_and_still_reports_the_oldest_run_age(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    session_id = await register(store)
    done = await start_run(store, session_id)
    await store.complete_job(done, "ok")
    await nursery.start(janitor.run, store, config(history_retention_s=0), "n1")
    await trio.sleep(2 * 24 * HOUR)
    assert not await gone(store, done.run_id)
    assert await store.list_audit(type="history.purged") == []
    age = metrics.REGISTRY.get_sample_value("ironflow_history_oldest_run_age_seconds")
    assert age == pytest.approx(2 * 24 * HOUR, abs=60)


async def test_a_janitor_restarted_after_a_crash_resumes_deleting(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    from actors.supervisor import Supervisor

    session_id = await register(store)
    done = await start_run(store, session_id)
    await store.complete_job(done, "ok")
    cfg = config()
    supervisor = Supervisor(nursery, cfg.timings)
    await supervisor.start("janitor", janitor.run, store, cfg, "n1")
    await trio.sleep(30)
    supervisor.crash("janitor")
    await trio.sleep(HOUR + 60)
    assert supervisor.restarts("janitor") == 1
    assert await gone(store, done.run_id)
