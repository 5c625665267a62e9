"""The node's HTTP and websocket surface (quart-trio under hypercorn).

REST under ``/v1`` for events, runs, functions, audit, keys and capacity; the
streaming-worker websocket ``/v1/worker`` (one session actor per socket); the
pull-worker long-poll endpoints; ``/healthz``, ``/readyz``, ``/metrics``.
See ``docs/http-api.md``.

Bad input never takes the node down: bodies are decoded with typed msgspec
decoders and every failure becomes ``{code, message}`` with a 4xx status; a
bad websocket frame closes that socket with 1002/1003/1009 and a reason.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Literal, NoReturn, TypeVar

import msgspec
import trio
from quart import Response, has_websocket_context, request, websocket
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException
from werkzeug.routing import WebsocketMismatch

from actors import session as session_actor
from actors.directory import LocalSession, SessionDirectory
from actors.messages import Kick, kick
from ironflow import logs, metrics, retention
from ironflow.config import NodeConfig
from ironflow.ids import new_id
from ironflow.protocol import (
    MAX_JSON_DEPTH,
    SESSION_SECRET_HEADER,
    TERMINAL_RUN_STATUSES,
    Cancel,
    CancelRequest,
    EmitBatchRequest,
    EmitBatchResponse,
    EmitRequest,
    EmitResponse,
    EngineMessage,
    FencedResponse,
    Heartbeat,
    InvokeRequest,
    JobAck,
    JobCompleted,
    JobFailed,
    JobNack,
    JobYielded,
    JsonTooDeep,
    KeyCreateRequest,
    KeyCreateResponse,
    PullPollRequest,
    PullPollResponse,
    PurgeRequest,
    PurgeResponse,
    Refused,
    Register,
    Registered,
    StepCompleted,
    StepFailed,
    WorkerMessage,
    check_json_depth,
    encoder,
    worker_message_decoder,
)
from ironflow.store import (
    Principal,
    SessionInfo,
    SessionNotFound,
    StaleExecution,
    Store,
    StoreError,
)
from ironflow.store.core import token_hash

log = logging.getLogger("ironflow.api")

T = TypeVar("T")

# Roles of a platform key that may mint further platform keys.
PLATFORM_ADMIN_ROLES = frozenset({"admin", "platform_admin"})
# How long a verified API key is trusted without asking the database again.
AUTH_CACHE_S = 30.0
# Verified pull sessions kept in memory; past this the cache starts afresh
# (sessions that expire without a goodbye would otherwise accumulate).
PULL_SESSION_CACHE = 10_000
# Websocket close codes (RFC 6455).
WS_PROTOCOL_ERROR = 1002
WS_UNSUPPORTED_DATA = 1003
WS_INVALID_PAYLOAD = 1007
WS_POLICY_VIOLATION = 1008
WS_INTERNAL_ERROR = 1011
WS_GOING_AWAY = 1001
# How long closing a worker socket may wait for the close handshake.
WS_CLOSE_TIMEOUT_S = 1.0

_STATUS_FOR_CODE = {
    "STALE_EXECUTION": 409,
    "CONFLICT": 409,
    "NOT_FOUND": 404,
    "FUNCTION_NOT_FOUND": 404,
    "RUN_NOT_FOUND": 404,
    "SESSION_NOT_FOUND": 404,
    "LIMIT_EXCEEDED": 422,
}


class ApiFailure(Exception):
    """An error answer: HTTP ``status`` with a stable ``code`` and a human message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class _CloseSocket(Exception):
    """Close the worker socket with ``code``; ``refusal`` is sent first when set,
    so the worker's SDK can report why rather than reconnect blindly."""

    def __init__(self, code: int, reason: str, refusal: Refused | None = None) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.refusal = refusal


class ApiDeps:
    """Everything the API needs from the node, passed in once."""

    def __init__(
        self,
        *,
        store: Store,
        config: NodeConfig,
        node_id: str,
        directory: SessionDirectory,
        kicks: trio.MemorySendChannel[Kick],
        shutdown_requested: trio.Event,
        ready: trio.Event,
    ) -> None:
        self.store = store
        self.config = config
        self.node_id = node_id
        self.directory = directory
        self.kicks = kicks
        self.shutdown_requested = shutdown_requested
        self.ready = ready


