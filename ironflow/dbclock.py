"""A lower bound of the database clock in a process's Trio clock.

A held job (a sleep woken ahead of its time) must not start before its time
by the database clock. Neither the worker nor the node may trust its own wall
clock for that; both learn the database clock from readings of it
(``ironflow_clock()``) taken inside transactions: a reading made before the
moment it is looked at is never ahead of the database at that moment.

The worker holds each job until the database has surely reached its start
(:class:`~ironflow.sdk.lifecycle._StartGates`); the node, which learns the
clock the same way from its reservations, re-stamps a held job's reading as it
writes the job to the socket (:func:`actors.directory.fresh_start`), so the
worker's bound is as old as the socket hop rather than the reservation's
commit and the dispatcher's round.
"""

from __future__ import annotations

# How fast the database clock and this process's monotonic clock may drift
# apart: a generous bound for NTP-disciplined clocks (they slew at most 500
# ppm). A clock offset observed t seconds ago is trusted less by this × t, so
# a held job never starts before its time by the database clock.
CLOCK_DRIFT = 500e-6


class DatabaseClock:
    """A lower bound of (database clock − Trio clock), learnt from readings.

    A reading ``db_now`` looked at (Trio time) ``seen`` was made before it was
    seen, so ``db_now − seen`` never exceeds the true offset; the largest such
    sample (the reading that spent least time in queues and in transit) is the
    tightest bound, aged by :data:`CLOCK_DRIFT`. Only differences of the
    database clock are used: the process's own wall clock plays no part.
    """

    def __init__(self) -> None:
        self._best: float | None = None
        self._at = 0.0

    @property
    def sampled(self) -> bool:
        return self._best is not None

    def observe(self, db_now: float, received: float) -> bool:
        """Take one sample; True if it tightened the bound."""
        sample = db_now - received
        if self._best is not None and sample <= self._best - CLOCK_DRIFT * (received - self._at):
            return False
        self._best, self._at = sample, received
        return True

    def local_time(self, db_time: float) -> float | None:
        """The earliest Trio time at which the database clock has surely reached
        ``db_time`` (None before any sample): the least t with
        t + best − DRIFT·(t − at) ≥ db_time."""
        if self._best is None:
            return None
        return (db_time - self._best - CLOCK_DRIFT * self._at) / (1 - CLOCK_DRIFT)

    def db_time(self, local: float) -> float | None:
        """A database time surely reached by Trio time ``local`` (None before
        any sample): ``local`` + the bound aged to ``local``."""
        if self._best is None:
            return None
        return local + self._best - CLOCK_DRIFT * max(local - self._at, 0.0)
