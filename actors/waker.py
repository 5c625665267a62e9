"""The waker: claims elapsed sleeps and timed-out waits/invokes and resumes their runs.

A claim moves the step to ``waking`` (claimed_by = this node, SKIP LOCKED so
exactly one node claims it); resuming queues the run's next segment. Both are
one transaction per batch. If the node dies between the two, loop 2 (the
stale-claim sweeper) restores the step.

Look-ahead (``waker_lookahead``): a sleep is claimed and resumed that long
before its wake time, and its run's next segment carries the wake time as its
start (``runs.start_at``): it is dispatched at once and held — by the worker,
or by the dispatcher for a worker that cannot hold — until then. A burst of
sleeps due at one instant is therefore claimed, queued and delivered before
the instant rather than worked through after it. Waits' and invokes' timeouts
are never resolved ahead: an event or the child may still come.
"""

from __future__ import annotations

import logging

import trio

from actors.messages import Kick, kick
from ironflow import logs
from ironflow.config import NodeConfig
from ironflow.store import Store

log = logging.getLogger("ironflow.waker")

# Steps claimed per transaction (and resumed, set-based, in the next one):
# a burst of 1,000 is claimed and queued in two pairs of transactions, early
# in the look-ahead, and two nodes racing over it still take half each.
BATCH = 500
# Wake this long after a claimable time: the claim is `wake_at <= now (+
# look-ahead)` in SQL, and the database clock must have reached it.
WAKE_SLACK_S = 0.005


async def run(
    store: Store,
    config: NodeConfig,
    node_id: str,
    kicks: trio.MemorySendChannel[Kick],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run until cancelled: claim a batch, resume it, kick the dispatcher; then
    sleep until the next claimable time (at most ``waker_interval``).

    Args:
      store: claims and resumes are one transaction per batch each.
      config: ``waker_interval`` (the longest sleep) and ``waker_lookahead``
        (how far ahead a sleep is claimed; 0 = at its wake time).
      node_id: recorded as the claimer (loop 2 restores a dead claimer's steps).
      kicks: one kick per batch that queued runs.

    A run cancelled (or a step restored by loop 2) between claim and resume
    is an expected race: it is skipped and logged, the rest of the batch goes on.
    """
    interval = config.timings.waker_interval_s
    lookahead = config.timings.waker_lookahead_s
    # Set when this node parks a step with a wake time: it may be due before the
    # loop's planned wake-up, so the loop re-reads the earliest wake at once.
    earlier = trio.Event()

    def on_wake_scheduled(wake_at: float) -> None:
        earlier.set()

    # Unregistered on the way out: the supervisor restarts a crashed waker on
    # the same store, and each restart would otherwise leave one more listener.
    unregister = store.on_wake_scheduled(on_wake_scheduled)
    try:
        task_status.started()
        while True:
            claimed = await store.claim_elapsed_steps(node_id, BATCH, lookahead_s=lookahead)
            if claimed:
                outcome = await store.resume_claimed_steps(node_id, claimed)
                if outcome.resumed:
                    kick(kicks, "steps woke")
                for run_id, step_id in outcome.lost:
                    # The claim was taken away since (the run was cancelled, or
                    # loop 2 restored the step): nothing is ours to resume.
                    logs.event(log, logging.INFO, "waker: claim lost before resume",
                               run_id=run_id, step_id=step_id)
                logs.event(log, logging.DEBUG, "waker: steps woke, runs resumed",
                           claimed=len(claimed), resumed=len(outcome.resumed))
            if len(claimed) == BATCH:
                continue
            next_wake = await store.seconds_until_next_wake(lookahead)
            delay = interval if next_wake is None else min(interval, next_wake + WAKE_SLACK_S)
            with trio.move_on_after(delay):
                await earlier.wait()
            if earlier.is_set():
                earlier = trio.Event()
    finally:
        unregister()
