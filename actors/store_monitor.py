"""The store monitor: notices an outage of the database, and its end.

While the store is up it reads the database every ``store_probe_s`` (a read:
an idle node writes nothing), so an outage nobody's call has met yet still
turns ``/readyz`` to 503 within about that; a probe that has not answered
within ``store_probe_timeout_s`` (a database gone silent: a partition holds
packets and closes nothing) marks the store down too, unless other calls
reached the database meanwhile (the probe queued behind a loaded node's
work). Past a fifth of its timeout a direct probe, on a connection of its
own, races the queued one: calls of this node that all wait on locks are no
outage. Any store call that meets an outage marks the store down itself
(``ironflow/store/availability.py``).

While the store is down it tries a *write* every ``store_probe_s`` (a full
disk still reads). Once one goes through, and before anything else resumes,
it gives this node's leases, reservations and worker sessions back the time
the node was blind (:meth:`Store.give_back_blind_time`): the capacity scanner
then judges them by the database clock as if the outage had not happened,
so nothing is expired or recovered because of the outage itself. Only then
does it mark the store up, which wakes the waiting actors and sessions.
"""

from __future__ import annotations

import contextlib
import logging

import trio

from ironflow import logs
from ironflow.config import NodeConfig
from ironflow.engine import metrics
from ironflow.store import Store, StoreUnavailable
from ironflow.store.availability import answered_when_down

log = logging.getLogger("ironflow.store")



# Share of the probe timeout after which a read probe still queued behind
# this node's calls is joined by a direct one (PostgreSQL: the monitor's own
# connection, one round trip): calls that wait on locks (a deadlock
# PostgreSQL breaks after its 1 s deadlock_timeout) hold every connection of
# the node without the database being silent. Early, so the direct one has
# most of the timeout on a loaded machine; an idle node's queued probe answers
# long before, so it seldom runs.
DIRECT_AFTER = 0.2


async def _probe(store: Store, timeout_s: float, *, write: bool) -> bool:
    """Whether one probe went through within ``timeout_s``. A hung one is
    given up on at the timeout (even one the database took: the probe is
    ANSWER_WHEN_DOWN) and marks the store down, which answers every API call
    still waiting on the database at once. A read probe is first queued like
    any call; past ``DIRECT_AFTER`` of the timeout a direct one races it."""
    started = trio.current_time()
    with trio.move_on_after(timeout_s), answered_when_down():
        try:
            if write:
                await store.probe(write=True)
            else:
                await _read_probe(store, timeout_s * DIRECT_AFTER)
        except StoreUnavailable:
            return False
        return True
    if not write and store.availability.last_ok > started:
        # Other calls reached the database while the probe waited: it answers,
        # the probe was queued behind their work (a loaded node), not lost.
        return True
    if store.availability.up:
        store.availability.went_down(
            "STORE_UNAVAILABLE",
            f"the database did not answer a probe within {timeout_s:g} s (timings.store_probe_timeout_s)",
        )
    return False


async def _read_probe(store: Store, direct_after_s: float) -> None:
    """The queued read probe, raced after ``direct_after_s`` by a direct one:
    returns when either answers, raises StoreUnavailable if one does."""
    failed: list[StoreUnavailable] = []
    async with trio.open_nursery() as nursery:

        async def ask(direct: bool) -> None:
            if direct:
                await trio.sleep(direct_after_s)
            try:
                await store.probe(write=False, direct=direct)
            except StoreUnavailable as exc:
                failed.append(exc)
            nursery.cancel_scope.cancel()

        nursery.start_soon(ask, False)
        nursery.start_soon(ask, True)
    if failed:
        raise failed[0]


async def run(
    store: Store,
    config: NodeConfig,
    node_id: str,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Watch the store until cancelled (see the module docstring)."""
    availability = store.availability
    period = config.timings.store_probe_s
    availability.monitored = True
    try:
        await _watch(store, node_id, period, config.timings.store_probe_timeout_s, task_status)
    finally:
        availability.monitored = False


async def _watch(
    store: Store, node_id: str, period: float, timeout_s: float, task_status: trio.TaskStatus[None]
) -> None:
    availability = store.availability
    task_status.started()
    # The direct probe's connection made now, not first on a loaded server.
    with trio.move_on_after(timeout_s), answered_when_down(), contextlib.suppress(StoreUnavailable):
        await store.probe(write=False, direct=True)
    while True:
        metrics.STORE_AVAILABLE.set(1 if availability.up else 0)
        await trio.sleep(period)
        if availability.up:
            await _probe(store, timeout_s, write=False)
            continue
        if not await _probe(store, timeout_s, write=True):
            continue
        blind_s = availability.blind_s()
        try:
            leases = await store.give_back_blind_time(node_id, blind_s)
        except StoreUnavailable:
            continue
        down_s = availability.came_back()
        metrics.STORE_AVAILABLE.set(1)
        metrics.STORE_OUTAGE_SECONDS.observe(down_s)
        logs.event(
            log, logging.INFO, "store: blind time given back to this node's leases",
            node_id=node_id, blind_s=f"{blind_s:.3f}", leases=leases,
        )
