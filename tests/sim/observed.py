"""The store as the simulated node sees it, watched by an oracle.

:class:`ObservedStore` stands between the node's actors and the one real
:class:`~ironflow.store.sqlite.SqliteStore` (inline mode: every transaction
runs on the Trio thread, synchronously, when the method is called). Before a
watched call it reads, on a separate read-only SQLite connection and with no
checkpoint in between, what the oracle needs to judge the call on its own
terms — is this fence live? which leases are due? which claims are stale? —
then lets the real call run and compares. Nothing interleaves between the
read and the call's transaction, so the judgement is exact.

On PostgreSQL (two nodes, ``Oracle.concurrent``) another node's transaction
may commit between any two statements. The fence is then read inside the
call's own transaction, right before its work; a refusal is a violation only
if the fence is still live after it (a fence never comes back to life); a
recovery only if it took a lease that was not due; a session's grouped calls
(acks, step results, job results) run in the store's grouped forms, each
fence judged. "Stale: nothing written" is checked after every refused step
write, on both backends.

The oracle's **counter table** (per run): activations, nacks, retries,
recoveries (with the consecutive count the ceiling applies to), yields,
cancels, the first accepted output of every step. The final invariants
compare it with the runs table and the audit trail.

Each node incarnation gets its own ObservedStore; a node that crashes hard
has its store *severed*: every later call raises :class:`NodeDown` before
touching the database (a dead process writes nothing — not even the
``finally`` blocks a Trio cancellation would still run).
"""

from __future__ import annotations

import functools
import json
import sqlite3
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import outcome
import trio

from ironflow.protocol import TERMINAL_RUN_STATUSES, WaitYield
from ironflow.store import Fence, Reservations, StaleExecution, StepResult, Store
from ironflow.store.core import Tx, token_hash
from ironflow.store.sql import SqlStore
from tests.sim.limits import FlowWatch

if TYPE_CHECKING:
    from tests.sim.simulator import Simulation


class OutcomesByTask(SqlStore):
    """Keeps the outcome of each task's last transaction, taken inside it.

    A cancel delivered at the inline store's checkpoint after the commit masks
    what the call returned or raised; this is how the oracle still knows
    whether a write was accepted (mixed into the store class of a run).

    It also numbers transactions for the oracle: on SQLite (one at a time)
    each transaction gets one number; on PostgreSQL (``tests/sim/pg.py``)
    a transaction's BEGIN and its COMMIT get theirs from one counter, so a
    commit numbered below a BEGIN was visible to that transaction.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outcomes: dict[Any, outcome.Outcome[Any]] = {}
        # A read to run inside the task's next transaction, after its work.
        self.probes: dict[Any, Callable[[Tx], None]] = {}
        # Reads to run inside it before its work, and what they read.
        self.before_probes: dict[Any, Callable[[Tx], Any]] = {}
        self.before_results: dict[Any, Any] = {}
        self.transactions = 0  # a clock that orders every transaction
        self.begun: dict[Any, int] = {}  # task → when its last transaction began
        self.committed: dict[Any, int] = {}  # task → when its last transaction committed

    async def _transact(self, work: Callable[[Tx], Any], *locks: Any, **kwargs: Any) -> Any:
        task = trio.lowlevel.current_task()

        def observed(tx: Tx) -> Any:
            on_commit = getattr(tx, "on_commit", None)
            if on_commit is None:
                self.transactions += 1
                self.begun[task] = self.committed[task] = self.transactions
            else:
                self.begun[task] = tx.begun_at  # type: ignore[attr-defined]
                on_commit.append(lambda n: self.committed.__setitem__(task, n))
            before = self.before_probes.get(task)
            if before is not None:
                self.before_results[task] = before(tx)
            result = outcome.capture(work, tx)
            self.outcomes[task] = result
            probe = self.probes.pop(task, None)
            if probe is not None:
                probe(tx)
            return result.unwrap()

        return await super()._transact(observed, *locks, **kwargs)

    def last_begin(self) -> int:
        return self.begun.get(trio.lowlevel.current_task(), self.transactions)

    def last_commit(self) -> int:
        return self.committed.get(trio.lowlevel.current_task(), self.transactions)

    def take_outcome(self) -> outcome.Outcome[Any] | None:
        return self.outcomes.pop(trio.lowlevel.current_task(), None)


class NodeDown(Exception):
    """A call into the store from a node incarnation that has crashed."""


@dataclass
class RunCounters:
    activations: int = 0
    nacks: int = 0
    retries: int = 0
    recoveries: list[tuple[int, bool]] = field(default_factory=list)  # (count, exhausted)
    consecutive: int = 0
    exhausted: bool = False
    yields: int = 0
    cancelled: bool = False
    ended_by: str | None = None  # "completed", a failure code, "cancelled"
    steps: dict[str, Any] = field(default_factory=dict)  # step_id → first accepted output
    step_recorded_at: dict[str, int] = field(default_factory=dict)  # step_id → transaction no.
    reserved_at: dict[int, int] = field(default_factory=dict)  # execution_seq → transaction no.


class Reader(Protocol):
    """Read-only queries on the run's database (``?`` placeholders)."""

    def one(self, sql: str, params: tuple[Any, ...] = ()) -> tuple[Any, ...] | None: ...

    def all(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]: ...

    def close(self) -> None: ...


