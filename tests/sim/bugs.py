"""Known bugs the simulator must find (``run_seed(seed, bug=NAME)``): test-only
store subclasses, so the engine carries no switch for them.

- ``record_step_unfenced``: ``record_step`` without the fence check — a
  worker whose lease was recovered can still write its step results.
- ``nack_spends_attempt``: a JobNack also bumps the run's attempt, as if the
  refused assignment had been tried.
- ``held_start_dropped``: an assignment loses its start delay, so a sleep the
  waker resumed ahead of its time (look-ahead) starts at once.
- ``key_count_ignored``: the dispatch does not count a concurrency key's
  leases and reservations in the database (only its own transaction's picks),
  so a keyed limit is exceeded across rounds (also on PostgreSQL).
- ``throttle_ignored``: the dispatch never applies a throttle: runs start
  as fast as credits allow.
- ``singleton_ignored``: an ingest never looks at a singleton's run in
  flight: every event starts a run.
- ``rate_limit_one_extra``: the rate limit's GCRA compares the theoretical
  arrival time with the period without the event's own interval: a burst
  lets ``limit + 1`` events through.
- ``debounce_keeps_first_event``: an event joining a debounced run's quiet
  period moves its start but not its event: the run starts with the
  period's first event's data, not its last.
- ``debounce_never_joins``: a held queue row is never found still filling
  (``_still_filling``, shared by debounce and batches): every event opens a
  new quiet period's run, the pending one left to fire too, and a new batch.
- ``batch_overfills``: a batch's fill check one event short: a batch takes
  ``max_size + 1`` events.
- ``begun_segment_unfenced``: a segment begun and ended in one
  transaction (its ack came with its result) takes its queue row by run and
  seq alone, without the reservation's session and token.
- ``late_tick_missed``: the scheduler takes every due tick for a missed one
  (``cron_missed_after_s`` read as 0): a tick fired a few milliseconds late
  is left to the catch-up policy, which under ``none`` drops it.

And on PostgreSQL (``run_seed(seed, bug=NAME, pg=...)``), the races of docs/isolation.md
with their fixes reverted, as they were at 4a4dd38: ``stranded_ack``,
``wait_row_skipped``, ``park_and_ingest_missed``, ``false_stale``; and
``cron_claim_unguarded``: a cron pass reads due schedules without ``FOR
UPDATE SKIP LOCKED`` and claims no tick in ``cron_ticks`` (each guard alone
makes a tick once: both are gone), so two nodes passing at one instant
both start the tick's run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec
import outcome

from ironflow.ids import new_id
from ironflow.protocol import ErrorInfo, FunctionDef, JobNackReason, RunRecord, lookup_path
from ironflow.protocol.cron import CRON_EVENT, next_tick, tick_data
from ironflow.store import Fence, JobOutcome, Reservation, StaleExecution, Store
from ironflow.store.core import (
    FENCE_SQL,
    RUN_COLS,
    Tx,
    dec,
    enc,
    new_run,
    placeholders,
    run_record,
    token_hash,
)
from ironflow.store.creation import create_run
from ironflow.store.cron import _SCHEDULE_COLS, _due
from ironflow.store.dispatch_flow import FlowPlan
from ironflow.store.fence import _BEGUN_AND_ENDED
from ironflow.store.flow import IngestFlow
from ironflow.store.records import CronFired
from ironflow.store.sqlite import SqliteStore
from ironflow.store.steps import _STEP_AUDITED_FUNCTION, STEP_RESULT_UPSERT, audit_steps
from ironflow.store.transitions import TERMINAL_SQL, audit_if_enabled, resume, write_audit
from ironflow.store.waits import park_locks
from tests.sim.pg import SimPostgresStore


class UnfencedRecordStep(SqliteStore):
    async def record_step(
        self,
        fence: Fence,
        *,
        step_id: str,
        name: str,
        status: Literal["completed", "failed"],
        output: Any = None,
        error: ErrorInfo | None = None,
        duration_ms: float = 0.0,
    ) -> None:
        out_text = enc(output) if status == "completed" else None
        err_text = None if error is None else enc(error)

        def work(tx: Tx) -> None:
            # The real statement, minus its `WHERE EXISTS (… the fence …)`.
            written = tx.execute(
                "INSERT INTO steps (run_id, step_id, name, kind, status, output, error,"
                " duration_ms, execution_seq, created_at, seq)"
                " VALUES (?, ?, ?, 'run', ?, ?, ?, ?, ?, ironflow_now(), ?)"
                + STEP_RESULT_UPSERT,
                (
                    fence.run_id,
                    step_id,
                    name,
                    status,
                    out_text,
                    err_text,
                    float(duration_ms),
                    fence.execution_seq,
                    time.time_ns(),
                ),
            )
            if written and status == "completed":
                audit_if_enabled(
                    tx, "step.completed", fence.run_id, {"step_id": step_id, "name": name}
                )

        await self._transact(work)


    # The interface's one-by-one form: the session's grouped step results
    # reach the unfenced record_step above too.
    record_steps = Store.record_steps
    record_steps_many = Store.record_steps_many


class NackSpendsAttempt(SqliteStore):
    async def nack_job(self, fence: Fence, reason: JobNackReason) -> JobOutcome:
        outcome = await super().nack_job(fence, reason)

        def work(tx: Tx) -> None:
            tx.execute("UPDATE runs SET attempt = attempt + 1 WHERE id = ?", (fence.run_id,))

        await self._transact(work)
        return outcome


class HeldStartDropped(SqliteStore):
    async def reserve_segments(self, *args: Any, **kwargs: Any) -> list[Reservation]:
        return [
            msgspec.structs.replace(
                r, assignment=msgspec.structs.replace(r.assignment, start_delay_ms=0, db_now=None)
            )
            for r in await super().reserve_segments(*args, **kwargs)
        ]

    async def ingest_and_reserve(self, *args: Any, **kwargs: Any) -> Any:
        results, made = await super().ingest_and_reserve(*args, **kwargs)
        return results, [
            msgspec.structs.replace(
                r, assignment=msgspec.structs.replace(r.assignment, start_delay_ms=0, db_now=None)
            )
            for r in made
        ]


class KeyCountIgnoredPlan(FlowPlan):
    """A reservation transaction's admission that reads no key's usage from
    the database: a keyed bucket counts only what this transaction picked."""

    def prepare(self, candidates: Sequence[Sequence[Any]]) -> None:
        before = dict(self.usage)
        super().prepare(candidates)
        for bucket in self.usage:
            if bucket[1] is not None:
                self.usage[bucket] = before.get(bucket, 0)


class ThrottleIgnoredPlan(FlowPlan):
    """A reservation transaction's admission that never applies a throttle."""

    def _lock_throttles(self, run_ids: list[str]) -> None:
        pass


