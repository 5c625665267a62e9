#!/usr/bin/env python
"""Chaos: real nodes and workers under load, real faults, then the engine's promises checked.

    python scripts/chaos.py [--seconds 30 | --minutes 10] [--seed N]
                            [--backend sqlite|postgres] [--workers 3] [--rate 4]
                            [--waits] [--report FILE] [--keep]

One ``--chaos`` node on SQLite, or two on one PostgreSQL database (a
throwaway cluster this script starts), with ``--workers`` worker processes
(this script re-invoked with ``--worker``) under a steady load of multi-step
runs: steps that append side-effect marks to a file, durable sleeps, waits
for an event, invokes of a child function, and a handler that fails its
first attempt. With ``--waits``, also the wait workload: runs
that do a step and then wait for the event of their own key, that event
emitted the moment the run is seen holding its lease, beside as many events
of the name no run waits on. For the given time, at moments drawn from
``--seed``, it:

- crashes a node actor (``POST /v1/chaos/crash`` with a platform key);
- kills a worker with SIGKILL and starts a new one;
- freezes a worker past its lease (SIGSTOP, SIGCONT after the lease expired);
- drains a worker (SIGTERM; it finishes its jobs and exits) and starts a new one;
- on PostgreSQL, kills a node with SIGKILL and restarts it on its port.

Then it stops the faults and the load, waits for every run to end, and
checks from the database (the store's own reads) and the marks file, printed
as a table:

- every emitted event has its runs, and every run belongs to an event or to
  its invoking parent;
- every run completed, or failed for a reason the schedule explains (the
  recovery ceiling);
- each step's result was recorded exactly once (one ``step.completed`` audit
  row) and came from an execution that finished it;
- no step body ran twice except one in flight when a fault hit its worker
  (kill, freeze, or its node's death): counted and listed;
- no write was accepted from a fenced ``execution_seq`` (and how many stale
  messages the nodes refused);
- attempt, recovery_count and execution_seq of every run agree with its audit
  trail and its parked steps;
- with ``--waits``: an event acknowledged after the segment that parks a wait
  began, and before the wait's timeout, that matches it resolves it (each
  event is sent once its run's detail shows that segment's lease; a wait
  parked by a later segment, after a fault, is counted and not judged);
- the nodes are alive, every actor restart was one we injected, and the
  nodes' RSS at start and end.

Exit status 1 on any violation, 0 otherwise. ``--report FILE`` writes the
figures as JSON (tests/integration/test_chaos_script.py reads it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from children import (  # noqa: E402
    LIVE,
    child_env,
    cleanup_all,
    free_port,
    mkdtemp,
    serve_worker_until_stopped,
    spawn_dev_node,
    stop,
    wait_ready,
)

# ── timings ──────────────────────────────────────────────────────────────────

# Node timings: short enough that a killed or frozen worker's lease expires
# and its run is recovered within a couple of seconds, long enough (leases
# 4x the heartbeat) that a live worker on a loaded 2-core machine keeps its.
NODE_TIMINGS = {
    "--heartbeat-interval": "0.5",
    # Longer than a freeze: the frozen worker's session (and socket) outlive
    # its leases, so what it sends after SIGCONT reaches the fence.
    "--session-expiry": "6",
    "--lease-expiry": "2",
    "--reservation-expiry": "1",
    "--scanner-interval": "0.25",
    "--recovery-grace": "0.25",
    "--waker-interval": "0.2",
    # At most half the reservation expiry (a worker that cannot hold a woken
    # job is sent it at its wake time, on a reservation made ahead of it).
    "--waker-lookahead": "0.5",
    "--stale-claim-interval": "1",
    "--stale-claim-threshold": "3",
    "--node-heartbeat": "1",
    "--dispatch-idle-poll": "1",
    "--drain-timeout": "5",
    "--metrics-sample": "1",
}
LEASE_EXPIRY_S = float(NODE_TIMINGS["--lease-expiry"])
# A frozen worker stays stopped this long past its lease: long enough that the
# scanner has surely recovered its runs, so its writes after SIGCONT are stale.
FREEZE_PAST_LEASE_S = 1.5
# A thawed worker first works off what reached it while it was stopped
# (assignments long since re-dispatched, a job whose lease expired): all on
# stale fences, within this long after SIGCONT on a loaded 2-core machine.
THAW_BACKLOG_S = 3.0
# A new worker must have registered within this (its node may be restarting).
WORKER_START_S = 30.0
# A killed PostgreSQL node is restarted after this long (its workers reconnect).
NODE_DOWN_S = 1.0
# No fault in the first seconds (workers connect, load builds up) nor in the
# last (the last fault's recovery should land inside the run).
WARMUP_S, COOLDOWN_S = 2.0, 2.0
# Mean time between two faults.
MEAN_FAULT_GAP_S = 1.5
# How long the runs may take to end once the faults and the load stop.
QUIESCE_TIMEOUT_S = 120.0
# A drained worker must be gone within its drain timeout plus this.
DRAIN_EXIT_GRACE_S = 10.0
# PostgreSQL's database clock is the transaction's start: a write racing a
# recovery may carry a start a little after the recovery's and still have
# been ordered before it. A stale write after a freeze comes seconds later.
PG_CLOCK_SLACK_S = 0.5

# ── the workload ─────────────────────────────────────────────────────────────

# Longest a step body sleeps: long enough for faults to land mid-step.
STEP_MAX_S = 0.6
# A wait for an event gives up after this (the run then completes without it).
WAIT_TIMEOUT_S = 8.0
DURABLE_NAP_S = 1.0
# Longest a segment runs on a worker: four steps of at most STEP_MAX_S.
JOB_SPAN_S = 4 * STEP_MAX_S
# A job goes on running on its worker after its node died, and a job frozen
# when its node died goes on after the thaw: a node-kill this long before a
# step started can still be why it ran again.
NODE_KILL_REACH_S = JOB_SPAN_S + LEASE_EXPIRY_S + FREEZE_PAST_LEASE_S
# Event name → (function id, relative weight in the load).
LOAD = {
    "chaos.chain": ("chain", 3),
    "chaos.nap": ("nap", 1),
    "chaos.wait": ("waiter", 1),
    "chaos.parent": ("parent", 1),
    "chaos.flaky": ("flaky", 1),
}
SIGNAL_EVENT = "chaos.signal"
# The wait workload (--waits): its runs' event name, the name they wait on, and
# the share of the load they take (as a weight beside LOAD's).
RACE_EVENT, GO_EVENT, RACE_WEIGHT = "chaos.race", "chaos.go", 2
# A racer's wait outlives any fault's delay: its event (sent once the run is
# seen started) comes well before it, so a wait that times out was lost.
RACE_WAIT_TIMEOUT_S = 30.0
# How long a racer's event waits for its run to be seen holding a lease.
RACE_START_S = 30.0
# The steps every completed run of each function must have recorded, by name and kind.
EXPECTED_STEPS: dict[str, dict[str, str]] = {
    "chain": {"s0": "run", "s1": "run", "s2": "run", "s3": "run"},
    "nap": {"a": "run", "nap": "sleep", "b": "run"},
    "waiter": {"a": "run", "signal": "wait", "b": "run"},
    "parent": {"a": "run", "child": "invoke", "b": "run"},
    "child": {"c0": "run", "c1": "run"},
    "flaky": {"a": "run", "b": "run"},
    "racer": {"a": "run", "go": "wait", "b": "run"},
}
# Attempts a completed run of each function takes: flaky fails its first.
EXPECTED_ATTEMPTS = {"flaky": 2}
PARK_KINDS = frozenset({"sleep", "wait", "invoke"})
# The one failure the schedule explains: a run recovered past the ceiling.
RECOVERY_EXHAUSTED = "EXECUTION_RECOVERY_EXHAUSTED"

FAULT_KINDS = ["actor-crash", "worker-kill", "worker-freeze", "worker-drain"]
PG_FAULT_KINDS = [*FAULT_KINDS, "node-kill"]
# Faults that can leave a step body in flight, to be run again elsewhere.
IN_FLIGHT_FAULTS = frozenset({"worker-kill", "worker-freeze", "node-kill"})


def worker_main(server: str, marks_path: str, max_jobs: int) -> None:
    """Worker mode: serve the chaos functions, appending one mark line per
    step-body start and end: ``<time> <pid> <run_id> <step> start|done|raise``."""
    import ironflow

    pid = os.getpid()
    fd = os.open(marks_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def mark(run_id: str, step: str, phase: str) -> None:
        # One write() on an O_APPEND file: whole lines, even from a process
        # killed a moment later.
        os.write(fd, f"{time.time():.6f} {pid} {run_id} {step} {phase}\n".encode())

    def body(run_id: str, step: str) -> Any:
        async def run() -> dict[str, Any]:
            mark(run_id, step, "start")
            await trio.sleep(random.uniform(0, STEP_MAX_S))
            mark(run_id, step, "done")
            return {"pid": pid}

        return run

    retries = ironflow.RetryPolicy(max_attempts=3, initial_delay_s=0.2)

    def fn(fid: str, event: str | None = None) -> Any:
        triggers = [ironflow.event(event)] if event else []
        return ironflow.function(id=fid, triggers=triggers, retries=retries, audit=True)

    @fn("chain", "chaos.chain")
    async def chain(ctx: Any) -> Any:
        for i in range(4):
            await ctx.step.run(f"s{i}", body(ctx.run.id, f"s{i}"))
        return "ok"

    @fn("nap", "chaos.nap")
    async def nap(ctx: Any) -> Any:
        await ctx.step.run("a", body(ctx.run.id, "a"))
        await ctx.step.sleep("nap", DURABLE_NAP_S)
        return await ctx.step.run("b", body(ctx.run.id, "b"))

    @fn("waiter", "chaos.wait")
    async def waiter(ctx: Any) -> Any:
        await ctx.step.run("a", body(ctx.run.id, "a"))
        got = await ctx.step.wait_for_event(
            "signal", event=SIGNAL_EVENT, match="data.key", timeout=WAIT_TIMEOUT_S
        )
        await ctx.step.run("b", body(ctx.run.id, "b"))
        return {"signalled": got is not None}

    @fn("racer", RACE_EVENT)
    async def racer(ctx: Any) -> Any:
        await ctx.step.run("a", body(ctx.run.id, "a"))
        got = await ctx.step.wait_for_event(
            "go", event=GO_EVENT, match="data.key", timeout=RACE_WAIT_TIMEOUT_S
        )
        await ctx.step.run("b", body(ctx.run.id, "b"))
        return {"key": None if got is None else got.data.get("key")}

    @fn("child")
    async def child(ctx: Any) -> Any:
        await ctx.step.run("c0", body(ctx.run.id, "c0"))
        await ctx.step.run("c1", body(ctx.run.id, "c1"))
        return "child-ok"

    @fn("parent", "chaos.parent")
    async def parent(ctx: Any) -> Any:
        await ctx.step.run("a", body(ctx.run.id, "a"))
        out = await ctx.step.invoke("child", function=child, data={}, timeout=60)
        await ctx.step.run("b", body(ctx.run.id, "b"))
        return out

    @fn("flaky", "chaos.flaky")
    async def flaky(ctx: Any) -> Any:
        await ctx.step.run("a", body(ctx.run.id, "a"))
        if ctx.run.attempt == 1:
            mark(ctx.run.id, "-", "raise")
            raise RuntimeError("first attempt fails on purpose")
        return await ctx.step.run("b", body(ctx.run.id, "b"))

    worker = ironflow.StreamingWorker(
        server, [chain, nap, waiter, racer, child, parent, flaky],
        max_concurrent_jobs=max_jobs, reconnect_delay=0.2, drain_timeout=5.0,
    )
    serve_worker_until_stopped(worker)


# ── processes ────────────────────────────────────────────────────────────────


@dataclass
class NodeProc:
    """One node: its id and port stay across restarts; ``incarnation`` counts them."""

    node_id: str
    port: int
    db: str
    state: str
    log: Any
    proc: subprocess.Popen[bytes] | None = None
    incarnation: int = 0
    rss_start_kib: int | None = None
    ready: bool = False  # answered /readyz since its last start

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def key(self) -> str:
        """Names this incarnation in the metrics tallies."""
        return f"{self.node_id}#{self.incarnation}"

    def up(self) -> bool:
        return self.ready and self.proc is not None and self.proc.poll() is None


@dataclass
class WorkerProc:
    proc: subprocess.Popen[bytes]
    node: NodeProc
    state: str = "running"  # starting | running | frozen | draining | gone

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass
class RaceGo:
    """A racer run's event: the segment its run was seen holding, and when the
    event matching its wait was acknowledged (None: never sent or acked)."""

    key: str
    seen_seq: int | None = None
    acked_at: float | None = None


@dataclass
class Fault:
    at: float  # seconds after the load started
    kind: str
    target: str = ""
    injected: bool = False
    wall: float = 0.0  # time.time() when injected
    ended: float = 0.0  # time.time() when a freeze was thawed
    pid: int | None = None  # the worker hit, if any
    node: str | None = None  # the node hit (node-kill) or asked (actor-crash)
    note: str = ""


def draw_schedule(rng: random.Random, seconds: float, kinds: list[str]) -> list[Fault]:
    """Fault times uniform over the run, kinds in shuffled rounds so that every
    kind comes up (a 30 s run still sees each several times)."""
    n = max(len(kinds), int((seconds - WARMUP_S - COOLDOWN_S) / MEAN_FAULT_GAP_S))
    times = sorted(rng.uniform(WARMUP_S, max(WARMUP_S, seconds - COOLDOWN_S)) for _ in range(n))
    order: list[str] = []
    while len(order) < n:
        round_ = list(kinds)
        rng.shuffle(round_)
        order += round_
    return [Fault(round(t, 3), kind) for t, kind in zip(times, order, strict=False)]


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


_METRIC_LINE = re.compile(r"^(ironflow_[a-z_]+)(?:\{([^}]*)\})? (\S+)$", re.M)


def parse_metrics(text: str) -> dict[tuple[str, str], float]:
    """``(name, labels) → value`` for the ironflow_* samples of a /metrics page."""
    return {(m[1], m[2] or ""): float(m[3]) for m in _METRIC_LINE.finditer(text)}


# ── the run ──────────────────────────────────────────────────────────────────


class Chaos:
    """Starts the processes, drives load and faults, and keeps what the checks need."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.tmp = Path(mkdtemp("ifchaos."))
        self.marks = self.tmp / "marks"
        self.marks.touch()
        self.nodes: list[NodeProc] = []
        self.workers: list[WorkerProc] = []
        self.platform_key = ""
        self.db_url = ""
        self.pg: Any = None
        self.t0 = 0.0
        self.faults: list[Fault] = []
        # Accepted emits: idempotency key → (event id, event name).
        self.emitted: dict[str, tuple[str, str]] = {}
        self.emit_failures: list[str] = []
        # Racer run id → its event (--waits).
        self.races: dict[str, RaceGo] = {}
        self.violations_during: list[str] = []
        # Last /metrics of each node incarnation, and the crashes we delivered to it.
        self.metrics: dict[str, dict[tuple[str, str], float]] = {}
        self.crashes: dict[str, Counter[str]] = defaultdict(Counter)
        self.worker_count = 0

    # processes ---------------------------------------------------------------

    async def start(self) -> None:
        args = self.args
        if args.backend == "postgres":
            from ironflow.testing import ThrowawayPostgres

            self.pg = ThrowawayPostgres()
            await trio.to_thread.run_sync(self.pg.start)
            self.db_url = await trio.to_thread.run_sync(self.pg.new_database, "chaos")
            count = 2
        else:
            self.db_url = str(self.tmp / "chaos.db")
            count = 1
        for i in range(count):
            state = str(self.tmp / f"node{i}")
            node = NodeProc(f"chaos-node-{i}", free_port(), self.db_url, state,
                            (self.tmp / f"node{i}.log").open("ab"))
            self.nodes.append(node)
            await self._spawn_node(node)
        # Straight in the database (the nodes created it): how a first platform key is made.
        from ironflow.cli.keys import mint_in_database

        minted = await trio.to_thread.run_sync(mint_in_database, self.db_url, "platform", "platform_admin")
        self.platform_key = minted.key
        for i in range(args.workers):
            await self._start_worker(self.nodes[i % len(self.nodes)])

    async def _restart_node(self, node: NodeProc) -> None:
        """Start ``node`` again; a node that cannot start is a violation."""
        try:
            await self._spawn_node(node)
        except SystemExit as exc:
            self.violations_during.append(f"{node.node_id} did not restart: {exc} (log {node.log.name})")

    async def _spawn_node(self, node: NodeProc) -> None:
        extra = ["--chaos", "--node-id", node.node_id, *(x for kv in NODE_TIMINGS.items() for x in kv)]
        node.ready = False
        node.proc = spawn_dev_node(node.db, node.state, node.port, extra, log=node.log)
        node.incarnation += 1
        await trio.to_thread.run_sync(wait_ready, node.url, node.proc)
        node.ready = True
        if node.rss_start_kib is None:
            node.rss_start_kib = rss_kib(node.proc.pid)

    async def _start_worker(self, node: NodeProc) -> None:
        """Start a worker on ``node`` and wait until it registered; one that does
        not within WORKER_START_S is a violation, and is stopped."""
        self.worker_count += 1
        log = (self.tmp / f"worker{self.worker_count}.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", node.url, "--marks", str(self.marks)],
            env=child_env(), stdout=subprocess.PIPE, stderr=log,
        )
        LIVE.append(proc)
        worker = WorkerProc(proc, node, state="starting")
        self.workers.append(worker)
        assert proc.stdout is not None
        line = b""
        with trio.move_on_after(WORKER_START_S):
            line = await trio.to_thread.run_sync(proc.stdout.readline, abandon_on_cancel=True)
        if line.strip() == b"READY":
            worker.state = "running"
            return
        self.violations_during.append(
            f"worker pid {proc.pid} on {node.node_id} did not register within "
            f"{WORKER_START_S:g}s (log {log.name})"
        )
        stop(proc, sig=signal.SIGKILL)
        worker.state = "gone"

    def running_workers(self) -> list[WorkerProc]:
        return [w for w in self.workers if w.state == "running"]

    async def top_up_workers(self) -> None:
        """Keep ``--workers`` workers running (frozen and draining ones do not count)."""
        while len(self.running_workers()) < self.args.workers:
            counts = Counter(w.node.node_id for w in self.running_workers())
            node = min(self.nodes, key=lambda n: counts[n.node_id])
            await self._start_worker(node)

    # load --------------------------------------------------------------------

    def live_nodes(self) -> list[NodeProc]:
        return [n for n in self.nodes if n.up()]

    async def _emit(
        self, client: httpx.AsyncClient, name: str, data: dict[str, Any]
    ) -> tuple[dict[str, Any], float] | None:
        """Emit once, whatever node dies meanwhile: retried with one idempotency key.
        Returns the answer and when it came (None: refused or given up)."""
        key = f"chaos-{self.rng.getrandbits(64):016x}"
        body = {"name": name, "data": data, "idempotency_key": key}
        deadline = trio.current_time() + 15.0
        while trio.current_time() < deadline:
            nodes = self.live_nodes()
            if nodes:
                node = nodes[self.rng.randrange(len(nodes))]
                try:
                    resp = await client.post(node.url + "/v1/events", json=body)
                except httpx.HTTPError:
                    resp = None
                if resp is not None and resp.status_code in (200, 201):
                    # A retry whose first try did land gets that event back (the
                    # key); a second event would show as a run no emit owns.
                    self.emitted[key] = (resp.json()["event_id"], name)
                    return resp.json(), time.time()
                if resp is not None and resp.status_code >= 500:
                    self.violations_during.append(f"emit {name}: {resp.status_code} {resp.text[:200]}")
                elif resp is not None:
                    self.violations_during.append(f"emit {name} refused: {resp.status_code} {resp.text[:200]}")
                    return None
            await trio.sleep(0.2)
        self.emit_failures.append(key)
        return None

    async def load(self, until: float) -> None:
        names = [n for n, (_, w) in LOAD.items() for _ in range(w)]
        if self.args.waits:
            names += [RACE_EVENT] * RACE_WEIGHT
        async with httpx.AsyncClient(timeout=10.0) as client, trio.open_nursery() as nursery:
            while trio.current_time() < until:
                name = self.rng.choice(names)
                data: dict[str, Any] = {"key": f"k{self.rng.getrandbits(48):x}"}
                if name != RACE_EVENT:
                    nursery.start_soon(self._emit, client, name, data)
                if name == "chaos.wait":
                    nursery.start_soon(self._signal_later, client, data["key"],
                                       self.rng.uniform(0.5, WAIT_TIMEOUT_S * 0.6))
                if name == RACE_EVENT:
                    # Its run's event, once the run is seen started, and one no run waits on.
                    nursery.start_soon(self._race, client, data["key"])
                    nursery.start_soon(self._emit, client, GO_EVENT, {"key": f"none{data['key']}"})
                await trio.sleep(self.rng.expovariate(self.args.rate))

    async def _race(self, client: httpx.AsyncClient, key: str) -> None:
        """Start a racer run; once its detail shows a segment holding its lease
        (that activation committed), emit the event its wait matches."""
        started = await self._emit(client, RACE_EVENT, {"key": key})
        if started is None or not started[0]["run_ids"]:
            return
        run_id = started[0]["run_ids"][0]
        race = self.races[run_id] = RaceGo(key)
        deadline = trio.current_time() + RACE_START_S
        while race.seen_seq is None and trio.current_time() < deadline:
            nodes = self.live_nodes()
            if nodes:
                node = nodes[self.rng.randrange(len(nodes))]
                try:
                    resp = await client.get(f"{node.url}/v1/runs/{run_id}")
                    lease = resp.json().get("lease") if resp.status_code == 200 else None
                except (httpx.HTTPError, ValueError):
                    lease = None
                if lease is not None:
                    race.seen_seq = lease["execution_seq"]
                    break
            await trio.sleep(0.02)
        if race.seen_seq is None:
            return
        acked = await self._emit(client, GO_EVENT, {"key": key})
        if acked is not None:
            race.acked_at = acked[1]

    async def _signal_later(self, client: httpx.AsyncClient, key: str, delay: float) -> None:
        await trio.sleep(delay)
        await self._emit(client, SIGNAL_EVENT, {"key": key})

    # faults ------------------------------------------------------------------

    async def inject(self, schedule: list[Fault]) -> None:
        async with httpx.AsyncClient(timeout=10.0) as client, trio.open_nursery() as nursery:
            for fault in schedule:
                await trio.sleep_until(self.t0 + fault.at)
                fault.wall = time.time()
                await getattr(self, "_" + fault.kind.replace("-", "_"))(fault, client, nursery)
                self.faults.append(fault)
                if fault.injected:
                    print(f"  {fault.at:7.2f}s {fault.kind:<13} {fault.target}", flush=True)
                await self.top_up_workers()

    def _victim(self) -> WorkerProc | None:
        running = self.running_workers()
        return running[self.rng.randrange(len(running))] if running else None

    async def _actor_crash(self, fault: Fault, client: httpx.AsyncClient, _: trio.Nursery) -> None:
        nodes = self.live_nodes()
        if not nodes:
            fault.note = "no node up"
            return
        node = nodes[self.rng.randrange(len(nodes))]
        headers = {"Authorization": f"Bearer {self.platform_key}"}
        try:
            actors = (await client.get(node.url + "/v1/chaos/actors", headers=headers)).json()["actors"]
            actor = self.rng.choice(sorted(a["name"] for a in actors))
            resp = await client.post(node.url + "/v1/chaos/crash", json={"actor": actor}, headers=headers)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            fault.note = f"not delivered: {exc!r}"
            return
        fault.target, fault.node = f"{actor} on {node.node_id}", node.key
        if resp.status_code == 202:
            fault.injected = True
            self.crashes[node.key][actor] += 1
        elif resp.status_code == 409:
            fault.note = "actor was restarting"
        else:
            self.violations_during.append(f"chaos crash of {actor}: {resp.status_code} {resp.text[:200]}")

    async def _worker_kill(self, fault: Fault, *_: Any) -> None:
        victim = self._victim()
        if victim is None:
            return
        os.kill(victim.pid, signal.SIGKILL)
        victim.state = "gone"
        LIVE.remove(victim.proc)
        await trio.to_thread.run_sync(victim.proc.wait)
        fault.injected, fault.pid, fault.target = True, victim.pid, f"worker pid {victim.pid}"

    async def _worker_freeze(self, fault: Fault, _: httpx.AsyncClient, nursery: trio.Nursery) -> None:
        victim = self._victim()
        if victim is None:
            return
        os.kill(victim.pid, signal.SIGSTOP)
        victim.state = "frozen"
        held = LEASE_EXPIRY_S + FREEZE_PAST_LEASE_S
        fault.injected, fault.pid = True, victim.pid
        fault.target = f"worker pid {victim.pid} for {held:g}s"

        async def thaw() -> None:
            await trio.sleep(held)
            fault.ended = time.time()  # before SIGCONT: whatever the worker marks comes after
            os.kill(victim.pid, signal.SIGCONT)
            victim.state = "running"

        nursery.start_soon(thaw)

    async def _worker_drain(self, fault: Fault, _: httpx.AsyncClient, nursery: trio.Nursery) -> None:
        victim = self._victim()
        if victim is None:
            return
        os.kill(victim.pid, signal.SIGTERM)
        victim.state = "draining"
        fault.injected, fault.pid, fault.target = True, victim.pid, f"worker pid {victim.pid}"

        async def reap() -> None:
            try:
                code = await trio.to_thread.run_sync(victim.proc.wait, 5.0 + DRAIN_EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                self.violations_during.append(f"drained worker {victim.pid} still running after its drain")
                stop(victim.proc, sig=signal.SIGKILL)
                code = None
            if code not in (0, None):
                self.violations_during.append(f"drained worker {victim.pid} exited {code}")
            victim.state = "gone"
            if victim.proc in LIVE:
                LIVE.remove(victim.proc)

        nursery.start_soon(reap)

    async def _node_kill(self, fault: Fault, client: httpx.AsyncClient, nursery: trio.Nursery) -> None:
        nodes = self.live_nodes()
        if len(nodes) < len(self.nodes):
            fault.note = "a node is already down"
            return
        node = nodes[self.rng.randrange(len(nodes))]
        await self.scrape(client, node)  # its counters die with it
        assert node.proc is not None
        node.ready = False
        os.kill(node.proc.pid, signal.SIGKILL)
        LIVE.remove(node.proc)
        await trio.to_thread.run_sync(node.proc.wait)
        fault.injected, fault.node = True, node.key
        fault.target = f"{node.node_id} pid {node.proc.pid}"

        async def restart() -> None:
            await trio.sleep(NODE_DOWN_S)
            await self._restart_node(node)

        nursery.start_soon(restart)

    # observation ---------------------------------------------------------------

    async def scrape(self, client: httpx.AsyncClient, node: NodeProc) -> None:
        try:
            resp = await client.get(node.url + "/metrics")
        except httpx.HTTPError:
            return
        if resp.status_code == 200:
            self.metrics[node.key] = parse_metrics(resp.text)

    def _note_unexpected_exit(self, node: NodeProc) -> None:
        """A node we did not kill has exited: a violation, noted once per incarnation."""
        if node.ready and node.proc is not None and node.proc.poll() is not None:
            self.violations_during.append(
                f"{node.key} exited by itself with code {node.proc.returncode} (log {node.log.name})"
            )
            node.ready = False

    async def scrape_forever(self) -> None:
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                for node in self.nodes:
                    self._note_unexpected_exit(node)
                for node in self.live_nodes():
                    await self.scrape(client, node)
                await trio.sleep(0.5)

    async def quiesce(self) -> list[str]:
        """Thaw and restart what the faults left down; wait until no run is left
        unended. Returns the ids of runs still unended at the timeout."""
        for worker in self.workers:
            if worker.state == "frozen":
                os.kill(worker.pid, signal.SIGCONT)
                worker.state = "running"
        for node in self.nodes:
            if not node.up():
                self._note_unexpected_exit(node)
                await self._restart_node(node)
        await self.top_up_workers()
        from ironflow.protocol import TERMINAL_RUN_STATUSES
        from ironflow.store import open_store

        deadline = trio.current_time() + QUIESCE_TIMEOUT_S
        unended: list[str] = []
        # Every run's status from one read (one snapshot): a listing per
        # status in turn misses a run that moves from a status not yet
        # listed to one already listed between two requests (a wait that
        # timed out, resumed: waiting → running), and it was then reported
        # unended though nothing was wrong.
        store = open_store(self.db_url)
        await store.open()
        try:
            while trio.current_time() < deadline:
                runs = await store.list_runs(limit=10**9)
                unended = [r.id for r in runs if r.status not in TERMINAL_RUN_STATUSES]
                if not unended:
                    break
                await trio.sleep(0.5)
        finally:
            await store.close()
        async with httpx.AsyncClient(timeout=10.0, headers={"Authorization": f"Bearer {self.platform_key}"}) as client:
            for node in self.nodes:
                await self.scrape(client, node)
        return unended


# ── the checks ───────────────────────────────────────────────────────────────


@dataclass
class Check:
    name: str
    violations: list[str] = field(default_factory=list)
    detail: str = ""


@dataclass
class Mark:
    t: float
    pid: int
    run_id: str
    step: str
    phase: str  # start | done | raise


@dataclass
class Evidence:
    """What the checks read once the runs ended: the store's records and the marks."""

    chaos: Chaos
    unended: list[str]
    events: list[Any]
    runs: list[Any]
    details: dict[str, Any]  # run id → RunDetail
    audits: dict[str, list[Any]]  # run id → its audit trail, oldest first
    marks: list[Mark]

    def trail(self, run_id: str, kind: str) -> list[Any]:
        return [a for a in self.audits[run_id] if a.type == kind]


def read_marks(path: Path) -> list[Mark]:
    marks = []
    for line in path.read_text().splitlines():
        t, pid, run_id, step, phase = line.split()
        marks.append(Mark(float(t), int(pid), run_id, step, phase))
    return marks


async def read_evidence(chaos: Chaos, unended: list[str]) -> Evidence:
    """Every event, run, run detail and audit trail, through the store's own reads."""
    from ironflow.store import open_store

    store = open_store(chaos.db_url)
    await store.open()
    try:
        events = await store.list_events(limit=10**9)
        runs = await store.list_runs(limit=10**9)
        details = {r.id: await store.get_run(r.id) for r in runs}
        audits = {r.id: await store.list_audit(run_id=r.id, limit=10**9) for r in runs}
    finally:
        await store.close()
    return Evidence(chaos, unended, events, runs, details, audits, read_marks(chaos.marks))


def check_events(ev: Evidence) -> Check:
    c = Check("events have their runs")
    stored = {e.id: e for e in ev.events}
    run_ids = {r.id for r in ev.runs}
    owned: set[str] = set()
    for key, (event_id, name) in ev.chaos.emitted.items():
        event = stored.get(event_id)
        if event is None:
            c.violations.append(f"event {event_id} ({key}) acknowledged but not stored")
            continue
        want = 0 if name in (SIGNAL_EVENT, GO_EVENT) else 1
        if len(event.run_ids) != want:
            c.violations.append(f"event {event_id} {name} has {len(event.run_ids)} runs, expected {want}")
        for run_id in event.run_ids:
            owned.add(run_id)
            if run_id not in run_ids:
                c.violations.append(f"event {event_id} names run {run_id}, which does not exist")
    children = {r.id for r in ev.runs if r.parent_run_id is not None}
    for run in ev.runs:
        if run.id not in owned and run.id not in children:
            c.violations.append(f"run {run.id} ({run.function_id}) belongs to no emitted event")
    c.detail = (f"{len(ev.chaos.emitted)} events acknowledged ({len(ev.chaos.emit_failures)} emits "
                f"given up), {len(owned)} runs + {len(children)} invoked")
    return c


def check_runs_ended(ev: Evidence) -> Check:
    c = Check("runs ended")
    for run_id in ev.unended:
        c.violations.append(f"run {run_id} had not ended {QUIESCE_TIMEOUT_S:g}s after the load stopped")
    exhausted = {r.id for r in ev.runs if r.error is not None and r.error.code == RECOVERY_EXHAUSTED}
    for run in ev.runs:
        if run.status == "completed" or run.id in ev.unended or run.id in exhausted:
            continue  # the ceiling itself is checked against the audit trail
        if run.status == "failed" and any(r.parent_run_id == run.id for r in ev.runs if r.id in exhausted):
            continue  # its invoked child hit the ceiling
        error = f"{run.error.code}: {run.error.message}" if run.error else ""
        c.violations.append(f"run {run.id} ({run.function_id}) {run.status} {error}")
    c.detail = ", ".join(f"{n} {s}" for s, n in sorted(Counter(r.status for r in ev.runs).items()))
    return c


def check_steps_recorded_once(ev: Evidence) -> Check:
    c = Check("steps recorded exactly once")
    finished_by: dict[tuple[str, str], set[int]] = defaultdict(set)
    for m in ev.marks:
        if m.phase == "done":
            finished_by[(m.run_id, m.step)].add(m.pid)
    recorded = 0
    for run in ev.runs:
        if run.status != "completed":
            continue
        steps = {s.name: s for s in ev.details[run.id].steps}
        expected = EXPECTED_STEPS.get(run.function_id, {})
        kinds = {name: s.kind for name, s in steps.items()}
        if kinds != expected:
            c.violations.append(f"run {run.id} ({run.function_id}) recorded steps {kinds}, expected {expected}")
            continue
        audited = Counter(a.data.get("name") for a in ev.trail(run.id, "step.completed"))
        for name, step in steps.items():
            if step.kind != "run":
                continue
            recorded += 1
            if audited[name] != 1:
                c.violations.append(f"step {run.id}/{name} recorded {audited[name]} times (step.completed audits)")
            pid = step.output.get("pid") if isinstance(step.output, dict) else None
            if pid not in finished_by[(run.id, name)]:
                c.violations.append(f"step {run.id}/{name} output {step.output} matches no finished execution")
    c.detail = f"{recorded} step results of completed runs"
    return c


def check_bodies_run_twice(ev: Evidence) -> Check:
    c = Check("step bodies run twice")
    starts: dict[tuple[str, str], list[Mark]] = defaultdict(list)
    for m in ev.marks:
        if m.phase == "start":
            starts[(m.run_id, m.step)].append(m)
    faults = [f for f in ev.chaos.faults if f.injected]
    worker_node = {w.pid: w.node for w in ev.chaos.workers}
    causes: Counter[str] = Counter()
    for (run_id, step), executions in starts.items():
        executions.sort(key=lambda m: m.t)
        for first, again in zip(executions, executions[1:], strict=False):
            cause = _in_flight_fault(first, again, faults, worker_node)
            if cause is None:
                c.violations.append(
                    f"{run_id}/{step} ran again at {again.t:.3f} (pid {again.pid}) after pid "
                    f"{first.pid} started it at {first.t:.3f}, with no fault in between to explain it"
                )
            else:
                causes[cause] += 1
    c.detail = f"{sum(causes.values())}, each explained: " + (
        "; ".join(f"{n}× {cause}" for cause, n in causes.most_common()) or "none"
    )
    return c


def check_fenced_writes(ev: Evidence) -> Check:
    c = Check("fenced writes accepted")
    slack = PG_CLOCK_SLACK_S if ev.chaos.args.backend == "postgres" else 0.0
    for run in ev.runs:
        fenced_at = {a.data["execution_seq"]: a.at for a in ev.trail(run.id, "capacity.lease.expired")}
        for step in ev.details[run.id].steps:
            at = fenced_at.get(step.execution_seq)
            if step.kind == "run" and at is not None and step.created_at > at + slack:
                c.violations.append(
                    f"step {run.id}/{step.name} recorded at {step.created_at:.3f} from seq "
                    f"{step.execution_seq}, fenced at {at:.3f}"
                )
        if run.status == "completed" and run.current_execution_seq in fenced_at:
            c.violations.append(f"run {run.id} completed by seq {run.current_execution_seq}, which was fenced")
    refused = sum(m.get(("ironflow_stale_messages_total", ""), 0.0) for m in ev.chaos.metrics.values())
    c.detail = f"0 expected; the nodes refused {refused:.0f} stale messages"
    return c


def check_counters_against_audit(ev: Evidence) -> Check:
    c = Check("attempts and recoveries vs audit")
    recoveries = 0
    for run in ev.runs:
        if run.id in ev.unended:
            continue
        expired = ev.trail(run.id, "capacity.lease.expired")
        recovered = ev.trail(run.id, "capacity.segment.recovered")
        nacked = ev.trail(run.id, "capacity.job.nacked")
        parks = [s for s in ev.details[run.id].steps if s.kind in PARK_KINDS]
        resumed = [s for s in parks if s.status not in ("sleeping", "waiting", "waking")]
        recoveries += len(recovered)
        if run.current_execution_seq != 1 + len(expired) + len(nacked) + (run.attempt - 1) + len(resumed):
            c.violations.append(
                f"run {run.id}: execution_seq {run.current_execution_seq}, but the trail accounts for "
                f"1 + {len(expired)} lease losses + {len(nacked)} nacks + {run.attempt - 1} retries "
                f"+ {len(resumed)} resumes"
            )
        # A park resets recovery_count; at the ceiling it stays at the count the audit says.
        last_park = max((s.execution_seq for s in parks), default=0)
        at_ceiling = [a for a in expired if a.data.get("ceiling_reached")]
        want = (at_ceiling[-1].data["recovery_count"] if at_ceiling
                else sum(1 for a in recovered if a.data["old_execution_seq"] > last_park))
        if run.recovery_count != want:
            c.violations.append(f"run {run.id}: recovery_count {run.recovery_count}, audit trail says {want}")
        if run.status == "completed" and run.attempt != EXPECTED_ATTEMPTS.get(run.function_id, 1):
            c.violations.append(
                f"run {run.id} ({run.function_id}) took {run.attempt} attempts, expected "
                f"{EXPECTED_ATTEMPTS.get(run.function_id, 1)}"
            )
    c.detail = f"{recoveries} recoveries, {len(ev.runs)} runs"
    return c


def check_waits_resolved(ev: Evidence) -> Check:
    """--waits: each racer's event, acknowledged after the segment that parked
    its wait was seen holding its lease and before the wait's timeout, resolved
    that wait (and no other event did)."""
    c = Check("waits resolved by their event")
    slack = PG_CLOCK_SLACK_S if ev.chaos.args.backend == "postgres" else 0.0
    judged, later, unsent = 0, 0, 0
    for run_id, race in ev.chaos.races.items():
        if race.acked_at is None:
            unsent += 1
            continue
        wait = next((s for s in ev.details[run_id].steps if s.name == "go"), None) if run_id in ev.details else None
        if wait is None or wait.execution_seq != race.seen_seq:
            later += 1  # parked by a later segment (a fault hit the one seen), or never
            continue
        if race.acked_at >= wait.created_at + RACE_WAIT_TIMEOUT_S - slack:
            later += 1
            continue
        judged += 1
        data = wait.output.get("data") if isinstance(wait.output, dict) else None
        if wait.status != "completed" or not isinstance(data, dict) or data.get("key") != race.key:
            c.violations.append(
                f"run {run_id}: its wait (seq {wait.execution_seq}) is {wait.status} with"
                f" {wait.output}, though the event of key {race.key} was acknowledged at"
                f" {race.acked_at:.3f}, after that segment was seen started"
            )
    c.detail = (f"{judged} waits judged, {later} parked by a later segment or past their timeout, "
                f"{unsent} events not sent (run never seen started)")
    return c


def check_nodes(ev: Evidence) -> list[Check]:
    chaos = ev.chaos
    alive = Check("nodes alive")
    alive.violations = [f"{n.node_id} is not running" for n in chaos.nodes if not n.up()]
    alive.detail = ", ".join(
        f"{n.node_id} pid {n.proc.pid if n.proc else '-'} ({n.incarnation} starts)" for n in chaos.nodes
    )
    restarts = Check("actor restarts")
    per_actor: Counter[str] = Counter()
    for key, sample in chaos.metrics.items():
        for (name, labels), value in sample.items():
            if name != "ironflow_actor_restarts_total":
                continue
            actor = labels.split('"')[1]
            per_actor[actor] += int(value)
            if int(value) != chaos.crashes[key][actor]:
                restarts.violations.append(
                    f"{key}: {actor} restarted {int(value)} times, {chaos.crashes[key][actor]} crashes injected"
                )
    restarts.detail = ", ".join(f"{a} {n}" for a, n in sorted(per_actor.items())) or "none"
    rss = Check("node RSS")
    rss.detail = ", ".join(
        f"{n.node_id} {(n.rss_start_kib or 0) / 1024:.0f} MB → "
        f"{((rss_kib(n.proc.pid) if n.proc else None) or 0) / 1024:.0f} MB"
        for n in chaos.nodes
    )
    during = Check("during the run")
    during.violations = list(chaos.violations_during)
    during.detail = "emits, crash requests, worker starts and drains, node exits"
    return [alive, restarts, rss, during]


def check_all(ev: Evidence) -> list[Check]:
    return [
        check_events(ev),
        check_runs_ended(ev),
        check_steps_recorded_once(ev),
        check_bodies_run_twice(ev),
        check_fenced_writes(ev),
        check_counters_against_audit(ev),
        *([check_waits_resolved(ev)] if ev.chaos.args.waits else []),
        *check_nodes(ev),
    ]


def _in_flight_fault(first: Mark, again: Mark, faults: list[Fault], worker_node: dict[int, Any]) -> str | None:
    """Why a step body ran again, if a fault explains it: the fault hit ``first``'s
    execution before ``again`` (its worker killed or frozen, its node killed), or
    either is a stale assignment that reached a frozen worker, run the moment it
    was thawed (the engine refuses what it reports)."""
    node = worker_node.get(first.pid)
    for f in faults:
        for m in (first, again):
            if f.kind == "worker-freeze" and f.pid == m.pid and f.ended <= m.t <= f.ended + THAW_BACKLOG_S:
                return "run by a thawed worker on a stale fence"
        if f.wall > again.t or f.kind not in IN_FLIGHT_FAULTS:
            continue
        if f.pid == first.pid and f.wall >= first.t:
            return f"in flight at a {f.kind}"
        # The worker learns its job's fence is stale only from the restarted node.
        if (f.kind == "node-kill" and node is not None and f.node is not None
                and f.node.startswith(node.node_id + "#") and f.wall >= first.t - NODE_KILL_REACH_S):
            return "in flight at a node-kill of its node"
    return None


# ── report ───────────────────────────────────────────────────────────────────


def report(chaos: Chaos, checks: list[Check], schedule: list[Fault], seconds: float) -> dict[str, Any]:
    args = chaos.args
    injected = Counter(f.kind for f in chaos.faults if f.injected)
    skipped = Counter(f.kind for f in chaos.faults if not f.injected)
    violations = sum(len(c.violations) for c in checks)
    print()
    print(f"chaos: {args.backend}, seed {args.seed}, {seconds:g} s, {args.workers} workers, "
          f"~{args.rate:g} events/s; {len(schedule)} faults scheduled")
    print("faults injected: " + ", ".join(f"{k} {injected[k]}" for k in sorted(set(schedule_kinds(args)))) +
          (f" (not delivered: {', '.join(f'{k} {n}' for k, n in sorted(skipped.items()))})" if skipped else ""))
    width = max(len(c.name) for c in checks)
    print(f"{'check':<{width}}  result  detail")
    for c in checks:
        result = "ok" if not c.violations else f"FAIL {len(c.violations)}"
        if c.name == "node RSS":
            result = "-"
        print(f"{c.name:<{width}}  {result:<6}  {c.detail}")
        for v in c.violations[:20]:
            print(f"{'':<{width}}          ! {v}")
        if len(c.violations) > 20:
            print(f"{'':<{width}}          ! … {len(c.violations) - 20} more")
    print(f"violations: {violations}")
    return {
        "backend": args.backend,
        "seed": args.seed,
        "seconds": seconds,
        "workers": args.workers,
        "faults_scheduled": len(schedule),
        "faults_injected": dict(injected),
        "faults_not_delivered": dict(skipped),
        "events": len(chaos.emitted),
        "races": len(chaos.races),
        "faults": [
            {"at": f.at, "kind": f.kind, "injected": f.injected, "wall": f.wall, "ended": f.ended,
             "pid": f.pid, "node": f.node, "target": f.target, "note": f.note}
            for f in chaos.faults
        ],
        "checks": {c.name: {"violations": c.violations, "detail": c.detail} for c in checks},
        "violations": violations,
    }


def schedule_kinds(args: argparse.Namespace) -> list[str]:
    return PG_FAULT_KINDS if args.backend == "postgres" else FAULT_KINDS


async def run(args: argparse.Namespace, seconds: float) -> int:
    chaos = Chaos(args)
    schedule = draw_schedule(chaos.rng, seconds, schedule_kinds(args))
    print(f"chaos: seed {args.seed}; schedule: " +
          ", ".join(f"{f.at:.1f}s {f.kind}" for f in schedule), flush=True)
    print(f"chaos: working in {chaos.tmp} (node and worker logs, marks)", flush=True)
    try:
        await chaos.start()
        chaos.t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(chaos.scrape_forever)
            async with trio.open_nursery() as timed:
                timed.start_soon(chaos.load, chaos.t0 + seconds)
                timed.start_soon(chaos.inject, schedule)
            print("chaos: load and faults stopped; waiting for every run to end", flush=True)
            unended = await chaos.quiesce()
            nursery.cancel_scope.cancel()
        checks = check_all(await read_evidence(chaos, unended))
        figures = report(chaos, checks, schedule, seconds)
        if args.report:
            Path(args.report).write_text(json.dumps(figures, indent=2))
        return 1 if figures["violations"] else 0
    finally:
        for w in chaos.workers:
            if w.state == "frozen":
                os.kill(w.pid, signal.SIGCONT)
        if args.keep:
            print(f"chaos: kept {chaos.tmp}")
            from children import TEMPS

            TEMPS.remove(str(chaos.tmp))
        cleanup_all()
        if chaos.pg is not None:
            chaos.pg.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--marks", help=argparse.SUPPRESS)
    ap.add_argument("--max-jobs", type=int, default=8, help="each worker's max_concurrent_jobs")
    length = ap.add_mutually_exclusive_group()
    length.add_argument("--seconds", type=float, help="how long the faults and the load last")
    length.add_argument("--minutes", type=float, help="the same, in minutes (default 0.5)")
    ap.add_argument("--seed", type=int, default=None, help="draws the fault schedule (default: random, printed)")
    ap.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    ap.add_argument("--workers", type=int, default=3, help="worker processes kept running")
    ap.add_argument("--rate", type=float, default=4.0, help="events emitted per second (mean)")
    ap.add_argument("--waits", action="store_true",
                    help="add the wait workload and check every such wait is resolved")
    ap.add_argument("--report", help="write the figures as JSON to this file")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs, marks, SQLite file)")
    args = ap.parse_args()
    if args.worker:
        worker_main(args.worker, args.marks, args.max_jobs)
        return
    if args.seed is None:
        args.seed = random.randrange(10**6)
    seconds = args.seconds if args.seconds is not None else 60 * (args.minutes or 0.5)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(trio.run(run, args, seconds))


if __name__ == "__main__":
    main()
