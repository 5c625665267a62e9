"""A function's life: live while a worker serves it, deleted by an operator,
restored by a worker registering it again (docs/schedules.md).

**Live.** A function is live while a worker session serving it has not
expired (``session_functions`` joined with ``worker_sessions.expires_at``)
and for ``function_live_s`` after. ``functions.last_seen_at`` is the last
moment a worker was known to serve it: written when a worker registers it
and when a session of it is removed (closed, or expired and reaped:
:func:`forget_sessions`). Every input is a row, judged by the database
clock, so every node decides alike; the scheduler's tick decision
(``cron.py``, :func:`live_function_ids`) and the function list read the one
expression, :data:`LIVE_SQL`.

The race it must hold against: a pass judges a tick "no live worker" while a
worker registers the function through another node. The registration updates
every schedule row of its cron functions (:func:`rewind_skipped`), the row
the firing transaction holds ``FOR UPDATE``, so the two take turns on it:
if the pass holds it first, the registration's UPDATE waits, then finds
``skipped_since`` set and makes the schedule due at once (its catch-up
policy then decides, from the first skipped tick); if the registration holds
it, the pass skips the row (SKIP LOCKED) until it commits. The pass reads
liveness (:func:`live_function_ids`) in a statement of its own *after*
locking the rows: under READ COMMITTED that statement's snapshot includes
every registration that committed before the lock was granted, which a
subquery of the locking statement itself (its snapshot taken before the
lock wait) would not.

**Deleted.** :meth:`FunctionLifeOps.delete_function` sets
``functions.deleted_at`` and removes the function's trigger-index rows and
schedules, in one transaction holding the function row ``FOR UPDATE``: an
emit that reads the trigger index after it commits starts no run of it (one
that read it before is ordered before the delete, as with a pause), and a
firing pass either holds the schedule row first (its tick is before the
delete) or finds it gone. Runs already started carry on; the definition stays
for their history; invoke, ``step.invoke`` and rerun are refused.

A registration takes the rows of its functions ``FOR UPDATE`` in id order
first (:func:`lock_registered`), so a delete and a registration of one
function take turns on that row: a registration after the delete restores the
function (trigger rows and schedules written again, each schedule from its
next tick: nothing is replayed for the time it was deleted), audited
``function.restored``.
"""

from __future__ import annotations

from ironflow.store.base import FunctionNotFound
from ironflow.store.core import SqlStoreBase, Tx, placeholders
from ironflow.store.transitions import write_audit

# Whether function ``f`` (the alias) is live; the parameters: the cutoff
# (now - function_live_s), twice. A function never seen (last_seen_at NULL,
# stored before it was recorded) counts from its last definition change.
LIVE_SQL = (
    "(coalesce(f.last_seen_at, f.updated_at) > ? OR EXISTS (SELECT 1 FROM session_functions sf"
    " JOIN worker_sessions w ON w.id = sf.session_id WHERE sf.function_id = f.id AND w.expires_at > ?))"
)
# Why a tick started no run (cron_schedules.skip_reason, FunctionSchedule).
NO_LIVE_WORKER = "NO_LIVE_WORKER"


def live_params(now: float, live_within_s: float) -> tuple[float, float]:
    """The parameters of :data:`LIVE_SQL`."""
    return now - live_within_s, now - live_within_s


def live_function_ids(tx: Tx, function_ids: list[str], now: float, live_within_s: float) -> set[str]:
    """Those of ``function_ids`` that are live at ``now`` (:data:`LIVE_SQL`)."""
    if not function_ids:
        return set()
    ids = sorted(set(function_ids))
    rows = tx.fetchall(
        f"SELECT f.id FROM functions f WHERE f.id IN ({placeholders(len(ids))}) AND {LIVE_SQL}",
        (*ids, *live_params(now, live_within_s)),
    )
    return {fid for (fid,) in rows}


def add_session(tx: Tx, session_id: str, function_ids: list[str]) -> None:
    """Record that the new session ``session_id`` serves ``function_ids``."""
    tx.executemany(
        "INSERT INTO session_functions (function_id, session_id) VALUES (?, ?)",
        [(fid, session_id) for fid in function_ids],
    )


def forget_sessions(tx: Tx, session_ids: list[str], now: float) -> None:
    """Sessions about to be deleted: their functions were last served at the
    session's end, ``now`` for a closed one, its expiry for one that expired
    (reaped after an outage of every node, a worker gone a day ago was not
    seen now)."""
    if not session_ids:
        return
    marks = placeholders(len(session_ids))
    seen = tx.fetchall(
        "SELECT sf.function_id, max(w.expires_at) FROM session_functions sf"
        f" JOIN worker_sessions w ON w.id = sf.session_id WHERE sf.session_id IN ({marks})"
        " GROUP BY sf.function_id ORDER BY sf.function_id",
        session_ids,
    )
    tx.executemany(
        "UPDATE functions SET last_seen_at = ? WHERE id = ? AND (last_seen_at IS NULL OR last_seen_at < ?)",
        [(min(now, until), fid, min(now, until)) for fid, until in seen],
    )
    tx.execute(f"DELETE FROM session_functions WHERE session_id IN ({marks})", session_ids)


def lock_registered(tx: Tx, function_ids: list[str]) -> set[str]:
    """Lock the stored rows of ``function_ids`` (id order: two registrations
    take them in one order); the ids of those deleted."""
    if not function_ids:
        return set()
    ids = sorted(function_ids)
    rows = tx.fetchall(
        f"SELECT id, deleted_at FROM functions WHERE id IN ({placeholders(len(ids))}) ORDER BY id"
        f" {tx.lock_wait()}",
        ids,
    )
    return {fid for fid, deleted_at in rows if deleted_at is not None}


def rewind_skipped(tx: Tx, function_ids: list[str], now: float) -> None:
    """A worker serves ``function_ids`` again: each schedule that skipped ticks
    for want of a live worker is due now, its catch-up policy to decide from
    the first skipped tick. Updates (so locks) every schedule row of them,
    skipped or not: the lock the module docstring's race turns on."""
    if function_ids:
        tx.execute(
            "UPDATE cron_schedules SET next_at = CASE WHEN skipped_since IS NOT NULL AND next_at > ?"
            f" THEN ? ELSE next_at END WHERE function_id IN ({placeholders(len(function_ids))})",
            (now, now, *sorted(function_ids)),
        )


class FunctionLifeOps(SqlStoreBase):
    """Functions deleted (the module docstring); registration restores them (sessions.py)."""

    async def delete_function(self, function_id: str, *, by: str) -> bool:
        def work(tx: Tx) -> bool:
            row = tx.fetchone(
                f"SELECT deleted_at FROM functions WHERE id = ? {tx.lock_wait()}", (function_id,)
            )
            if row is None:
                raise FunctionNotFound(f"function {function_id} is not registered")
            if row[0] is not None:
                return False
            tx.execute("UPDATE functions SET deleted_at = ironflow_now() WHERE id = ?", (function_id,))
            tx.execute("DELETE FROM function_triggers WHERE function_id = ?", (function_id,))
            tx.execute("DELETE FROM cron_schedules WHERE function_id = ?", (function_id,))
            write_audit(tx, "function.deleted", None, function_id, {"by": by})
            return True

        return await self._transact(work)
