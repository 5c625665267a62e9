"""What HTTP connections may hold of a node: how many are open at once, how
long a request head may take to arrive, how many result waits are held.

A connection is a descriptor and two tasks on the node's one thread whatever
it does, and a client chooses how many it opens and how slowly it sends, so
each of these is a named limit of the node config with a clear refusal past
it:

- ``limits.max_connections``: a connection past it is answered ``503
  TOO_MANY_CONNECTIONS`` with a ``Retry-After`` and closed, before hypercorn
  reads anything of it (:func:`apply` wraps hypercorn's per-connection
  ``TCPServer.run``);
- ``timings.http_header_timeout_s``: a request head not whole within it of its
  first byte closes its connection (the keep-alive timer of
  ``ironflow/api/hypercorn_patch.py`` enforces it; :class:`ServerConfig` carries it);
- ``limits.max_held_waits``: a result request with ``wait_s`` past it is
  answered ``429 TOO_MANY_HELD_WAITS`` (:class:`HeldWaits`, used by
  ``api/runs.py``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from collections.abc import Iterator
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.tcp_server import TCPServer

from ironflow.api.errors import ApiFailure
from ironflow.protocol import ApiError, encoder

# The hypercorn release whose ``TCPServer.run`` (one connection's whole life,
# its stream in ``self.stream``, its config in ``self.config``) :func:`apply` wraps.
HYPERCORN_RELEASE = "0.18."
# Seconds a refused client is told to wait: connections come and go within
# about that under load (requests take milliseconds; idle ones time out).
RETRY_AFTER_S = 1
# Longest the refusal's write may take: it fits a socket buffer at once; this
# only guards a client that reads nothing.
REFUSAL_WRITE_S = 1.0
# How long a refused connection is read (and what it sent dropped) after its
# answer, before it is closed: closing with unread bytes resets it, and the
# client would see a reset instead of the 503.
REFUSAL_LINGER_S = 0.5
# Bytes read per receive while a refused connection lingers.
_RECEIVE = 65536


class ConnectionLimit:
    """Open connections of one server, and the cap on them (Trio thread only)."""

    def __init__(self, max_connections: int) -> None:
        self.max = max_connections
        self.open = 0
        # Refused connections still lingering: bounded by ``max`` as well, so
        # a flood past the cap costs no more descriptors than the cap.
        self.refusing = 0


class ServerConfig(HypercornConfig):  # type: ignore[misc]
    """hypercorn's config, with the node's bounds on connections."""

    def __init__(self, max_connections: int, header_timeout: float) -> None:
        super().__init__()
        self.connection_limit = ConnectionLimit(max_connections)
        # Read by ironflow/api/hypercorn_patch.py's keep-alive timer.
        self.header_timeout = header_timeout


def _refusal(limit: ConnectionLimit) -> bytes:
    body = encoder.encode(ApiError(
        "TOO_MANY_CONNECTIONS",
        f"this node has its limit of {limit.max} open connections (limits.max_connections);"
        f" retry after {RETRY_AFTER_S} s, or on another node",
    ))
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "content-type: application/json\r\n"
        f"retry-after: {RETRY_AFTER_S}\r\n"
        "connection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _refuse(stream: Any, limit: ConnectionLimit) -> None:
    """Answer 503 on ``stream`` and close it (reading what the client sends
    for a moment first, so it gets the answer rather than a reset)."""
    try:
        if limit.refusing >= limit.max:
            return  # a flood: closed at once, no answer
        limit.refusing += 1
        try:
            with trio.move_on_after(REFUSAL_WRITE_S):
                await stream.send_all(_refusal(limit))
                await stream.send_eof()
            with trio.move_on_after(REFUSAL_LINGER_S):
                while await stream.receive_some(_RECEIVE):
                    pass
        finally:
            limit.refusing -= 1
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, AttributeError):
        pass  # gone already (AttributeError: a TLS stream has no send_eof)
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()


_original_run = TCPServer.run


async def _run(self: TCPServer) -> None:
    """hypercorn's ``TCPServer.run`` (one connection's life), counted against
    its config's :class:`ConnectionLimit` and refused past it."""
    limit: ConnectionLimit | None = getattr(self.config, "connection_limit", None)
    if limit is None:
        await _original_run(self)
        return
    if limit.open >= limit.max:
        await _refuse(self.stream, limit)
        return
    limit.open += 1
    try:
        await _original_run(self)
    finally:
        limit.open -= 1


def apply() -> bool:
    """Count and cap connections of every server whose config is a
    :class:`ServerConfig` (idempotent). False, and hypercorn left as it is,
    on a hypercorn release other than the one this wraps."""
    if not importlib.metadata.version("hypercorn").startswith(HYPERCORN_RELEASE):
        return False
    if TCPServer.run is not _run:
        TCPServer.run = _run  # type: ignore[method-assign]
    return True


class HeldWaits:
    """Result requests held open at once (``wait_s`` > 0), capped at ``max``."""

    def __init__(self, max_held: int) -> None:
        self.max = max_held
        self.held = 0

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """One held wait for the duration; a 429 ``TOO_MANY_HELD_WAITS`` past the cap."""
        if self.held >= self.max:
            raise ApiFailure(
                429, "TOO_MANY_HELD_WAITS",
                f"this node holds its limit of {self.max} result waits (limits.max_held_waits);"
                f" retry after {RETRY_AFTER_S} s, or ask with wait_s=0",
                headers=[("Retry-After", str(RETRY_AFTER_S))],
            )
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1
