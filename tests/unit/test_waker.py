"""The waker in virtual time, on a real SQLite store running inline.

``ironflow_now()`` is ``BASE + trio.current_time()`` under
``MockClock(autojump_threshold=0)``: a step's ``wake_at`` and the moment the
waker resumes it can be compared exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from actors import waker
from actors.messages import Kick
from ironflow.config import NodeConfig, Timings
from ironflow.protocol import FunctionDef, InvokeYield, SleepYield, Trigger, WaitYield, YieldInfo
from ironflow.store import Fence, Store
from tests.unit.virtual_time import BASE

FNS = [FunctionDef(id="fn", triggers=[Trigger("go")]), FunctionDef(id="child", triggers=[])]
# How late after a wake time the waker may act: its slack, plus float noise.
LATE = waker.WAKE_SLACK_S + 0.001


# The test itself must take ``autojump_clock`` too: pytest-trio only runs a
# test on the clock when the test asks for it.


def config(waker_interval_s: float = 1000.0, lookahead_s: float = 0.0) -> NodeConfig:
    """The waker's settings; no look-ahead unless asked (claims at the wake time)."""
    return NodeConfig(timings=Timings(waker_interval_s=waker_interval_s, waker_lookahead_s=lookahead_s))


async def park(store: Store, *yields: YieldInfo) -> list[str]:
    """Start one run per yield, take it to 'running' and park it on that yield."""
    info = await store.register_worker(
        node_id="n1", worker_id="w", mode="stream", max_concurrent_jobs=len(yields),
        functions=FNS, session_expiry_s=10**6,
    )
    run_ids = []
    for y in yields:
        await store.ingest_event("go", {}, None, idempotency_window_s=60)
        (res,) = await store.reserve_segments(
            "n1", {info.session_id: frozenset({"fn"})}, 1, reservation_expiry_s=10**6
        )
        a = res.assignment
        fence = Fence(info.session_id, a.run_id, a.execution_seq, a.lease_token)
        await store.activate_lease(fence, lease_expiry_s=10**6)
        await store.yield_job(fence, step_id="s", name="s", info=y)
        run_ids.append(a.run_id)
    return run_ids


async def start_waker(
    nursery: trio.Nursery, store: Any, cfg: NodeConfig | None = None
) -> trio.MemoryReceiveChannel[Kick]:
    kick_send, kick_receive = trio.open_memory_channel[Kick](100)
    await nursery.start(waker.run, store, cfg or config(), "n1", kick_send)
    return kick_receive


async def next_kick(kicks: trio.MemoryReceiveChannel[Kick]) -> Kick:
    """The waker's next kick; a waker that never kicks fails here, in virtual time."""
    with trio.fail_after(100):
        return await kicks.receive()


async def resumed(store: Store, run_id: str) -> bool:
    queue = (await store.get_run(run_id)).queue
    return queue is not None and queue.reason == "resume"


