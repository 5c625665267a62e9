"""The node supervisor: starts each actor, restarts a crashed one with backoff.

A crash of one actor is a value the supervisor decides about, not the end of
the node: it is logged, counted, and the actor is started again after an
exponential backoff. Because every actor keeps its state in the database (or
in objects the node owns and passes in again), a restarted actor simply
resumes its loop.

An outage of the database is not a crash: an actor whose store call met one
(:class:`~ironflow.store.StoreUnavailable`) waits until the store is back
(the store monitor decides that, ``actors/store_monitor.py``) and then resumes
its loop — not counted as a restart, not logged per actor (the store logs
the outage once, and its end once).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ironflow import logs
from ironflow.config import Timings
from ironflow.engine import metrics
from ironflow.store import Availability, StoreUnavailable

log = logging.getLogger("ironflow.supervisor")

# An actor that ran at least this long before crashing is considered healthy
# again: its next restart starts from the initial backoff.
HEALTHY_RUN_S = 10.0


class InjectedCrash(Exception):
    """Raised inside an actor by :meth:`Supervisor.crash` (chaos tests)."""


class _Child:
    def __init__(self, name: str) -> None:
        self.name = name
        self.scope: trio.CancelScope | None = None
        self.crash_requested = False
        self.restarts = 0


class Supervisor:
    """Owns the actors of one node. Create it inside the node's nursery.

    ``availability``: the store's (see the module docstring); without it an
    outage is a crash like any other.
    """

    def __init__(
        self, nursery: trio.Nursery, timings: Timings, availability: Availability | None = None
    ) -> None:
        self._nursery = nursery
        self._timings = timings
        self._availability = availability
        self._children: dict[str, _Child] = {}

    @property
    def names(self) -> list[str]:
        return list(self._children)

    def restarts(self, name: str) -> int:
        return self._children[name].restarts

    async def start(self, name: str, actor: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Start ``actor(*args, task_status=...)`` under supervision; return once it is ready.

        If the actor crashes before reporting ready, it is restarted until it
        does; the caller waits.
        """
        child = _Child(name)
        self._children[name] = child
        await self._nursery.start(self._supervise, child, actor, args)

    def crash(self, name: str) -> bool:
        """Make actor ``name`` fail now, as if it raised (tests and chaos scripts).

        Returns False, and changes nothing, while the actor is not running
        (waiting out its restart backoff): a request then would otherwise stay
        pending and turn the restarted actor's next clean exit into a crash.
        Raises KeyError for a name the supervisor does not own.
        """
        child = self._children[name]
        if child.scope is None:
            return False
        child.crash_requested = True
        child.scope.cancel()
        return True

    async def _supervise(
        self,
        child: _Child,
        actor: Callable[..., Awaitable[Any]],
        args: tuple[Any, ...],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        backoff = self._timings.restart_backoff_s
        ready_reported = False
        while True:
            started_at = trio.current_time()
            error: BaseException | None = None
            try:
                with trio.CancelScope() as scope:
                    child.scope = scope
                    async with trio.open_nursery() as inner:
                        await inner.start(lambda task_status: actor(*args, task_status=task_status))
                        if not ready_reported:
                            task_status.started()
                            ready_reported = True
                if child.crash_requested:
                    error = InjectedCrash(f"crash injected into {child.name}")
                else:
                    logs.event(log, logging.INFO, "actor: exited", actor=child.name)
                    return
            except Exception as exc:  # a crash is a value we decide about
                error = exc
            finally:
                child.scope = None
                child.crash_requested = False
            if self._availability is not None and _only_outages(error):
                log.debug("actor %s waits for the store", child.name)
                # The store may not be marked down (yet, or at all: a lone
                # connection died): then wait one backoff, never spin.
                if self._availability.up:
                    await trio.sleep(self._timings.restart_backoff_s)
                await self._availability.wait_up()
                backoff = self._timings.restart_backoff_s
                continue
            if trio.current_time() - started_at >= HEALTHY_RUN_S:
                backoff = self._timings.restart_backoff_s
            child.restarts += 1
            metrics.ACTOR_RESTARTS.labels(actor=child.name).inc()
            logs.event(
                log,
                logging.ERROR,
                "actor: crashed, restarting",
                actor=child.name,
                error=repr(error),
                restart_in_s=f"{backoff:.3f}",
                restarts=child.restarts,
            )
            await trio.sleep(backoff)
            backoff = min(backoff * 2, self._timings.restart_backoff_max_s)


def _only_outages(error: BaseException | None) -> bool:
    """Whether ``error`` is a store outage (alone or every leaf of a group)."""
    if isinstance(error, StoreUnavailable):
        return True
    if isinstance(error, BaseExceptionGroup):
        _, rest = error.split(StoreUnavailable)
        return rest is None
    return False
