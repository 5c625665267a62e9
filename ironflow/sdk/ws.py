"""A websocket client on AnyIO streams and wsproto: one code path for asyncio and Trio.

The worker needs little of a websocket library: text messages, a ping
answered, a close handshake, a size limit and bare exceptions. wsproto (the
sans-I/O protocol that hypercorn and trio-websocket use) does the framing;
AnyIO does the I/O, so the same client runs on whichever loop the worker's
user chose. No background reader task: the caller's receive loop reads, and
``aclose`` waits for it to see the engine's close (or reads itself when no
one else does), so exceptions reach the caller bare, never in a group.

One task may read at a time; any number may send (sends are serialised).
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import anyio
import anyio.abc
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.utilities import RemoteProtocolError

# One read from the socket: large enough that a batched frame is a few reads.
RECEIVE_CHUNK = 65536
# RFC 6455 close codes used here.
CLOSE_NORMAL = 1000
CLOSE_ABNORMAL = 1006  # never sent: what a dropped connection is reported as
CLOSE_PROTOCOL_ERROR = 1002
CLOSE_TOO_BIG = 1009


class WebSocketError(Exception):
    """Base class of this module's errors."""


class HandshakeError(WebSocketError):
    """The opening handshake failed (no HTTP upgrade answer, a bad answer, a timeout)."""


class ConnectionRejected(HandshakeError):
    """The server answered the upgrade with an HTTP status (401, 403, 503…)."""

    def __init__(self, status_code: int, body: bytes = b""):
        super().__init__(f"websocket upgrade rejected with HTTP {status_code}")
        self.status_code = status_code
        self.body = body


class ConnectionClosed(WebSocketError):
    """The connection is closed: ``code`` and ``reason`` from the close frame
    (1006 when it dropped without one)."""

    def __init__(self, code: int, reason: str | None = None):
        super().__init__(f"websocket closed: {code} {reason or ''}".rstrip())
        self.code = code
        self.reason = reason


class WebSocket:
    """One open websocket over ``stream``, driven by ``conn`` (client or server side)."""

    def __init__(
        self, stream: anyio.abc.ByteStream, conn: WSConnection, *, max_message_size: int
    ) -> None:
        self._stream = stream
        self._conn = conn
        self.max_message_size = max_message_size
        self._send_lock = anyio.Lock()
        self._parts: list[str | bytes] = []
        self._size = 0
        self._closed: ConnectionClosed | None = None
        self._close_seen = anyio.Event()
        self._reading = False

    @property
    def closed(self) -> ConnectionClosed | None:
        """Why the connection closed, or None while it is open."""
        return self._closed

    async def _write(self, data: bytes) -> None:
        if not data:
            return
        async with self._send_lock:
            try:
                await self._stream.send(data)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                self._mark_closed(ConnectionClosed(CLOSE_ABNORMAL, f"send failed: {exc!r}"))
                raise self._closed from exc  # type: ignore[misc]

    def _mark_closed(self, closed: ConnectionClosed) -> None:
        if self._closed is None:
            self._closed = closed
        self._close_seen.set()

    async def send_message(self, message: str | bytes) -> None:
        """Send one text (``str``) or binary (``bytes``) message.

        Raises ``ConnectionClosed`` once the connection is closing or closed.
        """
        if self._closed is not None or self._conn.state is not ConnectionState.OPEN:
            raise self._closed or ConnectionClosed(CLOSE_NORMAL, "closing")
        event = TextMessage(data=message) if isinstance(message, str) else BytesMessage(data=message)
        await self._write(self._conn.send(event))

    async def get_message(self) -> str | bytes:
        """The next whole message; ``ConnectionClosed`` when the connection ends.

        A ping is answered on the way; an oversized message closes the
        connection with 1009.
        """
        self._reading = True
        try:
            while True:
                for event in self._conn.events():
                    if isinstance(event, TextMessage | BytesMessage):
                        self._parts.append(bytes(event.data) if isinstance(event.data, bytearray) else event.data)
                        self._size += len(event.data)
                        if self._size > self.max_message_size:
                            await self._close_locally(CLOSE_TOO_BIG, "message too big")
                            raise ConnectionClosed(CLOSE_TOO_BIG, "message too big")
                        if event.message_finished:
                            parts, self._parts, self._size = self._parts, [], 0
                            first = parts[0]
                            return first if len(parts) == 1 else type(first)().join(parts)  # type: ignore[arg-type]
                    elif isinstance(event, Ping):
                        await self._write(self._conn.send(event.response()))
                    elif isinstance(event, CloseConnection):
                        if self._conn.state is ConnectionState.REMOTE_CLOSING:
                            await self._write_quietly(self._conn.send(event.response()))
                        self._mark_closed(ConnectionClosed(event.code, event.reason))
                if self._closed is not None:
                    raise self._closed
                try:
                    data = await self._stream.receive(RECEIVE_CHUNK)
                except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    self._mark_closed(ConnectionClosed(CLOSE_ABNORMAL, "connection dropped"))
                    raise self._closed from None  # type: ignore[misc]
                self._conn.receive_data(data)
        except RemoteProtocolError as exc:
            # The peer broke the protocol (a bad frame): the connection is
            # unusable, which the caller handles like any other closed one.
            self._mark_closed(ConnectionClosed(CLOSE_PROTOCOL_ERROR, f"protocol error: {exc}"))
            await self._stream.aclose()
            raise self._closed from exc  # type: ignore[misc]
        finally:
            self._reading = False

    async def _write_quietly(self, data: bytes) -> None:
        try:
            await self._write(data)
        except ConnectionClosed:
            pass

    async def _close_locally(self, code: int, reason: str | None) -> None:
        if self._conn.state is ConnectionState.OPEN:
            await self._write_quietly(self._conn.send(CloseConnection(code=code, reason=reason)))

    async def aclose(self, code: int = CLOSE_NORMAL, reason: str | None = None) -> None:
        """Send a close frame (if none was sent) and wait for the peer's.

        While another task reads, that task sees the peer's close and this
        waits for it; otherwise this reads until the close arrives. The
        caller bounds the wait (the worker uses its drain deadline).
        """
        await self._close_locally(code, reason)
        if self._closed is None:
            if self._reading:
                await self._close_seen.wait()
            else:
                try:
                    while True:
                        await self.get_message()
                except ConnectionClosed:
                    pass
        await self.abort()

    async def abort(self) -> None:
        """Drop the connection without a handshake."""
        self._mark_closed(self._closed or ConnectionClosed(CLOSE_ABNORMAL, "aborted"))
        await self._stream.aclose()


