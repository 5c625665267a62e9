"""Every way a run ends is counted and timed once, in virtual time.

``ironflow_run_duration_seconds`` and ``ironflow_runs_total`` are observed by
whoever ended the run: the session (a worker's final result), the capacity
scanner (recovery ceiling, function timeout), the session's close (recovery
ceiling on a dropped socket) and the drain coordinator (recovery ceiling at
the drain deadline). The store's clock is virtual, so each duration is exact.
The API's cancel and a pull worker's goodbye are covered through a real node
in ``tests/integration/test_metrics.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from actors import capacity_scanner, drain_coordinator
from actors import session as session_actor
from actors.directory import LocalSession, SessionDirectory
from actors.messages import Kick
from ironflow.config import NodeConfig, Timings
from ironflow.engine import metrics
from ironflow.protocol import (
    EngineMessage,
    ErrorInfo,
    FunctionDef,
    JobAck,
    JobCompleted,
    JobFailed,
    Register,
    RetryPolicy,
    Trigger,
    WorkerMessage,
)
from ironflow.store import Fence, StaleExecution, Store

ONCE = FunctionDef(id="once", triggers=[Trigger("go")], retries=RetryPolicy(max_attempts=1))
TIMED = FunctionDef(
    id="timed", triggers=[Trigger("go.timed")], retries=RetryPolicy(max_attempts=1), timeout_s=10.0
)
# Recovery ceiling 1 (the least a config allows): a run that was recovered
# once fails at its next lost lease.
CFG = NodeConfig(timings=Timings(recovery_ceiling=1, drain_timeout_s=25.0))


class Ends:
    """The run-end series of one function, read before and after a test acts."""

    def __init__(self, function_id: str) -> None:
        self.function_id = function_id
        self.before = {s: self._read(s) for s in ("completed", "failed", "cancelled")}

    def _read(self, status: str) -> tuple[float, float, float]:
        def get(name: str, **labels: str) -> float:
            return metrics.REGISTRY.get_sample_value(name, labels) or 0.0

        labels = {"function": self.function_id, "status": status}
        return (
            get("ironflow_run_duration_seconds_count", **labels),
            get("ironflow_run_duration_seconds_sum", **labels),
            get("ironflow_runs_total", status=status),
        )

    def grew(self, status: str) -> tuple[float, float, float]:
        """(observations, seconds observed, runs counted) added since construction."""
        now = self._read(status)
        return (now[0] - self.before[status][0], now[1] - self.before[status][1],
                now[2] - self.before[status][2])


async def session(store: Store, fn: FunctionDef, node_id: str) -> str:
    """A new worker session offering ``fn``."""
    info = await store.register_worker(
        node_id=node_id, worker_id="w", mode="stream", max_concurrent_jobs=1, functions=[fn],
        session_expiry_s=10**6,
    )
    return info.session_id


async def execute(store: Store, fn: FunctionDef, node_id: str, session_id: str) -> Fence:
    """Take ``fn``'s next queued segment to 'running' on ``session_id``."""
    (res,) = await store.reserve_segments(
        node_id, {session_id: frozenset({fn.id})}, 1, reservation_expiry_s=30
    )
    a = res.assignment
    fence = Fence(session_id, a.run_id, a.execution_seq, a.lease_token)
    await store.activate_lease(fence, lease_expiry_s=CFG.timings.lease_expiry_s)
    return fence


async def start_one(store: Store, fn: FunctionDef, *, node_id: str = "n1") -> Fence:
    """Emit ``fn``'s event and take the run to 'running' on a new worker session."""
    session_id = await session(store, fn, node_id)
    await store.ingest_event(fn.triggers[0].event, {}, None, idempotency_window_s=60)
    return await execute(store, fn, node_id, session_id)


async def start_recovered_once(store: Store, fn: FunctionDef, *, node_id: str = "n1") -> Fence:
    """A run 'running' again after one recovery: its next lost lease is past the ceiling."""
    first = await start_one(store, fn, node_id=node_id)
    t = CFG.timings
    (seg,) = await store.close_session(
        first.session_id, recover_leases=True, recovery_grace_s=t.recovery_grace_s,
        recovery_ceiling=t.recovery_ceiling,
    )
    assert not seg.exhausted and seg.recovery_count == 1
    # The first recovery has no grace: the segment is admitted again at once.
    return await execute(store, fn, node_id, await session(store, fn, node_id))


def completed(fence: Fence) -> JobCompleted:
    return JobCompleted("j", fence.run_id, fence.execution_seq, fence.lease_token, "done")


async def handle(store: Store, fence: Fence, msg: Any) -> None:
    kicks, _ = trio.open_memory_channel[Kick](100)
    await session_actor.handle(store, CFG, fence.session_id, msg, kicks)


async def test_a_completed_run_is_observed_once_with_its_duration(
    store: Store, autojump_clock: trio.testing.MockClock
) -> None:
    ends = Ends("once")
    fence = await start_one(store, ONCE)
    await trio.sleep(3.0)
    await handle(store, fence, completed(fence))
    count, seconds, runs = ends.grew("completed")
    assert (count, runs) == (1, 1) and seconds == pytest.approx(3.0, abs=1e-6)
    with pytest.raises(StaleExecution):  # a repeated final result changes nothing
        await handle(store, fence, completed(fence))
    assert ends.grew("completed")[0] == 1


