"""Whether the database answers: the store's availability, a state rather than an error.

An outage of the database (connection refused or reset, PostgreSQL shutting
down or in recovery, a read-only standby, a full disk, a read-only file
system) is not a fault of the node. Each backend recognises the errors that
mean one (its ``_unavailable`` classifier) and raises
:class:`~ironflow.store.base.StoreUnavailable` (``StorageFull`` for a full
disk) in place of the driver's error; the first such error marks the store
*down* here, with the cause, and logs one line. From then on:

- the API answers 503 ``STORE_UNAVAILABLE`` / 507 ``STORAGE_FULL`` with a
  ``Retry-After`` (``ironflow/api/errors.py``) and ``/readyz`` answers 503;
- a supervised actor whose store call failed so waits in
  :meth:`Availability.wait_up` instead of crash-looping (``actors/supervisor.py``);
- a worker session holds the frame it could not apply and applies it once
  the store is back (``actors/session.py``): the socket stays open;
- the store monitor (``actors/store_monitor.py``) probes until a write goes
  through, gives back the leases of this node the time it was blind, and
  only then marks the store *up* (one log line, with the outage's duration).

Nothing here talks to the database: this is the state and its transitions,
on the Trio thread.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

import outcome
import trio

from ironflow import logs
from ironflow.store.errors import StorageFull, StoreError, StoreUnavailable

T = TypeVar("T")

log = logging.getLogger("ironflow.store")

# True in a task whose store calls are answered rather than awaited to the
# end when the database stops answering: an HTTP request (its client would
# time out anyway, and must be answered within a second), the monitor's probe.
# Such a call is given up, with StoreUnavailable, as soon as the store is
# marked down, and on cancel, even after the database took it (its outcome
# then unknown: the message says so). Elsewhere (actors, worker sessions) a
# call the database took is awaited to its commit or rollback, never dropped.
# Only PostgreSQL's calls can be stuck on a connection that went silent;
# SQLite's are in-process and ignore it.
ANSWER_WHEN_DOWN: ContextVar[bool] = ContextVar("ironflow_answer_when_down", default=False)


@contextlib.contextmanager
def answered_when_down() -> Iterator[None]:
    """Within it, this task's store calls are :data:`ANSWER_WHEN_DOWN`."""
    token = ANSWER_WHEN_DOWN.set(True)
    try:
        yield
    finally:
        ANSWER_WHEN_DOWN.reset(token)


class Availability:
    """Up or down, since when, and why. Every method is called on the Trio thread."""

    def __init__(self) -> None:
        self.up = True
        # What the last outage's first error said (the API's message names it).
        self.cause = ""
        # The code of that error: STORE_UNAVAILABLE or STORAGE_FULL.
        self.code = ""
        # Trio time the store went down (meaningful while down).
        self.down_since = 0.0
        # Trio time of the last call that reached the database: the node has
        # been blind since then, not only since the first error it saw.
        self.last_ok = 0.0
        # last_ok when the store went down: the blind time runs from there
        # (the monitor's own probe reaches the database before it is up).
        self._blind_since = 0.0
        # Set while a store monitor runs (actors/store_monitor.py): only then
        # does a call fail fast during an outage (someone will notice its
        # end); a store used without one keeps trying the database.
        self.monitored = False
        self._back = trio.Event()
        self._back.set()
        # Called once the store is marked down: a backend answers the calls
        # still waiting on the database that are ANSWER_WHEN_DOWN.
        self.on_down: Callable[[], None] | None = None

    def check(self) -> None:
        """Raise the outage at once, without trying the database, while one
        is known and monitored: a 503 then costs no connection attempt and no
        thread hop (the monitor's probes find the end of it)."""
        if self.up or not self.monitored:
            return
        raise (StorageFull if self.code == StorageFull.code else StoreUnavailable)(self.cause)

    def reached(self) -> None:
        """A call reached the database (committed or got the database's own answer)."""
        try:
            self.last_ok = trio.current_time()
        except RuntimeError:
            pass  # outside a Trio run (a synchronous helper in a test)

    def went_down(self, code: str, cause: str) -> None:
        """A call failed because the database is unavailable; logs the first one only."""
        if not self.up:
            return
        self.up = False
        self.code, self.cause = code, cause
        self.down_since = trio.current_time()
        self._blind_since = self.last_ok
        self._back = trio.Event()
        logs.event(log, logging.WARNING, "store: unavailable", code=code, cause=cause)
        if self.on_down is not None:
            self.on_down()

    def came_back(self) -> float:
        """The store answers again (the monitor proved a write); returns how long
        it was down, 0 if it was not. Wakes every :meth:`wait_up`."""
        if self.up:
            return 0.0
        down_s = trio.current_time() - self.down_since
        self.up = True
        self._back.set()
        logs.event(
            log, logging.WARNING, "store: available again", code=self.code, cause=self.cause,
            down_s=f"{down_s:.3f}",
        )
        return down_s

    def blind_s(self) -> float:
        """Seconds since the last call that reached the database before the
        store went down (while up: since the last call that reached it)."""
        since = self.last_ok if self.up else self._blind_since
        return max(0.0, trio.current_time() - since)

    async def wait_up(self) -> None:
        """Return once the store is up (at once if it is)."""
        await self._back.wait()


def settle(
    availability: Availability,
    result: outcome.Outcome[T],
    classify: Callable[[BaseException], StoreError | None],
) -> T:
    """``result``'s value, or its error — as :class:`StoreUnavailable` (and the
    store marked down) when ``classify`` says the error is an outage, as the
    other store error it names if any (a timeout: the database is up)."""
    if isinstance(result, outcome.Error):
        error = result.error
        if not isinstance(error, Exception):
            # Cancelled (a probe given up on, its thread abandoned): nothing
            # was heard from the database, so it is not marked reached.
            return result.unwrap()
        gone = _outage(error, classify)
        if gone is not None:
            if isinstance(gone, StoreUnavailable):
                availability.went_down(gone.code, str(gone))
            else:
                availability.reached()  # the database answered: with a timeout
            if gone is error:
                return result.unwrap()  # raised as it is, traceback kept
            raise gone from error
    availability.reached()
    return result.unwrap()


def _outage(
    error: BaseException, classify: Callable[[BaseException], StoreError | None]
) -> StoreError | None:
    """``error`` as an outage: itself if the store already raised one (e.g.
    CommitOutcomeUnknown), else what ``classify`` makes of a driver error."""
    if isinstance(error, StoreUnavailable):
        return error
    return classify(error)


def translated(
    availability: Availability,
    results: list[outcome.Outcome[Any]],
    classify: Callable[[BaseException], StoreError | None],
) -> list[outcome.Outcome[Any]]:
    """:func:`settle` for a list of outcomes, without unwrapping them."""
    out: list[outcome.Outcome[Any]] = []
    for result in results:
        error = result.error if isinstance(result, outcome.Error) else None
        gone = _outage(error, classify) if error is not None else None
        if gone is not None:
            if gone is not error:
                gone.__cause__ = error
            if isinstance(gone, StoreUnavailable):
                availability.went_down(gone.code, str(gone))
            out.append(outcome.Error(gone))
        else:
            availability.reached()
            out.append(result)
    return out
