"""Ingest-side flow control: rate limit, debounce, singleton, event batches
and a full concurrency key's ``on_limit`` (ironflow/protocol/flow.py;
docs/flow-control.md).

An ingest hands the functions an event triggers to :meth:`IngestFlow.flow`,
which decides, in the ingest's own transaction, by the database clock, and
answers the runs to create (:class:`~ironflow.store.core.NewRun`: ids chosen
here, so a row can name its run before it exists; a held first segment for
a debounce or batch) with the notes. The caller creates them with the event,
on PostgreSQL the runs and events of a whole group of emits in one statement
(``ingest._create_runs_with_events``, ``_ingest_many``):

* **rate limit**: GCRA over ``rate_limits.tat`` (the theoretical arrival time
  of the next event): an event passes when ``max(tat, now) + period/limit``
  is no later than ``now + period``, and moves ``tat`` there. ``limit``
  events may pass at once, then one every ``period/limit``.
* **debounce**: one pending run per key (``debounces``), created with its
  queue row due ``period`` ahead (reason ``debounce``); a later event moves
  that row's ``eligible_at`` (bounded by ``first_at + max_wait``) and the
  run's event to itself. The dispatcher fires it like any queue row — on
  whichever node, once (``SKIP LOCKED`` claims), after any node's death (the
  row is in the database): the timer is the queue.
* **singleton**: ``singletons`` names the key's last run; while it has not
  ended, a new event's run is skipped (``skip``) or the old run is
  cancelled through :meth:`_cancel_in` (``cancel``). A new key, or a run
  the upsert sees ended, is taken over by the upsert itself (one statement).
* **batch**: one filling run per key (``batches``), due ``timeout`` after
  its first event; each event joins it (``batch_events``) until
  ``max_size``, which makes it due at once.
* **concurrency on_limit**: while the key has ``limit`` runs in flight
  (holding a slot or queued for one), a new run is skipped (``skip``) or the
  key's oldest are cancelled so that it fits (``cancel_in_progress``);
  ``on_limit_keys`` holds only the row whose lock the count is taken under.

Concurrency (PostgreSQL, READ COMMITTED): every decision starts with an
upsert of the ``(function_id, key)`` row of its table (``INSERT … ON CONFLICT
DO UPDATE``/``DO NOTHING`` then ``UPDATE``): the row lock (or, for the first
event of a key, the primary key's unique index, on which a concurrent insert
waits for the first to commit) is what two nodes ingesting one key take
turns on; the second then reads the first's committed row. A filling
debounce or batch is only joined while its queue row is unreserved and not
yet due, checked by an UPDATE of that row (which waits for a reservation in
progress and re-checks): an event never joins a run a worker may already
hold. These locks are taken per event in the order of its functions; a
group of ingests that cross two keys in opposite orders is a deadlock the
backend retries (ironflow/store/postgres.py).

A decision reads the runs of its key (a singleton's holder, a filling
batch's queue row, the runs an on_limit counts): within a group of emits, a
key decided a second time first has the group's planned runs created
(``touch``), so event by event the group decides as separate emits would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from ironflow.expressions import EvaluationError, ExpressionError, compile_key
from ironflow.ids import new_id
from ironflow.protocol import (
    TERMINAL_RUN_STATUSES,
    Concurrency,
    DebounceRecord,
    ErrorInfo,
    EventInfo,
    FlowNote,
    FunctionDef,
    concurrency_limits,
)
from ironflow.protocol.flow import FlowMechanism
from ironflow.store.base import Conflict, RunNotFound
from ironflow.store.cancel_on import notify_cancels
from ironflow.store.core import NewRun, SqlStoreBase, Tx, dec, enc, iso_time, new_run, placeholders
from ironflow.store.errors import KeyEvaluationFailed
from ironflow.store.filters import CompiledDefinitions
from ironflow.store.records import CancelNotice, CancelOutcome
from ironflow.store.transitions import TERMINAL_SQL, cancel

# Slack on the rate limit's comparison: period/limit * limit may round above period.
_GCRA_EPSILON = 1e-6
# The key of events whose key expression gives null (or of a function with no key).
_NO_KEY = ""


class FlowResult(msgspec.Struct):
    """What :meth:`IngestFlow.flow` decided for one event."""

    # The runs the event starts, ids chosen here (flow control's rows already
    # name them): the caller creates them with the event (PostgreSQL: in one
    # statement, ``ingest._create_runs_with_events``).
    runs: list[NewRun]
    notes: list[FlowNote]
    cancelled: list[CancelOutcome]

    def flow_json(self) -> str | None:
        """The event's ``events.flow`` column: its notes, or None."""
        return enc(self.notes) if self.notes else None


