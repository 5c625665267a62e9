"""Loop 1 in virtual time: the capacity scanner actor on a real SQLite store.

The store runs inline on the Trio thread with ``ironflow_now()`` driven by
``MockClock``, so a 90-second lease expiry takes milliseconds and every
timing assertion is exact.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from actors import capacity_scanner
from actors.messages import Kick
from ironflow.config import NodeConfig, Timings
from ironflow.protocol import FunctionDef, Trigger
from ironflow.store import Fence, Store
from tests.unit.virtual_time import BASE

FN = FunctionDef(id="fn", triggers=[Trigger("go")])




def config(**timings: Any) -> NodeConfig:
    return NodeConfig(timings=Timings(**timings))


class Harness:
    def __init__(self, store: Store, cfg: NodeConfig) -> None:
        self.store = store
        self.cfg = cfg
        self.kick_send, self.kick_receive = trio.open_memory_channel[Kick](100)
        self.session_id = ""

    async def start(self, nursery: trio.Nursery) -> None:
        info = await self.store.register_worker(
            node_id="n1", worker_id="w", mode="stream", max_concurrent_jobs=1, functions=[FN],
            session_expiry_s=self.cfg.timings.session_expiry_s,
        )
        self.session_id = info.session_id
        await nursery.start(capacity_scanner.run, self.store, self.cfg, self.kick_send)

    async def keep_session_alive(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Heartbeat like a live worker that does NOT report its job (so the lease is not refreshed)."""
        t = self.cfg.timings
        task_status.started()
        while True:
            await self.store.heartbeat(
                self.session_id, [], session_expiry_s=t.session_expiry_s, lease_expiry_s=t.lease_expiry_s
            )
            await trio.sleep(t.heartbeat_interval_s)

    async def execute_one(self) -> Fence:
        """Admit and activate the next queued segment on the session."""
        (res,) = await self.store.reserve_segments(
            "n1", {self.session_id: frozenset({"fn"})}, 10,
            reservation_expiry_s=self.cfg.timings.reservation_expiry_s,
        )
        a = res.assignment
        fence = Fence(self.session_id, a.run_id, a.execution_seq, a.lease_token)
        await self.store.activate_lease(fence, lease_expiry_s=self.cfg.timings.lease_expiry_s)
        return fence

    async def wait_status(self, run_id: str, status: str) -> float:
        """Virtual time at which the run reached ``status``."""
        while (await self.store.get_run(run_id)).run.status != status:
            await trio.sleep(0.01)
        return trio.current_time()


async def test_expired_lease_is_fenced_audited_and_requeued_after_grace(store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock) -> None:
    h = Harness(store, config())
    await h.start(nursery)
    await nursery.start(h.keep_session_alive)
    run_id = (await store.ingest_event("go", {}, None, idempotency_window_s=60)).run_ids[0]
    fence = await h.execute_one()
    t0 = trio.current_time()
    recovered_at = await h.wait_status(run_id, "waiting")
    # Recovered at lease expiry (90 s), not at the next 30 s scan tick after it.
    assert 90.0 <= recovered_at - t0 < 90.1
    detail = await store.get_run(run_id)
    assert detail.run.current_execution_seq == fence.execution_seq + 1
    assert detail.run.recovery_count == 1 and detail.run.attempt == 1
    assert detail.lease is None and detail.queue is not None
    assert detail.queue.reason == "recovery"
    assert detail.queue.eligible_at == pytest.approx(BASE + recovered_at + 30.0, abs=0.01)
    assert detail.waiting_reason is not None and detail.waiting_reason.startswith("recovery grace until")
    audit = [a.type for a in await store.list_audit(run_id=run_id)]
    # Recorded although the function's audit toggle is off.
    assert audit.count("capacity.lease.expired") == 1 and audit.count("capacity.segment.recovered") == 1
    assert h.kick_receive.receive_nowait().why == "capacity scan"
    # The recovery grace holds the segment back for exactly 30 s.
    offer = {h.session_id: frozenset({"fn"})}
    await trio.sleep(29.9)
    assert await store.reserve_segments("n1", offer, 10, reservation_expiry_s=30) == []
    await trio.sleep(0.2)
    (res,) = await store.reserve_segments("n1", offer, 10, reservation_expiry_s=30)
    assert res.assignment.execution_seq == fence.execution_seq + 1
    # The old fence can no longer activate (stale seq).
    from ironflow.store import StaleExecution

    with pytest.raises(StaleExecution):
        await store.activate_lease(fence, lease_expiry_s=90)


async def test_expired_reservation_frees_its_slot(store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock) -> None:
    h = Harness(store, config())
    await h.start(nursery)
    await nursery.start(h.keep_session_alive)
    run_id = (await store.ingest_event("go", {}, None, idempotency_window_s=60)).run_ids[0]
    offer = {h.session_id: frozenset({"fn"})}
    (res,) = await store.reserve_segments("n1", offer, 10, reservation_expiry_s=30)
    t0 = trio.current_time()
    while (await store.get_run(run_id)).queue.reservation_owner is not None:  # type: ignore[union-attr]
        await trio.sleep(0.01)
    assert 30.0 <= trio.current_time() - t0 < 30.1
    detail = await store.get_run(run_id)
    assert detail.run.status == "waiting_for_capacity" and detail.run.recovery_count == 0
    # The slot is free again: the same segment (same seq, new token) is admitted.
    (again,) = await store.reserve_segments("n1", offer, 10, reservation_expiry_s=30)
    assert again.assignment.execution_seq == res.assignment.execution_seq
    assert again.assignment.lease_token != res.assignment.lease_token


async def test_expired_session_cascades_credits_but_leaves_leases_to_their_own_clock(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    h = Harness(store, config(session_expiry_s=60.0))
    await h.start(nursery)
    run_id = (await store.ingest_event("go", {}, None, idempotency_window_s=60)).run_ids[0]
    await h.execute_one()  # no heartbeats from here on: the worker is gone
    await trio.sleep(60.1)
    assert await store.list_sessions() == []
    assert [lease.run_id for lease in await store.list_leases()] == [run_id]
    assert (await store.get_run(run_id)).run.status == "running"
    recovered_at = await h.wait_status(run_id, "waiting")
    assert 90.0 <= recovered_at < 90.2
    assert (await store.get_run(run_id)).run.recovery_count == 1


async def test_recovery_ceiling_permits_ten_recoveries_then_fails_the_run(store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock) -> None:
    h = Harness(store, config())
    await h.start(nursery)
    await nursery.start(h.keep_session_alive)
    run_id = (await store.ingest_event("go", {}, None, idempotency_window_s=60)).run_ids[0]
    starts = 0
    while True:
        detail = await store.get_run(run_id)
        if detail.run.status == "failed":
            break
        if detail.queue is not None and detail.queue.eligible_in_s <= 0:
            fence = await h.execute_one()
            starts += 1
            # A step completed inside a running segment does not reset the count.
            await store.record_step(fence, step_id=f"s{starts}", name="s", status="completed", output=starts)
        await trio.sleep(0.5)
    run = (await store.get_run(run_id)).run
    assert starts == 11
    assert run.error is not None and run.error.code == "EXECUTION_RECOVERY_EXHAUSTED"
    assert run.recovery_count == 10 and run.attempt == 1
    audit = [a.type for a in await store.list_audit(run_id=run_id)]
    assert audit.count("capacity.segment.recovered") == 10
    assert audit.count("capacity.lease.expired") == 11
