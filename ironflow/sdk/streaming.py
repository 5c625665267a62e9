"""``StreamingWorker``: runs functions for an engine over the ``/v1/worker`` websocket.

One connection ("worker session") at a time. Inside a session four kinds of
task share one task group: the receive loop (assignments, lease status,
cancels, shutdown), one writer draining a single outbox channel, the
heartbeat loop, and one task per job. Losing the connection cancels every
job without reporting (their fences belong to a dead session) and
reconnects; a drain refuses new work, lets running jobs finish until the
deadline, flushes the outbox and closes the socket with 1000.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ironflow.logs import log_fields
from ironflow.protocol import (
    MAX_FRAME_BYTES,
    Cancel,
    Heartbeat,
    JobAck,
    JobAssignment,
    JobNack,
    LeaseStatus,
    Refused,
    Registered,
    Shutdown,
    encoder,
    engine_frame_decoder,
    engine_message_decoder,
)
from ironflow.sdk.context import JobState
from ironflow.sdk.errors import IronflowError, RegistrationRefusedError, WorkerAuthError
from ironflow.sdk.function import Function
from ironflow.sdk.lifecycle import FRAME_ENVELOPE_BYTES, WorkerLifecycle
from ironflow.sdk.traces import configure as configure_tracing
from ironflow.sdk.ws import ConnectionClosed, ConnectionRejected, HandshakeError, WebSocket, connect

# The reference SDKs hold 256 queued messages per connection; more means the
# socket is not keeping up and backpressure on the jobs is the right answer.
# The outbox holds this many on top of one per slot: the receive loop queues
# each accepted job's JobAck itself and should not stop reading the socket to
# wait for room (a burst of held jobs is a burst of acks at once).
OUTBOX_SIZE = 256
# Most queued messages the writer puts in one batched frame.
WRITE_BATCH = 256
# How long a connect (TCP + websocket handshake) may take.
CONNECT_TIMEOUT_S = 10.0

_log = logging.getLogger("ironflow.worker")
_CLOSE = object()  # outbox sentinel: flush done, close the socket with 1000


def websocket_url(server_url: str) -> str:
    """``http(s)://host[:port]`` → ``ws(s)://host[:port]/v1/worker``."""
    url = server_url.rstrip("/")
    if url.startswith("https://"):
        url = "wss://" + url[len("https://") :]
    elif url.startswith("http://"):
        url = "ws://" + url[len("http://") :]
    elif not url.startswith(("ws://", "wss://")):
        url = "ws://" + url
    return url + "/v1/worker"


class _OutboxReporter:
    """Queues a job's messages on its session's outbox, unless the job was abandoned."""

    __slots__ = ("_send", "_worker")

    def __init__(self, send: MemoryObjectSendStream[Any], worker: WorkerLifecycle):
        self._send = send
        self._worker = worker

    @property
    def max_output_bytes(self) -> int:
        return self._worker.max_frame_bytes - FRAME_ENVELOPE_BYTES

    async def step_output(self, job: JobState, step_id: str) -> Any:
        return await self._worker.fetch_step_output(job.assignment.run_id, step_id)

    async def step(self, job: JobState, msg: Any) -> None:
        if not job.abandoned:
            await self._send.send(msg)

    async def result(self, job: JobState, msg: Any) -> None:
        """Queued at once when there is room (``send`` would yield first): the
        writer, woken by the segment's last step result and yielding once
        before it takes its batch, then sends both in one frame, which the
        engine commits as one (steps, job result and the run's end together)."""
        if job.abandoned:
            return
        try:
            self._send.send_nowait(msg)
        except anyio.WouldBlock:
            await self._send.send(msg)

    nack = step


class _Flushed:
    """An outbox entry whose sender wants to know when it reached the socket."""

    __slots__ = ("message", "written")

    def __init__(self, message: Any) -> None:
        self.message = message
        self.written = anyio.Event()


