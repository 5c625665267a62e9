"""The store monitor: notices an outage of the database, and its end.

While the store is up it reads the database every ``store_probe_s`` (a read:
an idle node writes nothing), so an outage nobody's call has met yet still
turns ``/readyz`` to 503 within about that. Any store call that meets an
outage marks the store down itself (``ironflow/store/availability.py``).

While the store is down it tries a *write* every ``store_probe_s`` (a full
disk still reads). Once one goes through, and before anything else resumes,
it gives this node's leases, reservations and worker sessions back the time
the node was blind (:meth:`Store.give_back_blind_time`): the capacity scanner
then judges them by the database clock as if the outage had not happened,
so nothing is expired or recovered because of the outage itself. Only then
does it mark the store up, which wakes the waiting actors and sessions.
"""

from __future__ import annotations

import logging

import trio

from ironflow import logs
from ironflow.config import NodeConfig
from ironflow.engine import metrics
from ironflow.store import Store, StoreUnavailable

log = logging.getLogger("ironflow.store")

# A probe that has not answered after this long counts as failed: about the
# 5 s within which every API call must be answered during an outage.
PROBE_TIMEOUT_S = 5.0


async def _probe(store: Store, *, write: bool) -> bool:
    """Whether one probe went through (a hung one is abandoned at the timeout)."""
    with trio.move_on_after(PROBE_TIMEOUT_S):
        try:
            await store.probe(write=write)
        except StoreUnavailable:
            return False
        return True
    if store.availability.up:
        store.availability.went_down(
            "STORE_UNAVAILABLE", f"the database did not answer a probe within {PROBE_TIMEOUT_S:g} s"
        )
    return False


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
        await _watch(store, node_id, period, task_status)
    finally:
        availability.monitored = False


async def _watch(
    store: Store, node_id: str, period: float, task_status: trio.TaskStatus[None]
) -> None:
    availability = store.availability
    task_status.started()
    while True:
        metrics.STORE_AVAILABLE.set(1 if availability.up else 0)
        await trio.sleep(period)
        if availability.up:
            await _probe(store, write=False)
            continue
        if not await _probe(store, write=True):
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
