"""The session supervisor: one per connected streaming worker.

It turns the worker's frames into store calls and answers on the worker's
outbox. Messages of different jobs are handled concurrently (their store
calls share a group commit); messages of one job are handled strictly in the
order they arrived, so a step result is never overtaken by its job's final
result. A stale fence is refused for that job only; the connection carries on.

When the socket closes without a drain, the worker is known dead at once: its
leases are fenced and recovered immediately (beyond the seed; lease expiry
stays the backstop for what no socket reports).

:func:`handle` is shared with the pull-worker HTTP endpoints.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Literal

import msgspec
import outcome
import trio

from actors.directory import LocalSession, SessionDirectory
from actors.grouped import Grouped
from actors.handout import BATCH, hand_out_or_expire
from actors.messages import Kick, kick
from actors.recovered import note_recovered
from ironflow import logs, tracing
from ironflow.config import Limits, NodeConfig
from ironflow.definitions import DefinitionRefused, compile_definition
from ironflow.engine import metrics
from ironflow.flow_rules import dispatch_flow_problem, flow_problem
from ironflow.protocol import (
    EngineMessage,
    ErrorInfo,
    FencedMessage,
    Heartbeat,
    JobAck,
    JobCompleted,
    JobFailed,
    JobNack,
    JobYielded,
    LeaseStatus,
    Refused,
    Register,
    Registered,
    StepCompleted,
    StepFailed,
    WorkerMessage,
)
from ironflow.protocol.cron import shortest_interval_s, trigger_problem
from ironflow.store import (
    Fence,
    JobOutcome,
    LimitExceeded,
    Reservation,
    RunRecord,
    SessionInfo,
    SessionNotFound,
    StaleExecution,
    StepResult,
    Store,
    StoreUnavailable,
)

log = logging.getLogger("ironflow.session")


class ProtocolViolation(Exception):
    """The worker broke the protocol (e.g. no Register first); the socket is closed."""


class SessionExpired(Exception):
    """The store no longer knows this session; the worker must reconnect."""


class RegistrationRefused(Exception):
    """A Register that the node's limits refuse; the message says which and why."""

    code = "REGISTRATION_REFUSED"


def check_register(msg: Register, limits: Limits) -> None:
    """Refuse a registration that exceeds the node's limits or repeats a function id.

    Raises:
      RegistrationRefused: naming the limit, the value asked for and the setting
        that raises it.
    """
    if msg.max_concurrent_jobs > limits.max_slots_per_session:
        raise RegistrationRefused(
            f"max_concurrent_jobs={msg.max_concurrent_jobs} exceeds this node's limit of "
            f"{limits.max_slots_per_session} (limits.max_slots_per_session)"
        )
    if len(msg.functions) > limits.max_functions_per_worker:
        raise RegistrationRefused(
            f"{len(msg.functions)} functions exceed this node's limit of "
            f"{limits.max_functions_per_worker} per worker (limits.max_functions_per_worker)"
        )
    seen: set[str] = set()
    for fd in msg.functions:
        if fd.id in seen:
            raise RegistrationRefused(f"function id {fd.id!r} is registered twice")
        seen.add(fd.id)
        # Cron triggers and the one-of event/cron rule (ironflow/protocol/cron.py).
        for i, trigger in enumerate(fd.triggers):
            problem = trigger_problem(trigger)
            if problem is not None:
                raise RegistrationRefused(f"function {fd.id!r}: {problem} - at `$.triggers[{i}]`")
            if trigger.cron is not None:
                every = shortest_interval_s(trigger.cron)
                if every < limits.cron_min_interval_s:
                    raise RegistrationRefused(
                        f"function {fd.id!r}: cron {trigger.cron!r} fires as often as every {every:g} s,"
                        f" more often than this node's limit of one tick per {limits.cron_min_interval_s:g} s"
                        f" (limits.cron_min_interval_s) - at `$.triggers[{i}]`"
                    )
        # Trigger filters, key and cancel-on expressions compile (docs/triggers.md).
        try:
            compile_definition(fd)
        except DefinitionRefused as exc:
            raise RegistrationRefused(str(exc)) from None
        # Flow control, dispatch side : keys and priority compile, one keyed constraint.
        problem = dispatch_flow_problem(fd)
        if problem is not None:
            raise RegistrationRefused(f"function {fd.id!r}: {problem}")
        problem = flow_problem(fd)  # ingest-side flow control (ironflow/flow_rules.py)
        if problem is not None:
            raise RegistrationRefused(f"function {fd.id!r}: {problem}")


