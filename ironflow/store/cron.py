"""Cron triggers and function pause/resume (docs/schedules.md).

A function's cron triggers are rows of ``cron_schedules`` (written when its
definition changes, :func:`sync_schedules`). Each row's ``next_at`` is the
earliest tick not yet considered, the one state every node agrees on. The
scheduler actor (``actors/scheduler.py``) calls :meth:`CronOps.fire_due_ticks`,
one transaction that, for each schedule whose ``next_at`` the database clock
has reached, decides which due ticks start a run (the catch-up policy),
claims each in ``cron_ticks`` — whose primary key ``(function_id,
scheduled_at)`` makes exactly one run per tick whatever the nodes, restarts
or clocks — creates the run with its ``ironflow.cron`` event, and moves
``next_at`` past the database's now.

Which due ticks fire (``due`` = ticks from ``next_at`` to now): a tick at
most ``missed_after_s`` old is late, not missed, and always fires (a node
that is up fires every tick). Older ones were missed while no node was up:

- ``latest`` (default): the latest due tick within the catch-up window, if
  no late one fires: one catch-up run, never a flood.
- ``none``: none of them.
- ``all``: every one within the window, the latest
  :data:`~ironflow.protocol.cron.MAX_CATCHUP_TICKS` of them.

A paused function (``functions.paused_at``) starts no run: its due ticks are
skipped (``next_at`` moves on), and emits report it (ingest.py). Resume
replays nothing unless asked, then the latest tick skipped while paused.

A function no worker served within ``live_within_s`` (function_life.py, read
after the schedule rows are locked) starts no run either: its ticks are skipped with ``NO_LIVE_WORKER`` and the
first of them kept in ``skipped_since``; a worker registering it makes the
schedule due (``rewind_skipped``), and that pass applies the catch-up policy
from ``skipped_since``, as if those ticks were missed with no node up. Each
schedule row says what its last tick did (``last_tick_at``, ``skip_reason``,
``skipped_ticks``); one audit record per run of skipped ticks, at its start
(``cron.ticks.skipped``), not one per tick.
"""

from __future__ import annotations

from collections.abc import Callable

from ironflow.ids import new_id
from ironflow.protocol import FunctionDef, FunctionSchedule
from ironflow.protocol.cron import (
    CRON_EVENT,
    MAX_CATCHUP_TICKS,
    latest_tick,
    next_tick,
    tick_data,
    ticks_between,
)
from ironflow.store.base import FunctionNotFound
from ironflow.store.core import SqlStoreBase, Tx
from ironflow.store.creation import create_run
from ironflow.store.function_life import NO_LIVE_WORKER, live_function_ids
from ironflow.store.records import CronFired
from ironflow.store.transitions import write_audit

# Ticks older than their catch-up window plus this are never fired again
# (next_at is past them), so their claims may go.
_CLAIM_KEEP_S = 60.0

_SCHEDULE_COLS = "s.function_id, s.cron, s.timezone, s.catchup, s.catchup_window_s, s.next_at"
# What a schedule's last tick did (FunctionSchedule): the columns after _SCHEDULE_COLS.
_TICK_COLS = "s.last_tick_at, s.skip_reason, s.skipped_ticks, s.skipped_since"
# Why due ticks started no run, besides NO_LIVE_WORKER (function_life.py).
PAUSED = "PAUSED"
MISSED = "MISSED"  # no node was up to fire them, and the catch-up policy fired none
DEFINITION_REFUSED = "DEFINITION_REFUSED"  # stored under looser rules; re-register it


def sync_schedules(tx: Tx, fd: FunctionDef, now: float) -> bool:
    """Make ``cron_schedules`` hold exactly ``fd``'s cron triggers; True if it has any.

    A schedule that stays keeps its ``next_at`` (a worker re-registering
    neither replays nor loses a tick); a new one starts at its first tick
    after ``now`` (the database clock); a removed one is deleted. Two nodes
    registering the same function at once: the upsert's conflict on the
    primary key makes one insert, the other an update of its policy.
    """
    wanted = {(t.cron, t.timezone): t for t in fd.triggers if t.cron is not None}
    for cron, timezone in tx.fetchall(
        "SELECT cron, timezone FROM cron_schedules WHERE function_id = ?", (fd.id,)
    ):
        if (cron, timezone) not in wanted:
            tx.execute(
                "DELETE FROM cron_schedules WHERE function_id = ? AND cron = ? AND timezone = ?",
                (fd.id, cron, timezone),
            )
    for (cron, timezone), t in sorted(wanted.items()):
        assert cron is not None
        tx.execute(
            "INSERT INTO cron_schedules (function_id, cron, timezone, catchup, catchup_window_s,"
            " next_at) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (function_id, cron, timezone)"
            " DO UPDATE SET catchup = excluded.catchup, catchup_window_s = excluded.catchup_window_s",
            (fd.id, cron, timezone, t.catchup, t.catchup_window_s, next_tick(cron, timezone, now)),
        )
    return bool(wanted)