# A flow-control key an ingest's decision reads runs of: (function id,
# mechanism, key). A group of emits must have created the runs it planned for
# a key before deciding on that key again (store/ingest.py ``_ingest_many``).
FlowKey = tuple[str, str, str]

# The upserts that start a singleton's and a batch's decision, for n keys at
# once: a new key's row names the run chosen for it (a singleton's also when
# the run it names is seen ended), an existing row is locked as it is.
_SINGLETON_UPSERT = (
    "INSERT INTO singletons (function_id, key, run_id) VALUES {values}"
    " ON CONFLICT (function_id, key) DO UPDATE SET run_id = CASE WHEN EXISTS"
    " (SELECT 1 FROM runs r WHERE r.id = singletons.run_id"
    f" AND r.status IN {TERMINAL_SQL}) THEN excluded.run_id ELSE singletons.run_id END"
    " RETURNING function_id, key, run_id"
)
_BATCH_UPSERT = (
    "INSERT INTO batches (function_id, key, run_id, first_at, size) VALUES {values}"
    " ON CONFLICT (function_id, key) DO UPDATE SET size = batches.size"
    " RETURNING function_id, key, run_id, size, first_at"
)
# The row an on_limit decision counts its key's runs in flight under.
_ON_LIMIT_UPSERT = (
    "INSERT INTO on_limit_keys (function_id, concurrency_key) VALUES {values}"
    " ON CONFLICT (function_id, concurrency_key) DO UPDATE"
    " SET concurrency_key = on_limit_keys.concurrency_key"
)
_UPSERTS: dict[str, tuple[str, str]] = {
    "singleton": (_SINGLETON_UPSERT, "(?, ?, ?)"),
    "batch": (_BATCH_UPSERT, "(?, ?, ?, ironflow_now(), 1)"),
}


class FlowGroup:
    """A group of emits deciding in one transaction (``ingest._ingest_many``).

    ``touch(key)`` before a decision reads a key's runs: the second time in a
    group, the runs planned so far are created first (``create``).
    ``claimed``: the upserted rows of the group's first event of each
    singleton and batch key (:meth:`IngestFlow.claim_keys`, one statement per
    table), taken by that event's decision instead of its own upsert."""

    def __init__(self, create: Callable[[], None]) -> None:
        self.touched: set[FlowKey] = set()
        self.claimed: dict[FlowKey, tuple[str, Any]] = {}  # → (the run id chosen, its row)
        self._create = create

    def touch(self, key: FlowKey) -> None:
        if key in self.touched:
            self._create()
            self.touched.clear()
        self.touched.add(key)


def on_limit_of(fd: FunctionDef) -> Concurrency | None:
    """``fd``'s concurrency constraint decided at ingest (``on_limit`` skip or
    cancel_in_progress; registration allows one), or None."""
    return next((c for c in concurrency_limits(fd) if c.on_limit != "queue"), None)


def has_flow(fd: FunctionDef) -> bool:
    """Whether ``fd`` declares any ingest-side flow control."""
    return (
        fd.rate_limit is not None
        or fd.debounce is not None
        or fd.singleton is not None
        or fd.batch is not None
        or on_limit_of(fd) is not None
    )


def batch_events(tx: Tx, run_ids: list[str]) -> dict[str, list[EventInfo]]:
    """The events of each batch run of ``run_ids``, in arrival order."""
    if not run_ids:
        return {}
    out: dict[str, list[EventInfo]] = {}
    for run_id, eid, name, data, received_at, key, traceparent in tx.fetchall(
        "SELECT b.run_id, e.id, e.name, e.data, e.received_at, e.idempotency_key, e.traceparent"
        " FROM batch_events b JOIN events e ON e.id = b.event_id"
        f" WHERE b.run_id IN ({placeholders(len(run_ids))}) ORDER BY b.run_id, b.position",
        run_ids,
    ):
        out.setdefault(run_id, []).append(
            EventInfo(eid, name, dec(data), received_at, key, traceparent)
        )
    return out