async def register(
    store: Store, config: NodeConfig, node_id: str, msg: Register, mode: Literal["stream", "pull"]
) -> SessionInfo:
    """Check ``msg`` against the limits and create its session in the store.

    Raises:
      RegistrationRefused: a limit is exceeded (nothing was written).
    """
    check_register(msg, config.limits)
    try:
        return await store.register_worker(
            node_id=node_id,
            worker_id=msg.worker_id,
            mode=mode,
            max_concurrent_jobs=msg.max_concurrent_jobs,
            functions=msg.functions,
            session_expiry_s=config.timings.session_expiry_s,
            hostname=msg.hostname,
            max_functions_per_trigger=config.limits.max_functions_per_trigger,
        )
    except LimitExceeded as exc:
        raise RegistrationRefused(str(exc)) from exc


def _fence(session_id: str, msg: FencedMessage) -> Fence:
    return Fence(session_id, msg.run_id, msg.execution_seq, msg.lease_token)


async def handle(
    store: Store,
    config: NodeConfig,
    session_id: str,
    msg: WorkerMessage,
    kicks: trio.MemorySendChannel[Kick],
) -> EngineMessage | None:
    """Apply one worker message to the store; return the answer to send, if any.

    Raises:
      StaleExecution: the message's fence is not the live one (caller refuses
        it for that job only).
      SessionNotFound: the session expired or was closed.
      ProtocolViolation: a message that makes no sense here (a second Register).
    """
    t = config.timings
    if isinstance(msg, Heartbeat):
        statuses = await store.heartbeat(
            session_id, msg.jobs, session_expiry_s=t.session_expiry_s, lease_expiry_s=t.lease_expiry_s
        )
        kick(kicks, "heartbeat")  # a held-back credit may have been released
        return LeaseStatus(statuses)
    if isinstance(msg, JobAck):
        await store.activate_lease(_fence(session_id, msg), lease_expiry_s=t.lease_expiry_s)
        return None
    if isinstance(msg, StepCompleted | StepFailed):
        await handle_steps(store.record_steps, session_id, [msg])
        return None
    if isinstance(msg, JobCompleted):
        completed(await store.complete_job(_fence(session_id, msg), msg.output))
        kick(kicks, "job completed")  # a credit is free
        return None
    if isinstance(msg, JobFailed):
        outcome = await store.fail_job(_fence(session_id, msg), msg.error)
        if outcome.status in ("failed", "cancelled"):  # cancelled: after a cancel's undos
            metrics.run_ended(outcome.status, outcome.function_id, outcome.duration_s)
            logs.event(log, logging.INFO, f"run: {outcome.status}", run_id=msg.run_id, code=msg.error.code)
        elif outcome.compensating:
            logs.event(
                log, logging.INFO, "run: failed, compensating", run_id=msg.run_id,
                code=msg.error.code, execution_seq=outcome.next_execution_seq,
            )
        else:
            logs.event(
                log,
                logging.INFO,
                "run: attempt failed, retry queued",
                run_id=msg.run_id,
                attempt=outcome.attempt,
                execution_seq=outcome.next_execution_seq,
                eligible_at=outcome.eligible_at,
            )
        kick(kicks, "job failed")
        return None
    if isinstance(msg, JobYielded):
        await store.yield_job(
            _fence(session_id, msg), step_id=msg.step_id, name=msg.name, info=msg.yield_info
        )
        kick(kicks, "job yielded")
        return None
    if isinstance(msg, JobNack):
        outcome = await store.nack_job(_fence(session_id, msg), msg.reason)
        metrics.NACKS.labels(reason=msg.reason).inc()
        logs.event(
            log,
            logging.INFO,
            "capacity: job nacked, re-queued with no attempt used",
            run_id=msg.run_id,
            reason=msg.reason,
            session_id=session_id,
            execution_seq=outcome.next_execution_seq,
        )
        kick(kicks, "job nacked")
        return None
    raise ProtocolViolation(f"unexpected message {type(msg).__name__} after Register")


