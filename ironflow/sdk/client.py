"""The event clients: emit events, inspect and cancel runs over HTTP.

:class:`Ironflow` is async (asyncio or Trio: httpx runs on both; one client is
safe to share across an application's concurrent requests); :class:`IronflowSync`
is its blocking twin (for scripts and the ``ironflow`` CLI). Both send the
calls described in :mod:`ironflow.sdk.calls` and decode every answer into the
protocol's types, so they share paths, bodies, decoding and error mapping and
differ only in the httpx client underneath.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, TypeVar

import anyio
import httpx
import msgspec

from ironflow.config import DEFAULT_SERVER_URL
from ironflow.protocol import (
    ApiError,
    CancelResponse,
    EmitResponse,
    EventRecord,
    RunDetail,
    RunRecord,
    RunResult,
)
from ironflow.protocol.run_control import ResumeResponse, RunPauseResponse
from ironflow.sdk import calls, outage
from ironflow.sdk.calls import Answer, Call
from ironflow.sdk.errors import IronflowAPIError, RunFailedError
from ironflow.tracing import current_traceparent

# REST calls are short; a slow node should surface as an error, not a hang.
DEFAULT_TIMEOUT_S = 30.0
# How much of a non-JSON error page (a proxy's, a crash page) to keep in the message.
ERROR_TEXT_MAX = 500

T = TypeVar("T")


def raise_for_api_error(resp: httpx.Response) -> None:
    """Raise ``IronflowAPIError(status, code, message)`` for a 4xx/5xx answer.

    The API's ``{code, message}`` body is used as is; any other body (a proxy's
    page) becomes the reason phrase as code (``BAD_GATEWAY``) and its text.
    """
    if resp.status_code < 400:
        return
    body = api_error_of(resp)
    raise IronflowAPIError(resp.status_code, body.code, body.message)


def api_error_of(resp: httpx.Response) -> ApiError:
    """The ``{code, message}`` of an error answer; any other body (a proxy's
    page) becomes the reason phrase as code (``BAD_GATEWAY``) and its text."""
    try:
        return msgspec.json.decode(resp.content, type=ApiError)
    except msgspec.DecodeError:
        code = resp.reason_phrase.upper().replace(" ", "_") or "HTTP_ERROR"
        return ApiError(code, resp.text.strip()[:ERROR_TEXT_MAX] or "(empty answer)")


def auth_headers(api_key: str | None) -> dict[str, str]:
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    return headers


def _target(server_url: str | None, api_key: str | None) -> tuple[str, str | None]:
    """The server and key a client uses: the arguments, else ``IRONFLOW_*``, else defaults."""
    server = (server_url or os.environ.get("IRONFLOW_SERVER_URL") or DEFAULT_SERVER_URL).rstrip("/")
    return server, api_key if api_key is not None else os.environ.get("IRONFLOW_API_KEY")


def _answer(call: Call[T], resp: httpx.Response) -> Answer[T]:
    raise_for_api_error(resp)
    return Answer(call.decode(resp.content), resp.content)


def _function_id(function: str | Any) -> str:
    """A function id, or the id of a ``Function`` object."""
    return function if isinstance(function, str) else str(function.id)


def _result_deadline(timeout: float | None) -> float | None:
    """When a result wait gives up (monotonic clock); None waits on.

    Raises:
      ValueError: ``timeout`` is negative or not a number (0 asks once).
    """
    if timeout is None:
        return None
    if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout >= 0):
        raise ValueError(f"result(timeout=...) must be None or a number of seconds >= 0, got {timeout!r}")
    return time.monotonic() + timeout


def _output_of(outcome: RunResult, timeout: float | None) -> Any:
    """The output of an ended run; its error as RunFailedError; TimeoutError if not ended."""
    if not outcome.ended:
        raise TimeoutError(f"run {outcome.run_id} is still {outcome.status} after {timeout:g} s")
    if outcome.status == "completed":
        return outcome.output
    error = outcome.error
    raise RunFailedError(
        outcome.run_id,
        outcome.status,
        error.code if error else outcome.status.upper(),
        error.message if error else f"run {outcome.status}",
    )


class Ironflow:
    """Async client for an engine node's HTTP API.

    ``server_url`` defaults to ``IRONFLOW_SERVER_URL`` (else
    ``http://localhost:9123``), ``api_key`` to ``IRONFLOW_API_KEY``. Use as
    ``async with Ironflow() as client:`` or call ``aclose()``. Every method
    raises ``IronflowAPIError`` on a 4xx/5xx answer, ``msgspec.DecodeError``
    on an answer that is not the documented type, and httpx's errors when the
    node cannot be reached.
    """

    def __init__(
        self,
        server_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.server_url, self.api_key = _target(server_url, api_key)
        self._http = httpx.AsyncClient(
            base_url=self.server_url,
            headers=auth_headers(self.api_key),
            timeout=timeout,
            transport=transport,
        )

    async def __aenter__(self) -> Ironflow:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def request(self, call: Call[T]) -> Answer[T]:
        """Send ``call`` (see :mod:`ironflow.sdk.calls`); its decoded answer and raw JSON."""
        return _answer(call, await self._send(call))

    async def _send(self, call: Call[Any]) -> httpx.Response:
        return await self._http.request(
            call.method, call.path, content=call.content(), params=call.query() or None,
            timeout=call.timeout if call.timeout is not None else httpx.USE_CLIENT_DEFAULT,
        )

    async def emit(
        self, name: str, data: Any = None, idempotency_key: str | None = None
    ) -> EmitResponse:
        """Emit event ``name`` with ``data``; returns the event id and the runs it started.

        The current OpenTelemetry span (if any) is sent as the event's
        ``traceparent``: the run's trace joins it. An outage of the engine's
        database (503/507) is waited out: the emit is sent again, bounded and
        backing off, each time logged (:mod:`ironflow.sdk.outage`)."""
        call = calls.emit(name, data, idempotency_key, current_traceparent())
        attempt = 1
        while True:
            resp = await self._send(call)
            delay = outage.retry_delay(resp, attempt, keyed=idempotency_key is not None)
            if delay is None:
                return _answer(call, resp).value
            outage.log_retry(name, resp, attempt, delay)
            await anyio.sleep(delay)
            attempt += 1

    async def get_run(self, run_id: str) -> RunDetail:
        """The run with its steps, queue entry, lease and why it waits."""
        return (await self.request(calls.get_run(run_id))).value

    async def list_runs(
        self, *, status: str | None = None, function: str | None = None, limit: int | None = None,
        include_data: bool = False,
    ) -> list[RunRecord]:
        """The newest runs (one page), optionally filtered by status and function
        id; without their outputs unless ``include_data`` (:meth:`get_run` has
        them). :meth:`iter_runs` reads every page."""
        call = calls.list_runs(status=status, function=function, limit=limit, include_data=include_data)
        return (await self.request(call)).value.runs

    async def iter_runs(
        self, *, status: str | None = None, function: str | None = None, page_size: int | None = None,
        include_data: bool = False,
    ) -> AsyncIterator[RunRecord]:
        """Every run, newest first, page by page (a run created meanwhile may or
        may not be seen; none is seen twice)."""
        cursor: str | None = None
        while True:
            call = calls.list_runs(
                status=status, function=function, limit=page_size, cursor=cursor, include_data=include_data
            )
            page = (await self.request(call)).value
            for run in page.runs:
                yield run
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def list_events(
        self, *, name: str | None = None, limit: int | None = None, include_data: bool = False
    ) -> list[EventRecord]:
        """The newest stored events (one page), each with the runs it started and
        what became of it; without their data unless ``include_data``."""
        call = calls.list_events(name=name, limit=limit, include_data=include_data)
        return (await self.request(call)).value.events

    async def cancel_run(self, run_id: str, reason: str = "cancelled by user") -> CancelResponse:
        """Cancel a run; its worker is told to stop the running segment."""
        return (await self.request(calls.cancel_run(run_id, reason))).value

    # run control (docs/run-control.md)
    async def resume_run(self, run_id: str, from_step: str | None = None) -> ResumeResponse:
        """A failed run again from its failed step (or ``from_step``), or a paused run."""
        return (await self.request(calls.resume_run(run_id, from_step))).value

    async def pause_run(self, run_id: str) -> RunPauseResponse:
        """Take a run off the queue; a running one stops at its next step boundary."""
        return (await self.request(calls.pause_run(run_id))).value

    async def invoke(
        self, function: str | Any, data: Any = None, *, wait: bool = False, timeout: float | None = None
    ) -> Any:
        """Start ``function`` (an id or a ``Function``) directly.

        Returns the new run id; with ``wait=True``, the run's output once it
        ends (as :meth:`result`).
        """
        run_id = (await self.request(calls.invoke(_function_id(function), data))).value.run_id
        return await self.result(run_id, timeout=timeout) if wait else run_id

    async def send(self, name: str, data: Any = None, idempotency_key: str | None = None) -> EmitResponse:
        """Send event ``name`` (the same as :meth:`emit`)."""
        return await self.emit(name, data, idempotency_key)

    async def result(self, run_id: str, *, timeout: float | None = None) -> Any:
        """The run's output as soon as it ends (the node holds the request open).

        Raises:
          RunFailedError: the run failed or was cancelled (its code and message).
          TimeoutError: it had not ended after ``timeout`` seconds (None: wait on).
          ValueError: ``timeout`` is negative or not a number.
          IronflowAPIError: the node refused (404 for an unknown run).
        """
        deadline = _result_deadline(timeout)
        while True:
            wait_s = calls.RESULT_WAIT_MAX_S if deadline is None else deadline - time.monotonic()
            outcome = (await self.request(calls.run_result(run_id, wait_s))).value
            if outcome.ended or (deadline is not None and time.monotonic() >= deadline):
                return _output_of(outcome, timeout)


class IronflowSync:
    """The blocking twin of :class:`Ironflow`, for scripts and the CLI.

    Same arguments and defaults; ``transport`` is a sync httpx transport
    (tests pass ``httpx.MockTransport``). Use as ``with IronflowSync() as
    client:`` or call ``close()``. :meth:`send` raises what
    :meth:`Ironflow.send` raises.
    """

    def __init__(
        self,
        server_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ):
        self.server_url, self.api_key = _target(server_url, api_key)
        self._http = httpx.Client(
            base_url=self.server_url,
            headers=auth_headers(self.api_key),
            timeout=timeout,
            transport=transport,
        )

    def __enter__(self) -> IronflowSync:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def request(self, call: Call[T]) -> Answer[T]:
        """Send ``call`` (see :mod:`ironflow.sdk.calls`); its decoded answer and raw JSON."""
        return _answer(call, self._send(call))

    def _send(self, call: Call[Any]) -> httpx.Response:
        return self._http.request(
            call.method, call.path, content=call.content(), params=call.query() or None,
            timeout=call.timeout if call.timeout is not None else httpx.USE_CLIENT_DEFAULT,
        )

    def emit(self, name: str, data: Any = None, idempotency_key: str | None = None) -> EmitResponse:
        """As :meth:`Ironflow.emit`, blocking (its outage retries too)."""
        call = calls.emit(name, data, idempotency_key, current_traceparent())
        attempt = 1
        while True:
            resp = self._send(call)
            delay = outage.retry_delay(resp, attempt, keyed=idempotency_key is not None)
            if delay is None:
                return _answer(call, resp).value
            outage.log_retry(name, resp, attempt, delay)
            time.sleep(delay)
            attempt += 1

    send = emit

    def invoke(
        self, function: str | Any, data: Any = None, *, wait: bool = False, timeout: float | None = None
    ) -> Any:
        """As :meth:`Ironflow.invoke`, blocking."""
        run_id = self.request(calls.invoke(_function_id(function), data)).value.run_id
        return self.result(run_id, timeout=timeout) if wait else run_id

    def result(self, run_id: str, *, timeout: float | None = None) -> Any:
        """As :meth:`Ironflow.result`, blocking."""
        deadline = _result_deadline(timeout)
        while True:
            wait_s = calls.RESULT_WAIT_MAX_S if deadline is None else deadline - time.monotonic()
            outcome = self.request(calls.run_result(run_id, wait_s)).value
            if outcome.ended or (deadline is not None and time.monotonic() >= deadline):
                return _output_of(outcome, timeout)
