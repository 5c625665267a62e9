"""A simulated streaming worker: the SDK's protocol behaviour, in virtual time.

It does what ``ironflow.sdk.streaming.StreamingWorker`` does on the wire —
Register, wait for Registered, JobAck before the handler starts (JobNack
DRAINING / AT_CAPACITY instead when it must refuse), step results as they
complete, one final JobCompleted / JobFailed / JobYielded, a Heartbeat with
its active jobs every interval, a job abandoned on LeaseStatus STALE/UNKNOWN,
on Cancel or on a job-scoped Refused, every job abandoned when the
connection is lost, and a drain on Shutdown — with a handler whose steps
come from its event's plan (:func:`tests.sim.schedule.plan_for`) and whose
"work" is virtual time.

Faults the simulator applies to it: crash (its task is cancelled, the
connection cut), freeze (a gate closes: nothing is sent, received or run
until it opens), a late heartbeat, a drain.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING, Any

import trio

from ironflow.protocol import (
    ActiveJob,
    Cancel,
    ErrorInfo,
    FunctionDef,
    Heartbeat,
    JobAck,
    JobAssignment,
    JobCompleted,
    JobFailed,
    JobNack,
    JobYielded,
    LeaseStatus,
    Refused,
    Register,
    Registered,
    Shutdown,
    SleepYield,
    StepCompleted,
    WaitYield,
)
from ironflow.protocol.cron import CRON_EVENT
from tests.sim.net import CLOSE, Connection, decode_engine
from tests.sim.ticks import CRON_FUNCTION, CRON_PLAN

if TYPE_CHECKING:
    from tests.sim.simulator import Simulation

REGISTER_TIMEOUT_S = 10.0
# After a stall the first heartbeat comes this much after the thaw.
STALL_HEARTBEAT_AFTER_S = 0.5
RECONNECT_DELAY_S = 2.0
SIGNAL_EVENT = "signal.k"
# What a race run waits for (its matching and non-matching events: schedule.race_plan).
RACE_EVENT = "race.go"


# Functions whose handler runs no step, whatever their event's plan: they are
# there for their flow control (invariants 13 to 16), and a run of no step
# costs the fewest transactions (their runs still face every fault).
NO_STEPS = frozenset({CRON_FUNCTION, "sim-l", "sim-d", "sim-t"})


def handler_plan(function_id: str, plan: dict[str, Any]) -> dict[str, Any]:
    """What ``function_id``'s handler does for an event of plan ``plan``."""
    return {"k": plan["k"], "durations": []} if function_id in NO_STEPS else plan