def completed(outcome_: JobOutcome) -> None:
    """A JobCompleted applied: count the run's end."""
    metrics.run_ended("completed", outcome_.function_id, outcome_.duration_s)


async def handle_steps(
    record: Callable[[Fence, list[StepResult]], Awaitable[None]],
    session_id: str,
    msgs: list[StepCompleted | StepFailed],
) -> None:
    """Several step results of one segment (one fence), recorded together by
    ``record`` (:meth:`Store.record_steps`, or the session's step group).
    Raises StaleExecution for all of them."""
    received = time.perf_counter()
    await record(_fence(session_id, msgs[0]), step_results(msgs))
    steps_recorded(msgs, received)


def step_results(msgs: list[StepCompleted | StepFailed]) -> list[StepResult]:
    return [
        StepResult(
            m.step_id,
            m.name,
            "completed" if isinstance(m, StepCompleted) else "failed",
            m.output if isinstance(m, StepCompleted) else None,
            m.error if isinstance(m, StepFailed) else None,
            m.duration_ms,
        )
        for m in msgs
    ]


# ironflow_steps_total's label values
_COMPLETED, _FAILED = ("completed",), ("failed",)


def steps_recorded(msgs: list[StepCompleted | StepFailed], received: float) -> None:
    """Step results committed: count them, time report → commit from ``received``."""
    elapsed = time.perf_counter() - received
    for m in msgs:
        metrics.STEP_COMMIT.observe(elapsed)
        metrics.STEPS_RECORDED.inc(labels=_COMPLETED if isinstance(m, StepCompleted) else _FAILED)


def _units(msgs: list[WorkerMessage]) -> list[list[WorkerMessage]]:
    """A run's messages in order, with consecutive step results under one fence
    made one unit (recorded together); every other message is a unit alone."""
    units: list[list[WorkerMessage]] = []
    for msg in msgs:
        if isinstance(msg, StepCompleted | StepFailed) and units:
            last = units[-1][-1]
            if isinstance(last, StepCompleted | StepFailed) and (
                last.execution_seq, last.lease_token
            ) == (msg.execution_seq, msg.lease_token):
                units[-1].append(msg)
                continue
        units.append([msg])
    return units


def _last_steps_and_result(steps: list[WorkerMessage], result: list[WorkerMessage]) -> bool:
    """Units ``steps`` (step results) then ``result`` (a JobCompleted) of one segment."""
    last = result[0]
    return (
        isinstance(steps[0], StepCompleted | StepFailed)
        and isinstance(last, JobCompleted)
        and (steps[0].execution_seq, steps[0].lease_token) == (last.execution_seq, last.lease_token)
    )


def _acked_segment(units: list[list[WorkerMessage]]) -> bool:
    """Units [JobAck], optionally [step results], then [JobCompleted], all of
    one segment (one execution and lease token)."""
    if len(units) not in (2, 3) or not isinstance(units[0][0], JobAck):
        return False
    ack, last = units[0][0], units[-1][0]
    if not isinstance(last, JobCompleted) or len(units[-1]) != 1:
        return False
    if len(units) == 3 and not _last_steps_and_result(units[1], units[2]):
        return False
    return (ack.run_id, ack.execution_seq, ack.lease_token) == (
        last.run_id, last.execution_seq, last.lease_token
    )


def _run_key(msg: WorkerMessage) -> str:
    """Messages of one run are serialised; everything else may run concurrently."""
    run_id = getattr(msg, "run_id", None)
    return run_id if run_id is not None else f"~{type(msg).__name__}"


# Most worker messages one session handles at once; beyond it the session
# stops reading its socket (backpressure) until some are done.
IN_FLIGHT_MAX = 512
# Most messages of one run applied as one chain (one group commit, in order).
CHAIN_MAX = 64
# What ends a segment: a held ack (``Timings.ack_hold_s``) waits for no more
# than one of these.
_SEGMENT_ENDS = (JobCompleted, JobFailed, JobYielded, JobNack)


