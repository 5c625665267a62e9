"""``POST /v1/events`` and ``GET /v1/runs/{id}/result`` served straight on
ASGI, ahead of the framework.

Why: every run starts with an emit, and on this project's 2-core machine
hypercorn alone answers a small POST for ~1.0 CPU-ms while the same route
through quart-trio costs ~1.8 ms (request context, URL map, signals, the
response object); that difference was a fifth of a whole 3-step run's node CPU
(measured with a bare ASGI app vs a one-route quart app, 3,000 requests, 32 in
flight). So this one route skips the framework: the handler logic is the
route's own (:func:`ironflow.api.events.ingest_one`), auth is the same
:func:`~ironflow.api.auth.require_org`, and every failure gets the same
``{code, message}`` answer the framework's error handlers give. Every other
request (including ``GET /v1/events``) goes to the quart app unchanged, and the
quart route stays registered, so the URL map and ``/openapi.json`` still list it.

The result wait is here for the same reason: with ``send()`` it is the other
half of a client's round trip (``client.result()``), and its framework cost
landed on the node's one thread while the run it waits for was being
dispatched (:func:`ironflow.api.runs.await_result` is the route's logic).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl

import trio
from hypercorn.typing import (
    ASGIReceiveCallable,
    ASGISendCallable,
    HTTPResponseStartEvent,
    Scope,
)

from ironflow import logs
from ironflow.api import events, runs
from ironflow.api.auth import require_org
from ironflow.api.errors import STATUS_FOR_CODE, ApiFailure, float_param, store_error_headers
from ironflow.api.state import EXTENSION, ApiState
from ironflow.ids import new_id
from ironflow.protocol import ApiError, encoder
from ironflow.store import StoreError
from ironflow.store.availability import ANSWER_WHEN_DOWN

log = logging.getLogger("ironflow.api")

_JSON_HEADERS = [(b"content-type", b"application/json")]
# ``GET /v1/runs/{run_id}/result``: the path around the run id.
_RESULT_PATH = ("/v1/runs/", "/result")

# A hot route's answer: status, JSON body, extra headers.
_Answer = tuple[int, bytes, list[tuple[bytes, bytes]]]


class _Headers:
    """Case-insensitive ``get`` over an ASGI scope's raw headers (what auth reads)."""

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self._raw = raw

    def get(self, name: str, default: str = "") -> str:
        wanted = name.lower().encode()
        for key, value in self._raw:
            if key.lower() == wanted:
                return value.decode("latin-1")
        return default