def _json(obj: Any, status: int = 200) -> Response:
    return Response(encoder.encode(obj), status=status, content_type="application/json")


def _error(status: int, code: str, message: str) -> Response:
    return _json({"code": code, "message": message}, status)


def _fail(status: int, code: str, message: str) -> NoReturn:
    raise ApiFailure(status, code, message)


def decode_frame(body: bytes | str, kind: Any) -> Any:
    """Decode one JSON body or frame as ``kind`` (a type or a typed Decoder).

    Raises:
      JsonTooDeep: nested deeper than MAX_JSON_DEPTH (checked before decoding).
      msgspec.DecodeError / msgspec.ValidationError: malformed, or not a ``kind``.
    """
    check_json_depth(body)
    try:
        if isinstance(kind, msgspec.json.Decoder):
            return kind.decode(body)
        return msgspec.json.decode(body, type=kind)
    except RecursionError as exc:  # backstop; the depth check should have caught it
        raise JsonTooDeep(f"JSON nests deeper than the limit of {MAX_JSON_DEPTH} levels") from exc


def _decode(body: bytes | str, kind: type[T]) -> T:
    if not body.strip():
        _fail(400, "BAD_REQUEST", "request body is empty; expected a JSON object")
    try:
        return decode_frame(body, kind)  # type: ignore[no-any-return]
    except JsonTooDeep as exc:
        _fail(400, "BAD_REQUEST", str(exc))
    except msgspec.ValidationError as exc:
        _fail(400, "VALIDATION_ERROR", f"invalid {getattr(kind, '__name__', 'message')}: {exc}")
    except msgspec.DecodeError as exc:
        _fail(400, "BAD_REQUEST", f"invalid JSON body: {exc}")


def _where() -> tuple[str, str]:
    """Method and path of the request or websocket being handled."""
    if has_websocket_context():
        return "WEBSOCKET", websocket.path
    return request.method, request.path


def _query_int(name: str, default: int, *, low: int = 1, high: int = 1000) -> int:
    raw = request.args.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        _fail(400, "VALIDATION_ERROR", f"query parameter {name} must be an integer, got {raw!r}")
    if not low <= value <= high:
        _fail(400, "VALIDATION_ERROR", f"query parameter {name} must be in {low}..{high}")
    return value


