"""The scheduler: fires cron ticks (docs/schedules.md).

Every node runs one. Each pass is one store transaction
(:meth:`~ironflow.store.Store.fire_due_ticks`) that claims each due tick in
the database — unique per function and scheduled time — and creates its run,
due-ness judged by the database clock: two nodes (or a node and its restart)
passing at the same instant start one run per tick, by construction, not by
timing. Between passes the scheduler sleeps until the earliest next tick, in
the waker's exact-deadline style, at most ``scheduler_recheck_s`` (a schedule
registered through another node is seen within it); a registration through
this node wakes it at once. A pass reads the earliest ``next_at`` (one index
lookup, off the write path) and opens the firing transaction only when a
tick is due: with nothing scheduled, or nothing due, it writes nothing.
A function no worker served within ``limits.function_live_s`` starts no runs:
the pass records its ticks as skipped (``NO_LIVE_WORKER``), decided in the
same transaction from the database's sessions, so every node decides alike;
a worker registering it makes the schedule due and its catch-up policy runs.
"""

from __future__ import annotations

import logging

import trio

from actors.messages import Kick, kick
from ironflow import logs
from ironflow.config import NodeConfig
from ironflow.store import Store

log = logging.getLogger("ironflow.scheduler")

# Schedules fired per transaction: a burst of due schedules (many functions
# on one minute) is fired in a few short transactions, not one long one.
BATCH = 200
# Wake this long after a tick: the claim is `next_at <= ironflow_now()` in
# SQL, and the database clock must have reached it.
TICK_SLACK_S = 0.005
# A due schedule another node is firing is looked at again after this: its
# transaction is short, and the next pass then finds it no longer due.
BUSY_RETRY_S = 0.05


async def run(
    store: Store,
    config: NodeConfig,
    node_id: str,
    kicks: trio.MemorySendChannel[Kick],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run until cancelled: fire the due ticks, kick the dispatcher, sleep
    until the next tick (at most ``scheduler_recheck_s``).

    Args:
      store: each pass is one transaction (claims, runs, next ticks).
      config: ``scheduler_recheck_s`` (the longest sleep),
        ``cron_missed_after_s`` (older due ticks were missed: the schedule's
        catch-up policy decides) and ``limits.function_live_s`` (a function
        no worker served for longer starts no runs).
      node_id: recorded with each claim.
      kicks: one kick per pass that started runs.

    A store outage is waited out by the supervisor; the ticks that passed
    meanwhile are then due, and their schedules' catch-up policies decide.
    """
    recheck = config.timings.scheduler_recheck_s
    missed_after = config.timings.cron_missed_after_s
    live_within = config.limits.function_live_s
    # Set when a registration through this node may have changed schedules.
    changed = trio.Event()

    def on_schedules_changed() -> None:
        changed.set()

    # Unregistered on the way out: a restarted scheduler registers again.
    unregister = store.on_schedules_changed(on_schedules_changed)
    try:
        task_status.started()
        while True:
            until = await store.seconds_until_next_tick()
            if until is not None and until <= 0:
                fired = await store.fire_due_ticks(
                    node_id, limit=BATCH, missed_after_s=missed_after, live_within_s=live_within
                )
                if fired:
                    kick(kicks, "cron ticks fired")
                    for tick in fired:
                        logs.event(log, logging.DEBUG, "scheduler: tick fired",
                                   function_id=tick.function_id, scheduled_at=tick.scheduled_at,
                                   run_id=tick.run_id)
                until = await store.seconds_until_next_tick()
                if until is not None and until <= 0 and not fired:
                    # Still due, nothing fired: another node holds the schedule
                    # (SKIP LOCKED) and is firing it. Look again shortly.
                    until = BUSY_RETRY_S
            delay = recheck if until is None else min(recheck, max(until, 0.0) + TICK_SLACK_S)
            with trio.move_on_after(delay):
                await changed.wait()
            if changed.is_set():
                changed = trio.Event()
    finally:
        unregister()
