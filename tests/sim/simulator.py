"""The deterministic simulator: a whole node, its workers and a seeded fault
schedule in one Trio run on ``MockClock``.

What is real: every supervised actor of a node, started by the node's own
:func:`ironflow.node.start_actors` under the real
:class:`~actors.supervisor.Supervisor`; the websocket bridge and the session
actor (``ironflow.api.worker_socket._serve_socket``); the protocol messages
and their codecs; the SQLite store (inline mode: every transaction runs on
the Trio thread, so the virtual clock never jumps while the database works
and ``ironflow_now()`` is ``BASE + trio.current_time()``). What is simulated:
the wire (:mod:`tests.sim.net`), the workers (:mod:`tests.sim.worker`), the
API's emit and cancel (the same store calls and kicks as the HTTP handlers),
and the node process around the actors (a restart cancels its tree and
starts a new one on the same database; a hard crash also severs its store).

Determinism: the schedule and every per-component RNG derive from the seed
(:mod:`tests.sim.schedule`); ids come from a seeded source
(:func:`ironflow.ids.ids_from`); and Trio's scheduling order is made a
function of the seed through the hook its Hypothesis plugin uses —
``trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING`` (each batch of runnable
tasks is sorted by task creation order, then shuffled) and the module RNG
``trio._core._run._r``, reseeded here for every run (see
:func:`deterministic_trio`). No thread, socket or wall clock takes part.
A run's trace digest is therefore a function of its seed, which
``tests/sim/test_simulator.py`` checks across processes with different
``PYTHONHASHSEED`` values.

The PostgreSQL mode (``run_seed(seed, pg=SimDatabases(server))``,
:mod:`tests.sim.pg`) runs two node slots, each with its own
``PostgresStore``, on one fresh database: the same schedule, workers, faults
and oracle, but real database threads whose transactions interleave, so it
does not replay exactly (the seed still drives every fault and pause).
Emits, cancels, worker connections and node faults go to a node picked by a
seeded RNG.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import os
import shutil
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import trio
import trio.testing

from actors.directory import SessionDirectory
from actors.handout import BATCH, hand_out
from actors.messages import Kick, kick
from actors.supervisor import Supervisor
from ironflow.api.state import ApiDeps
from ironflow.api.worker_socket import _serve_socket
from ironflow.config import NodeConfig
from ironflow.ids import ids_from
from ironflow.node import KICK_BUFFER, start_actors
from ironflow.protocol import (
    Batch,
    Cancel,
    Concurrency,
    Debounce,
    FunctionDef,
    RateLimit,
    RetryPolicy,
    Singleton,
    Throttle,
    Trigger,
)
from ironflow.store import Conflict, IngestResult, Reservation, RunNotFound, StoreError
from tests.sim import invariants
from tests.sim.net import Connection, Link
from tests.sim.observed import NodeDown, ObservedStore, Oracle, OutcomesByTask, Reader, SqliteReader
from tests.sim.pg import ClockHold, Pauses, PgReader, SimDatabases
from tests.sim.schedule import (
    CRASH_AFTER,
    QUIESCE_LIMIT_S,
    TIMED_FAULTS,
    Action,
    FrameFaults,
    Schedule,
    build,
    rng_for,
)
from tests.sim.ticks import TickWatch, cron_function
from tests.sim.worker import RACE_EVENT, SIGNAL_EVENT, SimWorker

# ``ironflow_now()`` at virtual time 0.
BASE = 1_800_000_000.0
# How long every unended run must stay stranded before quiescence stops waiting.
STRANDED_FOR_S = 60.0
# Node slots of the PostgreSQL mode: two nodes, each its own store, one database.
PG_NODES = 2
IDEMPOTENCY_WINDOW_S = 24 * 3600.0
# How long a worker stall waits for its worker to be connected, heartbeating
# and with free slots for three of the burst's runs (the first ack of a burst
# is applied alone, the next ones together: tests/sim/schedule.py).
STALL_WAIT_S = 20.0
STALL_FREE_SLOTS = 3

FUNCTIONS = [
    FunctionDef(
        id="sim-a",
        triggers=[Trigger("a.go"), Trigger("both.go")],
        retries=RetryPolicy(max_attempts=3, initial_delay_s=0.5),
        audit=True,
    ),
    FunctionDef(
        id="sim-r",
        triggers=[Trigger("r.go")],
        retries=RetryPolicy(max_attempts=2, initial_delay_s=0.5),
        audit=True,
    ),
    FunctionDef(
        id="sim-b",
        triggers=[Trigger("b.go"), Trigger("both.go")],
        retries=RetryPolicy(max_attempts=2, initial_delay_s=0.5),
        # Flow control at dispatch (docs/flow-control.md), judged by the oracle
        # at every reservation (tests/sim/invariants.py, 10 and 11): 2 in all,
        # 1 per group (``g``, in every plan: schedule.plan_for); first starts
        # at most one per 3 s (a throttle that binds in about a third of the
        # seeds: a few sim-b runs each, emitted over the fault phase).
        concurrency=[Concurrency(limit=2), Concurrency(limit=1, key="event.data.g")],
        throttle=Throttle(limit=1, period_s=3.0),
        audit=True,
    ),
    # A rate limit (ingest side): of a.go's events at most 1 per 10 s starts a
    # run of it (invariant 14); the stall bursts of a.go events (schedule.py)
    # run into it.
    FunctionDef(
        id="sim-l",
        triggers=[Trigger("a.go")],
        retries=RetryPolicy(max_attempts=3, initial_delay_s=0.5),
        rate_limit=RateLimit(limit=1, period_s=10.0),
        audit=True,
    ),
    # A debounce (ingest side): a.go's events start one run of it per quiet
    # period of 2 s, at most 4 s after the period's first event, with the
    # period's last event (invariant 15); the stall bursts make the periods.
    FunctionDef(
        id="sim-d",
        triggers=[Trigger("a.go")],
        retries=RetryPolicy(max_attempts=3, initial_delay_s=0.5),
        debounce=Debounce(period_s=2.0, max_wait_s=4.0),
        audit=True,
    ),
    # Event batches (ingest side): a.go's events in batches of at most 3,
    # each run 2 s after its batch's first event (or at once when full), one
    # run per batch (invariant 16); the stall bursts fill them.
    FunctionDef(
        id="sim-t",
        triggers=[Trigger("a.go")],
        retries=RetryPolicy(max_attempts=3, initial_delay_s=0.5),
        batch=Batch(max_size=3, timeout_s=2.0),
        audit=True,
    ),
    # A singleton (ingest-side flow control): a b.go event while a sim-s run is
    # in flight starts none (invariants 1 and 12).
    FunctionDef(
        id="sim-s",
        triggers=[Trigger("b.go")],
        retries=RetryPolicy(max_attempts=2, initial_delay_s=0.5),
        singleton=Singleton(),
        audit=True,
    ),
]
# What a campaign reports as "faults injected", in this order.
FAULT_KINDS = (*TIMED_FAULTS, "frame_drop", "frame_delay", "frame_duplicate", "frame_reorder")
TRIGGERED = {"a.go": ["sim-a", "sim-l", "sim-d", "sim-t"], "b.go": ["sim-b", "sim-s"], "both.go": ["sim-a", "sim-b"], "r.go": ["sim-r"]}


def deterministic_trio(seed: int) -> None:
    """Make Trio's scheduler a function of ``seed`` for the next ``trio.run``.

    Trio randomises the order in which it runs each batch of runnable tasks.
    Its Hypothesis plugin (``trio._core._run._hypothesis_plugin_setup``) turns
    that into a deterministic order: with ``_ALLOW_DETERMINISTIC_SCHEDULING``
    set, each batch is sorted by task creation counter, then shuffled with the
    module RNG ``_r``. We set the same flag (Hypothesis sets it too, whenever
    it is imported) and seed ``_r``. Private to Trio: pinned by the tests.
    """
    import trio._core._run as trio_run

    trio_run._ALLOW_DETERMINISTIC_SCHEDULING = True  # type: ignore[misc]
    trio_run._r.seed(f"trio:{seed}")


def seeded_ids(seed: int) -> Callable[[str], str]:
    rng = rng_for(seed, "ids")
    counter = iter(range(1, 1 << 62))

    def source(prefix: str) -> str:
        return f"{prefix}_{next(counter):016x}{rng.getrandbits(64):016x}"

    return source


@dataclass
class Result:
    seed: int
    violations: list[str]
    counts: Counter[str]
    digest: str
    schedule: str
    virtual_s: float
    wall_s: float
    cpu_s: float = 0.0
    trace: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def report(self) -> str:
        lines = [self.schedule]
        lines.append(
            f"  -> {'OK' if self.ok else 'VIOLATED'}: virtual {self.virtual_s:.1f}s,"
            f" wall {self.wall_s * 1000:.0f} ms, trace {self.digest[:16]}"
        )
        lines += [f"  !! {v}" for v in self.violations]
        return "\n".join(lines)


class SimNode:
    """One incarnation of the node process of node slot ``slot``."""

    def __init__(self, sim: Simulation, no: int, slot: int) -> None:
        self.sim = sim
        self.no = no
        self.slot = slot
        self.node_id = f"node-{no}"
        self.store = ObservedStore(sim, sim.real_stores[slot], sim.oracle, no)
        self.directory = SessionDirectory()
        self.shutdown_requested = trio.Event()
        self.drained = trio.Event()
        self.scope = trio.CancelScope()
        self.up = False
        self.supervisor: Supervisor | None = None
        self.nursery: trio.Nursery | None = None
        self.kick_send: trio.MemorySendChannel[Kick] | None = None
        self.deps: ApiDeps | None = None
        self.span: list[float] | None = None  # while up (invariant 13: tests/sim/ticks.py)

    def down(self) -> None:
        """From now on this incarnation fires no cron tick (crashed, stopped,
        or asked to drain: invariant 13 counts a draining node as down)."""
        self.sim.ticks.node_down(self.span, trio.current_time())

    async def run(self) -> None:
        cfg = self.sim.config
        try:
            with self.scope:
                kick_send, kick_receive = trio.open_memory_channel[Kick](KICK_BUFFER)
                self.kick_send = kick_send
                async with trio.open_nursery() as nursery:
                    self.nursery = nursery
                    supervisor = Supervisor(nursery, cfg.timings)
                    self.supervisor = supervisor
                    store: Any = self.store
                    await start_actors(
                        supervisor,
                        store,
                        cfg,
                        self.node_id,
                        self.directory,
                        kick_send,
                        kick_receive,
                        self.shutdown_requested,
                        self.drained,
                    )
                    self.deps = ApiDeps(
                        store=store,
                        config=cfg,
                        node_id=self.node_id,
                        directory=self.directory,
                        kicks=kick_send,
                        shutdown_requested=self.shutdown_requested,
                        ready=trio.Event(),
                    )
                    self.up = True
                    self.span = self.sim.ticks.node_up(trio.current_time())
                    self.sim.trace(f"node {self.no} up")
                    await self.drained.wait()
                    self.sim.trace(f"node {self.no} drained, stopping")
                    nursery.cancel_scope.cancel()
        except* NodeDown:
            pass  # calls made after a hard crash: a dead process writes nothing
        finally:
            self.up = False
            self.down()

    def accept(self, conn: Connection) -> bool:
        """A worker connects (refused while draining, like the API's 503)."""
        if not self.up or self.shutdown_requested.is_set() or self.nursery is None:
            return False
        self.nursery.start_soon(self._serve_connection, conn)
        return True

    async def _serve_connection(self, conn: Connection) -> None:
        assert self.deps is not None
        try:
            with conn.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(conn.up.pump)
                    nursery.start_soon(conn.down.pump)
                    with conn.bridge_scope:
                        await _serve_socket(conn.ws, self.deps)
                    conn.down.close()
                    # The worker reads what the bridge sent, then the close, and
                    # drops the connection (a frozen one is dropped after a while).
                    with trio.move_on_after(30.0):
                        await trio.sleep_forever()
                    nursery.cancel_scope.cancel()
        finally:
            conn.up.shut()
            conn.down.shut()
            conn.ended.set()


class Simulation:
    def __init__(
        self, seed: int, *, bug: str | None = None, keep_trace: bool = False, nodes: int = 1
    ) -> None:
        self.seed = seed
        self.bug = bug
        # More than one node slot only on PostgreSQL (tests/sim/pg.py), whose
        # transactions then interleave: the oracle judges accordingly.
        self.concurrent = nodes > 1
        self.schedule: Schedule = build(seed)
        # The workers' functions: FUNCTIONS and the seed's cron function.
        self.functions = [*FUNCTIONS, cron_function(seed)]
        self.ticks = TickWatch(self.functions[-1])  # invariant 13
        self.config = NodeConfig(timings=self.schedule.timings, idempotency_window_s=IDEMPOTENCY_WINDOW_S)
        self.counts: Counter[str] = Counter()
        self.keep_trace = keep_trace
        self._trace: list[str] = []
        self._digest = hashlib.sha256()
        self.nodes: list[SimNode | None] = [None] * nodes
        self.node_no = 0
        # Which node an emit, a cancel, a worker's connection or a node fault goes to.
        self.pick = rng_for(seed, "node-pick")
        self.workers: list[SimWorker | None] = [None] * len(self.schedule.workers)
        self.conn_no = 0
        self.links: list[Link] = []
        self.frame_faults = self.schedule.frame_faults
        self.faults_on = True
        self.stopping = False
        self.event_ids: dict[int, str] = {}
        self.event_runs: dict[int, list[str]] = {}
        self.pending_emits = 0
        self.rng = rng_for(seed, "sim")
        self.raced: set[str] = set()  # runs whose race events were emitted
        self.real_stores: list[Any] = []  # one per node slot
        self.reader: Reader
        self.oracle: Oracle
        self.root: trio.Nursery
        self.t0 = 0.0
        self.crashed = ""

    # ── clocks and trace ───────────────────────────────────────────────────

    def epoch_now(self) -> float:
        return BASE + trio.current_time()

    def trace(self, line: str) -> None:
        text = f"{trio.current_time():.3f} {line}"
        self._digest.update(text.encode() + b"\n")
        if self.keep_trace:
            self._trace.append(text)

    # ── hooks from the observed store ──────────────────────────────────────

    def after_store_call(self, node_no: int, method: str, n: int) -> None:
        node = next((x for x in self.nodes if x is not None and x.no == node_no), None)
        if not self.faults_on or node is None:
            return
        if (method, n) in self.schedule.crash_after:
            actor = CRASH_AFTER[method]
            if node.supervisor is not None:
                self.counts["actor_crash"] += 1
                self.trace(f"crash {actor} after {method}#{n}")
                node.supervisor.crash(actor)
        if (method, n) in self.schedule.node_crash_after:
            self.trace(f"node crash after {method}#{n}")
            self.crash_node(hard=True, node=node)

    # ── the node processes ─────────────────────────────────────────────────

    @property
    def node(self) -> SimNode | None:
        """A node to talk to: the only one, or (several slots) one picked at
        random among those up (else any)."""
        if len(self.nodes) == 1:
            return self.nodes[0]
        up = [n for n in self.nodes if n is not None and n.up and not n.shutdown_requested.is_set()]
        pool = up or [n for n in self.nodes if n is not None]
        return self.pick.choice(pool) if pool else None

    def crash_node(self, *, hard: bool, node: SimNode | None = None) -> None:
        node = node or self.node
        if node is None:
            return
        self.counts["node_crash" if hard else "node_restart"] += 1
        if hard:
            node.store.severed = True
        node.down()
        node.scope.cancel()

    async def _node_keeper(self, slot: int) -> None:
        rng = rng_for(self.seed, "node-keeper", *([slot] if slot else []))
        while not self.stopping:
            self.node_no += 1
            node = SimNode(self, self.node_no, slot)
            self.nodes[slot] = node
            await node.run()
            self.nodes[slot] = None
            self.trace(f"node {node.no} stopped")
            if self.stopping:
                break
            down = round(rng.uniform(0.2, 3.0), 3) if self.faults_on else 0.2
            await trio.sleep(down)

    def connect(self, worker: SimWorker) -> Connection | None:
        node = self.node
        if node is None or not node.up or node.shutdown_requested.is_set():
            return None
        self.conn_no += 1
        no = self.conn_no
        up = Link(f"c{no}>", rng_for(self.seed, "link", no, "up"), self.frame_faults, self.counts, upstream=True)
        down = Link(f"c{no}<", rng_for(self.seed, "link", no, "down"), self.frame_faults, self.counts, upstream=False)
        self.links += [up, down]
        conn = Connection(no, worker.name, up, down)
        if not node.accept(conn):
            return None
        self.trace(f"{worker.name} connects to node {node.no} (c{no})")
        return conn

    async def _worker_keeper(self, slot: int) -> None:
        rng = rng_for(self.seed, "worker-keeper", slot)
        incarnation = 0
        while not self.stopping:
            worker = SimWorker(self, slot, incarnation, self.schedule.workers[slot], self.functions)
            self.workers[slot] = worker
            await worker.run()
            self.workers[slot] = None
            self.trace(f"{worker.name} exited")
            incarnation += 1
            await trio.sleep(round(rng.uniform(0.5, 4.0), 3) if self.faults_on else 0.5)

    # ── the API's emit and cancel ──────────────────────────────────────────

    async def _emit(self, k: int, *, signal: bool = False) -> None:
        """Emit until a node takes it (a client retrying while the node is down)."""
        self.pending_emits += 1
        try:
            name, plan = self.schedule.events[k]
            while True:
                node = self.node
                if node is not None and node.up and node.kick_send is not None:
                    try:
                        if signal:
                            result = await self._emit_unkeyed(node, SIGNAL_EVENT, {"k": k})
                        else:
                            result = await node.store.ingest_event(
                                name, plan, f"ev-{k}", idempotency_window_s=IDEMPOTENCY_WINDOW_S
                            )
                    except NodeDown:
                        result = None
                    if result is not None:
                        if not signal and not result.duplicate and (result.run_ids or result.resumed_run_ids):
                            kick(node.kick_send, "event ingested")
                        if not signal:
                            self._note_event(k, result)
                        self.trace(
                            f"{'signal' if signal else 'emit'} {k} -> {result.event_id}"
                            f" runs={result.run_ids} resumed={result.resumed_run_ids} dup={result.duplicate}"
                        )
                        return
                await trio.sleep(1.0)
        finally:
            self.pending_emits -= 1

    async def _emit_unkeyed(self, node: SimNode, name: str, data: Any) -> IngestResult:
        """An emit without an idempotency key, as the API ingests one
        (``ApiState._ingest_group``, a group of one): while a local worker
        holds offers, the runs it queues are reserved in the ingest's own
        transaction (``Store.ingest_and_reserve``) and handed out before the
        emit is answered; the dispatcher is kicked for the rest."""
        assert node.kick_send is not None
        offers = node.directory.holding_offers()
        reserving_ns = time.time_ns()
        reservations: list[Reservation] = []
        if offers:
            [result], reservations = await node.store.ingest_and_reserve(
                [(name, data, None)],
                idempotency_window_s=IDEMPOTENCY_WINDOW_S,
                offers=offers,
                limit=BATCH,
                reservation_expiry_s=self.config.timings.reservation_expiry_s,
            )
            self.counts["emit_reserve_calls"] += 1
            self.counts["emit_reserve_queued"] += len(result.run_ids) + len(result.resumed_run_ids)
        else:
            result = await node.store.ingest_event(name, data, None, idempotency_window_s=IDEMPOTENCY_WINDOW_S)
        # Committed: from here nothing fails the emit (a node that crashed
        # meanwhile, right after the call, hands out and kicks nothing).
        if reservations:
            self.counts["emit_reservations"] += len(reservations)
            self.trace(f"{name} {data} reserved in its emit: {[r.assignment.run_id for r in reservations]}")
        if node.store.severed:
            self.counts["emit_reservations_orphaned"] += len(reservations)
            return result
        if reservations:
            try:
                await hand_out(node.store, node.directory, reservations, reserving_ns, None)
            except (StoreError, NodeDown):
                pass  # not handed out nor given back: it waits for its reservation's expiry
        reserved = {r.assignment.run_id for r in reservations}
        if any(rid not in reserved for rid in (*result.run_ids, *result.resumed_run_ids)):
            kick(node.kick_send, "event ingested")
        return result

    def race_started(self, run_id: str, plan: dict[str, Any]) -> None:
        """A worker began the step before a race run's wait: emit the run's
        matching event and the non-matching ones of the same name, concurrently,
        at the moment its plan says (see ``schedule.race_plan``)."""
        if run_id in self.raced:
            return
        self.raced.add(run_id)
        race = plan["race"]
        for data in [{"k": plan["k"]}, *({"k": k} for k in race["others"])]:
            self.root.start_soon(self._emit_race, data, float(race["after_s"]))

    async def _emit_race(self, data: dict[str, Any], after_s: float) -> None:
        self.pending_emits += 1
        try:
            await trio.sleep(after_s)
            while True:
                node = self.node
                if node is not None and node.up and node.kick_send is not None:
                    try:
                        result = await self._emit_unkeyed(node, RACE_EVENT, data)
                    except NodeDown:
                        result = None
                    if result is not None:
                        self.counts["race_events"] += 1
                        self.trace(f"race {data} -> {result.event_id} resumed={result.resumed_run_ids}")
                        return
                await trio.sleep(1.0)
        finally:
            self.pending_emits -= 1

    async def _stall(self, slot: int, past_expiry_s: float, burst: list[tuple[int, float]]) -> None:
        """Stall the worker of ``slot`` past its session's expiry, once it is
        connected and heartbeating (within STALL_WAIT_S); then emit the burst."""
        self.pending_emits += len(burst)  # quiescence waits for them
        try:
            with trio.move_on_after(STALL_WAIT_S):
                while (w := self.workers[slot]) is None or not w.heartbeating(STALL_FREE_SLOTS):
                    await trio.sleep(0.1)
            expiry = trio.current_time() + 3.0
            if w is not None and w.heartbeating(STALL_FREE_SLOTS):
                self.counts["worker_stall"] += 1
                self.trace(f"{w.name} stalls")
                expiry = w.last_heartbeat_at + self.schedule.timings.session_expiry_s
                self.root.start_soon(w.stall, self.schedule.timings.session_expiry_s, past_expiry_s)
            async with trio.open_nursery() as nursery:
                for k, before_s in burst:
                    nursery.start_soon(self._emit_after, k, max(0.0, expiry - before_s - trio.current_time()))
        finally:
            self.pending_emits -= len(burst)

    async def _emit_after(self, k: int, after_s: float) -> None:
        await trio.sleep(after_s)
        await self._emit(k)

    def _note_event(self, k: int, result: Any) -> None:
        first = self.event_ids.get(k)
        if first is None:
            self.event_ids[k] = result.event_id
            self.event_runs[k] = list(result.run_ids)
        elif result.event_id != first or not result.duplicate:
            self.oracle.violation(
                f"event {k} emitted again with its idempotency key: got {result.event_id}"
                f" (duplicate={result.duplicate}), first was {first}"
            )

    async def _cancel(self, k: int) -> None:
        node = self.node
        runs = self.event_runs.get(k)
        if node is None or not node.up or not runs or node.kick_send is None:
            return
        run_id = runs[0]
        try:
            outcome = await node.store.cancel_run(run_id, "cancelled by the schedule")
        except (Conflict, RunNotFound, NodeDown):
            return
        self.oracle.run(run_id).cancelled = True
        self.oracle.run(run_id).ended_by = "cancelled"
        self.counts["cancel"] += 1
        self.trace(f"cancelled {run_id}")
        if outcome.session_id is not None and outcome.job_id is not None:
            local = node.directory.get(outcome.session_id)
            if local is not None:
                with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                    local.outbox.send_nowait(Cancel(outcome.job_id, run_id, "cancelled by the schedule"))
        kick(node.kick_send, "run cancelled")

    # ── the schedule ───────────────────────────────────────────────────────

    async def _apply(self, a: Action) -> None:
        node = self.node
        w = self.workers[a.target] if isinstance(a.target, int) and a.kind not in ("emit", "emit_again", "signal", "cancel") else None
        self.trace(f"action {a}")
        if a.kind in ("emit", "emit_again"):
            self.root.start_soon(self._emit, a.target)
        elif a.kind == "signal":
            self.root.start_soon(functools.partial(self._emit, a.target, signal=True))
        elif a.kind == "cancel":
            await self._cancel(a.target)
        elif a.kind == "worker_crash" and w is not None:
            self.counts["worker_crash"] += 1
            w.crash()
        elif a.kind == "conn_cut" and w is not None and w.conn is not None:
            self.counts["conn_cut"] += 1
            w.cut()
        elif a.kind == "worker_stall":
            self.root.start_soon(self._stall, a.target, *a.arg)
        elif a.kind == "worker_freeze" and w is not None:
            self.counts["worker_freeze"] += 1
            self.root.start_soon(w.freeze, a.arg)
        elif a.kind == "late_heartbeat" and w is not None:
            self.counts["late_heartbeat"] += 1
            w.heartbeat_late_s = a.arg
        elif a.kind == "worker_drain" and w is not None:
            self.counts["worker_drain"] += 1
            w.begin_drain(5.0)
        elif a.kind == "actor_crash" and node is not None and node.supervisor is not None and node.up:
            self.counts["actor_crash"] += 1
            node.supervisor.crash(a.target)
        elif a.kind == "node_restart":
            self.crash_node(hard=False, node=node)
        elif a.kind == "node_crash":
            self.crash_node(hard=True, node=node)
        elif a.kind == "node_drain" and node is not None and node.up:
            self.counts["node_drain"] += 1
            node.down()
            node.shutdown_requested.set()

    async def _run_schedule(self) -> None:
        for a in self.schedule.actions:
            delay = self.t0 + a.at - trio.current_time()
            if delay > 0:
                await trio.sleep(delay)
            await self._apply(a)
        delay = self.t0 + self.schedule.fault_phase_s - trio.current_time()
        if delay > 0:
            await trio.sleep(delay)

    def _heal(self) -> None:
        self.faults_on = False
        self.frame_faults = FrameFaults()
        for link in self.links:
            link.faults = self.frame_faults
        for w in self.workers:
            if w is not None:
                w.gate.open()
                w.heartbeat_late_s = 0.0
        self.trace("healed")

    async def _quiesce(self) -> None:
        deadline = trio.current_time() + QUIESCE_LIMIT_S
        stranded_since = math.inf
        while trio.current_time() < deadline:
            await trio.sleep(5.0)
            if self.pending_emits:
                continue
            row = self.oracle.one(
                "SELECT count(*), count(*) FILTER (WHERE NOT EXISTS (SELECT 1 FROM dispatch_queue q"
                " WHERE q.run_id = r.id) AND NOT EXISTS (SELECT 1 FROM concurrency_leases l"
                " WHERE l.run_id = r.id) AND NOT EXISTS (SELECT 1 FROM steps s WHERE s.run_id = r.id"
                " AND s.status IN ('sleeping', 'waiting', 'waking'))) FROM runs r"
                " WHERE status NOT IN ('completed', 'failed', 'cancelled')"
            )
            if row is not None and row[0] == 0:
                return
            # Every run left is stranded (nothing any loop of the engine reads
            # can move it): no use waiting out the limit (invariant 2 says so).
            if row is not None and row[0] == row[1]:
                stranded_since = min(stranded_since, trio.current_time())
                if trio.current_time() - stranded_since >= STRANDED_FOR_S:
                    return
            else:
                stranded_since = math.inf

    async def main(self) -> None:
        self.oracle = Oracle(self, self.reader)
        opened = []
        try:
            for store in self.real_stores:
                await store.open()
                opened.append(store)
            async with trio.open_nursery() as root:
                self.root = root
                for slot in range(len(self.nodes)):
                    root.start_soon(self._node_keeper, slot)
                while not all(n is not None and n.up for n in self.nodes):
                    await trio.sleep(0.001)
                for slot in range(len(self.workers)):
                    root.start_soon(self._worker_keeper, slot)
                # The schedule's clock starts once the functions are registered
                # (an event emitted before that starts no run, by design).
                while self.oracle.one("SELECT count(*) FROM functions") != (len(self.functions),):
                    await trio.sleep(0.001)
                self.t0 = trio.current_time()
                row = self.oracle.one("SELECT min(next_at) FROM cron_schedules")
                self.ticks.first_at = None if row is None or row[0] is None else float(row[0])
                await self._run_schedule()
                self._heal()
                await self._quiesce()
                self.stopping = True
                self.ticks.stop_at = trio.current_time()
                self.trace("stopping")
                root.cancel_scope.cancel()
            invariants.check(self)
        finally:
            self.oracle.close()
            for store in opened:
                await store.close()



@contextlib.contextmanager
def _quiet_logs() -> Iterator[None]:
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(previous)


def _scratch_dir() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="ironflow-sim-", dir=base)