async def test_an_elapsed_sleep_completes_and_its_run_is_queued_at_the_wake_time_with_a_kick(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    (run_id,) = await park(store, SleepYield(until=BASE + 10.0))
    kicks = await start_waker(nursery, store)
    assert (await next_kick(kicks)).why == "steps woke"
    assert 10.0 <= trio.current_time() <= 10.0 + LATE
    detail = await store.get_run(run_id)
    assert detail.steps[0].status == "completed"
    assert detail.queue is not None and detail.queue.reason == "resume"
    assert detail.queue.execution_seq == detail.run.current_execution_seq == 2


async def test_a_wait_past_its_timeout_is_marked_timed_out_and_its_run_resumed(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    (run_id,) = await park(store, WaitYield(event="paid", timeout_at=BASE + 5.0))
    kicks = await start_waker(nursery, store)
    await next_kick(kicks)
    assert 5.0 <= trio.current_time() <= 5.0 + LATE
    assert (await store.get_run(run_id)).steps[0].status == "timed_out"
    assert await resumed(store, run_id)


async def test_an_invoke_past_its_timeout_fails_its_step_with_invoke_timeout_and_resumes_the_parent(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    (run_id,) = await park(store, InvokeYield("child", timeout_at=BASE + 8.0))
    kicks = await start_waker(nursery, store)
    await next_kick(kicks)
    assert 8.0 <= trio.current_time() <= 8.0 + LATE
    step = (await store.get_run(run_id)).steps[0]
    assert step.status == "failed" and step.error is not None and step.error.code == "INVOKE_TIMEOUT"
    assert await resumed(store, run_id)


async def test_the_waker_sleeps_until_the_earliest_wake_rather_than_its_interval(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    early, late = await park(store, SleepYield(until=BASE + 7.0), SleepYield(until=BASE + 20.0))
    kicks = await start_waker(nursery, store, config(waker_interval_s=1000.0))
    await next_kick(kicks)
    assert 7.0 <= trio.current_time() <= 7.0 + LATE
    assert await resumed(store, early) and not await resumed(store, late)
    await next_kick(kicks)
    assert 20.0 <= trio.current_time() <= 20.0 + LATE
    assert await resumed(store, late)


async def test_a_sleep_parked_while_the_waker_sleeps_is_resumed_at_its_time_not_the_next_tick(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # Nothing is parked: the waker sleeps a whole interval (10 s). Parking a
    # 0.5 s sleep tells it (the store announces the wake time), so it wakes for
    # that sleep instead of 9.7 s late at its next tick.
    kicks = await start_waker(nursery, store, config(waker_interval_s=10.0))
    await trio.sleep(0.3)
    (run_id,) = await park(store, SleepYield(until=BASE + 0.5))
    await next_kick(kicks)
    assert 0.5 <= trio.current_time() <= 0.5 + LATE
    assert await resumed(store, run_id)


async def test_a_full_batch_is_followed_at_once_by_the_next(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(waker, "BATCH", 2)
    run_ids = await park(store, *[SleepYield(until=BASE + 3.0)] * 5)
    kicks = await start_waker(nursery, store)
    await next_kick(kicks)
    woke_at = trio.current_time()
    assert 3.0 <= woke_at <= 3.0 + LATE
    await next_kick(kicks)
    await next_kick(kicks)  # three batches: 2 + 2 + 1, one kick each
    assert trio.current_time() == woke_at
    assert [await resumed(store, r) for r in run_ids] == [True] * 5


class CancelAfterClaim:
    """The store, with ``victim`` cancelled right after the waker claims its step.

    That is the race: an API cancel (or loop 2) landing between the
    waker's claim and its resume takes the claim away.
    """

    def __init__(self, store: Store, victim: str) -> None:
        self._store = store
        self._victim = victim

    async def claim_elapsed_steps(self, node_id: str, limit: int, **kw: Any) -> list[tuple[str, str]]:
        claimed = await self._store.claim_elapsed_steps(node_id, limit, **kw)
        if any(run_id == self._victim for run_id, _ in claimed):
            await self._store.cancel_run(self._victim, "cancelled by user")
        return claimed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


async def test_a_run_cancelled_between_claim_and_resume_does_not_stop_the_rest_of_the_batch(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # The victim's wake is 1 ms earlier, so both are claimed in one batch, victim first.
    victim, other, later = await park(
        store,
        SleepYield(until=BASE + 5.0 - 0.001),
        SleepYield(until=BASE + 5.0),
        SleepYield(until=BASE + 9.0),
    )
    kicks = await start_waker(nursery, CancelAfterClaim(store, victim))
    await next_kick(kicks)
    assert 5.0 <= trio.current_time() <= 5.0 + LATE
    cancelled = await store.get_run(victim)
    assert cancelled.run.status == "cancelled" and cancelled.queue is None
    assert cancelled.steps[0].status == "failed"
    # The rest of the batch is resumed at once, not left 'waking' for loop 2,
    # and the waker carries on with later sleeps.
    assert await resumed(store, other)
    await next_kick(kicks)
    assert 9.0 <= trio.current_time() <= 9.0 + LATE
    assert await resumed(store, later)


class CountingStore:
    """The store, counting the waker's claim and resume transactions."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.claims = 0
        self.resumes = 0

    async def claim_elapsed_steps(self, node_id: str, limit: int, **kw: Any) -> list[tuple[str, str]]:
        claimed = await self._store.claim_elapsed_steps(node_id, limit, **kw)
        self.claims += bool(claimed)
        return claimed

    async def resume_claimed_steps(self, node_id: str, steps: list[tuple[str, str]]) -> Any:
        self.resumes += 1
        return await self._store.resume_claimed_steps(node_id, steps)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


async def test_a_batch_of_claims_is_resumed_in_one_transaction(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(waker, "BATCH", 4)
    run_ids = await park(store, *[SleepYield(until=BASE + 3.0)] * 10)
    counting = CountingStore(store)
    kicks = await start_waker(nursery, counting)
    for _ in range(3):  # 4 + 4 + 2
        await next_kick(kicks)
    assert (counting.claims, counting.resumes) == (3, 3)
    assert [await resumed(store, r) for r in run_ids] == [True] * 10


async def start_at_of(store: Store, run_id: str) -> float | None:
    """``runs.start_at``: no record carries it."""

    def work(tx: Any) -> Any:
        return tx.fetchone("SELECT start_at FROM runs WHERE id = ?", (run_id,))[0]

    return await store._transact(work)  # type: ignore[attr-defined]


async def test_with_lookahead_a_sleep_is_resumed_ahead_of_its_wake_time_to_start_at_it(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    (run_id,) = await park(store, SleepYield(until=BASE + 10.0))
    kicks = await start_waker(nursery, store, config(lookahead_s=1.5))
    await next_kick(kicks)
    assert 8.5 <= trio.current_time() <= 8.5 + LATE  # 1.5 s ahead, not at 10 s
    detail = await store.get_run(run_id)
    assert detail.steps[0].status == "completed" and await resumed(store, run_id)
    assert await start_at_of(store, run_id) == BASE + 10.0  # what every dispatch honours


async def test_lookahead_never_claims_a_wait_or_an_invoke_before_its_timeout(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # An event may still match the wait, the child may still finish: neither
    # is resolved before its timeout, whatever the look-ahead. The sleep due
    # after the wait is claimed at its own look-ahead time, not at the wait's.
    wait, invoke, sleep = await park(
        store,
        WaitYield(event="paid", timeout_at=BASE + 5.0),
        InvokeYield("child", timeout_at=BASE + 8.0),
        SleepYield(until=BASE + 5.5),
    )
    kicks = await start_waker(nursery, store, config(lookahead_s=2.0))
    await next_kick(kicks)
    assert 3.5 <= trio.current_time() <= 3.5 + LATE
    assert await resumed(store, sleep)
    assert not await resumed(store, wait) and not await resumed(store, invoke)
    await next_kick(kicks)
    assert 5.0 <= trio.current_time() <= 5.0 + LATE
    assert await resumed(store, wait) and not await resumed(store, invoke)
    await next_kick(kicks)
    assert 8.0 <= trio.current_time() <= 8.0 + LATE
    assert await resumed(store, invoke)
    assert (await store.get_run(wait)).steps[0].status == "timed_out"


async def test_a_restarted_waker_leaves_no_wake_listener_behind(
    store: Store, autojump_clock: trio.testing.MockClock
) -> None:
    """Found by the simulator (tests/sim): every start of the waker registered a
    wake listener on the store and none was ever removed, so each supervisor
    restart (and each node restart on the same store object) added one more,
    all called on every parked sleep."""
    from actors.supervisor import Supervisor

    listeners: list[Any] = store._wake_listeners  # type: ignore[attr-defined]
    kick_send, _ = trio.open_memory_channel[Kick](100)
    async with trio.open_nursery() as nursery:
        sup = Supervisor(nursery, Timings(restart_backoff_s=0.01))
        await sup.start("waker", waker.run, store, config(), "n1", kick_send)
        for _ in range(3):
            sup.crash("waker")
            await trio.sleep(1)
        assert sup.restarts("waker") == 3
        assert len(listeners) == 1  # the running waker's only
        nursery.cancel_scope.cancel()
    assert listeners == []
