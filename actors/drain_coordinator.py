"""The drain coordinator: a node SIGTERM/SIGINT becomes a Shutdown to every session.

On the first signal the node stops taking new worker sessions, sends every
connected streaming worker ``Shutdown(drain_timeout_ms)`` so it drains (refuses
new work with JobNack(DRAINING), finishes what it runs, half-closes), and waits
until every streaming session has gone or the drain deadline passes. The node
then stops serving; whatever is still leased recovers through loop 1.
"""

from __future__ import annotations

import logging

import trio

from actors.directory import SessionDirectory
from ironflow import logs
from ironflow.config import NodeConfig
from ironflow.protocol import Shutdown

log = logging.getLogger("ironflow.drain")


async def run(
    config: NodeConfig,
    directory: SessionDirectory,
    shutdown_requested: trio.Event,
    drained: trio.Event,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Wait for ``shutdown_requested``, drain the sessions, then set ``drained``."""
    task_status.started()
    await shutdown_requested.wait()
    timeout = config.timings.drain_timeout_s
    deadline = trio.current_time() + timeout
    sessions = directory.streaming()
    logs.event(log, logging.INFO, "drain: node draining, Shutdown sent", sessions=len(sessions), drain_timeout_s=timeout)
    message = Shutdown("engine node shutting down", int(timeout * 1000))
    for session in sessions:
        session.draining = True
        try:
            session.outbox.send_nowait(message)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    with trio.move_on_at(deadline) as scope:
        while directory.streaming():
            await directory.wait_changed()
    left = len(directory.streaming())
    logs.event(
        log,
        logging.INFO if not scope.cancelled_caught else logging.WARNING,
        "drain: complete" if not scope.cancelled_caught else "drain: deadline reached",
        sessions_left=left,
    )
    drained.set()