def run_seed(
    seed: int, *, bug: str | None = None, keep_trace: bool = False, pg: SimDatabases | None = None
) -> Result:
    """Run one seed to the end and check its invariants: one node on an inline
    SQLite store, or with ``pg`` two nodes on a fresh PostgreSQL database of
    that server (:mod:`tests.sim.pg`; ``bug`` then names one of
    ``tests.sim.bugs.PG_BUGS``)."""
    from tests.sim.bugs import pg_store_class, store_class

    started = time.perf_counter()
    cpu_started = time.process_time()
    sim = Simulation(seed, bug=bug, keep_trace=keep_trace, nodes=PG_NODES if pg else 1)
    scratch = _scratch_dir()
    clock = trio.testing.MockClock(autojump_threshold=0)
    url = ""
    try:
        if pg is None:
            cls = type("SimStore", (OutcomesByTask, store_class(bug)), {})
            store = cls(os.path.join(scratch, "sim.db"), now=lambda: BASE + clock.current_time(), inline=True)
            sim.real_stores = [store]
            sim.reader = SqliteReader(store.path)
        else:
            url = pg.create(seed)
            hold = ClockHold(clock)
            pg_cls = pg_store_class(bug)
            sim.real_stores = [
                pg_cls(url, hold=hold, pauses=Pauses(seed, slot), base=BASE) for slot in range(PG_NODES)
            ]
            sim.reader = PgReader(url)
        deterministic_trio(seed)
        with _quiet_logs(), ids_from(seeded_ids(seed)):
            try:
                trio.run(sim.main, clock=clock)
            except Exception as exc:  # anything escaping the node is a finding too
                crash = "".join(traceback.format_exception(exc)[-6:])
                sim.crashed = f"the simulation raised {exc!r}:\n{crash}"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if url and pg is not None:
            pg.drop(url)
    violations = list(sim.oracle.violations) if hasattr(sim, "oracle") else []
    if sim.crashed:
        violations.append(sim.crashed)
    return Result(
        seed=seed,
        violations=violations,
        counts=sim.counts,
        digest=sim._digest.hexdigest(),
        schedule=sim.schedule.describe(),
        virtual_s=clock.current_time(),
        wall_s=time.perf_counter() - started,
        cpu_s=time.process_time() - cpu_started,
        trace=sim._trace,
    )