RUN_STATE_TOO_LARGE = "RUN_STATE_TOO_LARGE"
# What the run state budget counts (a step's output) or forgets (a segment's end).
_STATE_COUNTED = (StepCompleted, *_SEGMENT_ENDS)
_measure = msgspec.json.Encoder().encode


class RunStateBudget:
    """One session's jobs' run state, counted against ``limit``
    (``limits.max_run_state_bytes``): the step outputs stored before a job's
    segment (:attr:`SessionDirectory.state_before`, read when it was
    reserved) and those the session received since. The step result that
    crosses it is applied as that step's failure and the job's, not retried
    (RUN_STATE_TOO_LARGE), and the worker is told to stop the job; what the
    job still sends is refused by the fence, for that job only."""

    def __init__(self, directory: SessionDirectory, limit: int) -> None:
        self._before = directory.state_before
        self._limit = limit
        self._counted: dict[str, int] = {}  # job id → its run's state so far
        self._over: set[str] = set()  # jobs failed for going past the limit

    def check(self, msg: WorkerMessage, session_id: str) -> list[WorkerMessage]:
        """``msg`` as it is to be applied (itself, or the failures it makes)."""
        if isinstance(msg, StepCompleted):
            job_id = msg.job_id
            if job_id in self._over:
                return [msg]  # after its failure: the fence refuses it
            counted = self._counted.get(job_id)
            if counted is None:
                counted = self._before.pop(job_id, 0)
            total = counted + (len(_measure(msg.output)) if msg.output is not None else 0)
            if total <= self._limit:
                self._counted[job_id] = total
                return [msg]
            self._counted.pop(job_id, None)
            self._over.add(job_id)
            return self._failed(msg, total, session_id)
        if isinstance(msg, _SEGMENT_ENDS):
            self._counted.pop(msg.job_id, None)
            self._over.discard(msg.job_id)
            self._before.pop(msg.job_id, None)
        return [msg]

    def _failed(self, msg: StepCompleted, total: int, session_id: str) -> list[WorkerMessage]:
        error = ErrorInfo(
            f"step {msg.name!r} brings the run's state (its step outputs) to {total:,} bytes,"
            f" over the limit of {self._limit:,} (limits.max_run_state_bytes)",
            code=RUN_STATE_TOO_LARGE,
            retryable=False,
        )
        fence = (msg.job_id, msg.run_id, msg.execution_seq, msg.lease_token)
        logs.event(
            log, logging.WARNING, "run: state over its budget, failed", run_id=msg.run_id,
            execution_seq=msg.execution_seq, session_id=session_id, step=msg.name, bytes=total,
        )
        return [
            StepFailed(*fence, step_id=msg.step_id, name=msg.name, error=error, duration_ms=msg.duration_ms),
            JobFailed(*fence, error=error),
        ]