async def _serve_lifespan(receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
    """Answer the ASGI lifespan protocol: startup and shutdown complete at once.

    The node is the application's lifecycle (its nursery starts the store and
    every actor before hypercorn serves, and stops them after), and the quart
    app registers no serving hooks and runs no background tasks
    (tests/api/test_lifespan.py holds that), so quart-trio's lifespan handler
    has nothing to do here. Serving it here means hypercorn never logs "ASGI
    Framework Lifespan error, continuing without Lifespan support" (which it
    did when that handler raised before its startup completed).
    """
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


class HotRoutes:
    """ASGI app: ``POST /v1/events`` and ``GET /v1/runs/{id}/result`` here,
    everything else to ``app`` (the quart app)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.st: ApiState = app.extensions[EXTENSION]
        self.max_body = self.st.config.max_frame_bytes

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "http":
            # This request's task only (hypercorn gives each its own): its
            # store calls are answered 503 the moment the database is known
            # gone, not when a silent connection gives up (a worker's
            # websocket session, not an HTTP request, awaits every outcome).
            ANSWER_WHEN_DOWN.set(True)
            if scope["method"] == "POST" and scope["path"] == "/v1/events":
                headers = list(scope["headers"])
                await _respond(send, await _answer("POST", scope["path"], lambda: self._emit(headers, receive)))
                return
            run_id = _result_run_id(scope["method"], scope["path"])
            if run_id is not None:
                headers, query = list(scope["headers"]), scope["query_string"]
                await self._serve_result(headers, run_id, query, receive, send)
                return
        if scope["type"] == "lifespan":
            await _serve_lifespan(receive, send)
            return
        await self.app(scope, receive, send)

    async def _emit(self, headers: list[tuple[bytes, bytes]], receive: ASGIReceiveCallable) -> _Answer:
        await require_org(_Headers(headers), self.st)
        raw = await self._body(receive)
        traceparent = _Headers(headers).get("traceparent") or None
        answer, status = await events.ingest_one(self.st, raw, traceparent)
        return status, encoder.encode(answer), []

    async def _serve_result(
        self,
        headers: list[tuple[bytes, bytes]],
        run_id: str,
        query: bytes,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
    ) -> None:
        """The result wait, given up when the client goes away (hypercorn does
        not cancel an application; the framework's route is cancelled so)."""
        answers: list[_Answer] = []
        path = f"{_RESULT_PATH[0]}{run_id}{_RESULT_PATH[1]}"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            answers.append(await _answer("GET", path, lambda: self._result(headers, run_id, query)))
            nursery.cancel_scope.cancel()
        if answers:
            await _respond(send, answers[0])

    async def _result(self, headers: list[tuple[bytes, bytes]], run_id: str, query: bytes) -> _Answer:
        await require_org(_Headers(headers), self.st)
        raw = _query_param(query, "wait_s")
        wait_s = float_param("wait_s", raw, 0.0, low=0.0, high=runs.MAX_RESULT_WAIT_S)
        answer, status = await runs.await_result(self.st, run_id, wait_s)
        return status, encoder.encode(answer), []

    async def _body(self, receive: ASGIReceiveCallable) -> bytes:
        """The request body, refused with a 413 past the frame limit (as quart's
        ``MAX_CONTENT_LENGTH`` does), whether or not a Content-Length said so."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ApiFailure(400, "BAD_REQUEST", "the client went away mid-request")
            chunk: bytes = message.get("body", b"")  # type: ignore[assignment]
            size += len(chunk)
            if size > self.max_body:
                raise ApiFailure(
                    413, "PAYLOAD_TOO_LARGE", f"request body exceeds {self.max_body} bytes"
                )
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _result_run_id(method: str, path: str) -> str | None:
    """The run id of a ``GET /v1/runs/{run_id}/result``, else None."""
    prefix, suffix = _RESULT_PATH
    if method != "GET" or not path.startswith(prefix) or not path.endswith(suffix):
        return None
    run_id = path[len(prefix) : -len(suffix)]
    return run_id if run_id and "/" not in run_id else None


async def _cancel_on_disconnect(receive: ASGIReceiveCallable, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


def _query_param(query: bytes, name: str) -> str | None:
    """The first value of ``name`` in a raw query string, as the framework's
    ``request.args.get`` reads it (a blank value is kept: it is a 400)."""
    for key, value in parse_qsl(query.decode("latin-1"), keep_blank_values=True):
        if key == name:
            return value
    return None


async def _answer(method: str, path: str, handle: Callable[[], Awaitable[_Answer]]) -> _Answer:
    """``handle()``'s answer, or the ``{code, message}`` answer the framework's
    error handlers give for what it raised."""
    try:
        return await handle()
    except ApiFailure as exc:
        extra = [(k.lower().encode(), v.encode()) for k, v in exc.headers]
        return exc.status, encoder.encode(ApiError(exc.code, exc.message)), extra
    except StoreError as exc:
        status = STATUS_FOR_CODE.get(exc.code, 400)
        extra = [(k.lower().encode(), v.encode()) for k, v in store_error_headers(exc)]
        return status, encoder.encode(ApiError(exc.code, str(exc) or exc.code)), extra
    except Exception as exc:  # a fault of ours: logged with an id the caller sees
        request_id = new_id("req")
        logs.event(
            log, logging.ERROR, "api: internal error", request_id=request_id,
            method=method, path=path, error=type(exc).__name__, exc_info=exc,
        )
        message = f"internal error: {type(exc).__name__} (request id {request_id})"
        return 500, encoder.encode(ApiError("INTERNAL", message)), []


async def _respond(send: ASGISendCallable, answer: _Answer) -> None:
    status, body, extra = answer
    start: HTTPResponseStartEvent = {
        "type": "http.response.start",
        "status": status,
        "headers": [*_JSON_HEADERS, *extra, (b"content-length", str(len(body)).encode())],
        "trailers": False,
    }
    await send(start)
    await send({"type": "http.response.body", "body": body, "more_body": False})
