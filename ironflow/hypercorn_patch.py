"""Three changes to hypercorn's Trio worker (0.18), installed by :func:`apply`.

**Close a connection the protocol closed.** hypercorn (``trio/tcp_server.py``)
closes an HTTP/1.1 connection after a response to ``Connection: close`` or
HTTP/1.0 by sending ``Closed`` from the application's task. quart-trio cancels
that task as the response ends, so the ``send_eof``/``aclose`` inside is
cancelled at its first checkpoint and the socket stays open until the *client*
closes it: 200 such requests left 200 descriptors open on the node. The close
is quick and must not be skipped, so it is shielded here (bounded by a
timeout). Same family as upstream pgjones/hypercorn#106.

**One socket write per fixed-length response.** hypercorn writes an HTTP/1.1
response as one socket write per h11 event: the head, each body chunk, and the
end of message — which for a ``Content-Length`` response is zero bytes, yet
still takes the connection's send lock, a shielded cancel scope and a
checkpoint. Every run starts with a ``POST /v1/events``, and those writes were
the largest single item of the node's own CPU under load (docs/benchmarks.md,
"Where the node's CPU goes"). So the head of a response that declares its
length is held and written together with the next event's bytes (its body, or
its empty end), and empty writes are skipped. The bytes on the wire are the
same, in the same order. A response without a length (chunked, streamed: the
dashboard's live feed) has its head written at once, as before, and so does an
informational response (a websocket's ``101``).

**The keep-alive timer restarted without a handshake.** A connection's idle
timer is cancelled when a request arrives and started again when its response
is done (``TrioSingleTask``): per request, two lock acquisitions and a
``Nursery.start``, whose started-handshake costs a task switch of its own.
:class:`_SingleTask` does the same with ``start_soon`` and no lock (nothing in
it awaits, so restart and stop cannot interleave): the old run is cancelled,
a new one is started, as before.
"""

from __future__ import annotations

from typing import Any

import h11
import trio
from hypercorn.events import Closed, RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio import tcp_server
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import TrioSingleTask

# Upper bound on the shielded close: send_eof and aclose do not block on a
# healthy socket; this only guards a wedged one.
CLOSE_TIMEOUT_S = 1.0
# Attribute of an H11Protocol holding a response head not yet written.
_HELD_HEAD = "_ironflow_held_head"

_original_protocol_send = TCPServer.protocol_send


async def _protocol_send(self: TCPServer, event: Any) -> None:
    if isinstance(event, Closed):
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
            await _original_protocol_send(self, event)
        return
    await _original_protocol_send(self, event)


def _declares_length(event: h11.Response) -> bool:
    return any(name == b"content-length" for name, _ in event.headers)


async def _send_h11_event(self: H11Protocol, event: Any) -> None:
    """hypercorn's ``H11Protocol._send_h11_event``, writing a fixed-length
    response's head with the bytes that follow it, and no empty writes."""
    head: bytes = getattr(self, _HELD_HEAD, b"")
    try:
        data = self.connection.send(event)
    except h11.LocalProtocolError:
        if head:  # written where the original wrote it: before this event
            setattr(self, _HELD_HEAD, b"")
            await self.send(RawData(data=head))
        if self.connection.their_state != h11.ERROR:
            raise
        return
    if head:
        setattr(self, _HELD_HEAD, b"")
        data = head + data
    if isinstance(event, h11.Response) and _declares_length(event):
        # Held until its body or its end (h11 needs one to finish the response);
        # a head without its fixed-length body is of no use to the client.
        setattr(self, _HELD_HEAD, data)
        return
    if data:
        await self.send(RawData(data=data))


class _SingleTask:
    """hypercorn's ``TrioSingleTask`` (at most one run of an action, restarted
    or stopped), without a lock or a started-handshake per restart."""

    def __init__(self) -> None:
        self._scope: trio.CancelScope | None = None

    async def restart(self, task_group: Any, action: Any) -> None:
        """Cancel the running action, if any, and start ``action`` afresh in ``task_group``."""
        if self._scope is not None:
            self._scope.cancel()
        scope = self._scope = trio.CancelScope()
        task_group._nursery.start_soon(_run_in, scope, action)

    async def stop(self) -> None:
        """Cancel the running action, if any."""
        if self._scope is not None:
            self._scope.cancel()
        self._scope = None


async def _run_in(scope: trio.CancelScope, action: Any) -> None:
    with scope:
        await action()


def apply() -> None:
    """Install the three changes (idempotent)."""
    if TCPServer.protocol_send is not _protocol_send:
        TCPServer.protocol_send = _protocol_send  # type: ignore[method-assign]
    if H11Protocol._send_h11_event is not _send_h11_event:
        H11Protocol._send_h11_event = _send_h11_event  # type: ignore[method-assign]
    if tcp_server.TrioSingleTask is TrioSingleTask:  # what TCPServer() makes its idle_task of
        tcp_server.TrioSingleTask = _SingleTask  # type: ignore[misc,assignment]
