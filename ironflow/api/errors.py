"""Error answers: ``{code, message}`` with a 4xx status for anything a caller
did wrong, a 500 with a request id (also logged) only for a real fault.

Bad input never takes the node down: bodies are decoded with typed msgspec
decoders, checked for nesting depth first, and every failure is an answer.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn, TypeVar

import msgspec
from quart import Response, has_websocket_context, request, websocket
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException
from werkzeug.routing import WebsocketMismatch

from ironflow import logs
from ironflow.ids import new_id
from ironflow.protocol import MAX_JSON_DEPTH, ApiError, JsonTooDeep, check_json_depth, encoder
from ironflow.store import StoreError, StoreTimeout, StoreUnavailable

log = logging.getLogger("ironflow.api")

T = TypeVar("T")

# HTTP status of each store error code; anything else a store raises is a 400.
STATUS_FOR_CODE = {
    "STALE_EXECUTION": 409,
    "CONFLICT": 409,
    "NOT_FOUND": 404,
    "FUNCTION_NOT_FOUND": 404,
    "RUN_NOT_FOUND": 404,
    "STEP_NOT_FOUND": 404,
    "SESSION_NOT_FOUND": 404,
    "LIMIT_EXCEEDED": 422,
    # A list's ?cursor= it never handed out (ironflow/store/pages.py).
    "INVALID_CURSOR": 422,
    # A key expression that fails on an invocation's input (docs/triggers.md).
    "KEY_EVALUATION_FAILED": 422,
    # An outage of the database (ironflow/store/availability.py): try again.
    "STORE_UNAVAILABLE": 503,
    "STORAGE_FULL": 507,
    # The database connection broke while committing: retry with an idempotency key.
    "COMMIT_OUTCOME_UNKNOWN": 503,
    # A statement or lock wait ended at the node's PostgreSQL bounds: nothing committed.
    "STORE_TIMEOUT": 503,
}
# Seconds an outage answer tells the caller to wait (Retry-After): about the
# store monitor's probe interval, so a retry lands soon after the store is back.
RETRY_AFTER_S = 1


def store_error_headers(exc: StoreError) -> list[tuple[str, str]]:
    """Headers of the answer to ``exc``: a Retry-After for an outage."""
    if isinstance(exc, StoreUnavailable | StoreTimeout):
        return [("Retry-After", str(RETRY_AFTER_S))]
    return []


class ApiFailure(Exception):
    """An error answer: HTTP ``status`` with a stable ``code`` and a human message."""

    def __init__(
        self, status: int, code: str, message: str, *, headers: list[tuple[str, str]] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        # Extra headers of the answer (a Retry-After past a limit).
        self.headers = headers or []


def json_response(obj: Any, status: int = 200) -> Response:
    """``obj`` (a protocol struct) encoded as the JSON answer."""
    return Response(encoder.encode(obj), status=status, content_type="application/json")


def error_response(status: int, code: str, message: str) -> Response:
    return json_response(ApiError(code, message), status)


def fail(status: int, code: str, message: str) -> NoReturn:
    """Stop handling: the caller gets ``status`` with ``{code, message}``."""
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


def decode(body: bytes | str, kind: type[T]) -> T:
    """A request body as ``kind``, or a 400 naming what is wrong with it."""
    if not body.strip():
        fail(400, "BAD_REQUEST", "request body is empty; expected a JSON object")
    try:
        return decode_frame(body, kind)  # type: ignore[no-any-return]
    except JsonTooDeep as exc:
        fail(400, "BAD_REQUEST", str(exc))
    except msgspec.ValidationError as exc:
        fail(400, "VALIDATION_ERROR", f"invalid {getattr(kind, '__name__', 'message')}: {exc}")
    except msgspec.DecodeError as exc:
        fail(400, "BAD_REQUEST", f"invalid JSON body: {exc}")


async def optional_body(kind: type[T]) -> T:
    """The request body as ``kind``; an empty body means ``kind()``'s defaults."""
    raw = await request.get_data()
    return decode(raw, kind) if raw.strip() else kind()


