"""Loop 2 in virtual time: the stale-claim sweeper actor on a real SQLite store.

A step is claimed by a node that then "dies" (nothing resumes it); the
sweeper, ticking every ``stale_claim_interval`` on ``MockClock``, restores it
once the claim is older than ``stale_claim_threshold`` — unless its run is
held by the capacity layer (a lease or a queue row).
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from actors import stale_claim_sweeper
from ironflow.config import NodeConfig, Timings
from ironflow.protocol import FunctionDef, SleepYield, Trigger, WaitYield, YieldInfo
from ironflow.store import Fence, Store
from tests.unit.virtual_time import BASE

FN = FunctionDef(id="fn", triggers=[Trigger("go")])
INTERVAL = 60.0
THRESHOLD = 120.0
CFG = NodeConfig(
    timings=Timings(stale_claim_interval_s=INTERVAL, stale_claim_threshold_s=THRESHOLD)
)


# The test itself must take ``autojump_clock`` too: pytest-trio only runs a
# test on the clock when the test asks for it.


class Parked:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.session_id = ""

    async def park(self, *yields: YieldInfo) -> list[str]:
        """Start one run per yield, take it to 'running' and park it on that yield."""
        info = await self.store.register_worker(
            node_id="n1", worker_id="w", mode="stream", max_concurrent_jobs=2 * len(yields),
            functions=[FN], session_expiry_s=10**6,
        )
        self.session_id = info.session_id
        run_ids = []
        for y in yields:
            await self.store.ingest_event("go", {}, None, idempotency_window_s=60)
            fence = await self.admit()
            await self.store.yield_job(fence, step_id="s", name="s", info=y)
            run_ids.append(fence.run_id)
        return run_ids

    async def admit(self) -> Fence:
        """Reserve and activate the next queued segment: its run now holds a lease."""
        (res,) = await self.store.reserve_segments(
            "n1", {self.session_id: frozenset({"fn"})}, 1, reservation_expiry_s=10**6
        )
        a = res.assignment
        fence = Fence(self.session_id, a.run_id, a.execution_seq, a.lease_token)
        await self.store.activate_lease(fence, lease_expiry_s=10**6)
        return fence


async def claim_row(store: Store, run_id: str) -> tuple[Any, ...]:
    """(status, claimed_by, claimed_at, pre_claim_status) of the run's step."""

    def work(tx: Any) -> tuple[Any, ...]:
        return tuple(
            tx.fetchone(
                "SELECT status, claimed_by, claimed_at, pre_claim_status FROM steps"
                " WHERE run_id = ?",
                (run_id,),
            )
        )

    return await store._transact(work)  # type: ignore[attr-defined, no-any-return]


async def plant_queue_row(store: Store, run_id: str) -> None:
    """Queue the run's current segment by hand: no public path queues a run whose step is waking."""

    def work(tx: Any) -> None:
        tx.execute(
            "INSERT INTO dispatch_queue (run_id, execution_seq, function_id, concurrency_key,"
            " eligible_at, reason, enqueued_at) SELECT id, current_execution_seq, function_id,"
            " concurrency_key, ironflow_now(), 'resume', ironflow_now() FROM runs WHERE id = ?",
            (run_id,),
        )

    await store._transact(work)  # type: ignore[attr-defined]


async def test_a_waking_step_older_than_the_threshold_is_restored_to_its_pre_claim_status(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    sleeper, waiter = await Parked(store).park(
        SleepYield(until=BASE + 1.0), WaitYield(event="paid", timeout_at=BASE + 1.0)
    )
    await nursery.start(stale_claim_sweeper.run, store, CFG)
    await trio.sleep(2.0)
    assert len(await store.claim_elapsed_steps("dead-node", 10)) == 2  # and then it dies
    claimed_at = BASE + 2.0
    assert await claim_row(store, sleeper) == ("waking", "dead-node", claimed_at, "sleeping")
    # Ticks at 60 s and 120 s find the claim younger than 120 s; the 180 s tick restores it.
    await trio.sleep(180.0 - 2.0 - 0.1)
    assert (await claim_row(store, sleeper))[0] == "waking"
    await trio.sleep(0.2)
    assert await claim_row(store, sleeper) == ("sleeping", None, None, None)
    assert await claim_row(store, waiter) == ("waiting", None, None, None)
    # Restored, the steps are claimable again (by a live node's waker).
    assert len(await store.claim_elapsed_steps("n1", 10)) == 2


async def test_a_waking_step_whose_run_holds_a_lease_or_a_queue_row_is_left_alone(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    parked = Parked(store)
    leased, queued, free = await parked.park(*[SleepYield(until=BASE + 1.0)] * 3)
    await trio.sleep(2.0)
    assert len(await store.claim_elapsed_steps("dead-node", 10)) == 3
    await plant_queue_row(store, leased)
    assert (await parked.admit()).run_id == leased
    await plant_queue_row(store, queued)
    await nursery.start(stale_claim_sweeper.run, store, CFG)
    await trio.sleep(10 * THRESHOLD)  # many ticks, every claim long stale
    assert (await claim_row(store, free))[:2] == ("sleeping", None)
    for held in (leased, queued):
        assert (await claim_row(store, held))[:2] == ("waking", "dead-node")
    detail = await store.get_run(leased)
    assert detail.lease is not None and detail.queue is None
    detail = await store.get_run(queued)
    assert detail.lease is None and detail.queue is not None


class CountingStore:
    """The store, recording the virtual time of every ``reset_stale_claims`` call."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.sweeps: list[float] = []

    async def reset_stale_claims(self, threshold_s: float) -> int:
        assert threshold_s == THRESHOLD
        self.sweeps.append(trio.current_time())
        return await self._store.reset_stale_claims(threshold_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


async def test_the_sweeper_runs_every_interval_starting_one_interval_after_it_starts(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    counting = CountingStore(store)
    await nursery.start(stale_claim_sweeper.run, counting, CFG)
    await trio.sleep(5 * INTERVAL + 1.0)
    assert counting.sweeps == pytest.approx([INTERVAL * k for k in range(1, 6)])
