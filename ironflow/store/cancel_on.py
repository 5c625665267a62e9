"""Cancel on an event (``FunctionDef.cancel_on``, docs/triggers.md).

A run of a function with ``cancel_on`` entries is **subscribed** when it is
created, in the transaction that creates it: one ``cancel_subscriptions``
row per entry, keyed like a parked wait (waits.py ``wait_key``: the entry's
event name, its match path and the canonical value its triggering event
holds there). Every path a registered function's entries name is listed in
``cancel_paths`` per event name, read with the trigger index in the ingest's
first statement; so an emit computes the keys its event carries and looks up
exactly those rows (an index lookup), and an event no entry names costs
nothing more. A run whose triggering event lacks the match field is not
subscribed by that entry; an event that lacks it cancels nothing.

An ingest judges the rows found before it creates any run (the event never
cancels a run it starts itself): a row of a run that ended, or past its
``timeout_s`` (from the run's creation, by the database clock), is deleted;
a row with an ``expression`` is cancelled only when it is true (``event`` =
the run's triggering event, ``async`` = the incoming one; an evaluation
error cancels nothing). Each remaining run is cancelled by ``transitions.cancel``,
the path of ``POST /v1/runs/{id}/cancel``.

Ordering and locks (PostgreSQL, READ COMMITTED):

* **"An event that arrives before the run exists does not cancel it"**, by
  commit order: an event cancels the runs whose creation committed before its
  ingest's lookup statement began (that statement's snapshot). A run whose
  creation commits after that — concurrently, on another node — is not
  cancelled: the event counts as before it. Causality holds: a run a client
  has seen created is always cancelled by an event the client sends after.
  No named lock is needed for this: the rule is the snapshot's.
* **A cancel racing the run's own end** (completion, failure, timeout, a
  manual cancel, another cancelling event): ``transitions.cancel`` locks the run's
  queue row, then its lease, then the run (``FOR UPDATE``, the order an
  activation and a completion take them) and re-reads its status after the
  lock: whoever commits first ends the run, the other finds it ended and does
  nothing. A step write holds the lease ``FOR KEY SHARE`` and commits before
  the cancel's lock on it is granted, never after: the worker's later writes
  find no lease and are refused as stale.
* Several runs are cancelled in ``run_id`` order (two ingests cancelling the
  same runs lock them in the same order).
* A subscription row is deleted by the first ingest that finds its run ended
  (or by the run's purge, history.py); two ingests deleting it serialise on
  the row.

The worker holding a cancelled run's job is sent ``Cancel`` by the node its
session is on: on PostgreSQL a ``pg_notify`` on :data:`CANCEL_CHANNEL` in the
cancelling transaction (delivered at commit to every node's listener, this one
included); on SQLite (one node) after commit. A lost notification only delays
the worker: its next heartbeat is answered STALE and every write refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from ironflow.definitions import CANCEL_VARIABLES
from ironflow.expressions import EvaluationError, ExpressionError, compile_expression
from ironflow.protocol import TERMINAL_RUN_STATUSES, ErrorInfo, FunctionDef, lookup_path
from ironflow.store.base import Conflict, RunNotFound
from ironflow.store.core import Tx, dec, placeholders
from ironflow.store.records import CancelNotice, CancelOutcome
from ironflow.store.transitions import cancel
from ironflow.store.waits import first_event_by_key, wait_key

# LISTEN/NOTIFY channel of the jobs whose runs an event cancelled (PostgreSQL).
CANCEL_CHANNEL = "ironflow_cancel"
# Most payload bytes per NOTIFY (PostgreSQL refuses 8,000 and more).
_NOTIFY_MAX = 7900

_notices_encode = msgspec.json.Encoder().encode
notices_decode = msgspec.json.Decoder(list[CancelNotice]).decode


def cancel_reason(event_id: str) -> str:
    """What a run cancelled by event ``event_id`` is told (``Cancel.reason``)."""
    return f"cancelled by event {event_id}"


def register_cancel_paths(tx: Tx, fd: FunctionDef) -> None:
    """List the (event name, match path) pairs ``fd``'s cancel_on entries name
    (at registration; the rows stay, a handful per event name)."""
    for spec in fd.cancel_on:
        tx.execute(
            "INSERT INTO cancel_paths (event_name, match_path) VALUES (?, ?) ON CONFLICT DO NOTHING",
            (spec.event, spec.match or ""),
        )


def cancel_paths_sql(names: int) -> str:
    """The cancel-on match paths per event name (params: the names)."""
    return f"SELECT event_name, match_path FROM cancel_paths WHERE event_name IN ({placeholders(names)})"


def _event_keys(name: str, data: Any, paths: Sequence[str]) -> list[str]:
    keys = []
    for path in paths:
        if path == "":
            keys.append(wait_key(name, None, None))
            continue
        value = lookup_path(data, path)
        if value is not None:
            keys.append(wait_key(name, path, value))
    return keys


def _payloads(notices: list[CancelNotice]) -> list[str]:
    """``notices`` as JSON arrays of at most :data:`_NOTIFY_MAX` bytes each."""
    out: list[str] = []
    chunk: list[CancelNotice] = []
    for notice in notices:
        if chunk and len(_notices_encode([*chunk, notice])) > _NOTIFY_MAX:
            out.append(_notices_encode(chunk).decode())
            chunk = []
        chunk.append(notice)
    if chunk:
        out.append(_notices_encode(chunk).decode())
    return out


def notify_cancels(tx: Tx, notices: list[CancelNotice]) -> None:
    """Where NOTIFY reaches every node (PostgreSQL): tell them, at this
    transaction's commit, which jobs were taken from workers (SQLite's store
    announces them after commit instead: ``_notifies_cancels``)."""
    if notices and tx.notifies_nodes:
        for payload in _payloads(notices):
            tx.execute("SELECT pg_notify(?, ?)", (CANCEL_CHANNEL, payload))


def subscribe_cancels(tx: Tx, runs: list[tuple[str, FunctionDef, Any]]) -> None:
    """New runs ``(run_id, definition, event data)``: record their cancel-on
    subscriptions (module docstring), in the transaction that creates them."""
    rows: list[Any] = []
    for run_id, fd, data in runs:
        for spec_no, spec in enumerate(fd.cancel_on):
            if spec.match is None:
                key = wait_key(spec.event, None, None)
            else:
                value = lookup_path(data, spec.match)
                if value is None:
                    continue  # nothing to match: this entry never cancels the run
                key = wait_key(spec.event, spec.match, value)
            timeout = None if spec.timeout_s is None else float(spec.timeout_s)
            rows += [key, run_id, spec_no, spec.expression, timeout]
    if rows:
        tx.execute(
            "INSERT INTO cancel_subscriptions (cancel_key, run_id, spec, condition, expires_at)"
            " VALUES " + ", ".join(["(?, ?, ?, ?, ironflow_now() + ?)"] * (len(rows) // 5)),
            rows,
        )



def cancel_on_events(
    tx: Tx, events: Sequence[tuple[str, str, Any]], paths: dict[str, list[str]]
) -> list[list[CancelOutcome]]:
    """Cancel the runs these events (``(event_id, name, data)``, in order)
    cancel (module docstring): per event, the runs it cancelled."""
    cancelled: list[list[CancelOutcome]] = [[] for _ in events]
    keyed = first_event_by_key(events, paths, _event_keys)
    if not keyed:
        return cancelled
    keys = sorted(keyed)
    rows = tx.fetchall(
        "SELECT s.cancel_key, s.run_id, s.spec, s.condition,"
        " CASE WHEN s.expires_at IS NULL OR s.expires_at > ironflow_now() THEN 1 ELSE 0 END,"
        " r.status, r.event_id, e.name, e.data"
        " FROM cancel_subscriptions s LEFT JOIN runs r ON r.id = s.run_id"
        # The run's triggering event, only for a row with a condition.
        " LEFT JOIN events e ON s.condition IS NOT NULL AND e.id = r.event_id"
        f" WHERE s.cancel_key IN ({placeholders(len(keys))}) ORDER BY s.run_id, s.spec",
        keys,
    )
    ended: set[str] = set()
    expired: list[tuple[str, str, int]] = []
    victims: dict[str, int] = {}  # run id -> the first event that cancels it
    for key, run_id, spec, condition, live, status, trigger_id, trigger_name, trigger_data in rows:
        if status is None or status in TERMINAL_RUN_STATUSES:
            ended.add(run_id)
            continue
        if not live:
            expired.append((key, run_id, spec))
            continue
        place = keyed[key]
        trigger = {"name": trigger_name, "data": dec(trigger_data), "id": trigger_id}
        if condition is not None and not condition_holds(condition, trigger, events[place]):
            continue
        victims[run_id] = min(place, victims.get(run_id, place))
    notices: list[CancelNotice] = []
    for run_id in sorted(victims):
        event_id, name, _ = events[victims[run_id]]
        error = ErrorInfo(
            message=f"{cancel_reason(event_id)} ({name})", code="CANCELLED", retryable=False
        )
        audit = {"cause": "cancel-on-event", "event_id": event_id, "event": name}
        try:
            outcome = cancel(tx, run_id, error, audit)
        except (RunNotFound, Conflict):
            ended.add(run_id)  # it ended meanwhile (it was racing us): nothing to cancel
            continue
        cancelled[victims[run_id]].append(outcome)
        if outcome.session_id is not None and outcome.job_id is not None:
            notices.append(
                CancelNotice(run_id, outcome.session_id, outcome.job_id, cancel_reason(event_id))
            )
        ended.add(run_id)
    notify_cancels(tx, notices)
    if ended:
        gone = sorted(ended)
        tx.execute(f"DELETE FROM cancel_subscriptions WHERE run_id IN ({placeholders(len(gone))})", gone)
    if expired:
        tx.executemany(
            "DELETE FROM cancel_subscriptions WHERE cancel_key = ? AND run_id = ? AND spec = ?",
            expired,
        )
    return cancelled



def condition_holds(condition: str, trigger: dict[str, Any], incoming: tuple[str, str, Any]) -> bool:
    """A cancel-on ``expression``: true cancels; false or an error does not."""
    event_id, name, data = incoming
    try:
        return compile_expression(condition, CANCEL_VARIABLES).test(
            {"event": trigger, "async": {"name": name, "data": data, "id": event_id}}
        )
    except (EvaluationError, ExpressionError):
        return False
