"""``PullWorker``: runs functions for an engine over HTTP long-poll.

Same ``Context`` and job runner as the streaming worker; only the transport
differs. The worker registers (``POST /v1/worker/register``), long-polls for
as many jobs as it has free slots, acks each before running it, posts step
and job results, and heartbeats its active jobs. A 409 ``STALE_EXECUTION``
abandons that job; a 404 ``SESSION_NOT_FOUND`` abandons every job and
re-registers; 401/403 stops the worker.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import msgspec
from anyio.abc import TaskGroup, TaskStatus

from ironflow.logs import log_fields
from ironflow.protocol import (
    SESSION_SECRET_HEADER,
    Heartbeat,
    JobAck,
    JobAssignment,
    JobNack,
    LeaseStatus,
    PullPollRequest,
    PullPollResponse,
    Registered,
    Shutdown,
    encoder,
)
from ironflow.sdk.client import api_error_of, auth_headers
from ironflow.sdk.context import JobState
from ironflow.sdk.errors import IronflowError, RegistrationRefusedError, WorkerAuthError
from ironflow.sdk.function import Function
from ironflow.sdk.lifecycle import FRAME_ENVELOPE_BYTES, WorkerLifecycle
from ironflow.sdk.traces import configure as configure_tracing

# Backoff for a terminal result that did not get through (reference SDK: 1, 2, 4, 8 s).
RESULT_RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0)
# Backoff after a failed poll or registration: start here, double, cap.
POLL_BACKOFF_S = (1.0, 30.0)
# Plain calls (ack, steps, results) must answer quickly; the poll gets its wait on top.
CALL_TIMEOUT_S = 10.0
# Bound on the goodbye (DELETE session); a drain's deadline bounds it further.
GOODBYE_TIMEOUT_S = 5.0

_log = logging.getLogger("ironflow.worker")


class _SessionLost(Exception):
    """The engine no longer knows this session (404): re-register."""


def _error_code(resp: httpx.Response) -> str:
    return api_error_of(resp).code


def _error_message(resp: httpx.Response) -> str:
    error = api_error_of(resp)
    return f"{error.code}: {error.message}"


class _HttpReporter:
    """Posts a job's step and terminal messages to the engine."""

    __slots__ = ("_worker",)

    def __init__(self, worker: PullWorker):
        self._worker = worker

    @property
    def max_output_bytes(self) -> int:
        return self._worker.max_frame_bytes - FRAME_ENVELOPE_BYTES

    async def step_output(self, job: JobState, step_id: str) -> Any:
        return await self._worker.fetch_step_output(job.assignment.run_id, step_id)

    async def step(self, job: JobState, msg: Any) -> None:
        if job.abandoned:
            return
        try:
            resp = await self._worker._post("/steps", msg)
        except httpx.HTTPError as exc:
            # The step's result is lost; a replay re-runs it. The job carries on.
            _log.warning("Could not report a step: %r", exc, extra=log_fields(run_id=msg.run_id))
            return
        if resp.status_code == 409:
            self._worker._abandon(job, "step refused as stale")
            await anyio.lowlevel.checkpoint()  # let the cancellation land now

    async def nack(self, job: JobState, msg: JobNack) -> None:
        if job.abandoned:
            return
        with anyio.CancelScope(deadline=self._worker._call_deadline(CALL_TIMEOUT_S)):
            try:
                await self._worker._post("/nack", msg)
            except httpx.HTTPError as exc:
                # The engine recovers the segment when its lease expires.
                _log.warning("Could not nack a job: %r", exc, extra=log_fields(run_id=msg.run_id))

    async def result(self, job: JobState, msg: Any) -> None:
        for delay in (*RESULT_RETRY_DELAYS_S, None):
            if job.abandoned:
                return
            try:
                resp = await self._worker._post("/result", msg)
            except httpx.HTTPError as exc:
                _log.warning("Could not report a result: %r", exc, extra=log_fields(run_id=msg.run_id))
            else:
                if resp.status_code < 400:
                    return
                if resp.status_code == 409:
                    self._worker._abandon(job, "result refused as stale")
                    return
                if resp.status_code < 500:
                    _log.error(
                        "Result refused: %s %s", resp.status_code, _error_code(resp),
                        extra=log_fields(run_id=msg.run_id),
                    )
                    return
            if delay is None:
                _log.error("Giving up reporting a result; the lease will expire",
                           extra=log_fields(run_id=msg.run_id))
                return
            await anyio.sleep(delay)


