"""Reservations handed to the local sessions they were made for.

A reservation transaction (the dispatcher's round, or an emit's own
transaction: ``Store.ingest_and_reserve``) answers assignments; this puts
each in its session's outbox, gives back at once one whose session is gone
or full, and holds a job that may not start yet for a worker that cannot
hold it itself. The dispatcher and the emit path hand out the same way.
"""

from __future__ import annotations

import logging
import time

import trio

from actors.directory import LocalSession, SessionDirectory
from ironflow import logs, tracing
from ironflow.engine import metrics
from ironflow.protocol import TERMINAL_RUN_STATUSES, JobAssignment
from ironflow.store import Reservation, RunNotFound, Store, StoreError

log = logging.getLogger("ironflow.dispatcher")

# Segments admitted per reservation round: large enough to fill a 50-slot
# worker in one transaction, small enough to keep one transaction short.
BATCH = 64


async def hand_out(
    store: Store,
    directory: SessionDirectory,
    reservations: list[Reservation],
    reserving_ns: int,
    holds: trio.Nursery | None,
) -> None:
    """Deliver ``reservations`` (made by a transaction that began at
    ``reserving_ns``, wall clock) to their sessions' outboxes.

    A job that may not start yet goes out at once to a worker that holds it
    (``delayed_start``); for any other worker it is held in ``holds`` until
    its start time (given back at once when there is no ``holds``). A
    reservation whose session went away or is full is given back at once,
    not at its expiry."""
    reserved = trio.current_time()
    for reservation in reservations:
        assignment = reservation.assignment
        if assignment.db_now is not None:  # read before this moment
            directory.db_clock.observe(assignment.db_now, reserved)
        session = directory.get(reservation.session_id)
        if reservation.state_bytes:
            directory.note_state(assignment.job_id, reservation.state_bytes)
        if assignment.start_delay_ms and session is not None and not session.delayed_start:
            if holds is None:
                await _release(store, reservation)
                continue
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


async def hand_out_or_expire(
    store: Store,
    directory: SessionDirectory,
    reservations: list[Reservation],
    reserving_ns: int,
    made_by: str,
) -> None:
    """:func:`hand_out` for reservations made inside another call's
    transaction (``made_by``: an emit's, a completion's), with no task to
    hold a job until its start. One that can be neither handed out nor given
    back (the store failed meanwhile) waits for its reservation's expiry: the
    call it rode on committed and must not fail for it."""
    if not reservations:
        return
    try:
        await hand_out(store, directory, reservations, reserving_ns, None)
    except StoreError as exc:
        logs.event(
            log, logging.WARNING, f"dispatch: {made_by}'s reservation not handed out, it expires",
            error=type(exc).__name__, reservations=len(reservations),
        )


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
