"""What the streaming and the pull worker share: their settings, job table, drain, stop, signals.

Seed (graceful-drain.txt): SIGTERM/SIGINT or ``drain()`` puts the worker in
draining at once; running jobs get until the deadline; a second signal stops
at once; ``stop()`` stops at once. "The SDK already handles SIGINT and
SIGTERM. It drains all running workers in the process, then exits."

Signals are handled once per process, not once per worker: a loop delivers a
signal only to the most recently opened receiver (Trio's and asyncio's alike), so a receiver per worker
would drain one worker and leave the others' jobs to be cut. Every running
worker with ``handle_signals`` joins one :class:`_SignalHub` for its event loop;
the hub opens the single receiver (AnyIO's: asyncio's ``add_signal_handler`` or
Trio's receiver) while at least one worker is running. The
hub counts the user's signals, not the workers' states: a drain started by
the engine's ``Shutdown`` or by ``drain()`` keeps its deadline when the first
signal arrives; only a second signal stops every worker at once.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import ExitStack, asynccontextmanager, contextmanager
from typing import Any, Self
from urllib.parse import quote

import anyio
import anyio.lowlevel
import httpx
import msgspec
from anyio.abc import TaskStatus

from ironflow.dbclock import DatabaseClock
from ironflow.logs import formatter as log_formatter
from ironflow.protocol import (
    MAX_FRAME_BYTES,
    JobAssignment,
    JobLeaseStatus,
    JobNack,
    JobNackReason,
    Register,
)
from ironflow.sdk.context import Context, JobState, Reporter, execute_job
from ironflow.sdk.errors import IronflowError
from ironflow.sdk.function import Function
from ironflow.sdk.loops import current_loop
from ironflow.sdk.traces import segment_span

_log = logging.getLogger("ironflow.worker")

# A pull worker's goodbye (``DELETE`` of its session) must land before the
# drain deadline, even when jobs ran to it: the goodbye is what makes the node
# recover a cut job's lease at once (a streaming worker's dropped socket does
# that by itself). So a pull drain stops waiting for jobs this much (at most a
# tenth of the drain) before its deadline.
GOODBYE_RESERVE_S = 0.25
# What a step result's frame holds besides the output (ids, fence, name):
# an output may be the frame limit less this.
FRAME_ENVELOPE_BYTES = 4096
# How long reading one left-out step output may take (it is up to a frame).
MEMO_FETCH_TIMEOUT_S = 30.0


class _StderrUnlessConfigured(logging.StreamHandler):  # type: ignore[type-arg]
    """The worker's lines on stderr while the application has configured no logging.

    Attached to ``ironflow.worker``; a record is written here only when no
    other handler lies on its propagation path (root included). Once the
    application configures logging, its handlers get the record and this one
    stays silent, so nothing is printed twice. Like ``logging.lastResort`` it
    writes to whatever ``sys.stderr`` is at the time.
    """

    def __init__(self) -> None:
        logging.Handler.__init__(self)
        self.setFormatter(log_formatter())

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    def emit(self, record: logging.LogRecord) -> None:
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return  # the application's handlers have it
            if not logger.propagate:
                break
            logger = logger.parent
        super().emit(record)


def _announce_lifecycle() -> None:
    """Make the lifecycle lines visible out of the box (idempotent).

    INFO is enabled on ``ironflow.worker`` unless the application chose a
    level for ``ironflow`` or ``ironflow.worker`` itself.
    """
    if not any(isinstance(h, _StderrUnlessConfigured) for h in _log.handlers):
        _log.addHandler(_StderrUnlessConfigured())
    if _log.level == logging.NOTSET and logging.getLogger("ironflow").level == logging.NOTSET:
        _log.setLevel(logging.INFO)


class _SignalHub:
    """The process's one SIGTERM/SIGINT receiver, shared by every running worker."""

    def __init__(self) -> None:
        self.workers: set[WorkerLifecycle] = set()
        self.signals = 0
        self._scope: anyio.CancelScope | None = None

    def join(self, worker: WorkerLifecycle) -> None:
        """Add a running worker; the first one opens the receiver."""
        self.workers.add(worker)
        if self.signals:
            worker._begin_drain(worker.drain_timeout)  # started while the process drains
        if self._scope is None:
            self._scope = anyio.CancelScope()
            _spawn_detached(self._watch, self._scope)

    def leave(self, worker: WorkerLifecycle) -> None:
        """Remove a worker; the last one closes the receiver (default handlers return)."""
        self.workers.discard(worker)
        if not self.workers and self._scope is not None:
            self._scope.cancel()
            self._scope = None
            self.signals = 0

    async def _watch(self, scope: anyio.CancelScope) -> None:
        with scope, ExitStack() as stack:
            try:
                signals = stack.enter_context(
                    anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT)
                )
            except (RuntimeError, ValueError) as exc:  # not the main thread
                _log.warning("signal handling unavailable: %s", exc)
                return
            async for signum in signals:
                self._on_signal(signum)

    def _on_signal(self, signum: int) -> None:
        self.signals += 1
        workers = sorted(self.workers, key=lambda w: w.worker_id)
        if self.signals == 1:
            _log.info(
                "Received signal %s; draining %d workers",
                signal.Signals(signum).name,
                len(workers),
            )
            for worker in workers:
                worker._begin_drain(worker.drain_timeout)
        else:
            _log.info("Second signal; stopping now")
            for worker in workers:
                worker.stop()


