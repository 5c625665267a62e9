"""The store's side of an outage: the probe that proves the database writes
again, and the blind time given back to this node's leases once it does
(``ironflow/store/availability.py`` is the state; ``actors/store_monitor.py``
the actor that drives both).

Why give time back: leases, reservations and worker sessions are judged by
the database clock, and while the database is down no heartbeat can refresh
them. Without this, a lease whose worker heartbeated faithfully through a
10 s outage would be fenced and its segment recovered by the first scan after
it, for nothing but the outage. The node measures how long it could not reach
the database (since its last call that did, so the whole blind time and not
just the part after the first error) and pushes out the expiry of every
lease, reservation and worker session by that much — only what was still
live when it went blind: a lease that had already expired stays expired.

Every node's, not only its own: in an outage of the database every node is
blind, and the first back must not let its scanner expire the leases of a
node still reconnecting (that node's give-back would come too late). The
interval given back is recorded (``blind_time.given_until``, its row locked):
a second node back from the same outage extends only the part of its own
blind interval after it, so one outage is given back once. A node blind
alone (partitioned) extends everyone's by its blind time too: harmless, the
leases of workers that died meanwhile expire that much later.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ironflow.store.core import SqlStoreBase, Tx
from ironflow.store.transitions import write_audit

T = TypeVar("T")

# Bytes the write probe inserts (and deletes in the same transaction): more
# than a page, so a database that cannot grow (full disk, ``max_page_count``)
# refuses it, as it would refuse an emit.
PROBE_BYTES = 8192


class OutageOps(SqlStoreBase):
    """``probe`` and ``give_back_blind_time`` (see the module docstring)."""

    async def _outage_transact(self, work: Callable[[Tx], T]) -> T:
        """The transaction of a write probe or of the give-back: the store's own
        by default; PostgreSQL runs it on a connection of its own, so that it
        is not queued behind the groups of a recovering node's backlog."""
        return await self._transact(work)

    async def probe(self, *, write: bool, direct: bool = False) -> None:
        def work(tx: Tx) -> None:
            if not write:
                tx.fetchone("SELECT 1")
                return
            tx.execute("INSERT INTO store_probe (id, pad) VALUES (1, ?)", ("x" * PROBE_BYTES,))
            tx.execute("DELETE FROM store_probe WHERE id = 1")

        if write:
            await self._outage_transact(work)
        elif direct:
            await self._direct_read_probe(work)
        else:
            await self._transact(work)

    async def _direct_read_probe(self, work: Callable[[Tx], None]) -> None:
        """A read probe not queued behind this node's calls: the write probe's
        transaction by default; PostgreSQL reads on the monitor's own
        long-lived connection (one round trip, no connection made per probe)."""
        await self._outage_transact(work)

    async def give_back_blind_time(self, node_id: str, blind_s: float) -> int:
        def work(tx: Tx) -> int:
            # One give-back at a time, and what the last one covered.
            given = tx.fetchone(f"SELECT given_until FROM blind_time WHERE id = 1 {tx.lock_wait()}")
            row = tx.fetchone("SELECT ironflow_now()")
            assert row is not None
            now = float(row[0])
            start = now - blind_s
            if given is not None:
                start = max(start, float(given[0]))
            extend = now - start
            tx.execute(
                "INSERT INTO blind_time (id, given_until) VALUES (1, ?)"
                " ON CONFLICT (id) DO UPDATE SET given_until = excluded.given_until",
                (now,),
            )
            if extend <= 0:
                return 0
            # Only what was live when the blind interval began (expires_at
            # after it): an expiry already passed before stays passed.
            leases = tx.execute(
                "UPDATE concurrency_leases SET expires_at = expires_at + ? WHERE expires_at > ?",
                (extend, start),
            )
            tx.execute(
                "UPDATE dispatch_queue SET reservation_expires_at = reservation_expires_at + ?"
                " WHERE reservation_owner IS NOT NULL AND reservation_expires_at > ?",
                (extend, start),
            )
            tx.execute(
                "UPDATE worker_sessions SET expires_at = expires_at + ? WHERE expires_at > ?",
                (extend, start),
            )
            write_audit(
                tx, "store.outage.blind_time_given_back", None, None,
                {"node_id": node_id, "blind_s": round(blind_s, 3), "given_s": round(extend, 3),
                 "leases": leases},
            )
            return leases

        return await self._outage_transact(work)
