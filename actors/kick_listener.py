"""Carries dispatcher kicks between nodes that share one PostgreSQL database.

Work that one node makes runnable (an event ingested, a recovery, a released
reservation) may be for a worker connected to another node. The store
publishes a notification at commit; this actor turns each one into a local
kick, so a worker on any node is woken without waiting on a timer.
"""

from __future__ import annotations

import trio

from actors.messages import Kick, kick
from ironflow.store import Store


async def run(
    store: Store,
    kicks: trio.MemorySendChannel[Kick],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen until cancelled; a lost database connection crashes the actor (and it restarts)."""
    await store.watch_kicks(lambda: kick(kicks, "notify"), task_status=task_status)
