"""Keeps the capacity gauges of ``/metrics`` current: queue depth by state,
active leases and live sessions by transport, read from the database.

The counts are cluster-wide (every node reports the same numbers; aggregate
with ``max`` across nodes, not ``sum``).
"""

from __future__ import annotations

import trio

from ironflow.engine import metrics
from ironflow.store import Store

# Every transport a session can use, so a gauge drops to 0 rather than vanishing.
TRANSPORTS = ("stream", "pull")


async def run(
    store: Store, *, period_s: float, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Sample the capacity counts every ``period_s`` seconds until cancelled.

    Args:
      store: the node's store (one ``capacity_gauges`` read per sample).
      period_s: seconds between samples.
    """
    task_status.started()
    while True:
        counts = await store.capacity_gauges()
        metrics.QUEUE_DEPTH.labels(state="runnable").set(counts.runnable)
        metrics.QUEUE_DEPTH.labels(state="in_grace").set(counts.in_grace)
        metrics.QUEUE_DEPTH.labels(state="delayed").set(counts.delayed)
        metrics.ACTIVE_LEASES.set(counts.leases)
        for transport in {*TRANSPORTS, *counts.sessions_by_mode}:
            metrics.SESSIONS.labels(transport=transport).set(counts.sessions_by_mode.get(transport, 0))
        await trio.sleep(period_s)
