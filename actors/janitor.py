"""The janitor: deletes finished history past ``history_retention``.

Every ``janitor_interval`` it runs one purge pass
(:func:`ironflow.store.retention.purge_pass`): finished runs that ended more than
``history_retention`` ago go with their steps and audit rows, then events
past the idempotency window that no remaining run references — in batches,
each its own short transaction, so live work is never held up for long. A
run that has not ended, a child whose parent is kept and an event inside the
idempotency window are never deleted; those guards are in the store's SQL.

On PostgreSQL one node purges at a time (a transaction-level advisory lock);
the others find it taken and wait for their next tick. ``history_retention``
0 keeps everything: the janitor then only reports the oldest run's age.
"""

from __future__ import annotations

import logging

import trio

from ironflow import logs
from ironflow.config import NodeConfig
from ironflow.engine import metrics
from ironflow.store import PurgeCounts, Store, retention

log = logging.getLogger("ironflow.janitor")


async def purge_once(store: Store, config: NodeConfig, node_id: str) -> PurgeCounts:
    """One janitor pass (nothing when retention is 0); refreshes the oldest-run gauge."""
    t = config.timings
    counts = PurgeCounts()
    if t.history_retention_s > 0:
        counts = await retention.purge_pass(
            store,
            older_than_s=t.history_retention_s,
            idempotency_window_s=config.idempotency_window_s,
            by=f"janitor:{node_id}",
        )
    if counts.total:
        logs.event(
            log,
            logging.INFO,
            "janitor: history past retention deleted",
            runs=counts.runs,
            steps=counts.steps,
            audit=counts.audit,
            events=counts.events,
        )
    age = await store.oldest_finished_run_age()
    metrics.HISTORY_OLDEST_RUN_AGE.set(age or 0.0)
    return counts


async def run(
    store: Store,
    config: NodeConfig,
    node_id: str,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a purge pass every ``janitor_interval`` until cancelled (Trio's clock)."""
    task_status.started()
    while True:
        await trio.sleep(config.timings.janitor_interval_s)
        await purge_once(store, config, node_id)
