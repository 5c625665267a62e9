"""The dispatcher: matches runnable segments to local sessions with free credits.

Kicked, not polling: it runs a round whenever a producer sends a
:class:`~actors.messages.Kick` (event ingested, result, nack, recovery,
session opened), and otherwise sleeps exactly until the earliest
``eligible_at`` in the queue — so a recovery-grace or retry-delay countdown is
followed by dispatch with no tick added (deliberately beyond the seed).
"""

from __future__ import annotations

import logging
import time

import trio

from actors.directory import LocalSession, SessionDirectory
from actors.messages import Kick
from ironflow import logs, metrics, tracing
from ironflow.config import NodeConfig
from ironflow.protocol import TERMINAL_RUN_STATUSES, JobAssignment
from ironflow.store import Reservation, Reservations, RunNotFound, Store

log = logging.getLogger("ironflow.dispatcher")

# Segments admitted per store round trip: large enough to fill a 50-slot
# worker in one transaction, small enough to keep one transaction short.
BATCH = 64


async def _release(store: Store, reservation: Reservation) -> None:
    """Give a reservation no session took back at once (not at its expiry)."""
    a = reservation.assignment
    await store.release_reservation(reservation.session_id, a.run_id, a.execution_seq)


def _deliver(session: LocalSession | None, assignment: JobAssignment) -> bool:
    """Put ``assignment`` in the session's outbox; False if the session is gone or full."""
    if session is None:
        return False
    try:
        session.outbox.send_nowait(assignment)
    except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
        return False
    return True


async def _deliver_at_start(
    store: Store, directory: SessionDirectory, reservation: Reservation
) -> None:
    """Hold a job for a worker that cannot hold it itself (it did not register
    ``delayed_start``) until its start time, then deliver it. The reservation
    outlasts the wait (config: the look-ahead is at most half its expiry).

    A run that moved on meanwhile (cancelled, or its segment fenced) is not
    delivered: such a worker would start its handler before the engine could
    refuse its ack, and whoever moved the run on already dropped the reservation."""
    a = reservation.assignment
    await trio.sleep(a.start_delay_ms / 1000)
    try:
        run = await store.get_run_record(a.run_id)
    except RunNotFound:
        return
    if run.status in TERMINAL_RUN_STATUSES or run.current_execution_seq != a.execution_seq:
        logs.event(log, logging.INFO, "dispatch: held job not delivered, its run moved on",
                   run_id=a.run_id, execution_seq=a.execution_seq, session_id=reservation.session_id)
        return
    if not _deliver(directory.get(reservation.session_id), a):
        await _release(store, reservation)


def _dispatch_span(
    a: JobAssignment, session_id: str, started_ns: int, session: LocalSession | None
) -> None:
    """The ``ironflow.dispatch`` span of a traced run's segment: reserved → handed
    to the session (ironflow/tracing.py); the session keeps the trace for its
    commit spans."""
    span = tracing.start_span(
        "ironflow.dispatch",
        a.event.traceparent,
        {
            "ironflow.run_id": a.run_id,
            "ironflow.function_id": a.function_id,
            "ironflow.execution_seq": a.execution_seq,
            "ironflow.session_id": session_id,
        },
        kind=tracing.SpanKind.PRODUCER,
        start_time=started_ns,
    )
    span.end()
    if session is not None and a.event.traceparent is not None:
        session.traceparents[a.run_id] = a.event.traceparent