def create_app(deps: ApiDeps) -> QuartTrio:
    """Build the quart-trio application serving ``deps``."""
    app = QuartTrio("ironflow")
    app.config["MAX_CONTENT_LENGTH"] = deps.config.max_frame_bytes
    store = deps.store
    config = deps.config
    auth_cache: dict[str, tuple[float, Principal]] = {}
    # Pull sessions this node has verified: id → (hash of its secret, session).
    pull_sessions: dict[str, tuple[str, SessionInfo]] = {}

    async def principal(headers: Any) -> Principal | None:
        header = headers.get("Authorization", "")
        if not header:
            return None
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            _fail(401, "UNAUTHORIZED", "Authorization header must be 'Bearer <key>'")
        digest = hashlib.sha256(key.strip().encode()).hexdigest()
        cached = auth_cache.get(digest)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        found = await store.authenticate(key.strip())
        if found is None:
            _fail(401, "UNAUTHORIZED", "invalid API key")
        auth_cache[digest] = (time.monotonic() + AUTH_CACHE_S, found)
        return found

    async def require_org(headers: Any = None) -> Principal | None:
        found = await principal(headers if headers is not None else request.headers)
        if found is None and not config.dev:
            _fail(401, "UNAUTHORIZED", "an API key is required (Authorization: Bearer ifkey_…)")
        return found

    async def require_platform() -> Principal:
        found = await principal(request.headers)
        if found is None or found.kind != "platform":
            _fail(403, "FORBIDDEN", "platform credentials required here")
        return found

    @app.errorhandler(ApiFailure)
    async def on_api_failure(exc: ApiFailure) -> Response:
        return _error(exc.status, exc.code, exc.message)

    @app.errorhandler(StoreError)
    async def on_store_error(exc: StoreError) -> Response:
        return _error(_STATUS_FOR_CODE.get(exc.code, 400), exc.code, str(exc) or exc.code)

    @app.errorhandler(WebsocketMismatch)
    async def on_websocket_mismatch(_: Any) -> Response:
        method, path = _where()
        if method == "WEBSOCKET":
            return _error(400, "BAD_REQUEST", f"{path} is not a websocket endpoint")
        response = _error(
            426, "UPGRADE_REQUIRED", f"{path} is the worker websocket: connect with a websocket upgrade"
        )
        response.headers["Upgrade"] = "websocket"
        return response

    @app.errorhandler(404)
    async def on_not_found(_: Any) -> Response:
        method, path = _where()
        return _error(404, "NOT_FOUND", f"no route for {method} {path}")

    @app.errorhandler(405)
    async def on_bad_method(_: Any) -> Response:
        method, path = _where()
        return _error(405, "METHOD_NOT_ALLOWED", f"{method} is not allowed on {path}")

    @app.errorhandler(413)
    async def on_too_large(_: Any) -> Response:
        return _error(
            413, "PAYLOAD_TOO_LARGE", f"request body exceeds {config.max_frame_bytes} bytes"
        )

    @app.errorhandler(HTTPException)
    async def on_http_exception(exc: HTTPException) -> Response:
        # The framework's own refusals (bad request line, wrong method, …) keep
        # their status; only a real fault below becomes a 500.
        status = exc.code or 400
        code = (exc.name or "HTTP error").upper().replace(" ", "_")
        return _error(status, code, exc.description or exc.name or "HTTP error")

    @app.errorhandler(Exception)
    async def on_unexpected(exc: Exception) -> Response:
        method, path = _where()
        request_id = new_id("req")
        logs.event(
            log,
            logging.ERROR,
            "api: internal error",
            request_id=request_id,
            method=method,
            path=path,
            error=type(exc).__name__,
            exc_info=exc,
        )
        return _error(
            500, "INTERNAL", f"internal error: {type(exc).__name__} (request id {request_id})"
        )

    # ── health ──────────────────────────────────────────────────────────────

    @app.get("/healthz")
    async def healthz() -> Response:
        return _json({"status": "ok", "node_id": deps.node_id})

    @app.get("/readyz")
    async def readyz() -> Response:
        if deps.shutdown_requested.is_set():
            return _json({"status": "draining"}, 503)
        if not deps.ready.is_set():
            return _json({"status": "starting"}, 503)
        return _json({"status": "ready", "node_id": deps.node_id})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), content_type="text/plain; version=0.0.4")

    # ── events, runs, functions ───────────────────────────────────────────────

    @app.post("/v1/events")
    async def emit() -> Response:
        await require_org()
        body = _decode(await request.get_data(), EmitRequest)
        result = await store.ingest_event(
            body.name, body.data, body.idempotency_key, idempotency_window_s=config.idempotency_window_s
        )
        if not result.duplicate:
            metrics.EVENTS_EMITTED.inc()
            # New runs, and parked runs whose wait_for_event this event matched.
            if result.run_ids or getattr(result, "resumed_run_ids", None):
                kick(deps.kicks, "event ingested")
        logs.event(
            log,
            logging.DEBUG,
            "event: ingested",
            event_id=result.event_id,
            runs=len(result.run_ids),
            duplicate=result.duplicate,
        )
        return _json(EmitResponse(result.event_id, result.run_ids, result.duplicate), 200 if result.duplicate else 201)

    @app.post("/v1/events/batch")
    async def emit_batch() -> Response:
        await require_org()
        body = _decode(await request.get_data(), EmitBatchRequest)
        results = await store.ingest_events(
            [(e.name, e.data, e.idempotency_key) for e in body.events],
            idempotency_window_s=config.idempotency_window_s,
        )
        fresh = [r for r in results if not r.duplicate]
        metrics.EVENTS_EMITTED.inc(len(fresh))
        if any(r.run_ids or getattr(r, "resumed_run_ids", None) for r in fresh):
            kick(deps.kicks, "events ingested")
        return _json(
            EmitBatchResponse([EmitResponse(r.event_id, r.run_ids, r.duplicate) for r in results]), 201
        )

    @app.get("/v1/runs")
    async def list_runs() -> Response:
        await require_org()
        runs = await store.list_runs(
            status=request.args.get("status") or None,
            function_id=request.args.get("function") or None,
            limit=_query_int("limit", 50),
        )
        return _json({"runs": runs})

    @app.get("/v1/runs/<run_id>")
    async def get_run(run_id: str) -> Response:
        await require_org()
        return _json(await store.get_run(run_id))

    @app.post("/v1/runs/<run_id>/cancel")
    async def cancel_run(run_id: str) -> Response:
        await require_org()
        raw = await request.get_data()
        body = _decode(raw, CancelRequest) if raw.strip() else CancelRequest()
        outcome = await store.cancel_run(run_id, body.reason)
        if outcome.session_id is not None and outcome.job_id is not None:
            local = deps.directory.get(outcome.session_id)
            if local is not None:
                try:
                    local.outbox.send_nowait(Cancel(outcome.job_id, run_id, body.reason))
                except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # the fence refuses anything the segment still sends
        metrics.RUNS_FINISHED.labels(status="cancelled").inc()
        logs.event(log, logging.INFO, "run: cancelled", run_id=run_id, session_id=outcome.session_id)
        kick(deps.kicks, "run cancelled")  # a parent waiting on this run may resume
        return _json({"run_id": run_id, "status": "cancelled"})

    @app.post("/v1/runs/purge")
    async def purge_runs() -> Response:
        caller = await require_platform()
        body = _decode(await request.get_data(), PurgeRequest)
        statuses = frozenset(body.statuses) if body.statuses else TERMINAL_RUN_STATUSES
        counts = await retention.purge_pass(
            store,
            older_than_s=body.older_than_s,
            idempotency_window_s=config.idempotency_window_s,
            by=f"api:{caller.key_id}",
            statuses=statuses,
            wait_for_lock=True,  # an operator asked now: wait out another node's batch
        )
        logs.event(
            log,
            logging.INFO,
            "runs: purged on request",
            key_id=caller.key_id,
            runs=counts.runs,
            steps=counts.steps,
            audit=counts.audit,
            events=counts.events,
        )
        return _json(
            PurgeResponse(counts.runs, counts.steps, counts.audit, counts.events, body.older_than_s)
        )

    @app.get("/v1/functions")
    async def list_functions() -> Response:
        await require_org()
        records = await store.list_functions(live_within_s=config.limits.function_live_s)
        if request.args.get("all", "").lower() not in ("1", "true", "yes"):
            records = [r for r in records if r.live]
        return _json({"functions": records})

    @app.post("/v1/functions/<function_id>/invoke")
    async def invoke(function_id: str) -> Response:
        await require_org()
        raw = await request.get_data()
        body = _decode(raw, InvokeRequest) if raw.strip() else InvokeRequest()
        run_id = await store.invoke_function(function_id, body.data)
        kick(deps.kicks, "function invoked")
        return _json({"run_id": run_id}, 201)

    @app.get("/v1/audit")
    async def audit() -> Response:
        await require_org()
        events = await store.list_audit(
            run_id=request.args.get("run_id") or None,
            type=request.args.get("type") or None,
            limit=_query_int("limit", 100),
        )
        return _json({"events": events})

    @app.post("/v1/keys")
    async def create_key() -> Response:
        raw = await request.get_data()
        body = _decode(raw, KeyCreateRequest) if raw.strip() else KeyCreateRequest()
        caller = await principal(request.headers)
        if body.platform:
            if caller is None or caller.kind != "platform":
                _fail(403, "FORBIDDEN", "platform credentials required here")
            if caller.role not in PLATFORM_ADMIN_ROLES:
                _fail(403, "FORBIDDEN", "only a platform admin can create platform keys")
        elif caller is None:
            if not config.dev:
                _fail(401, "UNAUTHORIZED", "an admin API key is required to create keys")
        elif caller.kind == "org" and caller.role != "admin":
            _fail(403, "FORBIDDEN", "only an admin key can create keys")
        kind: Literal["org", "platform"] = "platform" if body.platform else "org"
        key_id, key = await store.create_api_key(kind, body.role)
        return _json(KeyCreateResponse(key_id, key, kind, body.role), 201)

    # ── capacity (platform principal only) ───────────────────────────────────

    @app.get("/v1/capacity/leases")
    async def capacity_leases() -> Response:
        await require_platform()
        return _json({"leases": await store.list_leases()})

    @app.get("/v1/capacity/sessions")
    async def capacity_sessions() -> Response:
        await require_platform()
        return _json({"sessions": await store.list_sessions()})

    @app.get("/v1/capacity/queue")
    async def capacity_queue() -> Response:
        await require_platform()
        return _json({"queue": await store.list_queue()})

    # ── pull workers ──────────────────────────────────────────────────────────

    @app.post("/v1/worker/register")
    async def pull_register() -> Response:
        await require_org()
        if deps.shutdown_requested.is_set():
            _fail(503, "DRAINING", "this node is draining; register with another node")
        body = _decode(await request.get_data(), Register)
        try:
            info = await session_actor.register(store, config, deps.node_id, body, "pull")
        except session_actor.RegistrationRefused as exc:
            _fail(422, exc.code, str(exc))
        assert info.secret is not None
        pull_sessions[info.session_id] = (token_hash(info.secret), info)
        logs.event(
            log, logging.INFO, "session: pull worker registered", session_id=info.session_id, worker_id=body.worker_id
        )
        t = config.timings
        return _json(
            Registered(
                info.session_id,
                int(t.heartbeat_interval_s * 1000),
                int(t.lease_expiry_s * 1000),
                session_secret=info.secret,
            ),
            201,
        )

    async def pull_session(session_id: str) -> SessionInfo:
        """The pull session the caller proves it owns (its secret in the header).

        A streaming session's id, an unknown or expired id and a wrong secret
        all answer the same 404 and change nothing: an id alone grants nothing.
        """
        secret = request.headers.get(SESSION_SECRET_HEADER, "")
        digest = token_hash(secret) if secret else ""
        known = pull_sessions.get(session_id)
        if known is not None and secret and known[0] == digest:
            return known[1]
        found = await store.pull_session(session_id, secret) if secret else None
        if found is None:
            _fail(404, "SESSION_NOT_FOUND", f"worker session {session_id} is unknown or expired; register again")
        if len(pull_sessions) >= PULL_SESSION_CACHE:
            pull_sessions.clear()  # expired sessions never said goodbye; start afresh
        pull_sessions[session_id] = (digest, found)
        return found

    @app.post("/v1/worker/sessions/<session_id>/poll")
    async def pull_poll(session_id: str) -> Response:
        await require_org()
        raw = await request.get_data()
        body = _decode(raw, PullPollRequest) if raw.strip() else PullPollRequest()
        session = await pull_session(session_id)
        wait_s = min(body.wait_s, config.timings.poll_max_wait_s)
        send, receive = trio.open_memory_channel[EngineMessage](body.max_jobs)
        local = LocalSession(session_id, frozenset(session.function_ids), send, mode="pull")
        jobs: list[Any] = []
        deps.directory.add(local)
        try:
            kick(deps.kicks, "pull poll")
            with trio.move_on_after(wait_s):
                jobs.append(await receive.receive())
            # No checkpoint between draining and closing: the dispatcher cannot
            # slip an assignment into the buffer after we looked; a later send
            # fails and the dispatcher releases that reservation at once.
            while True:
                try:
                    jobs.append(receive.receive_nowait())
                except trio.WouldBlock:
                    break
        finally:
            deps.directory.remove(session_id, send)
            receive.close()
        return _json(PullPollResponse(jobs))

    async def pull_message(session_id: str, kinds: tuple[type, ...]) -> Response:
        await require_org()
        msg: WorkerMessage = _decode(await request.get_data(), WorkerMessage)  # type: ignore[arg-type]
        if not isinstance(msg, kinds):
            _fail(
                400,
                "VALIDATION_ERROR",
                f"{type(msg).__name__} is not accepted here; expected {' or '.join(k.__name__ for k in kinds)}",
            )
        await pull_session(session_id)
        try:
            answer = await session_actor.handle(store, config, session_id, msg, deps.kicks)
        except StaleExecution as exc:
            metrics.STALE_REFUSED.inc()
            _fail(409, "STALE_EXECUTION", str(exc) or "stale execution: this segment was fenced")
        except SessionNotFound as exc:
            pull_sessions.pop(session_id, None)
            _fail(404, "SESSION_NOT_FOUND", str(exc) or "worker session unknown or expired")
        except session_actor.ProtocolViolation as exc:
            _fail(400, "PROTOCOL_ERROR", str(exc))
        return _json(answer if answer is not None else FencedResponse())

    @app.post("/v1/worker/sessions/<session_id>/heartbeat")
    async def pull_heartbeat(session_id: str) -> Response:
        return await pull_message(session_id, (Heartbeat,))

    @app.post("/v1/worker/sessions/<session_id>/ack")
    async def pull_ack(session_id: str) -> Response:
        return await pull_message(session_id, (JobAck,))

    @app.post("/v1/worker/sessions/<session_id>/nack")
    async def pull_nack(session_id: str) -> Response:
        return await pull_message(session_id, (JobNack,))

    @app.post("/v1/worker/sessions/<session_id>/steps")
    async def pull_steps(session_id: str) -> Response:
        return await pull_message(session_id, (StepCompleted, StepFailed))

    @app.post("/v1/worker/sessions/<session_id>/result")
    async def pull_result(session_id: str) -> Response:
        return await pull_message(session_id, (JobCompleted, JobFailed, JobYielded))

    @app.delete("/v1/worker/sessions/<session_id>")
    async def pull_goodbye(session_id: str) -> Response:
        await require_org()
        await pull_session(session_id)
        pull_sessions.pop(session_id, None)
        t = config.timings
        # A pull worker says goodbye after its jobs ended; anything it still
        # held is recovered now rather than at lease expiry.
        recovered = await store.close_session(
            session_id,
            recover_leases=True,
            recovery_grace_s=t.recovery_grace_s,
            recovery_ceiling=int(t.recovery_ceiling),
        )
        if recovered:
            kick(deps.kicks, "pull session closed")
        return _json(FencedResponse())

    # ── streaming workers ─────────────────────────────────────────────────────

    @app.websocket("/v1/worker")
    async def worker_socket() -> Response | None:
        if deps.shutdown_requested.is_set():
            return _error(503, "DRAINING", "this node is draining; connect to another node")
        try:
            await require_org(websocket.headers)
        except ApiFailure as exc:
            return _error(exc.status, exc.code, exc.message)
        await websocket.accept()
        ws = websocket._get_current_object()  # type: ignore[attr-defined]  # tasks outlive the context
        await _serve_socket(ws, deps)
        return None

    return app