def program(plan: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """The handler's steps in order: ``(kind, name, arg)``."""
    durations = plan["durations"]
    sleep, wait = plan.get("sleep"), plan.get("wait")
    items: list[tuple[str, str, Any]] = []
    for i in range(len(durations) + 1):
        if sleep is not None and sleep[0] == i:
            items.append(("sleep", "nap", sleep[1]))
        if wait is not None and wait[0] == i:
            items.append(("wait", "signal", wait[1]))
        if i < len(durations):
            items.append(("run", f"s{i}", durations[i]))
    return items


def step_id(run_id: str, name: str) -> str:
    return f"{run_id}:{name}:0"  # the SDK's form: run, escaped name, repeat counter


class Gate:
    """Open unless the worker is frozen."""

    def __init__(self) -> None:
        self._open = trio.Event()
        self._open.set()

    def close(self) -> None:
        if self._open.is_set():
            self._open = trio.Event()

    def open(self) -> None:
        self._open.set()

    async def wait(self) -> None:
        if self._open.is_set():
            return
        await self._open.wait()


class Job:
    def __init__(self, a: JobAssignment, start_at: float, no: int) -> None:
        self.a = a
        # The worker's count of assignments taken: step outputs name it, as one
        # segment may be assigned twice (same execution_seq, same job id, two
        # lease tokens: its reservation expired before the first ack came), and
        # the oracle tells the two executions' writes apart by their outputs.
        self.no = no
        self.scope = trio.CancelScope()
        self.abandoned = False
        # When the handler may start (virtual time): a held job's delay from receipt.
        self.start_at = start_at

    def abandon(self) -> None:
        self.abandoned = True
        self.scope.cancel()


class SimWorker:
    """One worker process (an incarnation of worker slot ``slot``)."""

    def __init__(
        self,
        sim: Simulation,
        slot: int,
        incarnation: int,
        max_jobs: int,
        functions: list[FunctionDef],
    ) -> None:
        self.sim = sim
        self.slot = slot
        self.name = f"w{slot}.{incarnation}"
        # Even slots hold a job sent ahead of its start time themselves (as the
        # SDK does); odd ones do not say they can, so the node holds it for them.
        self.delayed_start = slot % 2 == 0
        self.max_jobs = max_jobs
        self.functions = functions
        self.gate = Gate()
        self.jobs: dict[str, Job] = {}
        self.assignments = 0
        self.jobs_changed = trio.Event()
        self.draining = False
        self.drain_deadline = math.inf
        self.drain_requested = trio.Event()
        self.heartbeat_late_s = 0.0
        self.last_heartbeat_at = -math.inf  # virtual time of the last Heartbeat sent
        self.heartbeat_not_before = -math.inf  # after a stall (see stall)
        self.conn: Connection | None = None
        self.scope = trio.CancelScope()
        self.exited = trio.Event()
        self.counts: Counter[str] = sim.counts

    # ── control from the simulator ─────────────────────────────────────────

    def crash(self) -> None:
        self.scope.cancel()
        if self.conn is not None:
            self.conn.cut()

    def cut(self) -> None:
        if self.conn is not None:
            self.conn.cut()

    def begin_drain(self, timeout: float) -> None:
        if self.draining:
            return
        self.draining = True
        self.drain_deadline = trio.current_time() + timeout
        self.drain_requested.set()

    def heartbeating(self, free: int = 0) -> bool:
        """Connected, with a heartbeat sent on this connection (and ``free`` slots)."""
        return (
            self.conn is not None
            and self.last_heartbeat_at > -math.inf
            and self.max_jobs - len(self.jobs) >= free
        )

    async def stall(self, session_expiry_s: float, past_expiry_s: float) -> None:
        """Freeze until ``past_expiry_s`` after the session would expire, counted
        from the last heartbeat: a stalled process, whose session expires and
        which then acks what it was assigned meanwhile, in a burst."""
        frozen_s = max(0.0, self.last_heartbeat_at + session_expiry_s + past_expiry_s - trio.current_time())
        # Its heartbeat timer fires at its next tick, after the frames it
        # received meanwhile were handled (not at the very moment it thaws).
        self.heartbeat_not_before = trio.current_time() + frozen_s + STALL_HEARTBEAT_AFTER_S
        await self.freeze(frozen_s)

    async def freeze(self, seconds: float) -> None:
        self.gate.close()
        await trio.sleep(seconds)
        self.gate.open()

    # ── the process ────────────────────────────────────────────────────────

    async def run(self) -> None:
        try:
            with self.scope:
                while True:
                    conn = self.sim.connect(self)
                    if conn is not None:
                        self.conn = conn
                        try:
                            await self._session(conn)
                        finally:
                            self.sim.trace(f"{self.name} disconnected (c{conn.no}, close code {conn.close_code})")
                            self.conn = None
                            conn.cut()
                            for job in self.jobs.values():
                                job.abandon()
                            self.jobs.clear()
                    if self.draining:
                        return
                    await trio.sleep(RECONNECT_DELAY_S)
                    await self.gate.wait()
        finally:
            self.exited.set()

    def _send(self, msg: Any) -> None:
        conn = self.conn
        if conn is not None:
            conn.up.send(msg)

    async def _session(self, conn: Connection) -> None:
        self.last_heartbeat_at = -math.inf
        self._send(Register(worker_id=self.name, functions=self.functions, max_concurrent_jobs=self.max_jobs,
                            delayed_start=self.delayed_start))
        first: Any = None
        with trio.move_on_after(REGISTER_TIMEOUT_S):
            while True:
                text = await self._receive(conn)
                if text is None:
                    return
                first = decode_engine(text)
                if isinstance(first, Registered | Refused):
                    break
                first = None  # anything before Registered (a duplicate, a stray) is ignored
        if not isinstance(first, Registered):
            return  # refused, or no answer in time: drop the connection and reconnect
        interval = first.heartbeat_interval_ms / 1000.0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._heartbeats, interval)
            nursery.start_soon(self._drain_watch, conn)
            await self._receive_loop(conn, nursery)
            nursery.cancel_scope.cancel()

    async def _receive(self, conn: Connection) -> str | None:
        try:
            text = await conn.down.out_recv.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            return None
        await self.gate.wait()
        return None if text == CLOSE else text

    async def _receive_loop(self, conn: Connection, nursery: trio.Nursery) -> None:
        while True:
            text = await self._receive(conn)
            if text is None:
                return
            msg = decode_engine(text)
            if isinstance(msg, JobAssignment):
                self._on_assignment(msg, nursery)
            elif isinstance(msg, LeaseStatus):
                for js in msg.jobs:
                    if js.state in ("STALE", "UNKNOWN"):
                        job = self.jobs.get(js.job_id)
                        if job is not None and job.a.execution_seq == js.execution_seq:
                            job.abandon()
            elif isinstance(msg, Cancel):
                job = self.jobs.get(msg.job_id)
                if job is not None:
                    job.abandon()
            elif isinstance(msg, Refused):
                job = self.jobs.get(msg.job_id) if msg.job_id else None
                if job is not None:
                    job.abandon()
            elif isinstance(msg, Shutdown):
                self.begin_drain(msg.drain_timeout_ms / 1000.0 if msg.drain_timeout_ms > 0 else 5.0)

    def _on_assignment(self, a: JobAssignment, nursery: trio.Nursery) -> None:
        if a.job_id in self.jobs:
            return  # still running here (a duplicated assignment)
        fence = (a.job_id, a.run_id, a.execution_seq, a.lease_token)
        if self.draining:
            self._send(JobNack(*fence, reason="DRAINING"))
            return
        if len(self.jobs) >= self.max_jobs:
            self._send(JobNack(*fence, reason="AT_CAPACITY"))
            return
        delay = a.start_delay_ms / 1000 if self.delayed_start else 0.0
        self.assignments += 1
        job = Job(a, trio.current_time() + delay, self.assignments)
        self.jobs[a.job_id] = job
        self._send(JobAck(*fence))
        nursery.start_soon(self._execute, job)

    async def _heartbeats(self, interval: float) -> None:
        while True:
            late, self.heartbeat_late_s = self.heartbeat_late_s, 0.0
            await trio.sleep(interval + late)
            await self.gate.wait()
            if self.heartbeat_not_before > trio.current_time():
                await trio.sleep_until(self.heartbeat_not_before)
            jobs = [
                _active(j.a) for j in self.jobs.values() if not j.abandoned
            ]
            self._send(Heartbeat(jobs=jobs))
            self.last_heartbeat_at = trio.current_time()

    async def _drain_watch(self, conn: Connection) -> None:
        await self.drain_requested.wait()
        with trio.move_on_at(self.drain_deadline):
            while self.jobs:
                self.jobs_changed = trio.Event()
                await self.jobs_changed.wait()
        if self.jobs:
            for job in list(self.jobs.values()):
                job.abandon()
            conn.cut()  # past the deadline: drop without a handshake
            return
        conn.up.close()  # flushed: half-close, the engine closes its side
        with trio.move_on_at(self.drain_deadline):
            await conn.ended.wait()
        conn.cut()

    # ── the handler ─────────────────────────────────────────────────────────

    def _report(self, job: Job, msg: Any) -> None:
        if not job.abandoned:
            self._send(msg)

    async def _execute(self, job: Job) -> None:
        a = job.a
        fence = (a.job_id, a.run_id, a.execution_seq, a.lease_token)
        # A cron run's event carries its tick, not a plan: CRON_PLAN.
        plan = handler_plan(a.function_id, CRON_PLAN if a.event.name == CRON_EVENT else a.event.data)
        memo = {m.step_id: m for m in a.completed_steps}
        try:
            with job.scope:
                if job.start_at > trio.current_time():
                    # Held until its start time; a drain meanwhile hands it back.
                    with trio.move_on_at(job.start_at):
                        await self.drain_requested.wait()
                    if trio.current_time() < job.start_at:
                        self._report(job, JobNack(*fence, reason="DRAINING"))
                        return
                for kind, name, arg in program(plan):
                    sid = step_id(a.run_id, name)
                    if sid in memo:
                        if kind == "sleep":
                            # The handler is past the sleep: never before its wake time.
                            self.sim.oracle.check_woken(a.run_id, sid, self.name)
                        continue
                    await self.gate.wait()
                    if kind == "sleep":
                        until = self.sim.epoch_now() + float(arg)
                        self._report(job, JobYielded(*fence, step_id=sid, name=name,
                                                     yield_info=SleepYield(until=math.ceil(until * 1000) / 1000)))
                        return
                    if kind == "wait":
                        timeout_at = self.sim.epoch_now() + float(arg)
                        info = WaitYield(event=plan.get("wait_event", SIGNAL_EVENT), timeout_at=timeout_at, match="data.k",
                                         match_value=plan["k"])
                        self._report(job, JobYielded(*fence, step_id=sid, name=name, yield_info=info))
                        return
                    index = int(name[1:])
                    fail = plan.get("fail")
                    if fail is not None and fail["step"] == index and a.attempt in fail["attempts"]:
                        retryable = bool(fail["retryable"])
                        error = ErrorInfo(
                            message=f"planned failure at attempt {a.attempt}",
                            code="SIM_RETRYABLE" if retryable else "SIM_FATAL",
                            retryable=retryable,
                        )
                        self._report(job, JobFailed(*fence, error=error))
                        return
                    self.sim.oracle.check_memo(a.run_id, a.execution_seq, sid)
                    if "race" in plan and index == 0:
                        self.sim.race_started(a.run_id, plan)
                    await trio.sleep(float(arg))  # the step's body, in virtual time
                    self.counts["step_bodies_run"] += 1
                    await self.gate.wait()
                    output = {"i": index, "by": f"{self.name}/{a.execution_seq}#{job.no}"}
                    self._report(job, StepCompleted(*fence, step_id=sid, name=name, output=output))
                self._report(job, JobCompleted(*fence, output={"k": plan["k"], "steps": len(plan["durations"])}))
        finally:
            if self.jobs.get(a.job_id) is job:
                del self.jobs[a.job_id]
            self.jobs_changed.set()


def _active(a: JobAssignment) -> ActiveJob:
    return ActiveJob(job_id=a.job_id, run_id=a.run_id, execution_seq=a.execution_seq, lease_token=a.lease_token)
