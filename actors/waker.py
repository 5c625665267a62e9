"""The waker: claims elapsed sleeps and timed-out waits/invokes and resumes their runs.

A claim moves the step to ``waking`` (claimed_by = this node, SKIP LOCKED so
exactly one node claims it); resuming queues the run's next segment. If the
node dies between the two, loop 2 (the stale-claim sweeper) restores the step.
"""

from __future__ import annotations

import logging
import os

import trio

from actors.messages import Kick, kick
from ironflow import logs, metrics
from ironflow.config import NodeConfig
from ironflow.store import Conflict, Store

log = logging.getLogger("ironflow.waker")

# Steps claimed per transaction.
BATCH = 100
# Resumes of one batch in flight at once: they share group commits (SQLite) or
# pooled connections (PostgreSQL) instead of queueing one transaction each.
RESUME_CONCURRENCY = 32
# Wake this long after the earliest wake time: it is `wake_at <= now` in SQL,
# and the database clock must have reached it.
WAKE_SLACK_S = 0.005
# Test-only fault switch: a node started with this set to 1 exits the process
# (``os._exit``, no cleanup, like a crash) right after the waker's first claim
# commits and before it resumes anything, leaving the claimed steps
# ``waking``: what loop 2 exists to repair (tests/integration/test_wake_claims.py).
FAULT_EXIT_AFTER_CLAIM_ENV = "IRONFLOW_TEST_FAULT_EXIT_AFTER_WAKE_CLAIM"
FAULT_EXIT_CODE = 86


async def _resume(
    store: Store,
    node_id: str,
    run_id: str,
    step_id: str,
    limiter: trio.CapacityLimiter,
    kicks: trio.MemorySendChannel[Kick],
) -> None:
    async with limiter:
        try:
            outcome = await store.resume_claimed_step(node_id, run_id, step_id)
        except Conflict:
            # The claim was taken away since (the run was cancelled, or loop 2
            # restored the step): nothing is ours to resume; the batch goes on.
            logs.event(log, logging.INFO, "waker: claim lost before resume", run_id=run_id, step_id=step_id)
            return
    # Dispatch starts with the first resumed run, not after the whole batch
    # (kicks coalesce: a round already pending absorbs this one).
    kick(kicks, "steps woke")
    if outcome.wake_lateness_s is not None:
        metrics.WAKE_LATENESS.observe(max(outcome.wake_lateness_s, 0.0))
    logs.event(log, logging.DEBUG, "waker: step woke, run resumed", run_id=run_id, step_id=step_id)


async def run(
    store: Store,
    config: NodeConfig,
    node_id: str,
    kicks: trio.MemorySendChannel[Kick],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run until cancelled; sleeps until the earliest wake time (at most ``waker_interval``)."""
    interval = config.timings.waker_interval_s
    limiter = trio.CapacityLimiter(RESUME_CONCURRENCY)
    # Set when this node parks a step with a wake time: it may be due before the
    # loop's planned wake-up, so the loop re-reads the earliest wake at once.
    earlier = trio.Event()

    def on_wake_scheduled(wake_at: float) -> None:
        earlier.set()

    # Unregistered on the way out: the supervisor restarts a crashed waker on
    # the same store, and each restart would otherwise leave one more listener.
    unregister = store.on_wake_scheduled(on_wake_scheduled)
    crash_after_claim = os.environ.get(FAULT_EXIT_AFTER_CLAIM_ENV) == "1"
    try:
        task_status.started()
        while True:
            claimed = await store.claim_elapsed_steps(node_id, BATCH)
            if claimed and crash_after_claim:
                logs.event(log, logging.CRITICAL, "waker: test fault: exiting between claim and resume",
                           claimed=len(claimed))
                os._exit(FAULT_EXIT_CODE)
            async with trio.open_nursery() as nursery:
                for run_id, step_id in claimed:
                    nursery.start_soon(_resume, store, node_id, run_id, step_id, limiter, kicks)
            if len(claimed) == BATCH:
                continue
            next_wake = await store.seconds_until_next_wake()
            delay = interval if next_wake is None else min(interval, max(next_wake, 0.0) + WAKE_SLACK_S)
            with trio.move_on_after(delay):
                await earlier.wait()
            if earlier.is_set():
                earlier = trio.Event()
    finally:
        unregister()