class _Lanes:
    """One lane per run: a run's messages are handled in the order they arrived,
    different runs' at once, and without waiting for each other. The reader
    goes on reading while earlier messages wait for their commits, so every
    group commit finds the session's next messages already queued (a session
    that handled a batch and only then read the next one had at most one
    group commit in flight).

    Messages of a run that queued up while its lane waited are applied with
    :meth:`Store.in_order`: in order, each its own unit of work; on PostgreSQL
    in one group commit instead of one commit each (a worker sends a run's job
    ack, step results and job result in a burst). Consecutive step results
    of one segment are recorded together (:meth:`Store.record_steps`).

    The first :class:`SessionNotFound` or :class:`ProtocolViolation` a lane
    meets is kept in :attr:`fatal` and cancels ``nursery``: the session ends."""

    def __init__(
        self,
        nursery: trio.Nursery,
        store: Store,
        config: NodeConfig,
        session_id: str,
        outbox: trio.MemorySendChannel[EngineMessage],
        kicks: trio.MemorySendChannel[Kick],
        directory: SessionDirectory,
        traceparents: dict[str, str] | None = None,
    ) -> None:
        self._nursery = nursery
        # Where a completion group hands out what its transaction reserved.
        self._directory = directory
        # Traced runs assigned to this session (LocalSession.traceparents).
        self._traceparents = traceparents if traceparents is not None else {}
        self._store = store
        self._config = config
        self._session_id = session_id
        self._outbox = outbox
        self._kicks = kicks
        self._queues: dict[str, deque[WorkerMessage]] = {}
        # Lanes holding a lone JobAck, woken when their run's next message comes.
        self._woken: dict[str, trio.Event] = {}
        self._flushing = False  # the socket closed: nothing is held any more
        self._ack_hold_s = config.timings.ack_hold_s
        lease_expiry_s = config.timings.lease_expiry_s
        # A lane whose only message is of one of these kinds applies it with
        # other runs' (see actors/grouped.py).
        # Acks commit without waiting for their WAL flush: the session tells
        # the worker nothing when one commits (the SDK started the handler when
        # the JobAck went on the wire; only a refusal is answered), so a
        # PostgreSQL crash that loses one takes back nothing anyone was told —
        # the segment runs again once its reservation expires, as after a late
        # ack (FenceOps.activate_leases, docs/isolation.md).
        self._acks: Grouped[Fence, RunRecord] = Grouped(
            lambda fences: store.activate_leases(
                fences, lease_expiry_s=lease_expiry_s, synchronous_commit=False
            )
        )
        self._steps: Grouped[tuple[Fence, list[StepResult]], None] = Grouped(store.record_steps_many)
        # (fence, output, step results, whether its JobAck came with it).
        self._completions: Grouped[tuple[Fence, Any, list[StepResult], bool], JobOutcome] = Grouped(
            self._complete
        )
        self._room = trio.Semaphore(IN_FLIGHT_MAX)
        self._budget = RunStateBudget(directory, config.limits.max_run_state_bytes)
        self.fatal: Exception | None = None

    async def put(self, msg: WorkerMessage) -> None:
        if isinstance(msg, _STATE_COUNTED):
            applied = self._budget.check(msg, self._session_id)
            if applied[0] is not msg:
                self._directory.send_cancel(self._session_id, msg.job_id, msg.run_id, RUN_STATE_TOO_LARGE)
                for one in applied:
                    await self._put(one)
                return
        await self._put(msg)

    async def _put(self, msg: WorkerMessage) -> None:
        try:
            self._room.acquire_nowait()  # no checkpoint per message while there is room
        except trio.WouldBlock:
            await self._room.acquire()
        key = _run_key(msg)
        queue = self._queues.get(key)
        if queue is not None:
            queue.append(msg)  # its lane is running and takes it in turn
            if isinstance(msg, _SEGMENT_ENDS) or len(queue) >= CHAIN_MAX:
                # A lane holding its ack waits for this, not for every frame.
                woken = self._woken.pop(key, None)
                if woken is not None:
                    woken.set()
            return
        self._queues[key] = deque([msg])
        self._nursery.start_soon(self._lane, key)

    async def _lane(self, key: str) -> None:
        queue = self._queues[key]
        try:
            while queue:
                if self._ack_hold_s and isinstance(queue[0], JobAck) and not self._flushing:
                    await self._hold_ack(key, queue)
                msgs = [queue.popleft() for _ in range(min(len(queue), CHAIN_MAX))]
                try:
                    units = _units(msgs)
                    while units:
                        try:
                            units = await self._apply(units)
                        except StoreUnavailable:
                            # An outage: hold the frames (the socket stays
                            # open; the lane's room stays taken, so a long one
                            # stops the reader) and apply them once it is over,
                            # unless the node stops first.
                            if not await self._outage_over():
                                self._give_up(key, units, queue)
                                return
                finally:
                    for _ in msgs:
                        self._room.release()
        except (SessionNotFound, ProtocolViolation) as exc:
            if self.fatal is None:
                self.fatal = exc
            self._nursery.cancel_scope.cancel()
        finally:
            del self._queues[key]

    async def _outage_over(self) -> bool:
        """Wait out an outage of the store: True once it is back, False if the
        node stops first (``SessionDirectory.stopping``)."""
        stopping = self._directory.stopping
        back = False
        if stopping.is_set():
            return back
        async with trio.open_nursery() as nursery:
            async def store_back() -> None:
                nonlocal back
                await self._store.availability.wait_up()
                back = True
                nursery.cancel_scope.cancel()

            async def node_stops() -> None:
                await stopping.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(store_back)
            nursery.start_soon(node_stops)
        return back

    def _give_up(self, key: str, units: list[list[WorkerMessage]], queue: deque[WorkerMessage]) -> None:
        """The node stops while the store is down: the frames held for this run
        are not applied. Its lease expires in the database and another node
        recovers the segment (the steps those frames reported run again)."""
        held = sum(len(unit) for unit in units) + len(queue)
        for _ in queue:
            self._room.release()
        queue.clear()
        logs.event(
            log,
            logging.WARNING,
            "session: frames not applied, the database is unavailable and the node is stopping",
            session_id=self._session_id,
            run_id=key,
            frames=held,
        )

    async def _hold_ack(self, key: str, queue: deque[WorkerMessage]) -> None:
        """Wait (at most ``Timings.ack_hold_s``) until the held ack's run sent
        what ends its segment, or the socket closed. Also when some of the
        segment's step results came with the ack (read from the socket
        together): applied before the segment's end, the ack and they were
        two commits more, and the result a third behind them in the lane."""
        if len(queue) < CHAIN_MAX:
            for m in queue:  # (a loop, not any(): this runs per run)
                if isinstance(m, _SEGMENT_ENDS):
                    break
            else:
                with trio.move_on_after(self._ack_hold_s):
                    woken = self._woken[key] = trio.Event()
                    await woken.wait()  # set by put() or flush()
        self._woken.pop(key, None)

    def flush(self) -> None:
        """The socket closed: every held ack is applied now (frames read
        before a socket drops are applied before its leases are recovered)."""
        self._flushing = True
        for woken in self._woken.values():
            woken.set()
        self._woken.clear()

    async def _apply(self, units: list[list[WorkerMessage]]) -> list[list[WorkerMessage]]:
        """Apply a run's units in order; return those left to apply (empty once
        all were). Raises StoreUnavailable if none was applied for an outage."""
        if len(units) == 1:
            await self._handle_unit(units[0], grouped=True)
            return []
        if len(units) == 2 and _last_steps_and_result(units[0], units[1]):
            # A segment's last step results and its job's result,
            # sent together: one grouped completion.
            await self._handle_unit(units[0] + units[1], grouped=True)
            return []
        if _acked_segment(units):
            # A whole short segment: its ack, step results and result, one
            # grouped completion that activates the lease first.
            await self._handle_unit([m for unit in units for m in unit], grouped=True)
            return []
        outcomes = await self._store.in_order([partial(self._handle_unit, unit) for unit in units])
        for done, result in enumerate(outcomes):
            try:
                result.unwrap()  # the first fatal error ends the session
            except StoreUnavailable:
                if done == 0:
                    raise
                return units[done:]  # the rest, in order, once the store is back
        return []

    async def _complete(
        self, group: list[tuple[Fence, Any, list[StepResult], bool]]
    ) -> list[outcome.Outcome[JobOutcome]]:
        """A group of job results applied. The credits they free are offered
        again in the same transaction to the local workers that hold jobs
        themselves (:meth:`Store.complete_jobs_and_reserve`; none: no round)
        and what it reserved is handed out before the results are
        acknowledged. The dispatcher is kicked only when that round may have
        left work: it filled a whole batch, or some connected session was not
        offered work in it."""
        t = self._config.timings
        items = [(fence, output, steps) for fence, output, steps, _ in group]
        activate = frozenset(fence.run_id for fence, _, _, acked in group if acked)
        offers = self._directory.holding_offers()
        reservations: list[Reservation] = []
        if offers:
            reserving_ns = time.time_ns()
            results, reservations = await self._store.complete_jobs_and_reserve(
                items, offers=offers, limit=BATCH, reservation_expiry_s=t.reservation_expiry_s,
                activate=activate, lease_expiry_s=t.lease_expiry_s,
            )
            await hand_out_or_expire(self._store, self._directory, reservations, reserving_ns, "completion")
        else:
            results = await self._store.complete_jobs(
                items, activate=activate, lease_expiry_s=t.lease_expiry_s
            )
        if len(reservations) >= BATCH or len(offers) < len(self._directory.offers()):
            kick(self._kicks, "job completed")
        return results

    async def _record_steps(self, fence: Fence, steps: list[StepResult]) -> None:
        await self._steps((fence, steps))

    async def _handle_unit(self, unit: list[WorkerMessage], *, grouped: bool = False) -> None:
        """:meth:`_apply_unit`; a unit that ends its segment (job result, yield,
        nack) in an ``ironflow.commit`` span when its run is traced (a span per
        step result would double the worker's own step spans, at a cost)."""
        run_id: str | None = getattr(unit[0], "run_id", None)
        traceparent = self._traceparents.get(run_id) if run_id is not None else None
        ends = isinstance(unit[-1], JobCompleted | JobFailed | JobYielded | JobNack)
        if run_id is None or traceparent is None or not ends:
            await self._apply_unit(unit, grouped=grouped)
            return
        kinds = ",".join(sorted({type(m).__name__ for m in unit}))
        with tracing.span(
            "ironflow.commit", traceparent, {"ironflow.run_id": run_id, "ironflow.messages": kinds}
        ):
            await self._apply_unit(unit, grouped=grouped)
        self._traceparents.pop(run_id, None)  # its next segment is assigned afresh

    async def _apply_unit(self, unit: list[WorkerMessage], *, grouped: bool = False) -> None:
        """Apply one unit; ``grouped``: an ack, a segment's step results, or a
        job's result (with the step results sent just before it) goes to its
        kind's group with other runs' (not when chained with more of its
        run's messages: a chain is one group commit already)."""
        answers: list[EngineMessage] = []
        first = unit[0]
        try:
            if grouped and len(unit) == 1 and isinstance(first, JobAck) and self._store.group_acks:
                await self._acks(_fence(self._session_id, first))
            elif grouped and isinstance(unit[-1], JobCompleted):
                result = unit[-1]
                steps = [m for m in unit if isinstance(m, StepCompleted | StepFailed)]
                received = time.perf_counter()
                done = await self._completions((
                    _fence(self._session_id, result), result.output, step_results(steps),
                    isinstance(first, JobAck),
                ))
                if steps:
                    steps_recorded(steps, received)
                completed(done)  # its group kicked the dispatcher if need be
            elif grouped and isinstance(first, StepCompleted | StepFailed):
                steps = [m for m in unit if isinstance(m, StepCompleted | StepFailed)]
                await handle_steps(self._record_steps, self._session_id, steps)
            elif len(unit) > 1:
                steps = [m for m in unit if isinstance(m, StepCompleted | StepFailed)]
                await handle_steps(self._store.record_steps, self._session_id, steps)
            else:
                answer = await handle(self._store, self._config, self._session_id, unit[0], self._kicks)
                if answer is not None:
                    answers.append(answer)
        except StaleExecution as exc:
            for msg in unit:
                metrics.STALE_REFUSED.inc()
                run_id = getattr(msg, "run_id", None)
                logs.event(
                    log,
                    logging.INFO,
                    "fence: stale message refused",
                    run_id=run_id,
                    execution_seq=getattr(msg, "execution_seq", None),
                    session_id=self._session_id,
                    msg_type=type(msg).__name__,
                )
                answers.append(
                    Refused(exc.code, str(exc) or "stale execution", getattr(msg, "job_id", None), run_id)
                )
        for answer in answers:
            try:
                await self._outbox.send(answer)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the socket is gone; the store already has the outcome