class ThrottleIgnored(SqliteStore):
    flow_plan_class = ThrottleIgnoredPlan


class SingletonIgnoredFlow(IngestFlow):
    """An ingest that never looks at a singleton's run in flight: every event
    starts a run."""

    def _singleton(self, tx: Tx, fd: Any, key: str, event_id: str, result: Any, group: Any) -> None:
        result.runs.append(new_run(fd))


class KeyCountIgnored(SqliteStore):
    flow_plan_class = KeyCountIgnoredPlan


class RateLimitOneExtraFlow(IngestFlow):
    """``_rate_limit_passes`` (ironflow/store/flow.py) with its condition one
    interval short: ``max(tat, now) <= now + period``."""

    @staticmethod
    def _rate_limit_passes(tx: Tx, fd: FunctionDef, key: str) -> bool:
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
            " AND (CASE WHEN tat > ironflow_now() THEN tat ELSE ironflow_now() END)"
            " <= ironflow_now() + ?",
            (interval, fd.id, key, limit.period_s),
        ))


class _RunEventKept:
    """A transaction whose ``UPDATE runs SET event_id`` writes nothing."""

    def __init__(self, tx: Tx) -> None:
        self._tx = tx

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tx, name)

    def execute(self, sql: str, params: Any = ()) -> Any:
        if sql.startswith("UPDATE runs SET event_id"):
            return 1
        return self._tx.execute(sql, params)


class DebounceKeepsFirstEventFlow(IngestFlow):
    """``_debounce`` (ironflow/store/flow.py) without moving the pending run
    to the joining event."""

    def _debounce(self, tx: Tx, fd: FunctionDef, key: str, event_id: str, result: Any) -> None:
        super()._debounce(_RunEventKept(tx), fd, key, event_id, result)  # type: ignore[arg-type]


class DebounceNeverJoinsFlow(IngestFlow):
    """A debounced run's (or a batch's) held queue row is never found still filling."""

    @staticmethod
    def _still_filling(tx: Tx, run_id: str, due: str, params: tuple[Any, ...]) -> float | None:
        return None


