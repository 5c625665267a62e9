"""Dispatch: reserve runnable segments for sessions with free credits
(``FOR UPDATE SKIP LOCKED``, concurrency limits), build their assignments,
release a reservation a session could not take.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

from ironflow.protocol import (
    EventInfo,
    FunctionDef,
    JobAssignment,
    MemoStep,
    job_id_for,
)
from ironflow.store.base import (
    Reservation,
)
from ironflow.store.capacity_scan import CapacityLoop
from ironflow.store.core import (
    RESERVE_OVERSCAN,
    Tx,
    _dec,
    _dec_error,
    _marks,
    token_hash,
)
from ironflow.store.flow import batch_events


class DispatchOps(CapacityLoop):
    """Reservations and assignments for sessions with free credits."""

    async def reserve_segments(
        self,
        node_id: str,
        offers: dict[str, frozenset[str]],
        limit: int,
        *,
        reservation_expiry_s: float,
    ) -> list[Reservation]:
        function_ids = sorted(set().union(*offers.values())) if offers else []
        session_ids = sorted(offers)
        if limit <= 0 or not function_ids:
            return []

        def work(tx: Tx) -> list[Reservation]:
            self._expire_reservations(tx)
            credits = tx.fetchall(
                "SELECT c.session_id, c.slot FROM worker_credits c"
                " JOIN worker_sessions s ON s.id = c.session_id"
                f" WHERE c.session_id IN ({_marks(len(session_ids))}) AND s.draining = 0"
                " AND s.expires_at > ironflow_now() AND c.claimed_run_id IS NULL AND c.held = 0"
                # The session rows are share-locked (waiting, not skipping): a
                # DRAINING nack committing meanwhile would otherwise requeue its
                # run into this very transaction's later read, for a session
                # this read still saw as not draining.
                f" ORDER BY c.session_id, c.slot {tx.lock('c')} {tx.share_lock('s')}",
                session_ids,
            )
            if not credits:
                return []
            free: dict[str, list[int]] = {}
            for sid, slot in credits:
                free.setdefault(sid, []).append(slot)
            candidates = tx.fetchall(
                "SELECT q.run_id, q.execution_seq, q.function_id, q.concurrency_key,"
                " f.definition FROM dispatch_queue q JOIN functions f ON f.id = q.function_id"
                " WHERE q.reservation_owner IS NULL AND q.eligible_at <= ironflow_now()"
                f" AND q.function_id IN ({_marks(len(function_ids))})"
                f" ORDER BY q.eligible_at, q.enqueued_at LIMIT ? {tx.lock('q')}",
                [*function_ids, min(limit, len(credits)) * RESERVE_OVERSCAN],
            )
            if not candidates:
                return []
            usage = self._concurrency_usage(tx, candidates)
            chosen: list[tuple[str, int, str, str]] = []  # run_id, seq, session, token
            credit_rows: list[tuple[Any, ...]] = []
            for run_id, seq, function_id, ckey, definition in candidates:
                if len(chosen) >= limit:
                    break
                fd = self._fdef(definition)
                bucket = None
                if fd.concurrency is not None:
                    bucket = (function_id, ckey if fd.concurrency.key is not None else None)
                    if usage.get(bucket, 0) >= fd.concurrency.limit:
                        continue
                # The offering session with the most free credits spreads the load.
                best = max(
                    (s for s, ids in offers.items() if function_id in ids and free.get(s)),
                    key=lambda s: len(free[s]),
                    default=None,
                )
                if best is None:
                    continue
                slot = free[best].pop()
                if bucket is not None:
                    usage[bucket] = usage.get(bucket, 0) + 1
                token = secrets.token_hex(16)
                chosen.append((run_id, seq, best, token))
                credit_rows.append((run_id, seq, best, slot))
            if not chosen:
                return []
            tx.executemany(
                "UPDATE dispatch_queue SET reservation_owner = ?,"
                " reservation_expires_at = ironflow_now() + ?, lease_token_hash = ?,"
                # The segment begins here for a wait's look-back (waits.py).
                f" reserved_at = ironflow_now(), reservation_snapshot = {tx.snapshot_sql}"
                " WHERE run_id = ? AND execution_seq = ?",
                [
                    (sid, float(reservation_expiry_s), token_hash(tok), rid, seq)
                    for rid, seq, sid, tok in chosen
                ],
            )
            tx.executemany(
                "UPDATE worker_credits SET claimed_run_id = ?, claimed_execution_seq = ?"
                " WHERE session_id = ? AND slot = ?",
                credit_rows,
            )
            return self._assignments(tx, chosen)

        return await self._transact(work)

    def _concurrency_usage(
        self, tx: Tx, candidates: list[tuple[Any, ...]]
    ) -> dict[tuple[str, str | None], int]:
        """Live leases + live reservations per concurrency bucket of limited functions."""
        limited: dict[str, FunctionDef] = {}
        for _, _, function_id, _, definition in candidates:
            fd = self._fdef(definition)
            if fd.concurrency is not None:
                limited[function_id] = fd
        if not limited:
            return {}
        ids = sorted(limited)
        for function_id in ids:
            # Two nodes must not both see the same free bucket: serialise per function.
            tx.advisory_lock("conc:" + function_id)
        rows = tx.fetchall(
            "SELECT function_id, concurrency_key, count(*) FROM ("
            " SELECT function_id, concurrency_key FROM concurrency_leases"
            f" WHERE function_id IN ({_marks(len(ids))})"
            " UNION ALL SELECT function_id, concurrency_key FROM dispatch_queue"
            " WHERE reservation_owner IS NOT NULL AND reservation_expires_at > ironflow_now()"
            f" AND function_id IN ({_marks(len(ids))})"
            ") u GROUP BY function_id, concurrency_key",
            [*ids, *ids],
        )
        usage: dict[tuple[str, str | None], int] = {}
        for function_id, ckey, n in rows:
            conc = limited[function_id].concurrency
            assert conc is not None
            bucket = (function_id, ckey if conc.key is not None else None)
            usage[bucket] = usage.get(bucket, 0) + int(n)
        return usage

    def _assignments(self, tx: Tx, chosen: list[tuple[str, int, str, str]]) -> list[Reservation]:
        run_ids = [c[0] for c in chosen]
        marks = _marks(len(run_ids))
        runs = {
            row[0]: row
            for row in tx.fetchall(
                "SELECT r.id, r.function_id, r.attempt, r.max_attempts, e.id, e.name, e.data,"
                " e.received_at, e.idempotency_key, r.start_at - ironflow_clock(), q.reason,"
                " ironflow_clock(), e.traceparent, r.batch_size"
                " FROM runs r LEFT JOIN events e ON e.id = r.event_id"
                f" LEFT JOIN dispatch_queue q ON q.run_id = r.id WHERE r.id IN ({marks})",
                run_ids,
            )
        }
        memo: dict[str, list[MemoStep]] = {rid: [] for rid in run_ids}
        for run_id, step_id, name, kind, status, output, error in tx.fetchall(
            "SELECT run_id, step_id, name, kind, status, output, error FROM steps"
            f" WHERE run_id IN ({marks}) AND status IN ('completed', 'failed', 'timed_out')"
            " ORDER BY run_id, seq",
            run_ids,
        ):
            memo[run_id].append(
                MemoStep(step_id, name, kind, status, _dec(output), _dec_error(error))
            )
        # A batch run's events (store/flow.py), only read when one is among them.
        batches = batch_events(tx, [rid for rid in run_ids if runs[rid][13]])
        out = []
        for run_id, seq, session_id, token in chosen:
            r = runs[run_id]
            event = EventInfo(
                id=r[4] or "",
                name=r[5] or "",
                data=_dec(r[6]),
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
                self._free_credit(tx, session_id, run_id, execution_seq)

        await self._transact(work)

    async def seconds_until_next_eligible(self) -> float | None:
        def work(tx: Tx) -> float | None:
            row = tx.fetchone(
                "SELECT min(eligible_at) - ironflow_now() FROM dispatch_queue"
                " WHERE reservation_owner IS NULL"
            )
            return None if row is None or row[0] is None else max(0.0, float(row[0]))

        return await self._transact(work)
