"""Dispatch: reserve runnable segments for sessions with free credits
(``FOR UPDATE SKIP LOCKED``, concurrency limits), build their assignments,
release a reservation a session could not take.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from typing import Any

from ironflow.engine import metrics
from ironflow.protocol import (
    PRIORITY_MAX_S,
    EventInfo,
    JobAssignment,
    MemoStep,
    concurrency_limits,
    job_id_for,
)
from ironflow.store.capacity_scan import release_expired_reservations
from ironflow.store.core import (
    RESERVE_OVERSCAN,
    NamedLock,
    SqlStoreBase,
    Tx,
    dec,
    dec_error,
    placeholders,
    token_hash,
)
from ironflow.store.dispatch_flow import CANDIDATE_COLS, ORDER_SQL, FlowPlan, conc_lock
from ironflow.store.flow import batch_events
from ironflow.store.records import Reservation, Reservations
from ironflow.store.transitions import free_credit

# What a segment's assignment needs of its run (``r``), its trigger event
# (``e``) and its queue row (``q``), and the database clock.
_ASSIGNMENT_COLS = (
    "r.id, r.function_id, r.attempt, r.max_attempts, e.id, e.name, e.data,"
    " e.received_at, e.idempotency_key, r.start_at - ironflow_clock(), q.reason,"
    " ironflow_clock(), e.traceparent, r.batch_size"
)
# A later segment's memo: each step's output while the run's outputs so far
# (in step order) fit the inline budget, else NULL and its length (the worker
# fetches it by step id: GET /v1/runs/{id}/steps/{step_id}/output), so an
# assignment stays under the frame limit however large the run's state. A
# compensation marker is always inline: the SDK reads it before any step.
# Lengths are characters (as both dialects' length() counts text).
_MEMO_SELECT = (
    "SELECT run_id, step_id, name, kind, status, CASE WHEN name LIKE 'compensate:%'"
    " OR SUM(length(output)) OVER (PARTITION BY run_id ORDER BY seq ROWS UNBOUNDED PRECEDING) <= ?"
    " THEN output END, error, length(output) FROM steps"
)
# Candidate reads past held functions per reservation round, at most (each
# excludes the functions the one before found held): bounds a round's cost
# when many functions are held at once; the next round reads on.
HELD_READS_MAX = 4


def _credits_sql(tx: Tx, sessions: int) -> str:
    """The free credits of ``sessions`` sessions (ids as parameters) that may
    take work, locked (``SKIP LOCKED``), their session rows share-locked."""
    return (
        "SELECT c.session_id, c.slot FROM worker_credits c"
        " JOIN worker_sessions s ON s.id = c.session_id"
        f" WHERE c.session_id IN ({placeholders(sessions)}) AND s.draining = 0"
        " AND s.expires_at > ironflow_now() AND c.claimed_run_id IS NULL AND c.held = 0"
        # The session rows are share-locked (waiting, not skipping): a
        # DRAINING nack committing meanwhile would otherwise requeue its
        # run into this very transaction's later read, for a session
        # this read still saw as not draining.
        f" ORDER BY c.session_id, c.slot {tx.lock('c')} {tx.share_lock('s')}"
    )


def _candidates_sql(tx: Tx, functions: int, limit: str = "?") -> str:
    """Up to ``limit`` unreserved, eligible queue rows of ``functions``
    functions (ids as parameters) in dispatch order (priority first), locked
    (``SKIP LOCKED``) on PostgreSQL."""
    return (
        f"SELECT {CANDIDATE_COLS} FROM dispatch_queue q JOIN functions f ON f.id = q.function_id"
        " WHERE q.reservation_owner IS NULL AND q.eligible_at <= ironflow_now()"
        # A bound for the order index: priority is at most 600 s.
        f" AND (q.eligible_at - q.priority_s) <= ironflow_now() + {PRIORITY_MAX_S}"
        f" AND q.function_id IN ({placeholders(functions)})"
        f" ORDER BY {ORDER_SQL} LIMIT {limit} {tx.lock('q')}"
    )


def _read_candidates(tx: Tx, function_ids: list[str], n: int) -> list[tuple[Any, ...]]:
    """:func:`_candidates_sql`: up to ``n`` rows of ``function_ids``."""
    return tx.fetchall(_candidates_sql(tx, len(function_ids)), [*function_ids, n])


def _read_credits(
    tx: Tx, session_ids: list[str], function_ids: list[str], limit: int
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]] | None]:
    """The free credits of ``session_ids`` (:func:`_credits_sql`, locked) and,
    where statements are round trips (``tx.round_trips``), the first
    :func:`_candidates_sql` read of ``function_ids`` with them in one
    statement (``RESERVE_OVERSCAN`` rows per credit the round may fill;
    otherwise None: the caller reads them). The candidates' LIMIT counts the
    credits, so the credits are read and locked first, as by two statements;
    the candidates are read in the same snapshot (a DRAINING nack's requeued
    row, committed while the session row was waited for, is not among them)."""
    if not tx.round_trips:
        return tx.fetchall(_credits_sql(tx, len(session_ids)), session_ids), None
    rows = tx.fetchall(
        f"WITH c AS ({_credits_sql(tx, len(session_ids))}),"
        f" q AS ({_candidates_sql(tx, len(function_ids), f'least(?, (SELECT count(*) FROM c)) * {RESERVE_OVERSCAN}')})"
        " SELECT 0, session_id, slot, NULL, NULL, NULL, NULL FROM c"
        " UNION ALL SELECT 1, run_id, execution_seq, function_id, concurrency_key, definition, reason FROM q",
        [*session_ids, *function_ids, limit],
    )
    return [row[1:3] for row in rows if row[0] == 0], [row[1:] for row in rows if row[0] == 1]


class ReservationRound:
    """One reservation transaction's work, the named locks it takes at BEGIN,
    and what flow control held back in its committed attempt (counted once
    it committed: :meth:`count_held`)."""

    __slots__ = ("work", "locks", "held")

    def __init__(
        self, work: Callable[[Tx], Reservations], locks: list[NamedLock], held: list[int]
    ) -> None:
        self.work = work
        self.locks = locks
        self.held = held  # refused by a limit, throttled, fair passes

    def count_held(self) -> None:
        refused, throttled, fair_passes = self.held
        if refused:
            metrics.FLOW_HELD.labels("concurrency").inc(refused)
        if throttled:
            metrics.FLOW_HELD.labels("throttle").inc(throttled)
        if fair_passes:
            metrics.FLOW_FAIR_PASSES.inc(fair_passes)


class DispatchOps(SqlStoreBase):
    """Reservations and assignments for sessions with free credits."""

    # What admits candidates in a reservation transaction: a class attribute,
    # as ``PostgresStore.tx_class`` is, so a test can inject a planted bug
    # (tests/sim/bugs.py) without a switch in the engine.
    flow_plan_class: type[FlowPlan] = FlowPlan

    def __init__(self) -> None:
        super().__init__()
        # Function id → whether its usage is counted under :func:`conc_lock`
        # (a concurrency limit), as last seen; the reservation transaction
        # takes those locks at BEGIN (docs/isolation.md).
        self._flow_limited: dict[str, bool] = {}
        # Function id → the last concurrency key a fairness pass visited.
        self._flow_cursors: dict[str, str | None] = {}

    async def reserve_segments(
        self,
        node_id: str,
        offers: dict[str, frozenset[str]],
        limit: int,
        *,
        reservation_expiry_s: float,
    ) -> Reservations:
        round_ = self._reservation_round(offers, limit, reservation_expiry_s)
        if round_ is None:
            return Reservations()
        result = await self._transact(round_.work, round_.locks)
        round_.count_held()
        return result

    def _reservation_round(
        self, offers: dict[str, frozenset[str]], limit: int, reservation_expiry_s: float,
        *, joined: bool = False,
    ) -> ReservationRound | None:
        """The work of one reservation transaction (:meth:`reserve_segments`)
        and the named locks it takes at BEGIN; None when there is nothing to
        offer. Also run inside an emit's or a completion's transaction
        (``joined``: :meth:`~ironflow.store.sql.SqlStore.ingest_and_reserve`,
        ``complete_jobs_and_reserve``), which has no use for
        ``next_eligible`` and leaves expired reservations to the dispatcher's
        rounds and loop 1 (a statement per emit and per completion fewer; a
        credit an expired reservation still holds is only not offered by it)."""
        function_ids = sorted(set().union(*offers.values())) if offers else []
        session_ids = sorted(offers)
        if limit <= 0 or not function_ids:
            return None

        def work(tx: Tx) -> Reservations:
            made = reserve(tx)
            if len(made) >= limit or joined:
                return Reservations(made)
            # The queue ran dry for these offers: the dispatcher goes idle and
            # needs to know until when (one statement here, not a transaction).
            return Reservations(made, next_eligible=_next_eligible(tx), known=True)

        def reserve(tx: Tx) -> list[Reservation]:
            if unknown:
                # Learn whether they are limited from their definitions, so the
                # next round locks only the limited ones: a function offered
                # but never seen among candidates would otherwise keep every
                # round (and every emit's) serialised on its lock.
                self._flow_limited.update(
                    (fid, bool(concurrency_limits(self._fdef(definition))))
                    for fid, definition in tx.fetchall(
                        f"SELECT id, definition FROM functions WHERE id IN ({placeholders(len(unknown))})",
                        unknown,
                    )
                )
            if not joined:
                release_expired_reservations(tx)
            credits, first = _read_credits(tx, session_ids, function_ids, limit)
            if not credits:
                return []
            free: dict[str, list[int]] = {}
            for sid, slot in credits:
                free.setdefault(sid, []).append(slot)
            # Flow control (store/dispatch_flow.py): candidates in dispatch
            # order (priority); while a read came back full and credits remain,
            # read on past the functions none of whose rows could start (a
            # full limit, a throttle, no offering session with a credit): their
            # held rows must not stand in front of other functions' runs. Then
            # — when a full concurrency key refused some — the heads of the
            # other keys, round robin.
            window = min(limit, len(credits)) * RESERVE_OVERSCAN
            read = _read_candidates(tx, function_ids, window) if first is None else first
            candidates = list(read)
            if not candidates:
                return []
            plan = self.flow_plan_class(tx, locked, self._fdef)
            plan.prepare(candidates)
            chosen: list[tuple[str, int, str, str]] = []  # run_id, seq, session, token
            credit_rows: list[tuple[Any, ...]] = []

            def choose(rows: list[tuple[Any, ...]]) -> None:
                for row in rows:
                    if len(chosen) >= limit:
                        return
                    run_id, seq, function_id = row[0], row[1], row[2]
                    # The offering session with the most free credits spreads the load.
                    best = max(
                        (s for s, ids in offers.items() if function_id in ids and free.get(s)),
                        key=lambda s: len(free[s]),
                        default=None,
                    )
                    if best is None or not plan.admit(row):
                        continue
                    slot = free[best].pop()
                    token = secrets.token_hex(16)
                    chosen.append((run_id, seq, best, token))
                    credit_rows.append((run_id, seq, best, slot))

            choose(candidates)
            seen = {row[0] for row in candidates}
            passed: set[str] = set()
            for _ in range(HELD_READS_MAX):
                if len(read) < window or len(chosen) >= limit or not any(free.values()):
                    break
                taken = {c[0] for c in chosen}
                passed.update(row[2] for row in read if row[0] not in taken)
                rest = [fid for fid in function_ids if fid not in passed]
                if not rest:
                    break
                read = _read_candidates(tx, rest, window)
                rows = [row for row in read if row[0] not in seen]
                plan.prepare(rows)
                seen.update(row[0] for row in rows)
                candidates += rows
                choose(rows)
            for fid in sorted(plan.full_keyed):
                if len(chosen) >= limit or not any(free.values()):
                    break
                fd = self._fdef(next(r[4] for r in candidates if r[2] == fid))
                cursors = self._flow_cursors
                rows, cursors[fid] = plan.fair_candidates(
                    fd, cursors.get(fid), limit - len(chosen), seen
                )
                plan.prepare(rows)
                seen.update(row[0] for row in rows)
                choose(rows)
            self._flow_limited.update(plan.seen_limited)
            held[:] = [plan.held_by_limit, len(plan.bumps), plan.fair_passes]
            plan.finish()
            if plan.bumps:
                tx.notify()  # throttled rows moved: the dispatcher re-reads when they are due
            if not chosen:
                return []
            runs = _write_reservations(tx, chosen, credit_rows, reservation_expiry_s)
            return self._assignments(tx, chosen, runs)

        limited = self._flow_limited
        # Unknown: locked until a read shows otherwise (the round reads them).
        unknown = [fid for fid in function_ids if fid not in limited]
        locked = frozenset(fid for fid in function_ids if limited.get(fid, True))
        held = [0, 0, 0]  # of the committed attempt: refused by a limit, throttled, fair passes
        return ReservationRound(work, [(conc_lock(fid), True) for fid in sorted(locked)], held)

    def _assignments(
        self, tx: Tx, chosen: list[tuple[str, int, str, str]], read: list[tuple[Any, ...]] | None
    ) -> list[Reservation]:
        """The chosen segments' assignments; ``read``: their :data:`_ASSIGNMENT_COLS`
        rows if the reservation's statement returned them (else read here)."""
        run_ids = [c[0] for c in chosen]
        if read is None:
            read = tx.fetchall(
                f"SELECT {_ASSIGNMENT_COLS} FROM runs r LEFT JOIN events e ON e.id = r.event_id"
                f" LEFT JOIN dispatch_queue q ON q.run_id = r.id WHERE r.id IN ({placeholders(len(run_ids))})",
                run_ids,
            )
        runs = {row[0]: row for row in read}
        memo: dict[str, list[MemoStep]] = {rid: [] for rid in run_ids}
        # A run's first segment (seq 1) has no steps: a step is written only
        # under a segment's fence, and every later segment of a run (a resume,
        # retry, nack, recovery, compensation) has a higher seq. Most
        # reservations are first segments: their round reads no steps.
        again = [c[0] for c in chosen if c[1] > 1]
        state: dict[str, int] = {}
        for run_id, step_id, name, kind, status, output, error, size in tx.fetchall(
            f"{_MEMO_SELECT} WHERE run_id IN ({placeholders(len(again))})"
            " AND status IN ('completed', 'failed', 'timed_out') ORDER BY run_id, seq",
            (self.memo_inline_bytes, *again),
        ) if again else ():
            if size:
                state[run_id] = state.get(run_id, 0) + size
            if output is None and size:  # past the inline budget: the worker fetches it
                memo[run_id].append(MemoStep(step_id, name, kind, status, None, dec_error(error), True))
            else:
                memo[run_id].append(MemoStep(step_id, name, kind, status, dec(output), dec_error(error)))
        # A batch run's events (store/flow.py), only read when one is among them.
        batches = batch_events(tx, [rid for rid in run_ids if runs[rid][13]])
        out = []
        for run_id, seq, session_id, token in chosen:
            r = runs[run_id]
            event = EventInfo(
                id=r[4] or "",
                name=r[5] or "",
                data=dec(r[6]),
                received_at=r[7] or 0.0,
                idempotency_key=r[8],
                traceparent=r[12],
            )
            # A segment whose run may not start yet (a sleep woken ahead of
            # its time) carries the wait, from the database clock.
            ahead = r[9]
            delay_ms = math.ceil(ahead * 1000) if ahead is not None and ahead > 0 else 0
            out.append(
                Reservation(
                    session_id,
                    JobAssignment(
                        job_id=job_id_for(run_id, seq),
                        run_id=run_id,
                        function_id=r[1],
                        event=event,
                        attempt=r[2],
                        max_attempts=r[3],
                        completed_steps=memo[run_id],
                        execution_seq=seq,
                        lease_token=token,
                        start_delay_ms=delay_ms,
                        db_now=float(r[11]) if delay_ms else None,
                        events=batches.get(run_id),
                    ),
                    wake_lateness_s=-ahead if ahead is not None and r[10] == "resume" else None,
                    state_bytes=state.get(run_id, 0),
                )
            )
        return out

    async def release_reservation(self, session_id: str, run_id: str, execution_seq: int) -> None:
        def work(tx: Tx) -> None:
            tx.notify()
            if tx.execute(
                "UPDATE dispatch_queue SET reservation_owner = NULL,"
                " reservation_expires_at = NULL, lease_token_hash = NULL"
                " WHERE run_id = ? AND execution_seq = ? AND reservation_owner = ?",
                (run_id, execution_seq, session_id),
            ):
                free_credit(tx, session_id, run_id, execution_seq)

        await self._transact(work)

    async def seconds_until_next_eligible(self) -> float | None:
        return await self._transact(_next_eligible)