def read_schedules(tx: Tx) -> dict[str, list[FunctionSchedule]]:
    """Every function's schedules with their next fire time, by function id."""
    out: dict[str, list[FunctionSchedule]] = {}
    for fid, cron, tz, catchup, _, next_at, last, reason, skipped, since in tx.fetchall(
        f"SELECT {_SCHEDULE_COLS}, {_TICK_COLS} FROM cron_schedules s ORDER BY 1, 2, 3"
    ):
        out.setdefault(fid, []).append(
            FunctionSchedule(cron, tz, catchup, next_at, last, reason, skipped, since)
        )
    return out


def _due(catchup: str, cron: str, tz: str, window_s: float, next_at: float, now: float,
         missed_after_s: float) -> list[float]:
    """The due ticks (``next_at`` .. ``now``) that start a run under ``catchup``.

    A tick no older than ``missed_after_s`` is late, not missed: it fires
    under every policy (a node that is up but was slow loses no tick). Older
    ones were missed: ``all`` fires those within the window, ``latest`` the
    latest within it when nothing late fires, ``none`` nothing."""
    late = ticks_between(cron, tz, max(next_at, now - missed_after_s), now, MAX_CATCHUP_TICKS)
    if catchup == "none" or (late and catchup == "latest"):
        return late
    if catchup == "all":
        return ticks_between(cron, tz, max(next_at, now - window_s), now, MAX_CATCHUP_TICKS)
    latest = latest_tick(cron, tz, now)
    if latest is None or latest < next_at or now - latest > window_s:
        return []
    return [latest]