# Strong references to the detached asyncio tasks (asyncio keeps only weak ones).
_DETACHED: set[Any] = set()


def _spawn_detached(fn: Callable[[anyio.CancelScope], Awaitable[None]], scope: anyio.CancelScope) -> None:
    """Start ``fn(scope)`` outside every worker's task group: the signal receiver
    must outlive whichever worker opened it. On Trio a system task; on asyncio
    a plain task of the running loop."""
    if current_loop() == "trio":
        import trio

        trio.lowlevel.spawn_system_task(fn, scope, name="ironflow-signals")
        return
    import asyncio

    task: asyncio.Task[None] = asyncio.get_running_loop().create_task(
        fn(scope), name="ironflow-signals"  # type: ignore[arg-type]
    )
    _DETACHED.add(task)
    task.add_done_callback(_DETACHED.discard)


_HUB: anyio.lowlevel.RunVar[_SignalHub] = anyio.lowlevel.RunVar("ironflow_signal_hub")


def _signal_hub() -> _SignalHub:
    try:
        return _HUB.get()
    except LookupError:
        hub = _SignalHub()
        _HUB.set(hub)
        return hub


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class _StartGates:
    """Opens jobs held for a start time (``JobAssignment.start_delay_ms``).

    A job's start is its ``db_now + start_delay_ms`` by the database clock,
    turned into this process's clock through the best bound seen so far (see
    :class:`DatabaseClock`), and re-turned whenever a later job tightens it:
    the first jobs of a burst, received before the tightest sample, start on
    time too. A job without ``db_now`` starts at its delay from receipt.

    One timer per start millisecond, shared by every job held to it: a burst
    held to one instant starts through one ``Event`` rather than through a
    cancel scope per job all expiring at once (1,000 jobs held to one instant
    in one process, handler started: p50 16-23 ms, p99 32-43 ms with shared
    gates; 52-68 / 80-101 ms with ``trio.move_on_at`` per job). A gate opens
    at its millisecond rounded up, never before. :meth:`run` must run while
    jobs are held (each transport starts it).
    """

    def __init__(self) -> None:
        self.clock = DatabaseClock()
        # ("db", ms of the database clock) or ("local", ms of the loop clock).
        self._gates: dict[tuple[str, int], anyio.Event] = {}
        self._changed = anyio.Event()

    def observe(self, db_now: float, received: float) -> None:
        """A sample of the database clock (a held job's ``db_now``, received then)."""
        if self.clock.observe(db_now, received):
            self._changed.set()  # every gate may open earlier now

    def gate(self, job: JobState) -> anyio.Event:
        """The event set when ``job`` may start."""
        a = job.assignment
        if a.db_now is not None and self.clock.sampled:
            key = ("db", math.ceil((a.db_now + a.start_delay_ms / 1000) * 1000))
        else:
            key = ("local", math.ceil(job.start_at * 1000))
        gate = self._gates.get(key)
        if gate is None:
            gate = self._gates[key] = anyio.Event()
            self._changed.set()
        return gate

    def _opens_at(self, key: tuple[str, int]) -> float:
        kind, ms = key
        if kind == "local":
            return ms / 1000
        at = self.clock.local_time(ms / 1000)
        assert at is not None  # db keys exist only once a sample was taken
        return at

    def open_all(self) -> None:
        """Set every gate now (a drain: held jobs wake to be handed back)."""
        for gate in self._gates.values():
            gate.set()
        self._gates.clear()

    def new_connection(self) -> None:
        """Forget the clock learnt from the last connection (the next node may be
        another cluster's) and its gates: its jobs were abandoned with it."""
        self.clock = DatabaseClock()
        self._gates.clear()
        self._changed.set()

    async def run(self) -> None:
        """Until cancelled: set each gate when its time comes."""
        while True:
            self._changed = anyio.Event()
            if not self._gates:
                await self._changed.wait()
                continue
            with anyio.CancelScope(deadline=min(self._opens_at(k) for k in self._gates)):
                await self._changed.wait()  # a new gate, or a tighter clock
            now = anyio.current_time()
            for key in [k for k in self._gates if self._opens_at(k) <= now]:
                self._gates.pop(key).set()