def _write_reservations(
    tx: Tx,
    chosen: list[tuple[str, int, str, str]],
    credit_rows: list[tuple[Any, ...]],
    reservation_expiry_s: float,
) -> list[tuple[Any, ...]] | None:
    """The chosen segments' queue rows reserved (run, seq, session, token) and
    their credits claimed (run, seq, session, slot): rows the round has locked.
    PostgreSQL: one statement (a round trip, where two pipelined statements
    and the assignments' read cost three) that also returns what the
    assignments need (:data:`_ASSIGNMENT_COLS`; the joined runs and events
    are read, not locked); SQLite: one statement per table, None."""
    # The segment begins at reserved_at for a wait's look-back (waits.py).
    reserved = (
        "reservation_owner = {sid}, reservation_expires_at = ironflow_now() + {expiry},"
        " lease_token_hash = {digest}, reserved_at = ironflow_now(),"
        f" reservation_snapshot = {tx.snapshot_sql}"
    )
    queue_rows = [(rid, seq, sid, token_hash(tok)) for rid, seq, sid, tok in chosen]
    if tx.modifying_with:
        return tx.fetchall(
            "WITH v (run_id, execution_seq, session_id, digest) AS (VALUES "
            + ", ".join(["(?, ?, ?, ?)"] * len(queue_rows))
            + "), c (session_id, slot, run_id, execution_seq) AS (VALUES "
            + ", ".join(["(?, ?, ?, ?)"] * len(credit_rows))
            + "), k AS (UPDATE worker_credits w SET claimed_run_id = c.run_id,"
            " claimed_execution_seq = c.execution_seq FROM c"
            " WHERE w.session_id = c.session_id AND w.slot = c.slot)"
            " UPDATE dispatch_queue d SET "
            + reserved.format(sid="v.session_id", expiry="?", digest="v.digest")
            + " FROM v JOIN runs r ON r.id = v.run_id LEFT JOIN events e ON e.id = r.event_id"
            " WHERE d.run_id = v.run_id AND d.execution_seq = v.execution_seq"
            f" RETURNING {_ASSIGNMENT_COLS.replace('q.', 'd.')}",
            (
                *(value for row in queue_rows for value in row),
                *(value for rid, seq, sid, slot in credit_rows for value in (sid, slot, rid, seq)),
                float(reservation_expiry_s),
            ),
        )
    tx.executemany(
        "UPDATE dispatch_queue SET "
        + reserved.format(sid="?", expiry="?", digest="?")
        + " WHERE run_id = ? AND execution_seq = ?",
        [(sid, float(reservation_expiry_s), digest, rid, seq) for rid, seq, sid, digest in queue_rows],
    )
    tx.executemany(
        "UPDATE worker_credits SET claimed_run_id = ?, claimed_execution_seq = ?"
        " WHERE session_id = ? AND slot = ?",
        credit_rows,
    )
    return None


def _next_eligible(tx: Tx) -> float | None:
    """:meth:`~ironflow.store.base.Store.seconds_until_next_eligible` in ``tx``."""
    # The soonest row still to become eligible, even while rows eligible now
    # wait: those may be held by a concurrency limit or wait for a credit (a
    # kick ends that wait), but a throttled start, a debounce or a retry delay
    # comes due by the clock alone.
    row = tx.fetchone(
        "SELECT (SELECT min(eligible_at) FROM dispatch_queue WHERE reservation_owner IS NULL"
        " AND eligible_at > ironflow_now()) - ironflow_now(),"
        " EXISTS (SELECT 1 FROM dispatch_queue WHERE reservation_owner IS NULL)"
    )
    if row is None or not row[1]:
        return None
    return 0.0 if row[0] is None else max(0.0, float(row[0]))
