"""The drain coordinator: a node SIGTERM/SIGINT becomes a Shutdown to every session.

On the first signal the node stops taking new worker sessions and work is no
longer offered to any session of this node. Every connected streaming worker
gets ``Shutdown(drain_timeout_ms)`` so it drains (refuses new work with
JobNack(DRAINING), finishes what it runs, half-closes); a pull worker gets the
same ``Shutdown`` in the answer to its next poll (a poll waiting now answers
at once). The coordinator waits until no streaming session is left and no
pull session of this node holds work, or the drain deadline passes. At the
deadline every session of this node still in the store is closed with its
leases recovered at once, as for a lost socket: a pull worker's jobs do not
wait for lease expiry. Start, outcome and each recovery are audited.

The deadline holds whatever the database does: while it is unavailable the
coordinator keeps waiting for the sessions (a store read that fails counts
as "not idle yet"), and at the deadline what it cannot record (the closes,
the audit) is logged and left: this node's leases expire in the database and
the other nodes recover them, as after a crash. The node then stops, and its
sessions give up frames they could not apply (``actors/session.py``).
"""

from __future__ import annotations

import logging

import trio

from actors.directory import SessionDirectory
from actors.recovered import note_recovered
from ironflow import logs
from ironflow.config import NodeConfig
from ironflow.protocol import SessionRecord, Shutdown
from ironflow.store import Store, StoreUnavailable

log = logging.getLogger("ironflow.drain")

# How often the store is asked whether this node's pull sessions still hold
# work: a pull worker's result arrives by HTTP, not through the directory.
PULL_CHECK_INTERVAL_S = 0.1


def _busy_pull(sessions: list[SessionRecord], node_id: str) -> list[SessionRecord]:
    return [s for s in sessions if s.node_id == node_id and s.mode == "pull" and s.credits_claimed > 0]


async def _wait_until_idle(store: Store, node_id: str, directory: SessionDirectory) -> None:
    while True:
        if not directory.streaming():
            try:
                if not _busy_pull(await store.list_sessions(), node_id):
                    return
            except StoreUnavailable:
                pass  # unknown: not idle yet (the deadline bounds the wait)
        with trio.move_on_after(PULL_CHECK_INTERVAL_S):
            await directory.wait_changed()


async def _recover_at_deadline(store: Store, config: NodeConfig, node_id: str) -> int:
    """Close every session of this node still in the store, recovering its leases now."""
    t = config.timings
    recovered = 0
    for session in await store.list_sessions():
        if session.node_id != node_id:
            continue
        segments = await store.close_session(
            session.session_id,
            recover_leases=True,
            recovery_grace_s=t.recovery_grace_s,
            recovery_ceiling=int(t.recovery_ceiling),
        )
        for seg in segments:
            recovered += 1
            # Counted and logged first: the store has recovered it already.
            note_recovered(
                log, seg, path="drain_deadline",
                message="drain: deadline reached, segment recovered",
                fields=dict(
                    execution_seq=seg.new_execution_seq, old_execution_seq=seg.old_execution_seq,
                    session_id=session.session_id, mode=session.mode,
                ),
            )
            await store.record_node_drain(
                "node.drain.recovered",
                {
                    "node_id": node_id,
                    "session_id": session.session_id,
                    "mode": session.mode,
                    "execution_seq": seg.old_execution_seq,
                    "new_execution_seq": seg.new_execution_seq,
                    "recovery_count": seg.recovery_count,
                },
                run_id=seg.run_id,
            )
    return recovered


async def _record(store: Store, kind: str, data: dict[str, object]) -> None:
    """Audit a step of the drain; while the database is unavailable, log it instead."""
    try:
        await store.record_node_drain(kind, data)
    except StoreUnavailable as exc:
        logs.event(log, logging.WARNING, "drain: not audited, the database is unavailable", type=kind, cause=str(exc))


async def run(
    store: Store,
    config: NodeConfig,
    node_id: str,
    directory: SessionDirectory,
    shutdown_requested: trio.Event,
    drained: trio.Event,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Wait for ``shutdown_requested``, drain the sessions, then set ``drained``.

    Args:
      store: to see this node's pull sessions' work, recover leases at the
        deadline and audit the drain.
      directory: this node's sessions; its ``drain_deadline`` is set here so a
        pull poll can tell the worker the time left.
    """
    task_status.started()
    await shutdown_requested.wait()
    timeout = config.timings.drain_timeout_s
    deadline = trio.current_time() + timeout
    directory.drain_deadline = deadline
    streaming = directory.streaming()
    for session in directory.all():
        session.draining = True  # the dispatcher offers draining sessions nothing
    try:
        pull = [
            s for s in await store.list_sessions() if s.node_id == node_id and s.mode == "pull"
        ]
    except StoreUnavailable:
        pull = []  # not known while the database is unavailable
    logs.event(
        log,
        logging.INFO,
        "drain: node draining, Shutdown sent",
        sessions=len(streaming),
        pull_sessions=len(pull),
        drain_timeout_s=timeout,
    )
    await _record(
        store,
        "node.drain.started",
        {
            "node_id": node_id,
            "streaming_sessions": len(streaming),
            "pull_sessions": len(pull),
            "drain_timeout_s": timeout,
        },
    )
    message = Shutdown("engine node shutting down", int(timeout * 1000))
    for session in streaming:
        try:
            session.outbox.send_nowait(message)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    with trio.move_on_at(deadline) as scope:
        await _wait_until_idle(store, node_id, directory)
    if not scope.cancelled_caught:
        logs.event(log, logging.INFO, "drain: complete", sessions_left=0)
        await _record(store, "node.drain.completed", {"node_id": node_id, "recovered": 0})
    else:
        left = len(directory.streaming())
        try:
            busy_pull = len(_busy_pull(await store.list_sessions(), node_id))
            recovered = await _recover_at_deadline(store, config, node_id)
        except StoreUnavailable as exc:
            logs.event(
                log,
                logging.WARNING,
                "drain: deadline reached, the database is unavailable: this node's leases are"
                " recovered by the other nodes once they expire",
                sessions_left=left,
                cause=str(exc),
            )
            drained.set()
            return
        logs.event(
            log,
            logging.WARNING,
            "drain: deadline reached",
            sessions_left=left,
            pull_sessions_busy=busy_pull,
            recovered=recovered,
        )
        await _record(
            store,
            "node.drain.deadline_reached",
            {
                "node_id": node_id,
                "streaming_sessions_left": left,
                "pull_sessions_busy": busy_pull,
                "recovered": recovered,
            },
        )
    drained.set()