async def _handle_batch(batch: list[WorkerMessage], lanes: _Lanes) -> None:
    """Hand frames read together to their runs' lanes (waits only for room)."""
    for msg in batch:
        await lanes.put(msg)



async def _stop_watch(directory: SessionDirectory, store: Store, lanes: trio.CancelScope) -> None:
    """When the node stops while the store is down, end the session's lanes:
    a lane waiting on a call the silent database took would otherwise keep the
    node from stopping (``Store.abandon_calls``). With the store up they finish
    as usual."""
    await directory.stopping.wait()
    if not store.availability.up:
        lanes.cancel()

async def run(
    store: Store,
    config: NodeConfig,
    node_id: str,
    directory: SessionDirectory,
    kicks: trio.MemorySendChannel[Kick],
    inbound: trio.MemoryReceiveChannel[WorkerMessage],
    outbox: trio.MemorySendChannel[EngineMessage],
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve one streaming worker until its inbound channel closes.

    Args:
      inbound: decoded frames from the socket; closed when the socket closes.
      outbox: frames to the socket (assignments are also put here by the
        dispatcher through the directory).
    Reports the session id through ``task_status`` once registered.

    Raises ProtocolViolation if the first message is not Register,
    RegistrationRefused if the node's limits refuse it, and SessionExpired if
    the store dropped the session; the caller closes the
    socket either way. The session is always closed in the store on exit, its
    leases recovered at once.
    """
    t = config.timings
    try:
        first = await inbound.receive()
    except trio.EndOfChannel:
        return  # the socket closed before registering: nothing to clean up
    if not isinstance(first, Register):
        raise ProtocolViolation(f"first message must be register, got {type(first).__name__}")
    info = await register(store, config, node_id, first, "stream")
    session_id = info.session_id
    try:
        await outbox.send(
            Registered(
                session_id,
                int(t.heartbeat_interval_s * 1000),
                int(t.lease_expiry_s * 1000),
                batch_frames=True,  # the socket's reader takes batched frames
                max_frame_bytes=config.max_frame_bytes,
            )
        )
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # gone already: the loop below sees the closed inbound and cleans up
    local = LocalSession(
        session_id, frozenset(info.function_ids), outbox, delayed_start=first.delayed_start
    )
    directory.add(local)
    metrics.WORKERS_CONNECTED.inc()
    logs.event(
        log,
        logging.INFO,
        "session: worker registered",
        session_id=session_id,
        worker_id=first.worker_id,
        functions=",".join(info.function_ids),
        max_concurrent_jobs=first.max_concurrent_jobs,
    )
    kick(kicks, "session opened")
    task_status.started(session_id)
    try:
        violation: ProtocolViolation | None = None
        # The lanes' nursery inside a guard whose only task ends them if the
        # node stops while the store is down (see _stop_watch).
        async with trio.open_nursery() as guard:
            async with trio.open_nursery() as nursery:
                lanes = _Lanes(
                    nursery, store, config, session_id, outbox, kicks, directory, local.traceparents
                )
                guard.start_soon(_stop_watch, directory, store, nursery.cancel_scope)
                while True:
                    try:
                        msg = await inbound.receive()
                    except trio.EndOfChannel:
                        lanes.flush()  # held acks are applied now, not after their hold
                        break  # the nursery waits for the messages already read
                    batch = [msg]
                    while True:
                        try:
                            batch.append(inbound.receive_nowait())
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                    if any(isinstance(m, Register) for m in batch):
                        violation = ProtocolViolation("register sent twice on one connection")
                        lanes.flush()
                        break
                    await _handle_batch(batch, lanes)
            guard.cancel_scope.cancel()  # the lanes are done: so is the watch
        if violation is not None:
            raise violation
        if isinstance(lanes.fatal, SessionNotFound):
            raise SessionExpired(str(lanes.fatal)) from lanes.fatal
        if lanes.fatal is not None:
            raise lanes.fatal
    finally:
        directory.remove(session_id, outbox)
        metrics.WORKERS_CONNECTED.dec()
        metrics.WORKER_DISCONNECTS.inc()
        with trio.CancelScope(shield=True):
            try:
                recovered = await store.close_session(
                    session_id,
                    recover_leases=True,
                    recovery_grace_s=t.recovery_grace_s,
                    recovery_ceiling=int(t.recovery_ceiling),
                )
            except StoreUnavailable as exc:
                # Not waited out: the node may be stopping. The session and
                # its leases expire by the database clock once it is back.
                logs.event(
                    log, logging.WARNING,
                    "session: closed during a store outage, its leases expire instead",
                    session_id=session_id, cause=str(exc),
                )
                recovered = []
            for seg in recovered:
                note_recovered(
                    log, seg, path="disconnect",
                    message="capacity: worker lost, segment recovered",
                    exhausted_message="capacity: worker lost, recovery ceiling reached, run failed",
                    fields=dict(
                        execution_seq=seg.new_execution_seq, old_execution_seq=seg.old_execution_seq,
                        session_id=session_id, recovery_count=seg.recovery_count, eligible_at=seg.eligible_at,
                    ),
                )
            logs.event(
                log, logging.INFO, "session: closed", session_id=session_id, recovered=len(recovered)
            )
            kick(kicks, "session closed")