class PullWorker(WorkerLifecycle):
    """Executes ``functions`` for the engine at ``server_url`` by HTTP long-poll.

    Arguments match ``StreamingWorker``; ``poll_wait`` is how long one poll
    may be held open by the node. ``transport`` (an httpx transport) is for
    tests.
    """

    def __init__(
        self,
        server_url: str,
        functions: Iterable[Function],
        *,
        api_key: str | None = None,
        max_concurrent_jobs: int = 10,
        poll_wait: float = 20.0,
        drain_timeout: float = 30.0,
        worker_id: str | None = None,
        heartbeat_interval: float | None = None,
        reconnect_delay: float = 5.0,
        handle_signals: bool = True,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        super().__init__(
            server_url.rstrip("/"),
            functions,
            api_key=api_key,
            max_concurrent_jobs=max_concurrent_jobs,
            drain_timeout=drain_timeout,
            worker_id=worker_id,
            heartbeat_interval=heartbeat_interval,
            reconnect_delay=reconnect_delay,
            handle_signals=handle_signals,
        )
        self.poll_wait = poll_wait
        self._transport = transport
        self._http: httpx.AsyncClient | None = None
        # The session secret from Registered: proves on every call that this
        # worker owns the session (an id alone grants nothing).
        self._session_headers: dict[str, str] = {}
        self._interval = 30.0
        self._poll_scope: anyio.CancelScope | None = None
        self._reporter = _HttpReporter(self)

    # ── public control ───────────────────────────────────────────────────


    def _fetch_transport(self) -> httpx.AsyncBaseTransport | None:
        return self._transport
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Register, poll and execute jobs until drained or stopped.

        ``task_status.started()`` fires once registered. 401/403 raises
        ``WorkerAuthError``; other failures are retried with backoff.
        """
        self._running = True
        configure_tracing()  # OTEL_TRACES_EXPORTER, as for the node
        fatal: WorkerAuthError | RegistrationRefusedError | None = None
        try:
            async with httpx.AsyncClient(
                base_url=self.server_url,
                headers=auth_headers(self.api_key),
                timeout=httpx.Timeout(CALL_TIMEOUT_S, read=self.poll_wait + CALL_TIMEOUT_S),
                transport=self._transport,
            ) as http:
                self._http = http
                async with anyio.create_task_group() as nursery:
                    self._root_scope = nursery.cancel_scope
                    if self._stopped:
                        nursery.cancel_scope.cancel()
                    with self._signals_handled():
                        try:
                            await self._register()
                            self.state = "connected"
                            task_status.started()
                            nursery.start_soon(self._heartbeat_loop)
                            nursery.start_soon(self._start_gates.run)
                            await self._poll_loop(nursery)
                            await self._wait_for_jobs()
                        except (WorkerAuthError, RegistrationRefusedError) as exc:
                            _log.error("%s; stopping", exc)
                            fatal = exc
                    nursery.cancel_scope.cancel()
                if self.session_id is not None and not self._stopped and fatal is None:
                    # Within the drain's deadline, like everything in a drain.
                    with anyio.CancelScope(deadline=self._call_deadline(GOODBYE_TIMEOUT_S)):
                        try:
                            await http.delete(
                                f"/v1/worker/sessions/{self.session_id}",
                                headers=self._session_headers,
                            )
                        except httpx.HTTPError:
                            pass
            if fatal is not None:
                raise fatal
        finally:
            self.state = "stopped"
            self._running = False
            self._http = None
            self._finished.set()
            _log.info("Worker stopped", extra=log_fields(worker_id=self.worker_id, mode="pull"))

    # ── internals ────────────────────────────────────────────────────────

    def _drain_started(self) -> None:
        if self._poll_scope is not None:
            self._poll_scope.cancel()

    def _on_shutdown(self, msg: Shutdown) -> None:
        """The node drains: drain too, within its deadline (a positive one wins)."""
        if not self._draining:
            _log.info("Engine asked to shut down: %s", msg.reason)
        timeout = msg.drain_timeout_ms / 1000.0 if msg.drain_timeout_ms > 0 else self.drain_timeout
        self._begin_drain(timeout)

    async def _post(self, path: str, body: Any) -> httpx.Response:
        assert self._http is not None
        return await self._http.post(
            f"/v1/worker/sessions/{self.session_id}{path}",
            content=encoder.encode(body),
            headers=self._session_headers,
        )

    async def _register(self) -> None:
        assert self._http is not None
        body = self._register_message()
        delay = POLL_BACKOFF_S[0]
        while True:
            try:
                resp = await self._http.post("/v1/worker/register", content=encoder.encode(body))
                if resp.status_code in (401, 403):
                    raise WorkerAuthError(
                        f"engine refused the worker's credentials (HTTP {resp.status_code})"
                    )
                if resp.status_code in (400, 413, 422):
                    raise RegistrationRefusedError(
                        f"engine refused the registration (HTTP {resp.status_code}):"
                        f" {_error_message(resp)}"
                    )
                if resp.status_code >= 400:
                    raise IronflowError(f"register failed: {resp.status_code} {_error_code(resp)}")
                reg = msgspec.json.decode(resp.content, type=Registered)
                break
            except (httpx.HTTPError, IronflowError, msgspec.DecodeError) as exc:
                if isinstance(exc, WorkerAuthError | RegistrationRefusedError):
                    raise
                _log.warning("Registration failed: %r; retrying in %.0fs", exc, delay)
                await anyio.sleep(delay)
                delay = min(delay * 2, POLL_BACKOFF_S[1])
        self.session_id = reg.session_id
        self._new_connection()
        self._session_headers = {SESSION_SECRET_HEADER: reg.session_secret or ""}
        self._interval = self.heartbeat_interval or reg.heartbeat_interval_ms / 1000.0
        if reg.max_frame_bytes:
            self.max_frame_bytes = reg.max_frame_bytes
        _log.info(
            "Worker registered",
            extra=log_fields(worker_id=self.worker_id, session_id=self.session_id, mode="pull"),
        )

    async def _reregister(self) -> None:
        for job in list(self._jobs.values()):
            self._abandon(job, "session lost")
        await self._register()

    async def _poll_loop(self, nursery: TaskGroup) -> None:
        assert self._http is not None
        delay = POLL_BACKOFF_S[0]
        with anyio.CancelScope() as scope:
            self._poll_scope = scope
            if self._draining:
                scope.cancel()
            while not self._draining:
                free = self.max_concurrent_jobs - len(self._jobs)
                if free <= 0:
                    self._jobs_changed = anyio.Event()
                    await self._jobs_changed.wait()
                    continue
                try:
                    resp = await self._post(
                        "/poll",
                        PullPollRequest(wait_s=self.poll_wait, max_jobs=free, delayed_start=True),
                    )
                    if resp.status_code in (401, 403):
                        raise WorkerAuthError(f"poll refused (HTTP {resp.status_code})")
                    if resp.status_code == 404:
                        raise _SessionLost()
                    if resp.status_code >= 400:
                        raise IronflowError(f"poll failed: {resp.status_code} {_error_code(resp)}")
                    # Held jobs' start delays run from here (see JobState).
                    received = anyio.current_time()
                    answer = msgspec.json.decode(resp.content, type=PullPollResponse)
                    jobs = answer.jobs
                    if answer.shutdown is not None:
                        self._on_shutdown(answer.shutdown)
                except _SessionLost:
                    await self._reregister()
                    continue
                except (httpx.HTTPError, msgspec.DecodeError) as exc:
                    _log.warning("Poll failed: %r; retrying in %.0fs", exc, delay)
                    await anyio.sleep(delay)
                    delay = min(delay * 2, POLL_BACKOFF_S[1])
                    continue
                except WorkerAuthError:
                    raise
                except IronflowError as exc:
                    _log.warning("%s; retrying in %.0fs", exc, delay)
                    await anyio.sleep(delay)
                    delay = min(delay * 2, POLL_BACKOFF_S[1])
                    continue
                delay = POLL_BACKOFF_S[0]
                # Shielded: a drain must not cut an ack in half; each call is bounded.
                with anyio.CancelScope(shield=True):
                    for a in jobs:
                        await self._on_assignment(a, nursery, received)
        self._poll_scope = None

    async def _on_assignment(self, a: JobAssignment, nursery: TaskGroup, received: float) -> None:
        if a.job_id in self._jobs:
            return
        fence = (a.job_id, a.run_id, a.execution_seq, a.lease_token)
        reason = self._refusal(a)
        if reason is not None:
            with anyio.CancelScope(deadline=self._call_deadline(CALL_TIMEOUT_S)):
                try:
                    await self._post("/nack", JobNack(*fence, reason=reason))
                except httpx.HTTPError as exc:
                    _log.warning("Could not nack a job: %r", exc, extra=log_fields(run_id=a.run_id))
            return
        job = JobState(a, self._start_time(a, received))
        self._jobs[a.job_id] = job
        if not await self._ack(job):
            # Not executed; the engine recovers the segment when its lease expires.
            del self._jobs[a.job_id]
            self._jobs_changed.set()
            return
        nursery.start_soon(self._execute, job, self._reporter)

    async def _ack(self, job: JobState) -> bool:
        """Post the job's JobAck; True if the engine took it."""
        a = job.assignment
        try:
            resp = await self._post("/ack", JobAck(a.job_id, a.run_id, a.execution_seq, a.lease_token))
        except httpx.HTTPError as exc:
            _log.warning("Ack failed: %r", exc, extra=log_fields(run_id=a.run_id))
            return False
        return resp.status_code < 400

    async def _wait_for_jobs(self) -> None:
        """Running jobs get the drain, less the end kept for the goodbye."""
        if not self._stopped:
            await self._await_jobs(self._drain_deadline - self._goodbye_reserve())

    async def _heartbeat_loop(self) -> None:
        while True:
            await anyio.sleep(self._interval)
            jobs = [j.active_job() for j in self._jobs.values() if not j.abandoned]
            try:
                resp = await self._post("/heartbeat", Heartbeat(jobs=jobs))
            except httpx.HTTPError as exc:
                _log.warning("Heartbeat failed: %r", exc)
                continue
            if resp.status_code == 404:
                await self._reregister()
                continue
            if resp.status_code >= 400:
                _log.warning("Heartbeat refused: %s %s", resp.status_code, _error_code(resp))
                continue
            self._on_lease_statuses(msgspec.json.decode(resp.content, type=LeaseStatus).jobs)