def _key(source: str | None, name: str, data: Any, event_id: str) -> str:
    if source is None:
        return _NO_KEY
    text = compile_key(source).key(name, data, event_id)
    return _NO_KEY if text is None else text


class IngestFlow:
    """Rate limit, debounce, singleton and batch decisions of an ingest, in
    its transaction: one per store (``IngestOps``), holding nothing but the
    store's compilations (a key is computed as the run's would be)."""

    def __init__(self, definitions: CompiledDefinitions) -> None:
        self.definitions = definitions

    def flow(
        self, tx: Tx, fds: list[FunctionDef], event_id: str, name: str, data: Any,
        group: FlowGroup | None = None,
    ) -> FlowResult:
        """Apply each function's ingest-side flow control to event ``event_id``:
        the runs it starts (those of ``fds`` without any, as they are) and what
        it did. ``group``: the group of emits it is one of, if any."""
        result = FlowResult([], [], [])
        for fd in fds:
            if has_flow(fd):
                self._flow_one(tx, fd, event_id, name, data, result, group)
            else:
                result.runs.append(new_run(fd))
        return result

    def claim_keys(self, tx: Tx, group: FlowGroup, events: list[tuple[str, str, Any, list[FunctionDef]]]) -> None:
        """Upsert, in one statement per table and in key order, the singleton,
        batch and on_limit rows of the first event of each key among ``events``
        (``(event_id, name, data, starting functions)``), and count the on_limit
        keys' runs in flight (one statement per function, once every row is
        locked); the rows and counts go to ``group.claimed``. A function with
        a rate limit is left to its event (the rate limit decides first), as
        is a key that fails to evaluate."""
        wanted: dict[str, dict[FlowKey, str]] = {"singleton": {}, "batch": {}}
        limited: dict[FlowKey, FunctionDef] = {}
        for event_id, name, data, fds in events:
            for fd in fds:
                if fd.rate_limit is None and on_limit_of(fd) is not None:
                    try:
                        limited.setdefault((fd.id, "concurrency", self._on_limit_key(fd, name, data, event_id)), fd)
                    except KeyEvaluationFailed:
                        pass
                spec = fd.singleton or fd.batch
                if spec is None or fd.rate_limit is not None:
                    continue
                mechanism = "singleton" if fd.singleton is not None else "batch"
                try:
                    key = _key(spec.key, name, data, event_id)
                except (EvaluationError, ExpressionError):
                    continue
                wanted[mechanism].setdefault((fd.id, mechanism, key), new_id("run"))
        for mechanism, keys in wanted.items():
            if not keys:
                continue
            sql, values = _UPSERTS[mechanism]
            order = sorted(keys)  # one lock order for every group
            for row in tx.fetchall(
                sql.format(values=", ".join([values] * len(order))),
                [p for fk in order for p in (fk[0], fk[2], keys[fk])],
            ):
                fk = (row[0], mechanism, row[1])
                group.claimed[fk] = (keys[fk], row[2:])
        if limited:
            order = sorted(limited)
            tx.execute(
                _ON_LIMIT_UPSERT.format(values=", ".join(["(?, ?)"] * len(order))),
                [p for fk in order for p in (fk[0], fk[2])],
            )
            by_function: dict[str, list[str]] = {}
            for fk in order:
                by_function.setdefault(fk[0], []).append(fk[2])
            for function_id, lock_keys in by_function.items():
                counted = self._in_flight(tx, limited[(function_id, "concurrency", lock_keys[0])], lock_keys)
                for lock_key in lock_keys:
                    group.claimed[(function_id, "concurrency", lock_key)] = ("", counted[lock_key])

    def _upserted(
        self, tx: Tx, group: FlowGroup | None, key: FlowKey, run_id: str
    ) -> tuple[str, Any]:
        """The run id chosen for ``key``'s decision and its upserted row: the
        group's claim if it made one, else this event's own upsert."""
        claim = group.claimed.pop(key, None) if group is not None else None
        if claim is not None:
            return claim
        sql, values = _UPSERTS[key[1]]
        row = tx.fetchone(sql.format(values=values), (key[0], key[2], run_id))
        assert row is not None
        return run_id, row[2:]

    def _flow_one(
        self, tx: Tx, fd: FunctionDef, event_id: str, name: str, data: Any, result: FlowResult,
        group: FlowGroup | None,
    ) -> None:
        # Every key first: one that fails skips the event before any state moves.
        decider: tuple[FlowMechanism, str | None] | None = (
            ("singleton", fd.singleton.key) if fd.singleton is not None
            else ("debounce", fd.debounce.key) if fd.debounce is not None
            else ("batch", fd.batch.key) if fd.batch is not None else None
        )
        sources: list[tuple[FlowMechanism, str | None]] = [] if decider is None else [decider]
        if fd.rate_limit is not None:
            sources.insert(0, ("rate_limit", fd.rate_limit.key))
        keys: dict[FlowMechanism, str] = {}
        for mechanism, source in sources:
            try:
                keys[mechanism] = _key(source, name, data, event_id)
            except (EvaluationError, ExpressionError) as exc:  # a stored key today's rules refuse, too
                result.notes.append(FlowNote(fd.id, mechanism, "skipped", f"{mechanism} key: {exc}"))
                return
        limit = fd.rate_limit
        if limit is not None and not self._rate_limit_passes(tx, fd, keys["rate_limit"]):
            keyed = f" for key {keys['rate_limit']!r}" if limit.key is not None else ""
            result.notes.append(FlowNote(
                fd.id, "rate_limit", "skipped",
                f"rate limit: {limit.limit} per {limit.period_s:g}s{keyed} reached",
            ))
            return
        if decider is None and on_limit_of(fd) is None:
            result.runs.append(new_run(fd))
            return
        mechanism = "concurrency" if decider is None else decider[0]
        key = keys.get(mechanism) if decider is not None else self._on_limit_key(fd, name, data, event_id)
        assert key is not None
        if group is not None:
            group.touch((fd.id, mechanism, key))
        if decider is None:
            self._on_limit(tx, fd, key, event_id, result, group)
        elif decider[0] == "singleton":
            self._singleton(tx, fd, key, event_id, result, group)
        elif decider[0] == "debounce":
            self._debounce(tx, fd, key, event_id, result)
        else:
            self._batch(tx, fd, key, event_id, result, group)

    # ── rate limit ───────────────────────────────────────────────────────────

    @staticmethod
    def _rate_limit_passes(tx: Tx, fd: FunctionDef, key: str) -> bool:
        """GCRA: the first event of a key inserts its row (a concurrent first
        insert waits on the primary key, then finds the row); later ones move
        ``tat`` under the row lock of the UPDATE, whose condition PostgreSQL
        re-checks on the row as the lock holder committed it."""
        limit = fd.rate_limit
        assert limit is not None
        interval = limit.period_s / limit.limit
        if tx.fetchone(
            "INSERT INTO rate_limits (function_id, key, tat) VALUES (?, ?, ironflow_now() + ?)"
            " ON CONFLICT (function_id, key) DO NOTHING RETURNING 1",
            (fd.id, key, interval),
        ):
            return True
        return bool(tx.execute(
            "UPDATE rate_limits SET tat = (CASE WHEN tat > ironflow_now() THEN tat"
            " ELSE ironflow_now() END) + ? WHERE function_id = ? AND key = ?"
            " AND (CASE WHEN tat > ironflow_now() THEN tat ELSE ironflow_now() END) + ?"
            " <= ironflow_now() + ?",
            (interval, fd.id, key, interval, limit.period_s + _GCRA_EPSILON),
        ))

    # ── singleton ────────────────────────────────────────────────────────────

    def _singleton(
        self, tx: Tx, fd: FunctionDef, key: str, event_id: str, result: FlowResult, group: FlowGroup | None
    ) -> None:
        """At most one run of ``(fd, key)`` not ended: the ``singletons`` row,
        locked by its upsert, names it; a new run is only planned under that
        lock, its id chosen first. No further statement when the key is new
        or its run is seen ended (the upsert names the new run at once)."""
        single = fd.singleton
        assert single is not None
        run_id, (holder,) = self._upserted(tx, group, (fd.id, "singleton", key), new_id("run"))
        new = NewRun(fd, run_id)
        if holder != new.run_id:
            # Seen in flight by the upsert's snapshot, or not seen at all: a
            # run committed after it began (READ COMMITTED), or purged. A
            # fresh read decides.
            status = tx.fetchone("SELECT status FROM runs WHERE id = ?", (holder,))
            if status is not None and status[0] not in TERMINAL_RUN_STATUSES:
                if single.mode == "skip":
                    result.notes.append(FlowNote(
                        fd.id, "singleton", "skipped", f"singleton: run {holder} of key {key!r} is in flight",
                        run_id=holder,
                    ))
                    return
                outcome = self._cancel_in(tx, holder, f"singleton: replaced by event {event_id}")
                if outcome is not None:  # announced as ended by the ingest (unless compensating)
                    result.cancelled.append(outcome)
                    result.notes.append(FlowNote(
                        fd.id, "singleton", "cancelled", f"singleton: cancelled run {holder} of key {key!r}",
                        run_id=holder,
                    ))
            tx.execute(
                "UPDATE singletons SET run_id = ? WHERE function_id = ? AND key = ?", (new.run_id, fd.id, key)
            )
        # Created with the event's other runs, under the id the row names.
        result.runs.append(new)

    def _cancel_in(
        self, tx: Tx, run_id: str, reason: str, cause: FlowMechanism = "singleton"
    ) -> CancelOutcome | None:
        """Cancel ``run_id`` in this transaction (transitions.py ``cancel``: the
        lock order of ``cancel_run``, queue row, lease, run); None if it ended
        meanwhile. The worker holding it is told like a cancel-on's; the audit
        names ``cause``."""
        error = ErrorInfo(message=reason, code="CANCELLED", retryable=False)
        try:
            outcome = cancel(tx, run_id, error, {"reason": reason, "cause": cause})
        except (Conflict, RunNotFound):
            return None
        if outcome.session_id is not None and outcome.job_id is not None:
            notify_cancels(tx, [CancelNotice(run_id, outcome.session_id, outcome.job_id, reason)])
        return outcome

    # ── concurrency on_limit: skip or cancel_in_progress ────────────────────

    def _on_limit_key(self, fd: FunctionDef, name: str, data: Any, event_id: str) -> str:
        """The ``on_limit_keys`` key of a new run of ``fd``: '' for none, 'k:<key>'."""
        c = on_limit_of(fd)
        assert c is not None
        ckey = self.definitions.run_key(fd, name, data, event_id) if c.key is not None else None
        return _NO_KEY if ckey is None else "k:" + ckey

    @staticmethod
    def _in_flight(tx: Tx, fd: FunctionDef, lock_keys: list[str]) -> dict[str, list[str]]:
        """The runs in flight of each of ``fd``'s ``on_limit_keys`` keys
        ``lock_keys``, oldest first, in one statement. Called once their rows
        are locked, by a statement of its own: under READ COMMITTED its
        snapshot is taken then, so it sees the run of an ingest that held a
        lock before (a count in the upsert's statement would not)."""
        c = on_limit_of(fd)
        assert c is not None
        where, params = "", [fd.id]
        if c.key is not None:
            texts = [k[2:] for k in lock_keys if k != _NO_KEY]
            parts = [f"concurrency_key IN ({placeholders(len(texts))})"] if texts else []
            if _NO_KEY in lock_keys:
                parts.append("concurrency_key IS NULL")
            where, params = " AND (" + " OR ".join(parts) + ")", [fd.id, *texts]
        counted: dict[str, list[str]] = {k: [] for k in lock_keys}
        for ckey, run_id in tx.fetchall(
            "SELECT u.concurrency_key, r.id FROM runs r JOIN ("
            f" SELECT run_id, concurrency_key FROM concurrency_leases WHERE function_id = ?{where}"
            f" UNION SELECT run_id, concurrency_key FROM dispatch_queue WHERE function_id = ?{where}"
            ") u ON u.run_id = r.id ORDER BY r.created_at, r.id",
            params * 2,
        ):
            counted.setdefault(_NO_KEY if c.key is None or ckey is None else "k:" + ckey, []).append(run_id)
        return counted

    def _on_limit(
        self, tx: Tx, fd: FunctionDef, lock_key: str, event_id: str, result: FlowResult, group: FlowGroup | None
    ) -> None:
        """A new run of a full concurrency key: skipped, or the key's oldest
        runs in flight cancelled so that it fits. In flight is what the limit
        counts plus what waits for a slot: a segment holding a lease or a
        reservation, or queued (a sleeping or waiting run holds none). Counted
        under the row lock of the key's ``on_limit_keys`` upsert, so two nodes
        ingesting one key count in turn and the second sees the first's run."""
        c = on_limit_of(fd)
        assert c is not None
        ckey = lock_key[2:] if lock_key else None
        claim = group.claimed.pop((fd.id, "concurrency", lock_key), None) if group is not None else None
        if claim is not None:
            in_flight: list[str] = claim[1]
        else:
            tx.execute(_ON_LIMIT_UPSERT.format(values="(?, ?)"), (fd.id, lock_key))
            in_flight = self._in_flight(tx, fd, [lock_key])[lock_key]
        label = f"concurrency key {c.key}={ckey}" if c.key is not None else "concurrency limit"
        if len(in_flight) >= c.limit and c.on_limit == "skip":
            result.notes.append(FlowNote(
                fd.id, "concurrency", "skipped", f"{label}: {len(in_flight)}/{c.limit} in flight",
                run_id=in_flight[0],
            ))
            return
        # The oldest go, locked in run id order (cancel_on.py's order).
        for run_id in sorted(in_flight[: max(0, len(in_flight) - c.limit + 1)]):
            outcome = self._cancel_in(
                tx, run_id, f"concurrency: replaced by event {event_id} ({label}, limit {c.limit})",
                "concurrency",
            )
            if outcome is not None:  # announced as ended by the ingest (unless compensating)
                result.cancelled.append(outcome)
                result.notes.append(FlowNote(
                    fd.id, "concurrency", "cancelled", f"{label}: cancelled run {run_id}", run_id=run_id,
                ))
        result.runs.append(new_run(fd))

    # ── debounce and batch: a run held in the queue until due ───────────────

    @staticmethod
    def _still_filling(tx: Tx, run_id: str, due: str, params: tuple[Any, ...]) -> float | None:
        """Move the held first segment of ``run_id`` to ``due`` (SQL over
        ``eligible_at``) if it is still unreserved and not yet due; its new
        due time, or None when it is already due or taken (PostgreSQL: the
        UPDATE waits for a reservation in progress, then re-checks)."""
        row = tx.fetchone(
            f"UPDATE dispatch_queue SET eligible_at = {due} WHERE run_id = ? AND execution_seq = 1"
            " AND reservation_owner IS NULL AND eligible_at > ironflow_now() RETURNING eligible_at",
            (*params, run_id),
        )
        return None if row is None else float(row[0])

    def _debounce(self, tx: Tx, fd: FunctionDef, key: str, event_id: str, result: FlowResult) -> None:
        """Join the key's pending run (it now carries this event) or plan the
        next quiet period's, held ``period`` (its id chosen first: a new key's
        row names it in the upsert)."""
        debounce = fd.debounce
        assert debounce is not None
        new = NewRun(fd, new_id("run"), debounce.period_s, "debounce")
        row = tx.fetchone(
            "INSERT INTO debounces (function_id, key, run_id, event_id, first_at, fire_at)"
            " VALUES (?, ?, ?, ?, ironflow_now(), ironflow_now() + ?) ON CONFLICT (function_id, key)"
            " DO UPDATE SET event_id = excluded.event_id RETURNING run_id, first_at, fire_at",
            (fd.id, key, new.run_id, event_id, debounce.period_s),
        )
        assert row is not None
        pending, first_at, until = row[0], float(row[1]), float(row[2])
        if pending != new.run_id:
            bound = first_at + debounce.max_wait_s if debounce.max_wait_s is not None else None
            due = (
                "ironflow_now() + ?" if bound is None
                else "CASE WHEN ironflow_now() + ? < ? THEN ironflow_now() + ? ELSE ? END"
            )
            params: tuple[Any, ...] = (
                (debounce.period_s,) if bound is None
                else (debounce.period_s, bound, debounce.period_s, bound)
            )
            moved = self._still_filling(tx, pending, due, params)
            if moved is not None:
                # The pending run now carries this event (its data is what it runs with).
                tx.execute("UPDATE runs SET event_id = ? WHERE id = ?", (event_id, pending))
                tx.execute(
                    "UPDATE debounces SET fire_at = ? WHERE function_id = ? AND key = ?",
                    (moved, fd.id, key),
                )
                result.notes.append(self._debounce_note(fd, key, pending, moved))
                return
            row = tx.fetchone(
                "UPDATE debounces SET run_id = ?, event_id = ?, first_at = ironflow_now(),"
                " fire_at = ironflow_now() + ? WHERE function_id = ? AND key = ? RETURNING fire_at",
                (new.run_id, event_id, debounce.period_s, fd.id, key),
            )
            assert row is not None
            until = float(row[0])
        result.runs.append(new)
        result.notes.append(self._debounce_note(fd, key, new.run_id, until))

    @staticmethod
    def _debounce_note(fd: FunctionDef, key: str, run_id: str, until: float) -> FlowNote:
        keyed = f" of key {key!r}" if fd.debounce is not None and fd.debounce.key is not None else ""
        return FlowNote(
            fd.id, "debounce", "debounced", f"debounced{keyed} until {iso_time(until)}", run_id=run_id, until=until
        )

    def _batch(
        self, tx: Tx, fd: FunctionDef, key: str, event_id: str, result: FlowResult, group: FlowGroup | None
    ) -> None:
        """Join the key's filling batch or plan the next batch's run (its id
        chosen first: a new key's row names it, size 1, in the upsert)."""
        batch = fd.batch
        assert batch is not None
        delay = 0.0 if batch.max_size == 1 else batch.timeout_s
        run_id, (filling, size, first_at) = self._upserted(tx, group, (fd.id, "batch", key), new_id("run"))
        new = NewRun(fd, run_id, delay, "batch", batch=True)
        size, first_at = int(size), float(first_at)
        if filling != new.run_id:
            if size < batch.max_size:
                full = size + 1 >= batch.max_size
                until = self._still_filling(
                    tx, filling, "ironflow_now()" if full else "eligible_at", ()
                )
                if until is not None:
                    self._join_batch(tx, fd, key, filling, size, event_id)
                    result.notes.append(FlowNote(
                        fd.id, "batch", "batched", f"batch of run {filling}: {size + 1} of {batch.max_size}"
                        + (" (full, due now)" if full else f" until {iso_time(until)}"),
                        run_id=filling, until=until, size=size + 1,
                    ))
                    return
            row = tx.fetchone(
                "UPDATE batches SET run_id = ?, first_at = ironflow_now(), size = 1"
                " WHERE function_id = ? AND key = ? RETURNING first_at",
                (new.run_id, fd.id, key),
            )
            assert row is not None
            first_at = float(row[0])
        # Created with the event: batch_size 1, this event batch event 0 (core.py).
        result.runs.append(new)
        until = first_at + delay
        result.notes.append(FlowNote(
            fd.id, "batch", "batched", f"batch of run {new.run_id}: 1 of {batch.max_size} until {iso_time(until)}",
            run_id=new.run_id, until=until, size=1,
        ))

    @staticmethod
    def _join_batch(tx: Tx, fd: FunctionDef, key: str, run_id: str, size: int, event_id: str) -> None:
        tx.execute(
            "INSERT INTO batch_events (run_id, position, event_id) VALUES (?, ?, ?)",
            (run_id, size, event_id),
        )
        tx.execute(
            "UPDATE batches SET size = ? WHERE function_id = ? AND key = ?", (size + 1, fd.id, key)
        )

class FlowOps(SqlStoreBase):
    """The reads of ingest-side flow control: debounced runs pending."""

    # ── the event record and the reads ──────────────────────────────────────

    async def list_debounces(self, *, function_id: str | None = None, limit: int = 100) -> list[DebounceRecord]:
        def work(tx: Tx) -> list[DebounceRecord]:
            now = self._now(tx)
            clause = " AND d.function_id = ?" if function_id is not None else ""
            rows = tx.fetchall(
                "SELECT d.function_id, d.key, d.run_id, d.event_id, d.first_at, q.eligible_at"
                " FROM debounces d JOIN dispatch_queue q ON q.run_id = d.run_id"
                " AND q.execution_seq = 1 AND q.reservation_owner IS NULL AND q.reason = 'debounce'"
                f" WHERE 1 = 1{clause} ORDER BY q.eligible_at, d.function_id, d.key LIMIT ?",
                [*([function_id] if function_id is not None else []), limit],
            )
            return [
                DebounceRecord(
                    function_id=r[0], key=r[1], run_id=r[2], event_id=r[3], first_at=float(r[4]),
                    fire_at=float(r[5]), fire_in_s=float(r[5]) - now,
                )
                for r in rows
            ]

        return await self._read(work)
