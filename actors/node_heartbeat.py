"""Keeps this node's row in ``nodes`` fresh (observability of the cluster)."""

from __future__ import annotations

import trio

from ironflow.config import NodeConfig
from ironflow.store import Store


async def run(
    store: Store,
    config: NodeConfig,
    node_id: str,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Record a heartbeat every ``node_heartbeat_s`` until cancelled."""
    await store.register_node(node_id)
    task_status.started()
    while True:
        await trio.sleep(config.timings.node_heartbeat_s)
        await store.node_heartbeat(node_id)
