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
A caller cancelled while queued leaves the queue; whoever is first in it when
a group ends applies the next.
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


class _Entry(Generic[Item, Result]):
    """A caller's item, its outcome once applied, and what wakes it."""

    __slots__ = ("item", "result", "wake")

    def __init__(self, item: Item) -> None:
        self.item = item
        self.result: outcome.Outcome[Result] | None = None
        self.wake: trio.Event | None = None


class Grouped(Generic[Item, Result]):
    """``await grouped(item)`` → its result (or its error), applied with others'
    by ``apply(items) → [outcome per item, in order]``.

    One task switch per waiting caller: a caller queued behind the group being
    applied sleeps until ITS group is applied, except the first in the queue,
    which is woken when the group before it is done, to apply the next. (All
    queued callers woken at each group's end, to see whose turn it is, was two
    switches per caller under load: most of them only to sleep again.)
    """

    def __init__(self, apply: Callable[[list[Item]], Awaitable[list[outcome.Outcome[Result]]]]) -> None:
        self._apply_group = apply
        self._queued: list[_Entry[Item, Result]] = []
        # A group is being applied (its callers and the queue wait).
        self._busy = False

    async def __call__(self, item: Item) -> Result:
        entry: _Entry[Item, Result] = _Entry(item)
        self._queued.append(entry)
        try:
            while entry.result is None:
                if not self._busy:
                    await self._apply_next()
                else:
                    # Woken when its group is done, or (first in the queue)
                    # when the group before it is.
                    entry.wake = trio.Event()
                    await entry.wake.wait()
        except BaseException:
            # Cancelled while still queued: not applied later for nobody.
            for i, queued in enumerate(self._queued):
                if queued is entry:
                    # Only a parked caller is cancelled, and one parks only
                    # while a group is applied: the first in the queue when
                    # that group ends is woken to apply the next.
                    del self._queued[i]
                    raise
            # Cancelled while its group is applied (by another caller): that
            # write will commit, so its caller hears the result (an ack or job
            # result that committed is never reported as lost); the
            # cancellation is delivered at the caller's next checkpoint.
            with trio.CancelScope(shield=True):
                while entry.result is None and self._busy:
                    entry.wake = trio.Event()
                    await entry.wake.wait()
            if entry.result is None:
                raise
        return entry.result.unwrap()

    def _wake_first(self) -> None:
        if self._queued and self._queued[0].wake is not None:
            self._queued[0].wake.set()

    async def _apply_next(self) -> None:
        self._busy = True
        group = self._queued[:GROUP_MAX]
        del self._queued[:GROUP_MAX]
        try:
            # Shielded: the group is out of the queue, its callers wait on it.
            with trio.CancelScope(shield=True):
                try:
                    results = await self._apply_group([entry.item for entry in group])
                except Exception as exc:  # e.g. a store error: every item of the group hears it
                    results = [outcome.Error(exc) for _ in group]
            for entry, one in zip(group, results, strict=True):
                entry.result = one
        finally:
            self._busy = False
            for entry in group:
                if entry.wake is not None:
                    entry.wake.set()
            self._wake_first()  # the next group's turn