async def _dispatch_round(
    store: Store,
    config: NodeConfig,
    node_id: str,
    directory: SessionDirectory,
    holds: trio.Nursery,
) -> tuple[Reservations | None, float]:
    """Reserve and hand out segments until the queue or the credits run dry;
    return the last reservation transaction's answer (None if none ran: no
    session had a free credit) and when it came back (``trio.current_time``).

    A job that may not start yet goes out at once to a worker that holds it
    (``delayed_start``); for any other worker it is held in ``holds`` until
    its start time."""
    last: Reservations | None = None
    reserved = trio.current_time()
    while True:
        offers = directory.offers()
        if not offers:
            return last, reserved
        reserving_ns = time.time_ns()
        reservations = last = await store.reserve_segments(
            node_id,
            offers,
            BATCH,
            reservation_expiry_s=config.timings.reservation_expiry_s,
        )
        reserved = trio.current_time()
        for reservation in reservations:
            assignment = reservation.assignment
            if assignment.db_now is not None:  # read before this moment
                directory.db_clock.observe(assignment.db_now, reserved)
            session = directory.get(reservation.session_id)
            if assignment.start_delay_ms and session is not None and not session.delayed_start:
                holds.start_soon(_deliver_at_start, store, directory, reservation)
            elif not _deliver(session, assignment):
                # The session went away between offer and delivery: give the
                # segment back at once instead of waiting for reservation expiry.
                await _release(store, reservation)
                continue
            metrics.ASSIGNMENTS.inc()
            if assignment.event.traceparent is not None:
                _dispatch_span(assignment, reservation.session_id, reserving_ns, session)
            if assignment.execution_seq == 1:  # a new run's first segment: emit → dispatch
                metrics.EMIT_TO_DISPATCH.observe(max(time.time() - assignment.event.received_at, 0.0))
            if reservation.wake_lateness_s is not None:
                # Handed over ahead of its wake time, it starts at that time
                # (the worker, or the hold above, waits): on time, 0.
                metrics.WAKE_LATENESS.observe(max(reservation.wake_lateness_s, 0.0))
            logs.event(
                log,
                logging.DEBUG,
                "dispatch: assigned",
                run_id=assignment.run_id,
                execution_seq=assignment.execution_seq,
                session_id=reservation.session_id,
                start_delay_ms=assignment.start_delay_ms or None,
            )
        if len(reservations) < BATCH:
            return last, reserved


async def run(
    store: Store,
    config: NodeConfig,
    node_id: str,
    directory: SessionDirectory,
    kicks: trio.MemoryReceiveChannel[Kick],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the dispatcher until cancelled.

    Args:
      store: engine state; every reservation is one store transaction.
      config: timings (reservation expiry, idle re-check).
      node_id: this node, recorded on reservations.
      directory: local sessions and their outboxes (owned by the node).
      kicks: wake-ups from producers; several pending kicks make one round.
    """
    async with trio.open_nursery() as holds:
        task_status.started()
        while True:
            # Swallow every pending kick: one round serves them all.
            while True:
                try:
                    kicks.receive_nowait()
                except trio.WouldBlock:
                    break
            last, read_at = await _dispatch_round(store, config, node_id, directory, holds)
            if kicks.statistics().current_buffer_used:
                # Kicked during the round: go again, no need to ask when to
                # wake. The store waits are shielded, so this is the loop's one
                # point where a cancel (shutdown, an injected crash) can land
                # while kicks keep coming.
                await trio.lowlevel.checkpoint()
                continue
            wait_s = config.timings.dispatch_idle_poll_s
            if directory.offers():
                if isinstance(last, Reservations) and last.next_eligible_known:
                    # Read by the round's last transaction: less the time since.
                    next_eligible = last.next_eligible
                    if next_eligible is not None and next_eligible > 0:
                        next_eligible = max(next_eligible - (trio.current_time() - read_at), 1e-6)
                else:
                    next_eligible = await store.seconds_until_next_eligible()
                # 0 means "every row is eligible now but none could start" (no
                # free credit, a full concurrency limit): only a kick (a freed
                # slot, a new session) can change that. A row due later (a
                # throttled start) is counted even while others wait so.
                if next_eligible is not None and next_eligible > 0:
                    wait_s = min(wait_s, next_eligible)
            with trio.move_on_after(wait_s):
                await kicks.receive()
