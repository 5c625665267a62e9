"""The wait mechanism: a ``wait_for_event`` step parked, looked back, resolved
by an ingest, timed out — and the order of the locks that keep those four
from missing each other on PostgreSQL under READ COMMITTED.

A parked wait is a ``steps`` row (``kind = 'wait'``, ``status = 'waiting'``)
with a **wait key**: its event name, its match path and the canonical JSON of
the value it waits for (:func:`wait_key`), indexed (``steps_wait_key``). Every
path waited on for a name is listed in ``wait_paths`` (a handful of rows per
name), so an ingest computes the keys its event satisfies in Python and looks
up exactly those waits: an event for key 7 never reads, let alone locks, the
wait for key 8, and 20,000 waits parked on the name cost an emit nothing.

Locks, in the order they are taken:

1. **The name lock** ``wait:<event name>`` (:func:`park_locks`,
   :func:`ingest_locks`), a transaction-scoped advisory lock taken before the
   transaction's first statement (``Store._transact(..., locks=...)``; a group
   commit takes all its calls' locks at BEGIN, sorted). An ingest takes it
   *shared*, a park *exclusive*. Ingests of one name therefore never wait for
   each other, and one park and one ingest of the same name never overlap: the
   later one starts after the earlier committed, so it sees the earlier's row
   — the park sees the event in its look-back, or the ingest sees the parked
   wait. Without it both read before either commits and the event is lost
   (docs/isolation.md, race 3). Another name's lock is another lock: unrelated names
   never wait for each other.
2. **The wait rows an event matches**, locked by the ingest with a blocking
   ``FOR UPDATE`` in ``(run_id, step_id)`` order (two ingests resolving the same
   waits lock them in the same order: no deadlock), their ``status`` re-checked
   by PostgreSQL after each lock (a wait that timed out or was cancelled
   meanwhile is left alone). Never ``SKIP LOCKED`` here: a wait row locked by a
   concurrent timeout or cancel must be waited for, not skipped, or the
   matching event passes it by (race 2). ``SKIP LOCKED`` stays where any free
   row will do: the waker's claim of elapsed waits (``wake_claims.py``), whose
   skipped rows are claimed on its next pass.
3. The run row, by ``transitions.resume`` (an UPDATE), after its step.

The **look-back** of a park finds an event that arrived while the segment
ran, before the wait existed. The segment began when it was *reserved*: the
worker gets its assignment once the reservation commits and may start the
handler before its JobAck commits, so an event sent after the handler's first
step can commit before the activation. "After it began" is judged by commit
order, not clocks: the reservation records its statement's snapshot
(``dispatch_queue.reservation_snapshot``, carried to the lease as
``began_snapshot``), every event its transaction id (``events.xid``), and the
look-back takes the events of the name that snapshot did not see — exactly
those committed after the reservation (or so close before that the worker
could not have known), whatever their ``received_at``. An event whose
transaction began before the segment and committed after it is therefore
found; by ``received_at`` it was not. The run's own events (its trigger, a
batch's events) are excluded by id: a first segment reserved in the
transaction that ingested them (``SqlStore.ingest_and_reserve``) has a
snapshot that does not count them as seen. SQLite commits one transaction at a time
in the order they run, so there the look-back is ``received_at >=`` the
reservation's time (``began_at``). It reads events a page at a time until one
matches: no row limit can hide a matching event behind others.

The **timeout** is the waker's: ``wake_claims.py`` claims waits whose ``wake_at``
passed (``waking``) and resolves them ``timed_out``; an ingest that locks the
row after such a claim sees its status changed and leaves it. A wait is
therefore resolved exactly once: by one event, or by its timeout, or failed
by its run's end (``transitions.end_run``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec

from ironflow.protocol import WaitYield, lookup_path
from ironflow.store.core import NamedLock, Tx, dec, enc, placeholders
from ironflow.store.records import Fence
from ironflow.store.transitions import resume

# Events of the awaited name read per page when a wait parks and looks back.
LOOKBACK_PAGE = 100
# Separates the parts of a wait key (event name, match path, match value): a
# control character no event name or path contains.
_KEY_SEP = "\x1f"

_canonical_encode = msgspec.json.Encoder(order="sorted").encode


def _canonical(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)  # 1.0 and 1 are the same JSON number
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def match_text(value: Any) -> str:
    """The canonical JSON of a match value: equal values, equal text (sorted
    keys, integral floats as integers), so a match is an index lookup."""
    return _canonical_encode(_canonical(value)).decode()


def wait_key(event: str, match: str | None, match_value: Any) -> str:
    """The key a wait is parked under and an event is looked up by. A wait
    without ``match`` waits for any event of the name: path and value empty."""
    if match is None:
        return _KEY_SEP.join((event, "", ""))
    return _KEY_SEP.join((event, match, match_text(match_value)))


def event_keys(name: str, data: Any, paths: Iterable[str]) -> list[str]:
    """The wait keys an event ``name`` with ``data`` satisfies, given the match
    paths waited on for its name (``""``: waits without a match)."""
    return [
        wait_key(name, None, None) if path == "" else wait_key(name, path, lookup_path(data, path))
        for path in paths
    ]


def first_event_by_key(
    events: Sequence[tuple[str, str, Any]],
    paths: dict[str, list[str]],
    keys_of: Callable[[str, Any, Sequence[str]], list[str]],
) -> dict[str, int]:
    """Each key ``keys_of(name, data, paths of the name)`` gives for any of
    ``events`` (``(event_id, name, data)``, in order) → the place of the
    first event that carries it: a wait (or a cancel-on row) is resolved by
    the first event that matches it."""
    keyed: dict[str, int] = {}
    for place, (_, name, data) in enumerate(events):
        for key in keys_of(name, data, paths.get(name, ())):
            keyed.setdefault(key, place)
    return keyed


def _name_lock(event: str) -> str:
    return "wait:" + event


def park_locks(event: str) -> list[NamedLock]:
    """The named locks a park of a wait for ``event`` takes: its name, exclusive."""
    return [(_name_lock(event), True)]


def ingest_locks(names: Iterable[str]) -> list[NamedLock]:
    """The named locks an ingest of events ``names`` takes: each name, shared."""
    return [(_name_lock(name), False) for name in sorted(set(names))]


# ── park ──


def park_wait(
    tx: Tx,
    fence: Fence,
    step_id: str,
    name: str,
    info: WaitYield,
    *,
    began_at: float,
    began_snapshot: str | None,
) -> bool:
    """Park a wait (under :func:`park_locks`, taken by the caller's
    transaction) and look back for an event that came while its segment ran:
    True if one resolved it at once."""
    tx.execute(
        "INSERT INTO wait_paths (wait_event, wait_match) VALUES (?, ?) ON CONFLICT DO NOTHING",
        (info.event, info.match or ""),
    )
    tx.execute(
        "INSERT INTO steps (run_id, step_id, name, kind, status, execution_seq, created_at, seq,"
        " wake_at, wait_event, wait_match, wait_match_value, wait_key)"
        " VALUES (?, ?, ?, 'wait', 'waiting', ?, ironflow_now(), ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT (run_id, step_id) DO UPDATE SET kind = excluded.kind,"
        " status = excluded.status, error = NULL, execution_seq = excluded.execution_seq,"
        " wake_at = excluded.wake_at, wait_event = excluded.wait_event,"
        " wait_match = excluded.wait_match, wait_match_value = excluded.wait_match_value,"
        " wait_key = excluded.wait_key, invoke_run_id = NULL, claimed_by = NULL,"
        " claimed_at = NULL, pre_claim_status = NULL WHERE steps.status <> 'completed'",
        (
            fence.run_id, step_id, name, fence.execution_seq, time.time_ns(), info.timeout_at,
            info.event, info.match, enc(info.match_value),
            wait_key(info.event, info.match, info.match_value),
        ),
    )
    return look_back(tx, fence.run_id, step_id, info, began_at, began_snapshot)


def look_back(
    tx: Tx, run_id: str, step_id: str, info: WaitYield,
    began_at: float, began_snapshot: str | None,
) -> bool:
    """Complete a wait just parked with the first matching event committed
    after its segment began (see the module docstring)."""
    want = None if info.match is None else match_text(info.match_value)
    after: tuple[Any, str] | None = None
    # The run's own events (its trigger; a batch's events) never resolve its
    # waits: they came before it. Its first segment may be reserved in the
    # very transaction that ingested them (SqlStore.ingest_and_reserve),
    # whose snapshot does not count its own writes as seen.
    own = {
        row[0] for row in tx.fetchall(
            "SELECT event_id FROM runs WHERE id = ? UNION ALL"
            " SELECT event_id FROM batch_events WHERE run_id = ?",
            (run_id, run_id),
        )
    }
    while True:
        if began_snapshot is not None:
            # PostgreSQL: the events the activation's snapshot did not see.
            page = tx.fetchall(
                "SELECT id, data, received_at, xid FROM events WHERE name = ?"
                " AND xid >= pg_snapshot_xmin(?::pg_snapshot)::text::bigint"
                " AND NOT pg_visible_in_snapshot(xid::text::xid8, ?::pg_snapshot)"
                + ("" if after is None else " AND (xid, id) > (?, ?)")
                + f" ORDER BY xid, id LIMIT {LOOKBACK_PAGE}",
                (info.event, began_snapshot, began_snapshot, *(after or ())),
            )
        else:
            page = tx.fetchall(
                "SELECT id, data, received_at, received_at FROM events WHERE name = ?"
                " AND received_at >= ?"
                + ("" if after is None else " AND (received_at, id) > (?, ?)")
                + f" ORDER BY received_at, id LIMIT {LOOKBACK_PAGE}",
                (info.event, began_at, *(after or ())),
            )
        matching = [
            row for row in page
            if row[0] not in own
            and (want is None or match_text(lookup_path(dec(row[1]), info.match or "")) == want)
        ]
        if matching:
            event_id, data_text, received_at, _ = min(matching, key=lambda row: (row[2], row[0]))
            event = enc({
                "id": event_id, "name": info.event, "data": dec(data_text),
                "received_at": received_at,
            })
            return bool(tx.execute(
                "UPDATE steps SET status = 'completed', output = ?, wake_at = NULL"
                " WHERE run_id = ? AND step_id = ? AND status = 'waiting'",
                (event, run_id, step_id),
            ))
        if len(page) < LOOKBACK_PAGE:
            return False
        after = (page[-1][3], page[-1][0])


# ── resolve on ingest ──


def wait_paths_sql(names: int) -> str:
    """The match paths waited on for ``names`` event names (params: the names)."""
    return f"SELECT wait_event, wait_match FROM wait_paths WHERE wait_event IN ({placeholders(names)})"


def resolve_waits(
    tx: Tx,
    events: Sequence[tuple[str, str, Any]],
    paths: dict[str, list[str]],
) -> list[list[str]]:
    """Complete every parked wait these events (``(event_id, name, data)``,
    in arrival order, committed by this transaction) satisfy, each wait by
    the first of them that matches it; the runs each event resumed.
    ``paths``: the match paths waited on per name (:func:`wait_paths_sql`)."""
    resumed: list[list[str]] = [[] for _ in events]
    keyed = first_event_by_key(events, paths, event_keys)  # wait key -> the first event that satisfies it
    if not keyed:
        return resumed
    keys = sorted(keyed)
    # The matching waits only, locked in one order, status re-checked after
    # each lock (PostgreSQL re-reads a row it waited for): module docstring.
    waits = tx.fetchall(
        "SELECT run_id, step_id, wait_key FROM steps WHERE status = 'waiting' AND kind = 'wait'"
        f" AND wait_key IN ({placeholders(len(keys))}) ORDER BY run_id, step_id {tx.lock_wait()}",
        keys,
    )
    outputs: dict[int, str] = {}
    for run_id, step_id, key in waits:
        place = keyed[key]
        if place not in outputs:
            event_id, name, data = events[place]
            row = tx.fetchone("SELECT received_at FROM events WHERE id = ?", (event_id,))
            outputs[place] = enc({
                "id": event_id, "name": name, "data": data,
                "received_at": row[0] if row else None,
            })
        if (
            tx.execute(
                "UPDATE steps SET status = 'completed', output = ?, wake_at = NULL"
                " WHERE run_id = ? AND step_id = ? AND status = 'waiting'",
                (outputs[place], run_id, step_id),
            )
            and resume(tx, run_id) is not None
        ):
            resumed[place].append(run_id)
    return resumed