class BatchOverfillsFlow(IngestFlow):
    """``_batch`` (ironflow/store/flow.py) comparing the batch's size with
    ``max_size + 1``."""

    def _batch(self, tx: Tx, fd: FunctionDef, key: str, event_id: str, result: Any, group: Any) -> None:
        assert fd.batch is not None
        wider = msgspec.structs.replace(fd.batch, max_size=fd.batch.max_size + 1)
        super()._batch(tx, msgspec.structs.replace(fd, batch=wider), key, event_id, result, group)


class SingletonIgnored(SqliteStore):
    ingest_flow_class = SingletonIgnoredFlow


class RateLimitOneExtra(SqliteStore):
    ingest_flow_class = RateLimitOneExtraFlow


class DebounceKeepsFirstEvent(SqliteStore):
    ingest_flow_class = DebounceKeepsFirstEventFlow


class DebounceNeverJoins(SqliteStore):
    ingest_flow_class = DebounceNeverJoinsFlow


class BatchOverfills(SqliteStore):
    ingest_flow_class = BatchOverfillsFlow

class LateTickMissed(SqliteStore):
    """Every due tick is taken for a missed one: only the catch-up policy
    fires it."""

    async def fire_due_ticks(
        self, node_id: str, *, limit: int, missed_after_s: float, live_within_s: float
    ) -> list[CronFired]:
        return await super().fire_due_ticks(node_id, limit=limit, missed_after_s=0.0, live_within_s=live_within_s)


class UnfencedBegunSegment(SqliteStore):
    """A segment begun and ended in one transaction (its ack came with its
    result: ``FenceOps._begin_and_complete``) takes its queue row by run and
    seq alone — without the reservation's session and token — so an ack and
    result from a worker whose reservation expired and went to another
    session still complete the run."""

    @staticmethod
    def _begin_ended(
        tx: Tx, rows: list[tuple[Any, ...]], steps: list[tuple[Any, ...]]
    ) -> list[tuple[Any, ...]]:
        taken = [
            row for run_id, seq, *_ in rows
            for row in tx.fetchall(
                "DELETE FROM dispatch_queue WHERE run_id = ? AND execution_seq = ?"
                " RETURNING run_id, execution_seq, reservation_owner",
                (run_id, seq),
            )
        ]
        return SqliteStore._end_taken_per_table(tx, rows, taken, _BEGUN_AND_ENDED)


BUGS: dict[str, type[SqliteStore]] = {
    "record_step_unfenced": UnfencedRecordStep,
    "nack_spends_attempt": NackSpendsAttempt,
    "held_start_dropped": HeldStartDropped,
    "key_count_ignored": KeyCountIgnored,
    "throttle_ignored": ThrottleIgnored,
    "singleton_ignored": SingletonIgnored,
    "late_tick_missed": LateTickMissed,
    "rate_limit_one_extra": RateLimitOneExtra,
    "debounce_keeps_first_event": DebounceKeepsFirstEvent,
    "debounce_never_joins": DebounceNeverJoins,
    "batch_overfills": BatchOverfills,
    "begun_segment_unfenced": UnfencedBegunSegment,
}


def store_class(bug: str | None) -> type[SqliteStore]:
    if bug is None:
        return SqliteStore
    return BUGS[bug]


# ── the PostgreSQL mode's known bugs: the races of docs/isolation.md, each fix reverted ──