class TxReader:
    """The oracle's reads inside a store transaction (not paused, if the
    transaction pauses: they are the oracle's, not the engine's)."""

    def __init__(self, tx: Tx) -> None:
        self._tx = tx
        raw = getattr(type(tx), "unpaused", None)
        self._fetchone = functools.partial(raw.fetchone, tx) if raw else tx.fetchone
        self._fetchall = functools.partial(raw.fetchall, tx) if raw else tx.fetchall

    def one(self, sql: str, params: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
        return self._fetchone(sql, params)  # type: ignore[no-any-return]

    def all(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return self._fetchall(sql, params)  # type: ignore[no-any-return]

    def close(self) -> None:
        pass


class SqliteReader:
    """A read-only connection of the oracle's own to the SQLite file."""

    def __init__(self, path: str) -> None:
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)

    def one(self, sql: str, params: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = self._db.execute(sql, params).fetchone()
        return row

    def all(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return self._db.execute(sql, params).fetchall()

    def close(self) -> None:
        self._db.close()


@dataclass(frozen=True)
class Park:
    """A ``wait_for_event`` parked by one segment (what invariant 9 judges)."""

    segment_began: float  # its lease's activated_at, by the database clock
    # The number of the commit that reserved the segment (OutcomesByTask): a
    # worker may start the handler once it has the assignment, before its ack.
    began: int | None
    timeout_at: float
    event: str
    match: str | None
    match_value: Any
    begun: int = 0  # the park's transaction numbers (OutcomesByTask)
    committed: int = 0


class Oracle:
    """Judges watched store calls; keeps the counter table and the violations."""

    def __init__(self, sim: Simulation, db: Reader) -> None:
        self.sim = sim
        self.db = db
        # Whether transactions of other nodes may commit between the oracle's
        # read before a call and the call's own transaction (PostgreSQL mode):
        # then a call is judged only by what no other commit could change.
        self.concurrent = sim.concurrent
        self.runs: dict[str, RunCounters] = {}
        self.parks: dict[tuple[str, int], Park] = {}  # (run_id, execution_seq) → its wait
        self.ingests: dict[str, tuple[int, int]] = {}  # event id → its transaction's numbers
        self.reserved: dict[tuple[str, int], int] = {}  # (run_id, execution_seq) → its last reservation's commit
        self.violations: list[str] = []
        self.counts: Counter[str] = sim.counts
        self.flow = FlowWatch(self)  # invariants 10-12 (tests/sim/limits.py)

    def close(self) -> None:
        self.db.close()

    def run(self, run_id: str) -> RunCounters:
        c = self.runs.get(run_id)
        if c is None:
            c = self.runs[run_id] = RunCounters()
        return c

    def check_memo(self, run_id: str, seq: int, sid: str) -> None:
        """A worker is about to run step ``sid``'s body in segment ``seq``: if the
        step was recorded before that segment was reserved, the assignment's
        memo should have carried it."""
        c = self.run(run_id)
        recorded, reserved = c.step_recorded_at.get(sid), c.reserved_at.get(seq)
        if recorded is not None and reserved is not None and recorded < reserved:
            self.violation(
                f"step {sid} of run {run_id} runs again in segment {seq}, though it was"
                " recorded before that segment was reserved (missing from its memo)"
            )
        if recorded is not None:
            self.counts["step_bodies_rerun"] += 1

    def check_woken(self, run_id: str, sid: str, worker: str) -> None:
        """A handler is past sleep ``sid`` (its memo says completed): the
        database clock must have reached the sleep's wake time, however early
        the waker claimed it (look-ahead) and whoever held the job."""
        row = self.one("SELECT wake_at FROM steps WHERE run_id = ? AND step_id = ?", (run_id, sid))
        now = self.sim.epoch_now()
        self.counts["held_starts_checked"] += 1
        if row is not None and row[0] is not None and now < float(row[0]) - 1e-9:
            self.violation(
                f"{worker} runs run {run_id} past its sleep {sid} {float(row[0]) - now:.3f} s"
                " before the sleep's wake time"
            )

    def violation(self, text: str) -> None:
        self.violations.append(f"t={trio.current_time():.3f} {text}")
        self.sim.trace(f"VIOLATION {text}")

    def one(self, sql: str, params: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
        return self.db.one(sql, params)

    def all(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return self.db.all(sql, params)

    # ── the fence ──────────────────────────────────────────────────────────

    def fence_state(self, fence: Fence, db: Reader | None = None) -> dict[str, Any]:
        digest = token_hash(fence.lease_token)
        key = (fence.run_id, fence.execution_seq, fence.session_id, digest)
        row = (db or self.db).one(
            "SELECT r.current_execution_seq, r.status, r.attempt, r.max_attempts,"
            " EXISTS (SELECT 1 FROM concurrency_leases WHERE run_id = ? AND execution_seq = ?"
            "  AND session_id = ? AND lease_token_hash = ?),"
            " EXISTS (SELECT 1 FROM dispatch_queue WHERE run_id = ? AND execution_seq = ?"
            "  AND reservation_owner = ? AND lease_token_hash = ?),"
            " EXISTS (SELECT 1 FROM worker_sessions WHERE id = ?)"
            " FROM runs r WHERE r.id = ?",
            (*key, *key, fence.session_id, fence.run_id),
        )
        run = row[:4] if row is not None else None
        lease, queued, session = (bool(x) for x in row[4:]) if row is not None else (False, False, False)
        current = run is not None and run[0] == fence.execution_seq
        return {
            "run": run,
            "live_lease": lease and current,
            "live_reservation": queued
            and current
            and run is not None
            and run[1] not in TERMINAL_RUN_STATUSES
            and session,
            "reserved": queued and current,
        }

    def live_for(self, method: str, state: dict[str, Any]) -> bool:
        """The rule, stated once more independently of the store's SQL: a write
        is accepted only from the live fence (a JobAck or JobNack may also
        prove it by the live reservation it answers)."""
        if method in ("activate_lease", "begin_and_complete"):
            return bool(state["live_lease"] or state["live_reservation"])
        if method == "nack_job":
            return bool(state["live_lease"] or state["reserved"])
        return bool(state["live_lease"])

    # ── recoveries ─────────────────────────────────────────────────────────

    def due_leases(self, where: str, params: tuple[Any, ...]) -> list[str]:
        """Runs whose lease the coming recovery call must fence (their seq is current)."""
        rows = self.all(
            "SELECT l.run_id FROM concurrency_leases l JOIN runs r ON r.id = l.run_id"
            f" WHERE {where} AND r.current_execution_seq = l.execution_seq"
            " AND r.status NOT IN ('completed', 'failed', 'cancelled')",
            params,
        )
        return sorted(r[0] for r in rows)

    def apply_recoveries(self, method: str, expected: list[str], segments: list[Any]) -> None:
        got = {seg.run_id: seg for seg in segments}
        if self.concurrent:
            # Another node's scanner may have taken some first, or held their
            # rows (SKIP LOCKED: the next pass takes them); none it took may
            # have been anything but due.
            if not set(got) <= set(expected):
                self.violation(
                    f"{method}: recovered {sorted(set(got) - set(expected))}, whose leases were not due"
                )
            expected = sorted(got)
        elif sorted(got) != expected:
            self.violation(
                f"{method}: recovered {sorted(got)} but the leases due were {expected}"
            )
        ceiling = int(self.sim.schedule.timings.recovery_ceiling)
        for run_id in expected:
            c = self.run(run_id)
            c.consecutive += 1
            exhausted = c.consecutive > ceiling
            if exhausted:
                c.consecutive = ceiling
                c.exhausted = True
                c.ended_by = "EXECUTION_RECOVERY_EXHAUSTED"
            c.recoveries.append((c.consecutive, exhausted))
            self.counts["recoveries"] += 1
            if exhausted:
                self.counts["recoveries_exhausted"] += 1
            seg = got.get(run_id)
            if seg is not None and (seg.recovery_count, seg.exhausted) != (c.consecutive, exhausted):
                self.violation(
                    f"{method}: run {run_id} recovered with count {seg.recovery_count}"
                    f" exhausted={seg.exhausted}; the counter table says {c.consecutive}"
                    f" exhausted={exhausted}"
                )
            self.sim.trace(f"recovered {run_id} by {method} count={c.consecutive} exhausted={exhausted}")


# A fenced call's kind, or each call's of a group (:meth:`ObservedStore._fenced_many`).
Methods = str | Sequence[str]


def _per_call(methods: Methods, calls: Sequence[Any]) -> Sequence[str]:
    return [methods] * len(calls) if isinstance(methods, str) else methods


def _completion_methods(
    items: Sequence[tuple[Fence, Any, list[StepResult]]], activate: frozenset[str]
) -> list[str]:
    """How each job result of a completion group is judged: begun and ended
    with its ack (the ack came with it), or completed under its lease."""
    return ["begin_and_complete" if fence.run_id in activate else "complete_job" for fence, _, _ in items]


_FENCED = ("activate_lease", "record_step", "record_steps", "complete_job", "fail_job", "yield_job", "nack_job")


class ObservedStore:
    """The store one node incarnation uses: the real one, watched (see module doc)."""

    def __init__(self, sim: Simulation, store: Store, oracle: Oracle, node_no: int) -> None:
        self._sim = sim
        self._store = store
        self._oracle = oracle
        self._node_no = node_no
        self.severed = False
        self._calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name.startswith("_") or not callable(attr) or not _is_async(attr):
            return attr

        async def passthrough(*args: Any, **kwargs: Any) -> Any:
            self._check()
            result = await attr(*args, **kwargs)
            self._after(name, result)
            return result

        return passthrough

    def _check(self) -> None:
        if self.severed:
            raise NodeDown(f"node {self._node_no} is down")

    def _after(self, method: str, result: Any) -> None:
        if result or method in ("yield_job",):
            self._calls[method] += 1
            self._sim.after_store_call(self._node_no, method, self._calls[method])

    # ── fenced writes ──────────────────────────────────────────────────────

    def _steps_of(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[StepResult]:
        """The step results a fenced call writes (none for most)."""
        if method == "record_step":
            return [StepResult(kwargs["step_id"], kwargs["name"], kwargs["status"], kwargs.get("output"))]
        if method == "record_steps":
            return list(args[0])
        if method in ("complete_job", "begin_and_complete"):  # a grouped completion's last step results
            return list(kwargs.get("steps") or [])
        return []

    def _before(
        self, method: str, fence: Fence, args: tuple[Any, ...], kwargs: dict[str, Any], db: Reader | None = None
    ) -> Any:
        """What the oracle reads before a fenced call, beyond the fence itself."""
        o: Any = db or self._oracle.db
        if method == "yield_job":
            return o.one(
                "SELECT activated_at FROM concurrency_leases WHERE run_id = ? AND execution_seq = ?",
                (fence.run_id, fence.execution_seq),
            )
        steps = self._steps_of(method, args, kwargs)
        if method in ("complete_job", "begin_and_complete") and steps:
            return self._before("record_steps", fence, (steps,), {}, db)
        if method == "record_step":
            return o.one(
                "SELECT status, output FROM steps WHERE run_id = ? AND step_id = ?",
                (fence.run_id, steps[0].step_id),
            )
        if method == "record_steps":
            return {
                s.step_id: o.one(
                    "SELECT status, output FROM steps WHERE run_id = ? AND step_id = ?",
                    (fence.run_id, s.step_id),
                )
                for s in steps
            }
        return None

    def _judge_before(
        self, method: Methods, calls: list[tuple[Fence, tuple[Any, ...], dict[str, Any]]], db: Reader | None = None
    ) -> list[tuple[dict[str, Any], bool, Any]]:
        o = self._oracle
        judged = []
        for each, (fence, args, kwargs) in zip(_per_call(method, calls), calls, strict=True):
            state = o.fence_state(fence, db)
            judged.append((state, o.live_for(each, state), self._before(each, fence, args, kwargs, db)))
        return judged

    def _call_judged(
        self, method: Methods, calls: list[tuple[Fence, tuple[Any, ...], dict[str, Any]]], call: Any
    ) -> tuple[Any, Callable[[], list[tuple[dict[str, Any], bool, Any]] | None]]:
        """``call()`` (to await), and how to get the oracle's reads of
        ``calls`` before it (None: it ran no transaction). On PostgreSQL they
        are read inside the call's own transaction, right before its work (a
        chained call comes after its chain's earlier calls, whose writes a
        read outside would miss); on SQLite, before the call."""
        store: Any = self._store
        if not self._oracle.concurrent:
            judged = self._judge_before(method, calls)
            return call(), lambda: judged
        task = trio.lowlevel.current_task()
        store.before_probes[task] = lambda tx: self._judge_before(method, calls, TxReader(tx))

        def judged_inside() -> list[tuple[dict[str, Any], bool, Any]] | None:
            store.before_probes.pop(task, None)
            return store.before_results.pop(task, None)  # type: ignore[no-any-return]

        return call(), judged_inside

    async def _fenced(self, method: str, fence: Fence, *args: Any, **kwargs: Any) -> Any:
        self._check()
        store: Any = self._store
        pending, judge = self._call_judged(
            method, [(fence, args, kwargs)], lambda: getattr(store, method)(fence, *args, **kwargs)
        )
        try:
            result = await pending
        except trio.Cancelled:
            # Cancelled at the store's checkpoint after its transaction: judge
            # by the transaction's own outcome.
            judged, done = judge(), store.take_outcome()
            if judged is not None:
                ((state, live, before),) = judged
                if isinstance(done, outcome.Value):
                    self._accepted(method, fence, state, live, before, done.value, args, kwargs)
                elif done is not None and isinstance(done.error, StaleExecution):
                    self._refused(method, fence, live, before, args, kwargs)
            raise
        except StaleExecution:
            judged = judge()
            store.take_outcome()
            if judged is not None:
                ((state, live, before),) = judged
                self._refused(method, fence, live, before, args, kwargs)
            raise
        except BaseException:
            judge()
            store.take_outcome()
            raise
        judged = judge()
        store.take_outcome()
        if judged is not None:
            ((state, live, before),) = judged
            self._accepted(method, fence, state, live, before, result, args, kwargs)
        return result

    async def _fenced_many(
        self,
        method: Methods,
        calls: list[tuple[Fence, tuple[Any, ...], dict[str, Any]]],
        apply: Any,
        outcomes: Callable[[Any], list[outcome.Outcome[Any]]] = lambda value: value,
    ) -> Any:
        """A session's group of fenced calls (``apply()``: the store's grouped
        form, one transaction), each judged as :meth:`_fenced` judges one;
        ``outcomes``: the calls' outcomes in what the transaction returned."""
        self._check()
        store: Any = self._store
        pending, judge = self._call_judged(method, calls, apply)
        try:
            value = await pending
        except trio.Cancelled:
            judged, done = judge(), store.take_outcome()
            if judged is not None and isinstance(done, outcome.Value):
                self._judge_many(method, calls, judged, outcomes(done.value))
            raise
        except BaseException:
            judge()
            store.take_outcome()
            raise
        judged = judge()
        store.take_outcome()
        if judged is not None:
            self._judge_many(method, calls, judged, outcomes(value))
        return value

    def _judge_many(
        self,
        methods: Methods,
        calls: list[tuple[Fence, tuple[Any, ...], dict[str, Any]]],
        judged: list[tuple[dict[str, Any], bool, Any]],
        results: list[outcome.Outcome[Any]],
    ) -> None:
        for method, (fence, args, kwargs), (state, live, before), result in zip(
            _per_call(methods, calls), calls, judged, results, strict=True
        ):
            steps = kwargs.get("steps") if method in ("complete_job", "begin_and_complete") else None
            if isinstance(result, outcome.Value) and method == "begin_and_complete":
                # One transaction: the segment began (its ack), its steps, its end.
                self._sim.counts["begun_and_ended"] += 1
                self._accepted("activate_lease", fence, state, live, None, True, (), {})
                if steps:
                    self._accepted("record_steps", fence, state, live, before, None, (steps,), {})
                self._accepted("complete_job", fence, state, live, None if steps else before, result.value, args, {})
            elif isinstance(result, outcome.Value):
                if steps:
                    self._accepted("record_steps", fence, state, live, before, None, (steps,), {})
                self._accepted(method, fence, state, live, None if steps else before, result.value, args, {})
            elif isinstance(result.error, StaleExecution):
                self._refused(method, fence, live, before, args, kwargs)

    def _refused(
        self, method: str, fence: Fence, live: bool, before: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        o = self._oracle
        self._sim.counts["stale_refused"] += 1
        self._sim.trace(f"{method} {fence.run_id}/{fence.execution_seq} refused")
        # A fence never comes back to life: live after the refusal means live
        # all along (the read before may have been overtaken by another node).
        if live and (not o.concurrent or o.live_for(method, o.fence_state(fence))):
            o.violation(
                f"{method} from the live fence {fence.run_id}/{fence.execution_seq} refused"
            )
        steps = self._steps_of(method, args, kwargs)
        if steps:
            # "Stale: nothing written." This call's outputs are its own
            # (they name the worker, the segment and the worker's assignment:
            # a segment whose reservation expired before its ack may reach one
            # worker twice, and both executions write; tests/sim/worker.py).
            prior = before if isinstance(before, dict) else {steps[0].step_id: before}
            for s in steps:
                if s.status != "completed":
                    continue
                row = o.one(
                    "SELECT status, output FROM steps WHERE run_id = ? AND step_id = ? AND execution_seq = ?",
                    (fence.run_id, s.step_id, fence.execution_seq),
                )
                was = prior.get(s.step_id)
                if row is not None and row[1] is not None and json.loads(row[1]) == s.output and (
                    was is None or was[1] is None or json.loads(was[1]) != s.output
                ):
                    if method in ("complete_job", "begin_and_complete"):
                        # Its steps were written under the fence, then its result
                        # refused: the interface's order (steps, then the result).
                        o.run(fence.run_id).steps.setdefault(s.step_id, s.output)
                        continue
                    o.violation(
                        f"{method} from {fence.run_id}/{fence.execution_seq} refused as stale,"
                        f" but it wrote step {s.step_id}"
                    )
                    o.run(fence.run_id).steps.setdefault(s.step_id, s.output)

    def _accepted(
        self,
        method: str,
        fence: Fence,
        state: dict[str, Any],
        live: bool,
        step_before: Any,
        result: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        o = self._oracle
        detail = ""
        if method == "record_step":
            detail = f" {kwargs['step_id'].rsplit(':', 2)[1]}"
        elif method == "record_steps":
            detail = " " + ",".join(s.step_id.rsplit(":", 2)[1] for s in args[0])
        self._sim.trace(f"{method} {fence.run_id}/{fence.execution_seq}{detail} accepted")
        if not live:
            self._sim.counts["fence_violations"] += 1
            o.violation(
                f"{method} accepted from a fenced execution: run {fence.run_id}"
                f" seq {fence.execution_seq} (current {state['run'][0] if state['run'] else None})"
            )
        c = o.run(fence.run_id)
        if method == "activate_lease" and not state["live_lease"]:
            c.activations += 1
        elif method == "nack_job":
            c.nacks += 1
        elif method == "yield_job":
            c.yields += 1
            c.consecutive = 0
            info = kwargs["info"]
            if isinstance(info, WaitYield) and step_before is not None:
                # The segment began when its lease was activated (the look-back's `since`).
                o.parks[(fence.run_id, fence.execution_seq)] = Park(
                    float(step_before[0]), o.reserved.get((fence.run_id, fence.execution_seq)), info.timeout_at, info.event, info.match, info.match_value,
                    self._store.last_begin(), self._store.last_commit(),  # type: ignore[attr-defined]
                )
        elif method == "complete_job":
            c.ended_by = "completed"
        elif method == "fail_job":
            error = args[0] if args else kwargs["error"]
            run = state["run"]
            retry = bool(error.retryable and run is not None and run[2] < run[3])
            if retry:
                c.retries += 1
            else:
                c.ended_by = error.code
            if (result.status == "waiting") != retry:
                o.violation(f"fail_job of {fence.run_id}: outcome {result.status}, expected retry={retry}")
        elif method == "record_step" and kwargs["status"] == "completed":
            sid = kwargs["step_id"]
            if step_before is None or step_before[0] != "completed":
                c.steps.setdefault(sid, kwargs.get("output"))
                c.step_recorded_at.setdefault(sid, self._store.last_commit())  # type: ignore[attr-defined]
        elif method == "record_steps":
            for s in args[0]:
                before = step_before[s.step_id]
                if s.status == "completed" and (before is None or before[0] != "completed"):
                    c.steps.setdefault(s.step_id, s.output)
                    c.step_recorded_at.setdefault(s.step_id, self._store.last_commit())  # type: ignore[attr-defined]
        self._after(method, result)

    async def activate_lease(self, fence: Fence, **kwargs: Any) -> Any:
        return await self._fenced("activate_lease", fence, **kwargs)

    # On SQLite a session's groups (acks, step results, job results of several
    # runs) are watched one fence at a time (the interface's one-by-one forms),
    # except a completion group with acks that came with their results (its
    # one transaction is the only form that begins a segment without a
    # lease); on PostgreSQL the store's grouped forms run, each fence judged.

    async def activate_leases(
        self, fences: Sequence[Fence], *, lease_expiry_s: float, synchronous_commit: bool = True
    ) -> Any:
        if not self._oracle.concurrent:
            return await Store.activate_leases(self, fences, lease_expiry_s=lease_expiry_s)  # type: ignore[arg-type]
        return await self._fenced_many(
            "activate_lease",
            [(f, (), {"lease_expiry_s": lease_expiry_s}) for f in fences],
            lambda: self._store.activate_leases(
                fences, lease_expiry_s=lease_expiry_s, synchronous_commit=synchronous_commit
            ),
        )

    async def record_steps_many(self, items: Sequence[tuple[Fence, list[StepResult]]]) -> Any:
        if not self._oracle.concurrent:
            return await Store.record_steps_many(self, items)  # type: ignore[arg-type]
        return await self._fenced_many(
            "record_steps", [(f, (steps,), {}) for f, steps in items], lambda: self._store.record_steps_many(items)
        )

    async def complete_jobs(
        self,
        items: Sequence[tuple[Fence, Any, list[StepResult]]],
        *,
        activate: frozenset[str] = frozenset(),
        lease_expiry_s: float = 0.0,
    ) -> Any:
        if activate:
            # Acks that came with their results: the store's own transaction
            # (such a segment begins and ends there without a lease), judged
            # per segment as its ack, its steps and its end together; the
            # others as job results under their leases.
            return await self._fenced_many(
                _completion_methods(items, activate),
                [(f, (output,), {"steps": steps}) for f, output, steps in items],
                lambda: self._store.complete_jobs(items, activate=activate, lease_expiry_s=lease_expiry_s),
            )
        if not self._oracle.concurrent:
            return await Store.complete_jobs(self, items)  # type: ignore[arg-type]
        return await self._fenced_many(
            "complete_job",
            [(f, (output,), {"steps": steps}) for f, output, steps in items],
            lambda: self._store.complete_jobs(items),
        )

    async def complete_jobs_and_reserve(
        self,
        items: Sequence[tuple[Fence, Any, list[StepResult]]],
        *,
        offers: dict[str, frozenset[str]],
        limit: int,
        reservation_expiry_s: float,
        activate: frozenset[str] = frozenset(),
        lease_expiry_s: float = 0.0,
    ) -> Any:
        """A session's completion group that also activates the acks that came
        with it and reserves for the credits it freed. With acks: the store's
        own transaction (:meth:`_completed_and_reserved`). Without: judged as
        ``complete_jobs``, then a ``reserve_segments`` round. (The round in
        the completion's transaction is also tested in
        ``tests/store/test_complete_and_reserve.py`` on both backends.)"""
        if activate:
            return await self._completed_and_reserved(
                items, activate, lease_expiry_s, offers, limit, reservation_expiry_s
            )
        results = await self.complete_jobs(items, activate=activate, lease_expiry_s=lease_expiry_s)
        made = Reservations()
        if any(isinstance(r, outcome.Value) for r in results):
            made = await self.reserve_segments(
                f"node-{self._node_no}", offers, limit, reservation_expiry_s=reservation_expiry_s
            )
        return results, made

    async def _completed_and_reserved(
        self,
        items: Sequence[tuple[Fence, Any, list[StepResult]]],
        activate: frozenset[str],
        lease_expiry_s: float,
        offers: dict[str, frozenset[str]],
        limit: int,
        reservation_expiry_s: float,
    ) -> tuple[list[outcome.Outcome[Any]], Reservations]:
        """The store's own completion group with acks that came with their
        results: those segments begun and ended, the others completed under
        their leases, then the reservation round for the credits they freed,
        in one transaction — judged per segment (``begin_and_complete`` or
        ``complete_job``), then as a ``reserve_segments`` with the
        transaction's numbers and database time (as an emit's round is)."""
        store: Any = self._store
        task = trio.lowlevel.current_task()
        clock: list[float] = []
        store.probes[task] = lambda tx: clock.append(float(TxReader(tx).one("SELECT ironflow_now()")[0]))
        try:
            results, made = await self._fenced_many(
                _completion_methods(items, activate),
                [(f, (output,), {"steps": steps}) for f, output, steps in items],
                lambda: store.complete_jobs_and_reserve(
                    items, offers=offers, limit=limit, reservation_expiry_s=reservation_expiry_s,
                    activate=activate, lease_expiry_s=lease_expiry_s,
                ),
                lambda both: both[0],
            )
        finally:
            store.probes.pop(task, None)
        self._sim.counts["completion_reserve_calls"] += 1
        self._sim.counts["completion_reservations"] += len(made)
        self._reserved(made, clock)
        self._after("complete_jobs_and_reserve", made)
        return results, made

    async def record_step(self, fence: Fence, **kwargs: Any) -> Any:
        return await self._fenced("record_step", fence, **kwargs)

    async def record_steps(self, fence: Fence, steps: Any) -> Any:
        return await self._fenced("record_steps", fence, steps)

    async def complete_job(self, fence: Fence, output: Any) -> Any:
        return await self._fenced("complete_job", fence, output)

    async def fail_job(self, fence: Fence, error: Any) -> Any:
        return await self._fenced("fail_job", fence, error)

    async def yield_job(self, fence: Fence, **kwargs: Any) -> Any:
        return await self._fenced("yield_job", fence, **kwargs)

    async def nack_job(self, fence: Fence, reason: Any) -> Any:
        return await self._fenced("nack_job", fence, reason)

    async def ingest_event(self, *args: Any, **kwargs: Any) -> Any:
        self._check()
        result = await self._store.ingest_event(*args, **kwargs)
        store: Any = self._store
        self._oracle.ingests.setdefault(result.event_id, (store.last_begin(), store.last_commit()))
        store.take_outcome()
        self._oracle.flow.ingested(result)
        self._after("ingest_event", result)
        return result

    async def reserve_segments(self, *args: Any, **kwargs: Any) -> Any:
        self._check()
        store: Any = self._store
        task = trio.lowlevel.current_task()
        clock: list[float] = []  # the transaction's database time, read inside it
        store.probes[task] = lambda tx: clock.append(float(TxReader(tx).one("SELECT ironflow_now()")[0]))
        try:
            result = await store.reserve_segments(*args, **kwargs)
        finally:
            store.probes.pop(task, None)
        self._reserved(result, clock)
        self._after("reserve_segments", result)
        return result

    async def ingest_and_reserve(self, *args: Any, **kwargs: Any) -> Any:
        """An emit's ingest and its reservation round in one transaction:
        judged as an ``ingest_event`` for each event, then as a
        ``reserve_segments`` (same transaction numbers, its database time)."""
        self._check()
        store: Any = self._store
        task = trio.lowlevel.current_task()
        clock: list[float] = []
        store.probes[task] = lambda tx: clock.append(float(TxReader(tx).one("SELECT ironflow_now()")[0]))
        try:
            results, reservations = await store.ingest_and_reserve(*args, **kwargs)
        finally:
            store.probes.pop(task, None)
        store.take_outcome()
        for result in results:
            self._oracle.ingests.setdefault(result.event_id, (store.last_begin(), store.last_commit()))
            self._oracle.flow.ingested(result)
        self._reserved(reservations, clock)
        self._after("ingest_and_reserve", reservations)
        return results, reservations

    def _reserved(self, result: Sequence[Any], clock: list[float]) -> None:
        store: Any = self._store
        at = store.last_begin()
        committed = store.last_commit()
        self._oracle.flow.reserved(result, clock[-1] if clock else None, committed)
        for r in result:
            self._oracle.run(r.assignment.run_id).reserved_at[r.assignment.execution_seq] = at
            self._oracle.reserved[(r.assignment.run_id, r.assignment.execution_seq)] = committed
            self._sim.trace(f"reserved {r.assignment.run_id}/{r.assignment.execution_seq} for {r.session_id}")

    # ── loop 1: the recoveries ─────────────────────────────────────────────

    async def expire_leases(self, **kwargs: Any) -> Any:
        self._check()
        now = self._sim.epoch_now()
        expected = self._oracle.due_leases("l.expires_at <= ?", (now,))
        try:
            result = await self._store.expire_leases(**kwargs)
        except trio.Cancelled:  # after its transaction (see _fenced)
            done = self._store.take_outcome()  # type: ignore[attr-defined]
            self._oracle.apply_recoveries("expire_leases", expected, done.value if isinstance(done, outcome.Value) else [])
            raise
        self._store.take_outcome()  # type: ignore[attr-defined]
        self._oracle.apply_recoveries("expire_leases", expected, result)
        self._after("expire_leases", result)
        return result

    async def close_session(self, session_id: str, **kwargs: Any) -> Any:
        self._check()
        expected = (
            self._oracle.due_leases("l.session_id = ?", (session_id,))
            if kwargs.get("recover_leases")
            else []
        )
        try:
            result = await self._store.close_session(session_id, **kwargs)
        except trio.Cancelled:  # after its transaction (see _fenced)
            done = self._store.take_outcome()  # type: ignore[attr-defined]
            self._oracle.apply_recoveries("close_session", expected, done.value if isinstance(done, outcome.Value) else [])
            raise
        self._store.take_outcome()  # type: ignore[attr-defined]
        self._oracle.apply_recoveries("close_session", expected, result)
        self._after("close_session", result)
        return result

    # ── loop 2: stale claims ───────────────────────────────────────────────

    async def reset_stale_claims(self, threshold_s: float) -> Any:
        self._check()
        o = self._oracle
        now = self._sim.epoch_now()
        candidates = o.all(
            "SELECT s.run_id, s.step_id,"
            " EXISTS (SELECT 1 FROM concurrency_leases l WHERE l.run_id = s.run_id),"
            " EXISTS (SELECT 1 FROM dispatch_queue q WHERE q.run_id = s.run_id)"
            " FROM steps s WHERE s.status = 'waking' AND s.claimed_at <= ?",
            (now - threshold_s,),
        )

        def judge(tx: Tx) -> None:
            """Inside the sweeper's own transaction: which candidates it restored."""
            for run_id, sid, leased, queued in candidates:
                row = tx.fetchone("SELECT status FROM steps WHERE run_id = ? AND step_id = ?", (run_id, sid))
                if row is None or row[0] == "waking":
                    continue
                self._sim.counts["loop2_restores"] += 1
                self._sim.trace(f"loop 2 restored {run_id}/{sid}")
                if (leased or queued) and o.concurrent:
                    # Read before the call; another node may have ended that
                    # lease or taken that row since: owned still, inside the
                    # sweeper's transaction, is owned all along.
                    now_owned = tx.fetchone(
                        "SELECT EXISTS (SELECT 1 FROM concurrency_leases WHERE run_id = ?),"
                        " EXISTS (SELECT 1 FROM dispatch_queue WHERE run_id = ?)",
                        (run_id, run_id),
                    )
                    leased, queued = (leased and now_owned[0], queued and now_owned[1]) if now_owned else (0, 0)
                if leased or queued:
                    o.violation(
                        f"loop 2 restored step {sid} of run {run_id}, which loop 1 owns"
                        f" (lease={bool(leased)}, queued={bool(queued)})"
                    )

        store: Any = self._store
        store.probes[trio.lowlevel.current_task()] = judge
        result = await store.reset_stale_claims(threshold_s)
        store.take_outcome()
        self._after("reset_stale_claims", result)
        return result


def _is_async(fn: Callable[..., Any]) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)
