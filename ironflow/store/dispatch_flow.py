"""Flow control at dispatch (docs/flow-control.md): layered
concurrency limits, the round robin across concurrency keys, throttle (GCRA
kept in ``flow_throttle``, by ``ironflow_now()``) and priority.

:class:`FlowPlan` is built once per reservation transaction
(``dispatch.py``): it counts live leases and reservations per bucket (under
the ``conc:<function>`` named locks the transaction took at BEGIN), admits or
refuses each candidate, and at the end writes the throttle states and moves
throttled rows' ``eligible_at`` to their start times (so the dispatcher sleeps
until then instead of polling).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ironflow.expressions import EvaluationError, compile_expression, compile_key, event_variables
from ironflow.protocol import PRIORITY_MAX_S, FunctionDef, concurrency_limits
from ironflow.store.tx import Tx, dec, iso_time, placeholders

# The candidate columns every read of the queue returns (dispatch.py).
CANDIDATE_COLS = (
    "q.run_id, q.execution_seq, q.function_id, q.concurrency_key, f.definition, q.reason"
)
# Dispatch order: a priority moves a segment that many seconds ahead.
ORDER_SQL = "(q.eligible_at - q.priority_s), q.enqueued_at"
# Keys visited per function by one fairness pass, at most: bounds the pass's
# cost by the work wanted, not by how many keys are queued.
FAIR_KEYS_MAX = 64
# Throttle keys per statement (2-3 parameters each): far under both backends'
# parameter limits, and a round rarely reads more candidates than this.
THROTTLE_KEYS_PER_STATEMENT = 500


def conc_lock(function_id: str) -> str:
    """The named lock under which a function's concurrency usage is counted."""
    return "conc:" + function_id


def priority_of(fd: FunctionDef, name: str, data: Any) -> float:
    """A new run's priority in seconds, clamped to ±PRIORITY_MAX_S (0 when it
    cannot be evaluated on this event or is not a number)."""
    if fd.priority is None:
        return 0.0
    try:
        value = compile_expression(fd.priority).evaluate(event_variables(name, data))
    except EvaluationError:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return max(-PRIORITY_MAX_S, min(PRIORITY_MAX_S, float(value)))


def set_priorities(tx: Tx, rows: Sequence[tuple[str, float]]) -> None:
    """Write ``(run_id, priority_s)`` on the runs' first queue rows."""
    rows = [r for r in rows if r[1]]
    if rows:
        tx.executemany(
            "UPDATE dispatch_queue SET priority_s = ? WHERE run_id = ?", [(p, r) for r, p in rows]
        )


def _throttle_key(fd: FunctionDef, name: str, data: Any, event_id: str) -> str:
    assert fd.throttle is not None
    if fd.throttle.key is None:
        return ""
    try:
        key = compile_key(fd.throttle.key).key(name, data, event_id)
    except EvaluationError:
        key = None
    return "" if key is None else "k:" + key