class StreamingWorker(WorkerLifecycle):
    """Executes ``functions`` for the engine at ``server_url`` over a websocket.

    ``max_concurrent_jobs`` bounds running jobs (assignments beyond it are
    nacked ``AT_CAPACITY``); ``drain_timeout`` is the drain deadline in
    seconds unless an engine ``Shutdown`` brings a positive one;
    ``heartbeat_interval`` overrides the engine's; ``handle_signals`` makes
    SIGTERM/SIGINT drain (a second signal stops at once).
    """

    def __init__(
        self,
        server_url: str,
        functions: Iterable[Function],
        *,
        api_key: str | None = None,
        max_concurrent_jobs: int = 10,
        drain_timeout: float = 30.0,
        worker_id: str | None = None,
        heartbeat_interval: float | None = None,
        reconnect_delay: float = 5.0,
        handle_signals: bool = True,
    ):
        super().__init__(
            server_url,
            functions,
            api_key=api_key,
            max_concurrent_jobs=max_concurrent_jobs,
            drain_timeout=drain_timeout,
            worker_id=worker_id,
            heartbeat_interval=heartbeat_interval,
            reconnect_delay=reconnect_delay,
            handle_signals=handle_signals,
        )
        self._drain_requested = anyio.Event()
        self._session_scope: anyio.CancelScope | None = None
        # Around the whole connection, close handshake included: cancelled
        # when a drain's deadline leaves no time to close politely.
        self._connection_scope: anyio.CancelScope | None = None
        self._outbox: MemoryObjectSendStream[Any] | None = None
        # Whether the engine reads batched frames (its Registered says so).
        self._engine_batches = False

    # ── public control ───────────────────────────────────────────────────

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Connect, register and execute jobs until drained or stopped.

        ``task_status.started()`` fires after the first ``Registered``. A lost
        connection reconnects after ``reconnect_delay``; 401/403 raises
        ``WorkerAuthError`` and a refused registration (a node limit)
        ``RegistrationRefusedError``, without reconnecting.
        """
        self._running = True
        configure_tracing()  # OTEL_TRACES_EXPORTER, as for the node
        fatal: WorkerAuthError | RegistrationRefusedError | None = None
        try:
            async with anyio.create_task_group() as nursery:
                self._root_scope = nursery.cancel_scope
                if self._stopped:
                    nursery.cancel_scope.cancel()
                with self._signals_handled():
                    try:
                        await self._connect_loop(task_status)
                    except (WorkerAuthError, RegistrationRefusedError) as exc:
                        _log.error("%s; not reconnecting", exc)
                        fatal = exc
                nursery.cancel_scope.cancel()
            if fatal is not None:
                raise fatal
        finally:
            self.state = "stopped"
            self._running = False
            self._finished.set()
            _log.info("Worker stopped", extra=log_fields(worker_id=self.worker_id))

    # ── connection management ────────────────────────────────────────────

    def _drain_started(self) -> None:
        self._drain_requested.set()
        if self._session_scope is None and self._root_scope is not None:
            self._root_scope.cancel()  # not connected: nothing to drain

    async def _connect_loop(self, task_status: TaskStatus[None]) -> None:
        started = [False]

        def on_registered() -> None:
            if not started[0]:
                started[0] = True
                task_status.started()

        while not (self._stopped or self._draining):
            self.state = "connecting"
            try:
                await self._session(on_registered)
            except (WorkerAuthError, RegistrationRefusedError):
                raise
            except (HandshakeError, ConnectionClosed, OSError, anyio.BrokenResourceError) as exc:
                _log.warning(
                    "Connection to engine lost: %r", exc, extra=log_fields(worker_id=self.worker_id)
                )
            if self._stopped or self._draining:
                return
            await anyio.sleep(self.reconnect_delay)

    async def _session(self, on_registered: Any) -> None:
        headers = None
        if self.api_key:
            headers = [(b"authorization", f"Bearer {self.api_key}".encode())]
        try:
            with anyio.CancelScope() as self._connection_scope:
                # No read-ahead beyond the socket's own buffer: the receive
                # loop reads as fast as it applies frames (backpressure is TCP's).
                async with connect(
                    websocket_url(self.server_url),
                    headers=headers or (),
                    max_message_size=MAX_FRAME_BYTES,
                    connect_timeout=CONNECT_TIMEOUT_S,
                ) as ws:
                    await self._serve(ws, on_registered)
        except ConnectionRejected as exc:
            if exc.status_code in (401, 403):
                raise WorkerAuthError(
                    f"engine refused the worker's credentials (HTTP {exc.status_code})"
                ) from exc
            raise

    async def _serve(self, ws: WebSocket, on_registered: Any) -> None:
        register = self._register_message(batch_frames=True)
        await ws.send_message(encoder.encode(register).decode())
        first = engine_message_decoder.decode(await ws.get_message())
        if isinstance(first, Refused):
            if first.code in ("UNAUTHENTICATED", "UNAUTHORIZED", "FORBIDDEN"):
                raise WorkerAuthError(f"{first.code}: {first.message}")
            raise RegistrationRefusedError(f"registration refused: {first.code}: {first.message}")
        if not isinstance(first, Registered):
            raise IronflowError(f"expected 'registered', got {type(first).__name__}")
        self.session_id = first.session_id
        self._new_connection()
        self._engine_batches = first.batch_frames
        if first.max_frame_bytes:
            self.max_frame_bytes = first.max_frame_bytes
        interval = self.heartbeat_interval or first.heartbeat_interval_ms / 1000.0
        send, recv = anyio.create_memory_object_stream[Any](OUTBOX_SIZE + self.max_concurrent_jobs)
        reporter = _OutboxReporter(send, self)
        _log.info(
            "Worker registered",
            extra=log_fields(
                worker_id=self.worker_id,
                session_id=self.session_id,
                functions=",".join(self.functions),
            ),
        )
        try:
            async with anyio.create_task_group() as nursery:
                self._session_scope = nursery.cancel_scope
                self._outbox = send
                if not self._draining:
                    self.state = "connected"
                on_registered()
                nursery.start_soon(self._writer, ws, recv, nursery.cancel_scope)
                nursery.start_soon(self._start_gates.run)
                nursery.start_soon(self._heartbeat_loop, send, interval)
                nursery.start_soon(self._drain_watch, send)
                await self._receive_loop(ws, send, reporter, nursery)
                nursery.cancel_scope.cancel()
        finally:
            send.close()  # every task that held it ended with the task group
            recv.close()
            self._session_scope = None
            self._outbox = None
            for job in self._jobs.values():
                job.abandon()
            self._jobs.clear()

    # ── session tasks ────────────────────────────────────────────────────

    async def _writer(
        self, ws: WebSocket, recv: MemoryObjectReceiveStream[Any], scope: anyio.CancelScope
    ) -> None:
        """The only task that writes the socket. Everything queued goes out in one
        frame when the engine reads batches (``Registered.batch_frames``), else
        one frame per message; a close ends the batch before it."""
        limit = WRITE_BATCH if self._engine_batches else 1
        try:
            async for first in recv:
                if limit > 1 and first is not _CLOSE:
                    # One scheduling round before the batch is taken: what the
                    # tasks woken with this one queue meanwhile (a job's result
                    # right after its last step result, the acks of one
                    # assignment frame) goes in the same frame.
                    await anyio.lowlevel.checkpoint()
                batch = [first]
                while batch[-1] is not _CLOSE and len(batch) < limit:
                    try:
                        batch.append(recv.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                closing = batch[-1] is _CLOSE
                if closing:
                    batch.pop()
                if batch:
                    messages = [m.message if isinstance(m, _Flushed) else m for m in batch]
                    frame = encoder.encode(messages[0] if len(messages) == 1 else messages)
                    if len(frame) > self.max_frame_bytes and len(messages) > 1:
                        # Together past the engine's frame limit (large step
                        # outputs, each within it): one frame each instead.
                        for message in messages:
                            await ws.send_message(encoder.encode(message).decode())
                    else:
                        await ws.send_message(frame.decode())
                    for m in batch:
                        if isinstance(m, _Flushed):
                            m.written.set()
                if closing:
                    await ws.aclose(1000)
                    break
        except ConnectionClosed:
            pass
        scope.cancel()

    async def _heartbeat_loop(self, send: MemoryObjectSendStream[Any], interval: float) -> None:
        while True:
            await anyio.sleep(interval)
            jobs = [j.active_job() for j in self._jobs.values() if not j.abandoned]
            await send.send(Heartbeat(jobs=jobs))

    async def _drain_watch(self, send: MemoryObjectSendStream[Any]) -> None:
        """Wait for the running jobs, then flush and close, all by the drain deadline."""
        await self._drain_requested.wait()
        deadline = self._drain_deadline
        if await self._await_jobs(deadline):
            # Flush what the jobs queued, then half-close and wait for the
            # engine's close; the writer ends the session once closed.
            with anyio.CancelScope(deadline=deadline):
                await send.send(_CLOSE)
                await anyio.sleep_forever()
        # The deadline has passed: drop the connection without a handshake
        # (the engine recovers what it still leases to this session).
        if self._connection_scope is not None:
            self._connection_scope.cancel()

    async def _receive_loop(
        self,
        ws: WebSocket,
        send: MemoryObjectSendStream[Any],
        reporter: _OutboxReporter,
        nursery: TaskGroup,
    ) -> None:
        while True:
            try:
                text = await ws.get_message()
            except ConnectionClosed as exc:
                if not self._draining:
                    _log.warning("Engine closed the connection: %s", exc.reason)
                return
            # A job's start delay runs from here, not from when its turn in
            # the frame comes: a batch of held jobs all start on time.
            received = anyio.current_time()
            try:
                frame = engine_frame_decoder.decode(text)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                _log.warning("Ignoring a bad frame from the engine: %s", exc)
                continue
            for msg in frame if isinstance(frame, list) else [frame]:
                await self._on_engine_message(msg, send, reporter, nursery, received)

    async def _on_engine_message(
        self,
        msg: Any,
        send: MemoryObjectSendStream[Any],
        reporter: _OutboxReporter,
        nursery: TaskGroup,
        received: float,
    ) -> None:
        """Apply one engine message (frames are applied in order); ``received``:
        when its frame arrived (loop clock)."""
        if isinstance(msg, JobAssignment):
            await self._on_assignment(msg, send, reporter, nursery, received)
        elif isinstance(msg, LeaseStatus):
            self._on_lease_statuses(msg.jobs)
        elif isinstance(msg, Cancel):
            job = self._jobs.get(msg.job_id)
            if job is not None:
                _log.info(
                    "Run cancelled; cancelling job",
                    extra=log_fields(run_id=msg.run_id, reason=msg.reason),
                )
                job.abandon()
        elif isinstance(msg, Refused):
            job = self._jobs.get(msg.job_id) if msg.job_id else None
            if job is not None:
                _log.warning(
                    "Engine refused a message; abandoning job",
                    extra=log_fields(run_id=msg.run_id, code=msg.code),
                )
                job.abandon()
            else:
                _log.warning("Engine refused a message: %s: %s", msg.code, msg.message)
        elif isinstance(msg, Shutdown):
            _log.info("Engine asked to shut down: %s", msg.reason)
            timeout = (
                msg.drain_timeout_ms / 1000.0 if msg.drain_timeout_ms > 0 else self.drain_timeout
            )
            self._begin_drain(timeout)

    async def _on_assignment(
        self,
        a: JobAssignment,
        send: MemoryObjectSendStream[Any],
        reporter: _OutboxReporter,
        nursery: TaskGroup,
        received: float,
    ) -> None:
        if a.job_id in self._jobs:
            return  # still running here: a nack would requeue a running job
        reason = self._refusal(a)
        if reason is not None:
            await send.send(
                JobNack(
                    job_id=a.job_id,
                    run_id=a.run_id,
                    execution_seq=a.execution_seq,
                    lease_token=a.lease_token,
                    reason=reason,
                )
            )
            return
        job = JobState(a, self._start_time(a, received))
        self._jobs[a.job_id] = job
        acked = _Flushed(JobAck(a.job_id, a.run_id, a.execution_seq, a.lease_token))
        await send.send(acked)
        nursery.start_soon(self._execute, job, reporter, acked.written)