def query_int(name: str, default: int, *, low: int = 1, high: int = 1000) -> int:
    """Integer query parameter ``name`` in ``low..high``, or a 400."""
    return int(_query_number(name, default, low, high, int, "an integer"))


def query_float(name: str, default: float, *, low: float, high: float) -> float:
    """Number query parameter ``name`` in ``low..high``, or a 400."""
    return _query_number(name, default, low, high, float, "a number")


def float_param(name: str, raw: str | None, default: float, *, low: float, high: float) -> float:
    """:func:`query_float` of a value already read (None: absent), for the
    framework-free routes (ironflow/api/hot.py)."""
    return _number(name, raw, default, low, high, float, "a number")


def _query_number(
    name: str, default: float, low: float, high: float, kind: type[int] | type[float], what: str
) -> float:
    return _number(name, request.args.get(name), default, low, high, kind, what)


def _number(
    name: str, raw: str | None, default: float, low: float, high: float,
    kind: type[int] | type[float], what: str,
) -> float:
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        fail(400, "VALIDATION_ERROR", f"query parameter {name} must be {what}, got {raw!r}")
    if not low <= value <= high:
        fail(400, "VALIDATION_ERROR", f"query parameter {name} must be in {low:g}..{high:g}")
    return value


def _where() -> tuple[str, str]:
    """Method and path of the request or websocket being handled."""
    if has_websocket_context():
        return "WEBSOCKET", websocket.path
    return request.method, request.path


async def _on_api_failure(exc: ApiFailure) -> Response:
    response = error_response(exc.status, exc.code, exc.message)
    for name, value in exc.headers:
        response.headers[name] = value
    return response


async def _on_store_error(exc: StoreError) -> Response:
    response = error_response(STATUS_FOR_CODE.get(exc.code, 400), exc.code, str(exc) or exc.code)
    for name, value in store_error_headers(exc):
        response.headers[name] = value
    return response


async def _on_websocket_mismatch(_: Any) -> Response:
    method, path = _where()
    if method == "WEBSOCKET":
        return error_response(400, "BAD_REQUEST", f"{path} is not a websocket endpoint")
    response = error_response(
        426, "UPGRADE_REQUIRED", f"{path} is the worker websocket: connect with a websocket upgrade"
    )
    response.headers["Upgrade"] = "websocket"
    return response


async def _on_not_found(_: Any) -> Response:
    method, path = _where()
    return error_response(404, "NOT_FOUND", f"no route for {method} {path}")


async def _on_bad_method(exc: Any) -> Response:
    method, path = _where()
    response = error_response(405, "METHOD_NOT_ALLOWED", f"{method} is not allowed on {path}")
    # RFC 9110: a 405 names the methods the resource does support.
    allowed = sorted(getattr(exc, "valid_methods", None) or [])
    if allowed:
        response.headers["Allow"] = ", ".join(allowed)
    return response


async def _on_http_exception(exc: HTTPException) -> Response:
    # The framework's own refusals (bad request line, wrong method, …) keep
    # their status; only a real fault below becomes a 500.
    code = (exc.name or "HTTP error").upper().replace(" ", "_")
    return error_response(exc.code or 400, code, exc.description or exc.name or "HTTP error")


async def _on_unexpected(exc: Exception) -> Response:
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
    return error_response(
        500, "INTERNAL", f"internal error: {type(exc).__name__} (request id {request_id})"
    )


def install(app: QuartTrio, max_body_bytes: int) -> None:
    """Register every error handler on ``app`` (most specific first)."""

    async def on_too_large(_: Any) -> Response:
        return error_response(413, "PAYLOAD_TOO_LARGE", f"request body exceeds {max_body_bytes} bytes")

    app.register_error_handler(ApiFailure, _on_api_failure)
    app.register_error_handler(StoreError, _on_store_error)
    app.register_error_handler(WebsocketMismatch, _on_websocket_mismatch)
    app.register_error_handler(404, _on_not_found)
    app.register_error_handler(405, _on_bad_method)
    app.register_error_handler(413, on_too_large)
    app.register_error_handler(HTTPException, _on_http_exception)
    app.register_error_handler(Exception, _on_unexpected)