class WorkerLifecycle:
    """State and control shared by both workers; they call this ``__init__`` first."""

    def __init__(
        self,
        server_url: str,
        functions: Iterable[Function],
        *,
        api_key: str | None,
        max_concurrent_jobs: int,
        drain_timeout: float,
        worker_id: str | None,
        heartbeat_interval: float | None,
        reconnect_delay: float,
        handle_signals: bool,
    ) -> None:
        if max_concurrent_jobs < 1:
            raise ValueError("max_concurrent_jobs must be at least 1")
        self.server_url = server_url
        # The largest frame the engine reads (its Registered says; the
        # protocol's default until then).
        self.max_frame_bytes = MAX_FRAME_BYTES
        functions = list(functions)
        for f in functions:
            if not isinstance(f, Function):
                if inspect.iscoroutine(f):
                    f.close()
                raise TypeError(
                    f"a worker runs functions declared with @ironflow.function, got {f!r}"
                )
        self.functions = {f.id: f for f in functions}
        # Like the event client: the environment supplies the key when none is given.
        self.api_key = api_key if api_key is not None else os.environ.get("IRONFLOW_API_KEY")
        self.max_concurrent_jobs = max_concurrent_jobs
        self.drain_timeout = drain_timeout
        self.worker_id = worker_id or default_worker_id()
        self.heartbeat_interval = heartbeat_interval
        self.reconnect_delay = reconnect_delay
        self.handle_signals = handle_signals
        self.session_id: str | None = None
        self.state = "idle"  # idle | connecting | connected | draining | stopped
        self._jobs: dict[str, JobState] = {}
        self._jobs_changed = anyio.Event()
        self._draining = False
        # Opens jobs held for their start time (a drain opens them all).
        self._start_gates = _StartGates()
        self._drain_started_at = 0.0
        self._drain_deadline = 0.0
        self._stopped = False
        self._running = False
        self._finished = anyio.Event()
        self._root_scope: anyio.CancelScope | None = None
        # Run by running(): the host application owns the process's signals.
        self._embedded = False

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Connect, register and execute jobs until drained or stopped (per transport)."""
        raise NotImplementedError

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Self]:
        """Run the worker beside the caller's own tasks while the block runs.

        For an application that owns its event loop (a FastAPI/Starlette
        lifespan, an aiohttp ``cleanup_ctx``): enters once the worker is
        registered (``run``'s readiness), and on exit drains it (new jobs
        refused, running ones get ``drain_timeout``) and waits for it to stop,
        even when the block is being cancelled. Signals are left to the host
        application, whose shutdown ends the block; ``handle_signals`` does not
        apply here. A fatal error (``WorkerAuthError``) raises at entry.
        """
        self._embedded = True
        async with anyio.create_task_group() as tg:
            await tg.start(self.run)
            try:
                yield self
            finally:
                # Shielded: a host cancelling its lifespan still gets the drain
                # (bounded by the drain deadline) rather than cut jobs.
                with anyio.CancelScope(shield=True):
                    await self.drain()

    @property
    def active_jobs(self) -> int:
        return len(self._jobs)

    @property
    def draining(self) -> bool:
        return self._draining

    async def drain(self, timeout: float | None = None) -> None:
        """Drain now (refuse new jobs, finish running ones until the deadline) and wait."""
        self._begin_drain(self.drain_timeout if timeout is None else timeout)
        if self._running:
            await self._finished.wait()

    def stop(self) -> None:
        """Stop at once: running jobs are cancelled and report nothing."""
        self._stopped = True
        if self._root_scope is not None:
            self._root_scope.cancel()

    def _begin_drain(self, timeout: float) -> None:
        if self._draining:
            return  # a drain in progress keeps its original deadline
        self._draining = True
        self._start_gates.open_all()
        self.state = "draining"
        self._drain_started_at = anyio.current_time()
        self._drain_deadline = self._drain_started_at + max(timeout, 0.0)
        _log.info("Draining worker...", extra={"fields": {"worker_id": self.worker_id}})
        self._drain_started()

    def _drain_started(self) -> None:
        """Transport-specific reaction to a drain (wake what waits for new work)."""

    def _call_deadline(self, timeout: float) -> float:
        """When a call to the engine must give up: after ``timeout``, and never
        past the drain deadline while draining (the whole drain ends by it)."""
        at = anyio.current_time() + timeout
        return min(at, self._drain_deadline) if self._draining else at

    def _goodbye_reserve(self) -> float:
        """The end of a drain kept for the goodbye (see ``GOODBYE_RESERVE_S``)."""
        return min(GOODBYE_RESERVE_S, (self._drain_deadline - self._drain_started_at) / 10)

    async def _await_jobs(self, until: float) -> bool:
        """The drain's wait: running jobs get until ``until``; the rest are cancelled.

        Logs the seed's lines (``Waiting for N jobs to complete...``, and
        ``Drain deadline reached; cancelling N active jobs``). True when every
        job ended in time.
        """
        if self._jobs:
            _log.info(f"Waiting for {len(self._jobs)} jobs to complete...")
        with anyio.CancelScope(deadline=until):
            while self._jobs:
                self._jobs_changed = anyio.Event()
                await self._jobs_changed.wait()
        if not self._jobs:
            return True
        _log.warning(f"Drain deadline reached; cancelling {len(self._jobs)} active jobs")
        for job in list(self._jobs.values()):
            job.abandon()
        return False

    def _fetch_transport(self) -> httpx.AsyncBaseTransport | None:
        """The HTTP transport to read step outputs over (None: httpx's own)."""
        return None

    async def fetch_step_output(self, run_id: str, step_id: str) -> Any:
        """A memoised step's output the assignment left out (the run's state
        is past the engine's inline budget): read from the engine by step id.

        Raises:
          IronflowError: the engine could not be asked or did not answer it
            (retryable: the attempt fails and is retried).
        """
        url = f"{self.server_url.rstrip('/')}/v1/runs/{quote(run_id, safe='')}/step-output"
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            async with httpx.AsyncClient(timeout=MEMO_FETCH_TIMEOUT_S, transport=self._fetch_transport()) as client:
                resp = await client.get(url, params={"step_id": step_id}, headers=headers)
        except httpx.HTTPError as exc:
            raise IronflowError(f"could not read step {step_id!r}'s output: {exc!r}", code="MEMO_FETCH_FAILED") from exc
        if resp.status_code != 200:
            raise IronflowError(
                f"could not read step {step_id!r}'s output: HTTP {resp.status_code} {resp.text[:200]}",
                code="MEMO_FETCH_FAILED",
            )
        return msgspec.json.decode(resp.content)

    def _register_message(self, *, batch_frames: bool = False) -> Register:
        """This worker's ``Register``: every function's full definition, its slots."""
        return Register(
            worker_id=self.worker_id,
            functions=[f.definition for f in self.functions.values()],
            max_concurrent_jobs=self.max_concurrent_jobs,
            hostname=socket.gethostname(),
            batch_frames=batch_frames,
            delayed_start=True,  # _execute holds a job until its start time
        )

    def _on_lease_statuses(self, statuses: Iterable[JobLeaseStatus]) -> None:
        """A heartbeat's answer: abandon each job whose lease is gone (STALE: a
        later segment holds the run; UNKNOWN: no lease at all). Only the segment
        named is abandoned: a newer assignment of the same run keeps running."""
        for js in statuses:
            if js.state in ("STALE", "UNKNOWN"):
                job = self._jobs.get(js.job_id)
                if job is not None and job.assignment.execution_seq == js.execution_seq:
                    self._abandon(job, f"lease {js.state}")

    def _abandon(self, job: JobState, why: str) -> None:
        """Cancel a job's handler and drop whatever it still reports (logged once)."""
        if not job.abandoned:
            a = job.assignment
            _log.warning(
                "Abandoning job: %s", why,
                extra={"fields": {"run_id": a.run_id, "execution_seq": a.execution_seq}},
            )
            job.abandon()

    def _refusal(self, a: JobAssignment) -> JobNackReason | None:
        """Why this worker refuses assignment ``a`` (logged), or None to take it.

        DRAINING while draining (another worker takes it, no attempt spent);
        AT_CAPACITY with every slot busy (the engine holds a credit back).
        """
        fields = {"run_id": a.run_id, "execution_seq": a.execution_seq}
        if self._draining:
            _log.info("Draining, refusing job", extra={"fields": fields})
            return "DRAINING"
        if len(self._jobs) >= self.max_concurrent_jobs:
            _log.info("At capacity, refusing job", extra={"fields": fields})
            return "AT_CAPACITY"
        return None

    async def _execute(self, job: JobState, reporter: Reporter, acked: anyio.Event | None = None) -> None:
        """Run one accepted job's segment to its single report; forget it after.

        ``acked``: user code starts only once the JobAck is on the wire, so a
        handler that dies at once still leaves the engine a lease to recover.

        A job with a start delay (a sleep woken ahead of its time) is acked on
        receipt like any other, then held: it keeps its slot and its lease
        (heartbeats list it) and starts its handler at its start time, never
        before (see :class:`_StartGates`). A drain during the hold hands it
        back with ``JobNack(DRAINING)`` (its handler never started); a cancel
        or a stale lease abandons it.
        """
        function = self.functions.get(job.assignment.function_id)
        # Built before any hold: at the start time only the handler runs (a
        # burst of held jobs all start at one instant, one after another).
        ctx = Context(job, reporter) if function is not None else None
        try:
            with job.scope:
                if acked is not None:
                    await acked.wait()
                if not await self._hold(job):
                    a = job.assignment
                    _log.info(
                        "Draining, handing back a job held for its start time",
                        extra={"fields": {"run_id": a.run_id, "execution_seq": a.execution_seq}},
                    )
                    await reporter.nack(
                        job, JobNack(a.job_id, a.run_id, a.execution_seq, a.lease_token, reason="DRAINING")
                    )
                    return
                with segment_span(job.assignment):
                    await execute_job(function, job, reporter, ctx)
        finally:
            job.done = True
            if self._jobs.get(job.assignment.job_id) is job:
                del self._jobs[job.assignment.job_id]
            self._jobs_changed.set()

    def _start_time(self, a: JobAssignment, received: float) -> float:
        """When (loop clock) an assignment received at ``received`` may start its
        handler at the latest: its delay from receipt (a held job's gate may
        open earlier, see :class:`_StartGates`)."""
        if a.start_delay_ms and a.db_now is not None:
            self._start_gates.observe(a.db_now, received)
        return received + a.start_delay_ms / 1000

    def _new_connection(self) -> None:
        """A new session: what was learnt of the engine's clock is not carried over
        (the next node may be another cluster's); jobs of the last one are gone."""
        self._start_gates.new_connection()

    async def _hold(self, job: JobState) -> bool:
        """Wait until the job may start; False if a drain began before it could."""
        if job.start_at <= anyio.current_time():
            return True
        if not self._draining:
            await self._start_gates.gate(job).wait()
        return not self._draining

    @contextmanager
    def _signals_handled(self) -> Iterator[None]:
        """While ``run()`` runs: SIGTERM/SIGINT drain this worker with the others.

        Also makes the lifecycle lines visible (see :func:`_announce_lifecycle`).
        """
        _announce_lifecycle()
        if not self.handle_signals or self._embedded:
            yield
            return
        hub = _signal_hub()
        hub.join(self)
        try:
            yield
        finally:
            hub.leave(self)
