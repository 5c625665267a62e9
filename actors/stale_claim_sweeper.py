"""Loop 2 — the stale-claim sweeper (seed: docs/seeds/crash-recovery.txt).

Every ``stale_claim_interval`` it restores ``waking`` steps whose claim is
older than ``stale_claim_threshold`` and whose run holds neither a lease nor a
queue row to their ``pre_claim_status``. The ``NOT EXISTS`` guards live in the
store's SQL: the two loops are disjoint by construction, not by timing.
"""

from __future__ import annotations

import logging

import trio

from ironflow import logs
from ironflow.config import NodeConfig
from ironflow.store import Store

log = logging.getLogger("ironflow.stale_claims")


async def run(
    store: Store,
    config: NodeConfig,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run loop 2 until cancelled."""
    t = config.timings
    task_status.started()
    while True:
        await trio.sleep(t.stale_claim_interval_s)
        reset = await store.reset_stale_claims(t.stale_claim_threshold_s)
        if reset:
            logs.event(log, logging.WARNING, "stale claims: steps restored to pre_claim_status", count=reset)