def _seed_in_child(args: tuple[int, str | None]) -> Result:
    seed, bug = args
    r = run_seed(seed, bug=bug)
    r.schedule = r.schedule if r.violations else ""  # keep what crosses the pipe small
    return r


def campaign(
    seeds: range | list[int],
    *,
    bug: str | None = None,
    processes: int = 1,
    stop_at_first: bool = False,
    deadline_s: float = math.inf,
    on_result: Callable[[Result], None] | None = None,
    pg: SimDatabases | None = None,
) -> list[Result]:
    """Run many seeds (in ``processes`` worker processes; with ``pg``, one
    after another in this process: each seed's nodes are threads already);
    results in seed order."""
    results: list[Result] = []
    started = time.perf_counter()
    if processes <= 1 or pg is not None:
        for seed in seeds:
            r = run_seed(seed, bug=bug, pg=pg)
            results.append(r)
            if on_result:
                on_result(r)
            if (stop_at_first and not r.ok) or time.perf_counter() - started > deadline_s:
                break
        return results
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(processes) as pool:
        for r in pool.imap(_seed_in_child, [(s, bug) for s in seeds], chunksize=4):
            results.append(r)
            if on_result:
                on_result(r)
            if (stop_at_first and not r.ok) or time.perf_counter() - started > deadline_s:
                pool.terminate()
                break
    return results