class CronOps(SqlStoreBase):
    """Due ticks claimed and fired; functions paused and resumed (module docstring)."""

    def _claim_tick(
        self, tx: Tx, fd: FunctionDef, cron: str, tz: str, scheduled_at: float, node_id: str
    ) -> str | None:
        """Claim tick ``scheduled_at`` of ``fd`` and start its run; None if it was
        claimed already. PostgreSQL: a concurrent claim of the same tick waits on
        the primary key of ``cron_ticks`` and, once the first commits, inserts
        nothing (``ON CONFLICT DO NOTHING``): the claim and the run are one
        transaction, so one run per tick."""
        event_id = new_id("evt")
        if not tx.execute(
            "INSERT INTO cron_ticks (function_id, scheduled_at, event_id, node_id, claimed_at)"
            " VALUES (?, ?, ?, ?, ironflow_now()) ON CONFLICT (function_id, scheduled_at) DO NOTHING",
            (fd.id, scheduled_at, event_id, node_id),
        ):
            return None
        data = tick_data(cron, tz, scheduled_at)
        run_id = create_run(tx, self.definitions, fd, event_id, data, event_name=CRON_EVENT)
        self._insert_event(tx, event_id, CRON_EVENT, data, None, [run_id])
        return run_id

    async def fire_due_ticks(
        self, node_id: str, *, limit: int, missed_after_s: float, live_within_s: float
    ) -> list[CronFired]:
        def work(tx: Tx) -> list[CronFired]:
            now = self._now(tx)
            # SKIP LOCKED: a schedule another node is firing (or a registration
            # is rewinding: function_life.py) is its to finish; once it commits,
            # next_at is past now and the row is not due. The claim's primary
            # key, not this lock, is what makes a tick once.
            rows = tx.fetchall(
                f"SELECT {_SCHEDULE_COLS}, s.skipped_ticks, s.skipped_since, f.definition,"
                " f.paused_at FROM cron_schedules s"
                " JOIN functions f ON f.id = s.function_id WHERE s.next_at <= ?"
                f" ORDER BY s.next_at LIMIT ? {tx.lock('s')}",
                (now, limit),
            )
            # After the lock, in a statement of its own (function_life.py).
            live_ids = live_function_ids(tx, [row[0] for row in rows], now, live_within_s)
            fired: list[CronFired] = []
            for fid, cron, tz, catchup, window_s, next_at, skipped, since, text, paused_at in rows:
                live = fid in live_ids
                fd = self._fdef_or_none(text)
                reason = (
                    PAUSED if paused_at is not None else DEFINITION_REFUSED if fd is None
                    else None if live else NO_LIVE_WORKER
                )
                due: list[float] = []
                if reason is None:
                    assert fd is not None
                    # A worker is back after skipped ticks: they count as missed.
                    anchor = next_at if since is None else since
                    due = _due(catchup, cron, tz, window_s, anchor, now, missed_after_s)
                    for scheduled_at in due:
                        run_id = self._claim_tick(tx, fd, cron, tz, scheduled_at, node_id)
                        if run_id is not None:
                            fired.append(CronFired(fid, scheduled_at, run_id))
                    if not due or due[0] > anchor:
                        # anchor is a tick, due and not fired: ticks passed with
                        # no node up (or no worker) to fire them. Say which.
                        write_audit(tx, "cron.ticks.missed", None, fid, {
                            "cron": cron, "timezone": tz, "catchup": catchup, "from": anchor,
                            "to": latest_tick(cron, tz, now), "fired": due,
                        })
                    if not due:
                        reason = MISSED
                if reason == NO_LIVE_WORKER and since is None:
                    write_audit(tx, "cron.ticks.skipped", None, fid, {
                        "cron": cron, "timezone": tz, "reason": reason, "from": next_at,
                        "live_within_s": live_within_s,
                    })
                if reason is None:
                    skipped, since = 0, None
                else:
                    skipped += len(ticks_between(cron, tz, next_at, now, MAX_CATCHUP_TICKS))
                    since = (next_at if since is None else since) if reason == NO_LIVE_WORKER else None
                tx.execute(
                    "UPDATE cron_schedules SET next_at = ?, last_tick_at = ?, skip_reason = ?,"
                    " skipped_ticks = ?, skipped_since = ? WHERE function_id = ? AND cron = ?"
                    " AND timezone = ?",
                    (next_tick(cron, tz, now), latest_tick(cron, tz, now), reason, skipped, since,
                     fid, cron, tz),
                )
                tx.execute(
                    "DELETE FROM cron_ticks WHERE function_id = ? AND scheduled_at < ?",
                    (fid, now - window_s - _CLAIM_KEEP_S),
                )
            return fired

        return await self._transact(work)

    def on_schedules_changed(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener()`` after each registration through this store that
        may have changed cron schedules. Returns the call that unregisters it."""
        self._schedule_listeners.append(listener)

        def unregister() -> None:
            if listener in self._schedule_listeners:
                self._schedule_listeners.remove(listener)

        return unregister

    async def seconds_until_next_tick(self) -> float | None:
        def work(tx: Tx) -> float | None:
            row = tx.fetchone(
                "SELECT min(next_at) - ironflow_now() FROM cron_schedules"
            )
            return None if row is None or row[0] is None else float(row[0])

        return await self._read(work)

    async def pause_function(self, function_id: str, *, by: str) -> bool:
        def work(tx: Tx) -> bool:
            row = tx.fetchone(
                f"SELECT paused_at FROM functions WHERE id = ? {tx.lock_wait()}", (function_id,)
            )
            if row is None:
                raise FunctionNotFound(f"function {function_id} is not registered")
            if row[0] is not None:
                return False
            tx.execute("UPDATE functions SET paused_at = ironflow_now() WHERE id = ?", (function_id,))
            write_audit(tx, "function.paused", None, function_id, {"by": by})
            return True

        return await self._transact(work)

    async def resume_function(
        self, function_id: str, *, catchup: bool, by: str, node_id: str
    ) -> tuple[bool, str | None]:
        def work(tx: Tx) -> tuple[bool, str | None]:
            row = tx.fetchone(
                f"SELECT paused_at, definition FROM functions WHERE id = ? {tx.lock_wait()}",
                (function_id,),
            )
            if row is None:
                raise FunctionNotFound(f"function {function_id} is not registered")
            paused_at, text = row
            if paused_at is None:
                return False, None
            tx.execute("UPDATE functions SET paused_at = NULL WHERE id = ?", (function_id,))
            run_id = self._catch_up(tx, function_id, text, paused_at, node_id) if catchup else None
            write_audit(tx, "function.resumed", None, function_id, {
                "by": by, "catchup": catchup, "paused_at": paused_at, "run_id": run_id,
            })
            return True, run_id

        return await self._transact(work)

    def _catch_up(self, tx: Tx, function_id: str, text: str, paused_at: float, node_id: str) -> str | None:
        """Start a run for the latest tick skipped since ``paused_at`` (over every
        schedule of the function), if there was one; its run id."""
        fd = self._fdef_or_none(text)
        now = self._now(tx)
        latest: tuple[float, str, str] | None = None
        for cron, tz in tx.fetchall(
            "SELECT cron, timezone FROM cron_schedules WHERE function_id = ?", (function_id,)
        ):
            t = latest_tick(cron, tz, now)
            if t is not None and t >= paused_at and (latest is None or t > latest[0]):
                latest = (t, cron, tz)
        if fd is None or latest is None:
            return None
        return self._claim_tick(tx, fd, latest[1], latest[2], latest[0], node_id)
