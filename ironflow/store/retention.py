"""History retention: one purge pass, shared by the janitor actor and ``POST /v1/runs/purge``.

A pass is many short transactions, never one long one: each
:meth:`~ironflow.store.base.Store.purge_history` call deletes one batch and
commits, so the SQLite writer (or a PostgreSQL row lock) is held for
milliseconds at a time and live work slips in between batches. The pass ends
at the first batch that is not full (we caught up), then gives the freed
pages back to the file system (SQLite) and writes one audit event with the
totals when it deleted anything. No SQL here: the guards live in the store.
"""

from __future__ import annotations

from ironflow.engine import metrics
from ironflow.protocol import TERMINAL_RUN_STATUSES
from ironflow.store.base import Store
from ironflow.store.records import PurgeCounts

__all__ = ["purge_pass", "BATCH", "VACUUM_PAGES"]

# Runs (with their steps and audit rows) and events deleted per transaction:
# a few milliseconds of writer time for typical runs of a handful of steps.
BATCH = 500
# Free pages given back per transaction (~20 µs each on SQLite: ~20 ms).
VACUUM_PAGES = 1000


async def purge_pass(
    store: Store,
    *,
    older_than_s: float,
    idempotency_window_s: float,
    by: str,
    statuses: frozenset[str] = TERMINAL_RUN_STATUSES,
    wait_for_lock: bool = False,
    batch: int = BATCH,
) -> PurgeCounts:
    """Delete finished history older than ``older_than_s`` seconds, batch by batch.

    Args:
      store: the engine store.
      older_than_s: runs that ended strictly longer ago than this go.
      idempotency_window_s: events received longer ago than this, and no
        longer referenced by any run, go (never one inside the window: a
        duplicate emit must still be recognised).
      by: who runs the pass, recorded in the audit event (``janitor:<node>``,
        ``api:<key id>``).
      statuses: only runs in these finished statuses.
      wait_for_lock: on PostgreSQL, wait for another node's batch instead of
        giving the pass up (an operator's purge waits; a janitor does not).
      batch: rows per transaction.

    Returns the totals; ``locked_out`` is True when another node was purging
    and this pass stopped without deleting.
    """
    total = PurgeCounts()
    while True:
        counts = await store.purge_history(
            older_than_s=older_than_s,
            idempotency_window_s=idempotency_window_s,
            statuses=statuses,
            batch=batch,
            wait_for_lock=wait_for_lock,
        )
        total = total.plus(counts)
        if counts.locked_out or not counts.more:
            break
    for kind in ("runs", "steps", "audit", "events"):
        metrics.HISTORY_DELETED.labels(kind=kind).inc(getattr(total, kind))
    if total.total:
        while await store.reclaim_space(VACUUM_PAGES) == VACUUM_PAGES:
            pass
        await store.record_purge(total, by=by, older_than_s=older_than_s)
    return total