async def test_a_run_failed_by_its_worker_is_observed_once(
    store: Store, autojump_clock: trio.testing.MockClock
) -> None:
    ends = Ends("once")
    fence = await start_one(store, ONCE)
    await trio.sleep(2.0)
    error = ErrorInfo(message="no", code="ValueError", retryable=True)
    await handle(store, fence, JobFailed("j", fence.run_id, fence.execution_seq, fence.lease_token, error))
    count, seconds, runs = ends.grew("failed")
    assert (count, runs) == (1, 1) and seconds == pytest.approx(2.0, abs=1e-6)


async def test_a_run_failed_by_its_function_timeout_is_observed_once_and_its_late_result_not_at_all(
    store: Store, autojump_clock: trio.testing.MockClock
) -> None:
    ends = Ends("timed")
    fence = await start_one(store, TIMED)
    kicks, _ = trio.open_memory_channel[Kick](100)
    await trio.sleep(10.0)
    await capacity_scanner.scan_once(store, CFG, kicks)
    run = (await store.get_run(fence.run_id)).run
    assert run.status == "failed" and run.error is not None and run.error.code == "FUNCTION_TIMEOUT"
    count, seconds, runs = ends.grew("failed")
    assert (count, runs) == (1, 1) and seconds == pytest.approx(10.0, abs=1e-6)
    # The worker finishes after the timeout: refused, neither counted nor timed.
    with pytest.raises(StaleExecution):
        await handle(store, fence, completed(fence))
    await capacity_scanner.scan_once(store, CFG, kicks)
    assert ends.grew("failed") == (count, seconds, runs)
    assert ends.grew("completed")[0] == 0


async def test_a_run_failed_at_the_recovery_ceiling_by_the_capacity_scanner_is_observed_once(
    store: Store, autojump_clock: trio.testing.MockClock
) -> None:
    ends = Ends("once")
    fence = await start_recovered_once(store, ONCE)
    kicks, _ = trio.open_memory_channel[Kick](100)
    await trio.sleep(CFG.timings.lease_expiry_s)  # no heartbeat: the lease expires
    await capacity_scanner.scan_once(store, CFG, kicks)
    run = (await store.get_run(fence.run_id)).run
    assert run.status == "failed" and run.error is not None
    assert run.error.code == "EXECUTION_RECOVERY_EXHAUSTED"
    count, seconds, runs = ends.grew("failed")
    assert (count, runs) == (1, 1) and seconds == pytest.approx(CFG.timings.lease_expiry_s, abs=1e-6)
    await capacity_scanner.scan_once(store, CFG, kicks)
    assert ends.grew("failed") == (count, seconds, runs)


async def test_a_run_failed_at_the_recovery_ceiling_when_its_socket_drops_is_observed_once(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    ends = Ends("once")
    directory = SessionDirectory()
    send, inbound = trio.open_memory_channel[WorkerMessage](10)
    outbox, received = trio.open_memory_channel[EngineMessage](10)
    kick_send, _ = trio.open_memory_channel[Kick](100)
    await send.send(Register(worker_id="w1", functions=[ONCE], max_concurrent_jobs=1))
    done = trio.Event()

    async def serve(task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        await session_actor.run(store, CFG, "n1", directory, kick_send, inbound, outbox, task_status=task_status)
        done.set()

    session_id = await nursery.start(serve)
    lost = await start_one(store, ONCE)  # on another session, which is lost once
    t = CFG.timings
    await store.close_session(
        lost.session_id, recover_leases=True, recovery_grace_s=t.recovery_grace_s,
        recovery_ceiling=t.recovery_ceiling,
    )
    (res,) = await store.reserve_segments("n1", {session_id: frozenset({"once"})}, 1, reservation_expiry_s=30)
    a = res.assignment
    await send.send(JobAck(a.job_id, a.run_id, a.execution_seq, a.lease_token))
    while (await store.get_run(a.run_id)).run.status != "running":
        await trio.sleep(0.001)
    await trio.sleep(4.0)
    await send.aclose()  # the socket dropped without a drain
    with trio.fail_after(10):
        await done.wait()
    run = (await store.get_run(a.run_id)).run
    assert run.status == "failed" and run.error is not None
    assert run.error.code == "EXECUTION_RECOVERY_EXHAUSTED"
    count, seconds, runs = ends.grew("failed")
    assert (count, runs) == (1, 1) and seconds == pytest.approx(4.0, abs=0.01)


async def test_a_run_failed_at_the_recovery_ceiling_at_the_drain_deadline_is_observed_once(
    store: Store, nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    ends = Ends("once")
    fence = await start_recovered_once(store, ONCE, node_id="node-a")
    directory = SessionDirectory()
    stuck, _outbox = trio.open_memory_channel[EngineMessage](10)
    directory.add(LocalSession(fence.session_id, frozenset({"once"}), stuck, mode="stream"))
    shutdown, drained = trio.Event(), trio.Event()
    await nursery.start(
        drain_coordinator.run, store, CFG, "node-a", directory, shutdown, drained
    )
    shutdown.set()  # the job outlives the 25 s drain deadline
    with trio.fail_after(100):
        await drained.wait()
    run = (await store.get_run(fence.run_id)).run
    assert run.status == "failed" and run.error is not None
    assert run.error.code == "EXECUTION_RECOVERY_EXHAUSTED"
    count, seconds, runs = ends.grew("failed")
    assert (count, runs) == (1, 1) and seconds == pytest.approx(25.0, abs=0.01)