class FlowPlan:
    """What one reservation transaction admits (see the module docstring)."""

    def __init__(self, tx: Tx, locked: frozenset[str], decode: Any):
        self.tx = tx
        self.locked = locked
        self.now = 0.0  # read with the throttle states (only a throttled round needs it)
        self.decode = decode
        self.usage: dict[tuple[str, str | None], int] = {}
        self.counted: set[str] = set()
        self.unlocked: set[str] = set()  # limited functions whose lock this tx lacks
        self.full_keyed: set[str] = set()  # functions with a candidate refused by a full key
        self.tat: dict[tuple[str, str], float] = {}
        self.dirty: set[tuple[str, str]] = set()
        self.tkeys: dict[str, str] = {}
        self.waiting: dict[tuple[str, str], int] = {}
        self.bumps: list[tuple[float, str, int]] = []
        self.seen_limited: dict[str, bool] = {}  # function id → has a concurrency limit
        self.held_by_limit = 0  # candidates refused by a full limit (ironflow_flow_held_total)
        self.fair_passes = 0

    def prepare(self, candidates: Sequence[Sequence[Any]]) -> None:
        """Count usage of the limited functions among ``candidates`` and lock
        the throttle states their first starts need (sorted: one order)."""
        limited: dict[str, FunctionDef] = {}
        throttled: list[str] = []
        for run_id, seq, fid, _, definition, reason in candidates:
            fd = self.decode(definition)
            self.seen_limited[fid] = bool(concurrency_limits(fd))
            if concurrency_limits(fd) and fid not in self.counted:
                if fid in self.locked:
                    limited[fid] = fd
                else:
                    self.unlocked.add(fid)
            if fd.throttle is not None and seq == 1 and reason == "new" and run_id not in self.tkeys:
                throttled.append(run_id)
        if limited:
            ids = sorted(limited)
            self.counted.update(ids)
            for fid, ckey, n in self.tx.fetchall(
                "SELECT function_id, concurrency_key, count(*) FROM ("
                " SELECT function_id, concurrency_key FROM concurrency_leases"
                f" WHERE function_id IN ({placeholders(len(ids))})"
                # Every reservation still on its row counts, expired or not:
                # this transaction cleared the expired ones it could lock
                # (release_expired_reservations), and one it could not is locked by a
                # JobAck that may yet make it a lease (SKIP LOCKED passed it).
                " UNION ALL SELECT function_id, concurrency_key FROM dispatch_queue"
                " WHERE reservation_owner IS NOT NULL"
                f" AND function_id IN ({placeholders(len(ids))})"
                ") u GROUP BY function_id, concurrency_key",
                [*ids, *ids],
            ):
                for c in concurrency_limits(limited[fid]):
                    bucket = (fid, ckey if c.key is not None else None)
                    self.usage[bucket] = self.usage.get(bucket, 0) + int(n)
        if throttled:
            self._lock_throttles(throttled)

    def _lock_throttles(self, run_ids: list[str]) -> None:
        rows = self.tx.fetchall(
            "SELECT r.id, f.definition, e.name, e.data, e.id FROM runs r"
            " JOIN functions f ON f.id = r.function_id LEFT JOIN events e ON e.id = r.event_id"
            f" WHERE r.id IN ({placeholders(len(run_ids))})",
            run_ids,
        )
        row = self.tx.fetchone("SELECT ironflow_now()")
        self.now = float(row[0]) if row else 0.0
        wanted: set[tuple[str, str]] = set()
        for run_id, definition, name, data, event_id in rows:
            fd = self.decode(definition)
            key = _throttle_key(fd, name or "", dec(data), event_id or "")
            self.tkeys[run_id] = key
            if (fd.id, key) not in self.tat:
                wanted.add((fd.id, key))
        keys = sorted(wanted)
        for at in range(0, len(keys), THROTTLE_KEYS_PER_STATEMENT):
            chunk = keys[at:at + THROTTLE_KEYS_PER_STATEMENT]
            pairs = ", ".join(["(?, ?)"] * len(chunk))
            flat = [v for k in chunk for v in k]
            self.tx.execute(
                "INSERT INTO flow_throttle (function_id, throttle_key, tat)"
                f" VALUES {', '.join(['(?, ?, 0)'] * len(chunk))}"
                " ON CONFLICT (function_id, throttle_key) DO NOTHING",
                flat,
            )
            # The row locks (waited for, never skipped) serialise the nodes'
            # starts of a key: READ COMMITTED re-reads the committed tat. Taken
            # in key order (the sort is below the lock), as every round takes
            # them, so two rounds cannot deadlock on them.
            for fid, key, tat in self.tx.fetchall(
                "SELECT function_id, throttle_key, tat FROM flow_throttle"
                f" WHERE (function_id, throttle_key) IN (VALUES {pairs})"
                f" ORDER BY function_id, throttle_key {self.tx.lock_wait()}",
                flat,
            ):
                self.tat[(fid, key)] = float(tat)

    def admit(self, candidate: Sequence[Any]) -> bool:
        """Whether ``candidate`` may be reserved now; if so its slot and its
        throttle token are taken (in memory, written by :meth:`finish`)."""
        run_id, seq, fid, ckey, definition, _ = candidate
        fd = self.decode(definition)
        limits = concurrency_limits(fd)
        buckets = []
        if limits:
            if fid not in self.counted:
                return False  # limited since this tx began: next round, under the lock
            for c in limits:
                bucket = (fid, ckey if c.key is not None else None)
                if self.usage.get(bucket, 0) >= c.limit:
                    self.held_by_limit += 1
                    if c.key is not None:
                        self.full_keyed.add(fid)
                    return False
                buckets.append(bucket)
        tkey = self.tkeys.get(run_id)
        if fd.throttle is not None and tkey is not None:
            t = fd.throttle
            interval = t.period_s / t.limit
            tau = interval * (t.burst - 1)
            tat = self.tat.get((fid, tkey), 0.0)
            allowed_at = tat - tau
            if self.now < allowed_at - 1e-6:
                n = self.waiting.get((fid, tkey), 0)
                self.waiting[(fid, tkey)] = n + 1
                self.bumps.append((allowed_at + n * interval, run_id, seq))
                return False
            self.tat[(fid, tkey)] = max(tat, self.now) + interval
            self.dirty.add((fid, tkey))
        for bucket in buckets:
            self.usage[bucket] = self.usage.get(bucket, 0) + 1
        return True

    def finish(self) -> None:
        """Write the throttle states taken and move throttled rows to their start times."""
        dirty = sorted(self.dirty)
        for at in range(0, len(dirty), THROTTLE_KEYS_PER_STATEMENT):
            chunk = dirty[at:at + THROTTLE_KEYS_PER_STATEMENT]
            # One statement for the round's keys (rows this transaction locked).
            self.tx.execute(
                "UPDATE flow_throttle SET tat = CAST(v.column3 AS DOUBLE PRECISION)"
                f" FROM (VALUES {', '.join(['(?, ?, ?)'] * len(chunk))}) AS v"
                " WHERE flow_throttle.function_id = v.column1"
                " AND flow_throttle.throttle_key = v.column2",
                [v for k in chunk for v in (k[0], k[1], self.tat[k])],
            )
        if self.bumps:
            self.tx.executemany(
                "UPDATE dispatch_queue SET eligible_at = ? WHERE run_id = ? AND execution_seq = ?"
                " AND reservation_owner IS NULL",
                self.bumps,
            )

    def fair_candidates(
        self, fd: FunctionDef, cursor: str | None, want: int, seen: set[str]
    ) -> tuple[list[tuple[Any, ...]], str | None]:
        """Round robin across ``function_id``'s concurrency keys: from the key
        after ``cursor`` (wrapping), the heads of keys with a free slot — a skip
        scan of the (function_id, concurrency_key, order) index, one probe per
        key, at most :data:`FAIR_KEYS_MAX` keys. Returns the candidates and the
        last key visited (the next pass's cursor)."""
        tx, function_id = self.tx, fd.id
        self.fair_passes += 1
        keys = _scan_keys(tx, function_id, cursor, FAIR_KEYS_MAX)
        if len(keys) < FAIR_KEYS_MAX and cursor is not None:
            keys += [k for k in _scan_keys(tx, function_id, None, FAIR_KEYS_MAX - len(keys)) if k <= cursor]
        picks: list[tuple[str, int]] = []
        for key in keys:
            free = min(
                (c.limit - self.usage.get((function_id, key if c.key is not None else None), 0)
                 for c in concurrency_limits(fd)),
                default=want,
            )
            if free > 0:
                picks.append((key, min(free, want)))
            if len(picks) >= want:
                break
        if not picks:
            return [], cursor
        parts = [
            f"SELECT * FROM (SELECT {CANDIDATE_COLS} FROM dispatch_queue q"
            " JOIN functions f ON f.id = q.function_id WHERE q.function_id = ?"
            " AND q.concurrency_key = ? AND q.reservation_owner IS NULL"
            f" AND q.eligible_at <= ironflow_now() ORDER BY {ORDER_SQL} LIMIT ?) AS h{i}"
            for i in range(len(picks))
        ]
        rows = tx.fetchall(
            " UNION ALL ".join(parts), [p for key, n in picks for p in (function_id, key, n)]
        )
        rows = [r for r in rows if r[0] not in seen]
        if rows and tx.lock():
            # The heads were read unlocked (no FOR UPDATE with UNION): lock them now,
            # skipping any another node took meanwhile.
            ids = [r[0] for r in rows]
            got = {
                r[0]
                for r in tx.fetchall(
                    f"SELECT q.run_id FROM dispatch_queue q WHERE q.run_id IN ({placeholders(len(ids))})"
                    f" AND q.reservation_owner IS NULL {tx.lock('q')}",
                    ids,
                )
            }
            rows = [r for r in rows if r[0] in got]
        return rows, picks[-1][0]


