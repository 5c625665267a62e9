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
    """Record a heartbeat every ``node_heartbeat_s`` until cancelled.

    A database only this node uses (SQLite) gets the start-up row only: its
    ``heartbeat_at`` tells no other node anything, and an idle node should not
    write (the WAL would grow by a page every interval)."""
    await store.register_node(node_id)
    task_status.started()
    if not store.shared_by_nodes:
        await trio.sleep_forever()
    while True:
        await trio.sleep(config.timings.node_heartbeat_s)
        await store.node_heartbeat(node_id)