def _endpoint(url: str) -> tuple[str, int, str, bool]:
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss"):
        raise ValueError(f"a websocket URL starts with ws:// or wss://, got {url!r}")
    tls = parts.scheme == "wss"
    host = parts.hostname or "localhost"
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return host, parts.port or (443 if tls else 80), target, tls


async def _handshake(
    ws: WebSocket, host_header: str, target: str, headers: Sequence[tuple[bytes, bytes]]
) -> None:
    conn = ws._conn
    await ws._write(conn.send(Request(host=host_header, target=target, extra_headers=list(headers))))
    rejected: RejectConnection | None = None
    body = b""
    while True:
        for event in conn.events():
            if isinstance(event, AcceptConnection):
                return
            if isinstance(event, RejectConnection):
                rejected = event
                if not event.has_body:
                    raise ConnectionRejected(event.status_code)
            elif isinstance(event, RejectData):
                body += event.data
                if event.body_finished and rejected is not None:
                    raise ConnectionRejected(rejected.status_code, body)
        try:
            data = await ws._stream.receive(RECEIVE_CHUNK)
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError) as exc:
            if rejected is not None:
                raise ConnectionRejected(rejected.status_code, body) from exc
            raise HandshakeError(f"connection closed during the websocket handshake: {exc!r}") from exc
        try:
            conn.receive_data(data)
        except RemoteProtocolError as exc:
            raise HandshakeError(f"bad websocket upgrade answer: {exc}") from exc


@asynccontextmanager
async def connect(
    url: str,
    *,
    headers: Sequence[tuple[bytes, bytes]] = (),
    max_message_size: int,
    connect_timeout: float,
    ssl_context: ssl.SSLContext | None = None,
) -> AsyncIterator[WebSocket]:
    """Open a client websocket to ``url`` (``ws://`` or ``wss://``); close it on exit.

    ``connect_timeout`` bounds the TCP connect and the upgrade together
    (``HandshakeError`` past it); a refused upgrade is ``ConnectionRejected``
    with its HTTP status; ``OSError`` when nothing listens. On exit the
    socket is dropped if the caller did not close it: a caller that wants
    the close handshake calls :meth:`WebSocket.aclose` first.
    """
    host, port, target, tls = _endpoint(url)
    try:
        with anyio.fail_after(connect_timeout):
            if tls:
                stream: anyio.abc.ByteStream = await anyio.connect_tcp(
                    host, port, tls=True, ssl_context=ssl_context or ssl.create_default_context(),
                    tls_hostname=host,
                )
            else:
                stream = await anyio.connect_tcp(host, port)
            ws = WebSocket(stream, WSConnection(ConnectionType.CLIENT), max_message_size=max_message_size)
            try:
                default_port = 443 if tls else 80
                await _handshake(ws, host if port == default_port else f"{host}:{port}", target, headers)
            except BaseException:
                await anyio.aclose_forcefully(stream)
                raise
    except TimeoutError as exc:
        raise HandshakeError(f"websocket connect to {url} timed out after {connect_timeout:g} s") from exc
    try:
        yield ws
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.aclose_forcefully(stream)
