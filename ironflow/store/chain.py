"""Store calls chained into one group commit, in order.

A streaming worker sends a run's messages in a burst (its job ack, each
step's result, the job's result: the SDK does not wait for one to commit
before sending the next). Applied one after another, each waits for its own
group commit: five commit round trips for a three-step run. Chained, the
calls that are queued together become consecutive requests of ONE group
(never split between two groups or two PostgreSQL connections), each still
its own unit of work with its own outcome: one call's error never undoes
another's, and a later call sees what the earlier ones wrote.

How: :func:`in_order` runs each call in its own task with a context variable
naming its place in the chain. The call's first ``_transact`` (see
:func:`chained`) registers its work there instead of queueing it; once every
call has registered (or finished without a transaction), the works go
together to the ``transact_many`` given (PostgreSQL's ``_transact_many``), and
each call resumes with its own result. A call's second transaction, if any, runs
on its own. Used by :class:`~ironflow.store.postgres.PostgresStore` only.
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import outcome
import trio

T = TypeVar("T")

Work = Callable[[Any], Any]

_SLOT: contextvars.ContextVar[tuple[_Chain, int] | None] = contextvars.ContextVar(
    "ironflow_store_chain_slot", default=None
)


class _Chain:
    """The works of one chain, by place, and their results once committed."""

    def __init__(self, size: int) -> None:
        self.works: list[tuple[Work, Sequence[Any]] | None] = [None] * size
        self._undecided = size
        self.all_decided = trio.Event()
        self.results: dict[int, outcome.Outcome[Any]] = {}
        self.committed = trio.Event()

    def decide(self, place: int, work: Work | None, locks: Sequence[Any] = ()) -> None:
        """Place ``place`` registers ``work`` and the named locks it takes (None:
        it needs no transaction here)."""
        if work is not None:
            self.works[place] = (work, locks)
        self._undecided -= 1
        if self._undecided == 0:
            self.all_decided.set()

    async def result(self, place: int) -> Any:
        await self.committed.wait()
        return self.results[place].unwrap()


def chained(work: Callable[[Any], T], locks: Sequence[Any] = ()) -> Awaitable[T] | None:
    """In a chained call's first transaction: register ``work`` (and the named
    locks it takes) and return what to await for its result. Otherwise None
    (the backend runs it alone)."""
    slot = _SLOT.get()
    if slot is None:
        return None
    _SLOT.set(None)  # a second transaction of the same call runs on its own
    chain, place = slot
    chain.decide(place, work, locks)
    return chain.result(place)


async def in_order(
    calls: Sequence[Callable[[], Awaitable[Any]]],
    transact_many: Callable[[list[tuple[Work, Sequence[Any]]]], Awaitable[list[outcome.Outcome[Any]]]],
) -> list[outcome.Outcome[Any]]:
    """Run ``calls`` (store method calls) with their first transactions chained
    into one group, in this order; each call's outcome, in this order."""
    chain = _Chain(len(calls))
    outcomes: list[outcome.Outcome[Any] | None] = [None] * len(calls)

    async def one(place: int, call: Callable[[], Awaitable[Any]]) -> None:
        _SLOT.set((chain, place))  # this task's context only
        try:
            outcomes[place] = outcome.Value(await call())
        except Exception as exc:
            outcomes[place] = outcome.Error(exc)
        finally:
            if _SLOT.get() is not None:  # finished (or failed) before any transaction
                _SLOT.set(None)
                chain.decide(place, None)

    async with trio.open_nursery() as nursery:
        for place, call in enumerate(calls):
            nursery.start_soon(one, place, call)
        await chain.all_decided.wait()
        placed = [(place, work) for place, work in enumerate(chain.works) if work is not None]
        if placed:
            # Shielded: once queued the works commit; their callers must hear it.
            with trio.CancelScope(shield=True):
                results = await transact_many([work for _, work in placed])
            for (place, _), result in zip(placed, results, strict=True):
                chain.results[place] = result
        chain.committed.set()
    return [o if o is not None else outcome.Error(RuntimeError("call did not finish")) for o in outcomes]