def _scan_keys(tx: Tx, function_id: str, after: str | None, n: int) -> list[str]:
    """Up to ``n`` distinct queued concurrency keys of ``function_id`` after
    ``after`` (from the first if None), in key order: a recursive skip scan."""
    first = "concurrency_key > ?" if after is not None else "concurrency_key IS NOT NULL"
    rows = tx.fetchall(
        "WITH RECURSIVE k(key, n) AS ("
        " SELECT (SELECT min(concurrency_key) FROM dispatch_queue WHERE function_id = ?"
        f" AND reservation_owner IS NULL AND {first}), 1"
        " UNION ALL SELECT (SELECT min(concurrency_key) FROM dispatch_queue WHERE function_id = ?"
        " AND reservation_owner IS NULL AND concurrency_key > k.key), k.n + 1"
        " FROM k WHERE k.key IS NOT NULL AND k.n < ?"
        ") SELECT key FROM k WHERE key IS NOT NULL",
        [function_id, *([after] if after is not None else []), function_id, n],
    )
    return [r[0] for r in rows]


def waiting_reason(tx: Tx, fd: FunctionDef, run_id: str, ckey: str | None,
                   eligible_at: float, reason: str, now: float) -> str | None:
    """Why a queued segment of ``fd`` waits, when flow control holds it
    ("throttled until …", "concurrency key customer=42: 2/2 in use"); None
    when nothing of flow control does (``runs get``, store/reads.py)."""
    if fd.throttle is not None and reason == "new" and eligible_at > now:
        return f"throttled until {iso_time(eligible_at)} ({eligible_at - now:.1f}s)"
    for c in concurrency_limits(fd):
        params: list[Any] = []
        where, label = "1 = 1", "concurrency limit"
        if c.key is not None:
            label = f"concurrency key {c.key}={ckey}"
            where, params = ("concurrency_key = ?", [ckey]) if ckey is not None else ("concurrency_key IS NULL", [])
        row = tx.fetchone(
            "SELECT (SELECT count(*) FROM concurrency_leases WHERE function_id = ?"
            f" AND {where}) + (SELECT count(*) FROM dispatch_queue WHERE function_id = ?"
            f" AND {where} AND reservation_owner IS NOT NULL)",
            [fd.id, *params, fd.id, *params],
        )
        used = int(row[0]) if row else 0
        if used >= c.limit:
            return f"{label}: {used}/{c.limit} in use"
    return None