class StrandedAck(SimPostgresStore):
    """Race 1: ``activate_leases``' one-statement form as it was — the queue row
    deleted without its session in view; the lease inserted only by a join on
    the session. An ack from a session removed since its reservation deletes
    the queue row and writes no lease: the run is stranded."""

    def _activate(self, tx: Tx, fences: Sequence[Fence], lease_expiry_s: float) -> list[outcome.Outcome[RunRecord]]:
        if not tx.modifying_with:
            return super()._activate(tx, fences, lease_expiry_s)
        rows = [(f.run_id, f.execution_seq, f.session_id, token_hash(f.lease_token)) for f in fences]
        values = ", ".join(["(?, ?, ?, ?)"] * len(rows))
        started = {
            row[0]: row
            for row in tx.fetchall(
                # The engine's statement (fence.py) without the session in the DELETE's view.
                f"WITH v (run_id, execution_seq, session_id, digest) AS (VALUES {values}),"
                " q AS (DELETE FROM dispatch_queue d USING v WHERE d.run_id = v.run_id"
                " AND d.execution_seq = v.execution_seq AND d.reservation_owner = v.session_id"
                " AND d.lease_token_hash = v.digest AND EXISTS (SELECT 1 FROM runs"
                " WHERE id = v.run_id AND current_execution_seq = v.execution_seq"
                f" AND status NOT IN {TERMINAL_SQL}) RETURNING d.run_id, d.execution_seq,"
                " d.function_id, d.concurrency_key, v.session_id, v.digest,"
                " d.reserved_at, d.reservation_snapshot),"
                " l AS (INSERT INTO concurrency_leases (run_id, execution_seq, function_id,"
                " concurrency_key, session_id, node_id, lease_token_hash, expires_at,"
                " activated_at, began_at, began_snapshot) SELECT q.run_id, q.execution_seq,"
                " q.function_id, q.concurrency_key, s.id, s.node_id, q.digest,"
                " ironflow_now() + ?, ironflow_now(), q.reserved_at, q.reservation_snapshot"
                " FROM q JOIN worker_sessions s ON s.id = q.session_id RETURNING run_id)"
                " UPDATE runs r SET status = 'running', started_at = coalesce(r.started_at,"
                " ironflow_now()), deadline_at = coalesce(r.deadline_at, ironflow_now() + r.timeout_s),"
                f" updated_at = ironflow_now() FROM l WHERE r.id = l.run_id RETURNING {RUN_COLS},"
                " (SELECT f.audit FROM functions f WHERE f.id = function_id)",
                (*(value for row in rows for value in row), float(lease_expiry_s)),
            )
        }
        results: list[outcome.Outcome[RunRecord]] = []
        for fence in fences:
            run = started.get(fence.run_id)
            if run is not None:
                record = run_record(run)
                if run[-1]:
                    write_audit(tx, "run.started", fence.run_id, record.function_id,
                                {"execution_seq": fence.execution_seq})
                results.append(outcome.Value(record))
            elif self._fence_alive(tx, fence):
                again = tx.fetchone(f"SELECT {RUN_COLS} FROM runs r WHERE r.id = ?", (fence.run_id,))
                assert again is not None
                results.append(outcome.Value(run_record(again)))
            else:
                results.append(outcome.Error(StaleExecution(f"{fence.run_id}/{fence.execution_seq} refused")))
        return results


class WaitRowSkipped(SimPostgresStore):
    """Race 2: an ingest reads every wait parked on its event's name ``FOR
    UPDATE SKIP LOCKED`` and matches in Python, as it did: a wait row another
    ingest of the name holds (matching or not) is passed by."""

    def _resolve_waits(
        self, tx: Tx, events: Sequence[tuple[str, str, Any]], paths: dict[str, list[str]]
    ) -> list[list[str]]:
        resumed: list[list[str]] = [[] for _ in events]
        names = sorted({name for _, name, _ in events})
        waiting = tx.fetchall(
            "SELECT run_id, step_id, wait_event, wait_match, wait_match_value FROM steps"
            f" WHERE status = 'waiting' AND kind = 'wait' AND wait_event IN ({placeholders(len(names))})"
            f" {tx.lock()}",
            names,
        )
        for place, (event_id, name, data) in enumerate(events):
            for run_id, step_id, event, match, value in waiting:
                if event != name or (match is not None and lookup_path(data, match) != dec(value)):
                    continue
                received = tx.fetchone("SELECT received_at FROM events WHERE id = ?", (event_id,))
                output = enc({"id": event_id, "name": name, "data": data,
                               "received_at": received[0] if received else None})
                if tx.execute(
                    "UPDATE steps SET status = 'completed', output = ?, wake_at = NULL"
                    " WHERE run_id = ? AND step_id = ? AND status = 'waiting'",
                    (output, run_id, step_id),
                ) and resume(tx, run_id) is not None:
                    resumed[place].append(run_id)
        return resumed


# The name lock a park takes (exclusive) and an ingest (shared): waits.py.
_WAIT_LOCK_PREFIX = park_locks("")[0][0]


class ParkAndIngestUnserialised(SimPostgresStore):
    """Race 3: no lock on the event name between a park of a wait and an
    ingest of that name, as before: each reads before the other commits and
    neither sees the other's row."""

    async def _transact(self, work: Callable[[Any], Any], *locks: Any, **kwargs: Any) -> Any:
        kept = [[lock for lock in group if not lock[0].startswith(_WAIT_LOCK_PREFIX)] for group in locks]
        return await super()._transact(work, *kept, **kwargs)

    async def _transact_many(self, works: list[Any]) -> Any:
        return await super()._transact_many([
            (work, [lock for lock in locks if not lock[0].startswith(_WAIT_LOCK_PREFIX)]) for work, locks in works
        ])


