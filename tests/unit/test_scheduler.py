"""The scheduler in virtual time, on a real SQLite store running inline
(``ironflow_now()`` is ``BASE + trio.current_time()``): ticks fire at their
time, once each; a registration wakes it; nothing is written while nothing is
due; a function with no live worker starts nothing until a worker returns."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from actors import scheduler
from actors.messages import Kick
from ironflow.config import Limits, NodeConfig, Timings
from ironflow.protocol import FunctionDef, Trigger
from ironflow.store import Store
from tests.unit.virtual_time import BASE

# How late after its time a tick may fire: the scheduler's slack, plus float noise.
LATE = scheduler.TICK_SLACK_S + 0.001


def config(recheck_s: float = 1.0, live_s: float = 300.0) -> NodeConfig:
    return NodeConfig(timings=Timings(scheduler_recheck_s=recheck_s), limits=Limits(function_live_s=live_s))


async def register(store: Store, cron: str) -> str:
    info = await store.register_worker(
        node_id="n1", worker_id="w", mode="stream", max_concurrent_jobs=1,
        functions=[FunctionDef(id="f", triggers=[Trigger(cron=cron)])], session_expiry_s=10**6,
    )
    return info.session_id


async def start(nursery: trio.Nursery, store: Any, cfg: NodeConfig) -> trio.MemoryReceiveChannel[Kick]:
    kick_send, kick_receive = trio.open_memory_channel[Kick](100)
    await nursery.start(scheduler.run, store, cfg, "n1", kick_send)
    return kick_receive


async def test_each_tick_fires_once_at_its_time(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    await register(store, "*/20 * * * * *")
    kicks = await start(nursery, store, config())
    fired_at = []
    for _ in range(3):
        with trio.fail_after(100):
            await kicks.receive()
        fired_at.append(BASE + trio.current_time())
    runs = await store.list_runs(function_id="f", limit=10)
    ticks = sorted([(await store.get_event(r.event_id)).data["scheduled_at_epoch"] for r in runs])
    assert len(ticks) == 3 and ticks[1] - ticks[0] == ticks[2] - ticks[1] == 20
    for at, tick in zip(fired_at, ticks, strict=True):
        assert tick <= at <= tick + LATE


async def test_a_registration_wakes_a_scheduler_sleeping_past_the_new_tick(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    kicks = await start(nursery, store, config(recheck_s=1000.0))
    await trio.sleep(5)  # asleep, nothing scheduled: up to its 1000 s re-check
    await register(store, "* * * * * *")
    t0 = trio.current_time()
    with trio.fail_after(100):
        await kicks.receive()
    assert trio.current_time() - t0 <= 1 + LATE


async def test_nothing_due_opens_no_firing_transaction(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    calls: list[str] = []
    fire = store.fire_due_ticks

    async def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append("fire")
        return await fire(*args, **kwargs)

    store.fire_due_ticks = counted  # type: ignore[method-assign]
    assert BASE % 3600 == 0  # so the hourly tick is an hour after the registration
    await register(store, "0 0 * * * *")
    await start(nursery, store, config())
    await trio.sleep(600)  # ten minutes of one-second re-checks, no tick due
    assert calls == []
    await trio.sleep(3000 + 1)
    assert calls == ["fire"]


async def test_ticks_stop_once_no_worker_was_live_for_the_window_and_catch_up_when_one_returns(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    live_s = 30.0
    session = await register(store, "*/10 * * * * *")
    await start(nursery, store, config(live_s=live_s))
    await trio.sleep(5)
    await store.close_session(session, recover_leases=True, recovery_grace_s=1, recovery_ceiling=10)
    left_at = BASE + trio.current_time()

    async def ticks() -> list[float]:
        runs = await store.list_runs(function_id="f", limit=1000)
        return sorted([(await store.get_event(r.event_id)).data["scheduled_at_epoch"] for r in runs])

    await trio.sleep(600)  # ten minutes with no worker
    fired = await ticks()
    # Every tick within the window after the worker left, none after it.
    assert fired and max(fired) <= left_at + live_s < max(fired) + 10
    [record] = await store.list_functions(live_within_s=live_s)
    [schedule] = record.schedules
    assert not record.live and schedule.skip_reason == "NO_LIVE_WORKER"
    assert schedule.skipped_ticks == (schedule.last_tick_at - schedule.skipped_since) / 10 + 1
    # The worker returns 5 s after a tick: the latest skipped tick runs at once
    # (catchup="latest"), then every tick again.
    back_at = BASE + trio.current_time()
    await register(store, "*/10 * * * * *")
    await trio.sleep(1)
    caught_up = [t for t in await ticks() if t not in fired]
    assert caught_up == [back_at - back_at % 10]
    await trio.sleep(30)
    assert len(await ticks()) == len(fired) + 1 + 3
