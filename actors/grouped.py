"""Calls of one kind from concurrent tasks, applied together.

Many tasks each have one item for the store (a worker session's lanes: the
acks, step results and job results of different runs; the API's requests:
emits). One store call each is a group-commit request and a statement each;
on PostgreSQL every statement is a round trip through a database thread, the
node's scarcest resource under load. :class:`Grouped` queues the items and
applies whatever has queued as ONE call of a batch method (e.g.
:meth:`~ironflow.store.Store.activate_leases`), each item keeping its own
outcome. Nothing waits to fill a group: an item that finds nothing being
applied is applied at once; the items that queue while a group is applied
form the next one. So one item alone costs what it did, and a burst costs a
few statements.

No task of its own: the first waiting caller whose item is not yet applied
applies the next group (its own item included) — so a caller never serves
groups after its own item is done, and there is no task to start or stop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import outcome
import trio

# Most items applied in one call.
GROUP_MAX = 256

Item = TypeVar("Item")
Result = TypeVar("Result")


class Grouped(Generic[Item, Result]):
    """``await grouped(item)`` → its result (or its error), applied with others'
    by ``apply(items) → [outcome per item, in order]``."""

    def __init__(self, apply: Callable[[list[Item]], Awaitable[list[outcome.Outcome[Result]]]]) -> None:
        self._apply_group = apply
        self._queued: list[tuple[Item, list[outcome.Outcome[Result]]]] = []
        # Set when the group being applied is done (None: nothing is applied).
        self._applied: trio.Event | None = None

    async def __call__(self, item: Item) -> Result:
        result: list[outcome.Outcome[Result]] = []
        entry = (item, result)
        self._queued.append(entry)
        try:
            while not result:
                if self._applied is None:
                    await self._apply_next()
                else:
                    await self._applied.wait()  # then: done, or the next to apply
        except BaseException:
            # Cancelled while still queued: not applied later for nobody.
            for i, queued in enumerate(self._queued):
                if queued is entry:
                    del self._queued[i]
                    raise
            # Cancelled while its group is applied (by another caller): that
            # write will commit, so its caller hears the result (an ack or job
            # result that committed is never reported as lost); the
            # cancellation is delivered at the caller's next checkpoint.
            with trio.CancelScope(shield=True):
                while not result and self._applied is not None:
                    await self._applied.wait()
            if not result:
                raise
        return result[0].unwrap()

    async def _apply_next(self) -> None:
        applied = self._applied = trio.Event()
        group = self._queued[:GROUP_MAX]
        del self._queued[:GROUP_MAX]
        try:
            # Shielded: the group is out of the queue, its callers wait on it.
            with trio.CancelScope(shield=True):
                try:
                    results = await self._apply_group([item for item, _ in group])
                except Exception as exc:  # e.g. a store error: every item of the group hears it
                    results = [outcome.Error(exc) for _ in group]
            for (_, result), one in zip(group, results, strict=True):
                result.append(one)
        finally:
            self._applied = None
            applied.set()