class FalseStale(SimPostgresStore):
    """Race 4: each segment's step rows written under ``WHERE EXISTS (fence)``
    and, when fewer rows came back than were sent (replays), the fence checked
    again by a later statement, as it was: a lease ended in between turns
    rows already written into a StaleExecution."""

    def _record_live(self, tx: Tx, fences: dict[str, Fence], rows: list[tuple[Any, ...]]) -> set[str]:
        live: set[str] = set()
        for run_id, fence in fences.items():
            mine = [row for row in rows if row[0] == run_id]
            if not mine:
                continue
            written = tx.fetchall(
                "WITH v (run_id, step_id, name, status, output, error, duration_ms, seq) AS (VALUES "
                + ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?)"] * len(mine))
                + ") INSERT INTO steps (run_id, step_id, name, kind, status, output, error,"
                " duration_ms, execution_seq, created_at, seq)"
                " SELECT v.run_id, v.step_id, v.name, 'run', v.status, v.output, v.error,"
                " v.duration_ms, ?, ironflow_now(), v.seq FROM v"
                f" WHERE EXISTS (SELECT 1 FROM concurrency_leases WHERE {FENCE_SQL})"
                + STEP_RESULT_UPSERT
                + f" RETURNING run_id, step_id, status, {_STEP_AUDITED_FUNCTION}",
                (*(value for row in mine for value in row), fence.execution_seq, *self._fence_params(fence)),
            )
            if len(written) < len(mine) and not self._fence_alive(tx, fence):
                continue  # "nothing was written": all refused (rows may have been)
            live.add(run_id)
            audit_steps(tx, mine, written)
        return live


class KeyCountIgnoredPg(SimPostgresStore):
    flow_plan_class = KeyCountIgnoredPlan


class CronClaimUnguarded(SimPostgresStore):
    """``fire_due_ticks`` (ironflow/store/cron.py) with neither of its two
    guards: the due schedules read without ``FOR UPDATE SKIP LOCKED``, and
    each tick's run started without its claim in ``cron_ticks``."""

    def _claim_tick(self, tx: Tx, fd: FunctionDef, cron: str, tz: str, scheduled_at: float, node_id: str) -> str:
        event_id = new_id("evt")
        data = tick_data(cron, tz, scheduled_at)
        run_id = create_run(tx, self.definitions, fd, event_id, data, event_name=CRON_EVENT)
        self._insert_event(tx, event_id, CRON_EVENT, data, None, [run_id])
        return run_id

    async def fire_due_ticks(
        self, node_id: str, *, limit: int, missed_after_s: float, live_within_s: float
    ) -> list[CronFired]:
        def work(tx: Tx) -> list[CronFired]:
            now = self._now(tx)
            rows = tx.fetchall(
                f"SELECT {_SCHEDULE_COLS}, f.definition, f.paused_at FROM cron_schedules s"
                " JOIN functions f ON f.id = s.function_id WHERE s.next_at <= ?"
                " ORDER BY s.next_at LIMIT ?",
                (now, limit),
            )
            fired: list[CronFired] = []
            for fid, cron, tz, catchup, window_s, next_at, text, paused_at in rows:
                fd = self._fdef_or_none(text)
                due = [] if paused_at is not None or fd is None else _due(
                    catchup, cron, tz, window_s, next_at, now, missed_after_s
                )
                for scheduled_at in due:
                    assert fd is not None
                    fired.append(CronFired(fid, scheduled_at, self._claim_tick(tx, fd, cron, tz, scheduled_at, node_id)))
                tx.execute(
                    "UPDATE cron_schedules SET next_at = ? WHERE function_id = ? AND cron = ? AND timezone = ?",
                    (next_tick(cron, tz, now), fid, cron, tz),
                )
            return fired

        return await self._transact(work)


PG_BUGS: dict[str, type[SimPostgresStore]] = {
    "stranded_ack": StrandedAck,
    "wait_row_skipped": WaitRowSkipped,
    "park_and_ingest_missed": ParkAndIngestUnserialised,
    "false_stale": FalseStale,
    "key_count_ignored": KeyCountIgnoredPg,
    "cron_claim_unguarded": CronClaimUnguarded,
}


def pg_store_class(bug: str | None) -> type[SimPostgresStore]:
    if bug is None:
        return SimPostgresStore
    return PG_BUGS[bug]