async def _serve_socket(ws: Any, deps: ApiDeps) -> None:
    """Shuttle frames between one websocket and its session actor."""
    inbound_send, inbound_receive = trio.open_memory_channel[WorkerMessage](256)
    outbox_send, outbox_receive = trio.open_memory_channel[EngineMessage](1024)
    close_code, close_reason = 1000, ""
    refusal: Refused | None = None

    async def reader() -> None:
        # close() rather than `async with`: aclose() checkpoints, and a cancel
        # arriving there would swallow the _CloseSocket that explains the close.
        try:
            while True:
                data = await ws.receive()
                if isinstance(data, bytes):
                    raise _CloseSocket(WS_UNSUPPORTED_DATA, "binary frames are not supported: send JSON text frames")
                msg = _decode_worker_frame(data)
                await inbound_send.send(msg)
        finally:
            inbound_send.close()

    async def writer() -> None:
        try:
            async for msg in outbox_receive:
                await ws.send(encoder.encode(msg).decode())
        finally:
            # Later sends (dispatcher, session) fail fast instead of queueing
            # into a socket that is gone.
            outbox_receive.close()

    closed = False
    try:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(reader)
                nursery.start_soon(writer)
                # Shielded: when the socket drops, the reader is cancelled and
                # closes the inbound channel; the session still applies every
                # frame that already arrived (an ack, a step result) before it
                # closes the session — received data is never dropped.
                with trio.CancelScope(shield=True):
                    await session_actor.run(
                        deps.store,
                        deps.config,
                        deps.node_id,
                        deps.directory,
                        deps.kicks,
                        inbound_receive,
                        outbox_send,
                    )
                nursery.cancel_scope.cancel()
        except* _CloseSocket as group:
            exc = group.exceptions[0]
            assert isinstance(exc, _CloseSocket)
            close_code, close_reason, refusal = exc.code, exc.reason, exc.refusal
        except* session_actor.RegistrationRefused as group:
            message = str(group.exceptions[0])
            close_code, close_reason = WS_POLICY_VIOLATION, _short(f"registration refused: {message}")
            refusal = Refused(session_actor.RegistrationRefused.code, message)
        except* session_actor.ProtocolViolation as group:
            close_code, close_reason = WS_PROTOCOL_ERROR, _short(str(group.exceptions[0]))
        except* session_actor.SessionExpired as group:
            close_code, close_reason = WS_POLICY_VIOLATION, _short(f"session expired: {group.exceptions[0]}; reconnect")
        except* trio.EndOfChannel:
            pass  # the reader stopped first; its own error (above) says why
        except* Exception as group:
            log.error("api: worker socket failed", exc_info=group)
            if close_code == 1000:
                close_code, close_reason = WS_INTERNAL_ERROR, "internal error"
        if close_code != 1000:
            logs.event(log, logging.INFO, "api: closing worker socket", code=close_code, reason=close_reason)
        with trio.move_on_after(WS_CLOSE_TIMEOUT_S):
            if refusal is not None:
                try:
                    await ws.send(encoder.encode(refusal).decode())
                except Exception:
                    pass  # the peer is gone; the close below says the same
            await ws.close(close_code, close_reason)
        closed = True
    finally:
        if not closed:
            # Cancelled: the node is stopping (or the peer is already gone).
            # Say so with 1001 rather than leave the worker a bare 1006.
            with trio.CancelScope(shield=True), trio.move_on_after(WS_CLOSE_TIMEOUT_S):
                try:
                    await ws.close(WS_GOING_AWAY, "engine node stopping")
                except Exception:
                    pass


def _decode_worker_frame(data: str) -> WorkerMessage:
    """One worker frame, or :class:`_CloseSocket` saying why it cannot be read.

    Malformed JSON is a protocol error (1002); well-formed JSON that is no
    valid message — an unknown type, a wrong field, a number out of bounds,
    nesting too deep — is invalid payload data (1007). Either way the worker
    first receives a ``Refused`` naming the problem.
    """
    try:
        msg: WorkerMessage = decode_frame(data, worker_message_decoder)
        return msg
    except (msgspec.ValidationError, JsonTooDeep) as exc:  # ValidationError is a DecodeError
        code, message = WS_INVALID_PAYLOAD, f"invalid message: {exc}"
    except msgspec.DecodeError as exc:
        code, message = WS_PROTOCOL_ERROR, f"invalid message: {exc}"
    raise _CloseSocket(code, _short(message), Refused("INVALID_MESSAGE", message))


def _short(reason: str) -> str:
    """A close reason must fit in 123 bytes of UTF-8."""
    encoded = reason.encode()
    return reason if len(encoded) <= 120 else encoded[:117].decode(errors="ignore") + "..."
