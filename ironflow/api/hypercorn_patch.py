"""Six changes to hypercorn's Trio worker, installed by :func:`apply` when the
installed hypercorn is the release they were written for (:data:`WRITTEN_FOR`).

Each replaces one hypercorn internal with a cheaper one of the same
behaviour (same bytes on the wire, in the same order; same events to the
application): a shielded close of a connection the protocol closed; one
socket write per fixed-length response; a write the socket takes at once
without a task switch; one keep-alive timer task per connection; an
application queue that passes a message without a task switch; a socket read
as one wait and one read. Why each, and how to port them to a new hypercorn:
docs/hypercorn-patch.md.
"""

from __future__ import annotations

import importlib.metadata
import logging
import socket
from collections import deque
from typing import Any

import h11
import trio
from hypercorn.events import Closed, RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio import task_group, tcp_server
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.trio.worker_context import TrioSingleTask
from trio.lowlevel import ParkingLot

from ironflow import logs

log = logging.getLogger("ironflow.api")

# The hypercorn release whose internals the six replacements were written
# against, read line by line; any other release may have changed them, so it
# is served by its own code (docs/hypercorn-patch.md says how to port).
WRITTEN_FOR = "0.18.0"

# Upper bound on the shielded close: send_eof and aclose do not block on a
# healthy socket; this only guards a wedged one.
CLOSE_TIMEOUT_S = 1.0
# Attribute of an H11Protocol holding a response head not yet written.
_HELD_HEAD = "_ironflow_held_head"

_original_protocol_send = TCPServer.protocol_send


async def _protocol_send(self: TCPServer, event: Any) -> None:
    if type(event) is RawData and type(self.stream) is trio.SocketStream and not self.send_lock.locked():
        # Written at once when the socket takes all of it and no earlier
        # write is under way (that one holds the send lock: bytes never
        # overtake it); whatever is left goes hypercorn's way.
        data = event.data
        try:
            sent = self.stream.socket._sock.send(data)  # trio keeps it non-blocking
        except OSError:  # full (BlockingIOError), or broken: hypercorn's path says which
            sent = 0
        if sent == len(data):
            return
        if sent:
            event = RawData(data=data[sent:])
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


class _KeepAliveTimer:
    """Stands in for hypercorn's ``TrioSingleTask`` as a connection's idle timer:
    ``restart(task_group, server._idle_timeout)`` arms it (``keep_alive_timeout``
    from now), ``stop()`` disarms it. Both only note the connection's state and
    the time; the timer task, waking at the deadline it last set, compares
    them and either closes the connection or waits again (per request, no
    cancel scope's deadline is moved: that was a recalculation of the task
    tree's cancel status twice per request)."""

    def __init__(self) -> None:
        self._armed = False
        self._idle_since = 0.0
        # When the first bytes of a request head not yet whole arrived (the
        # connection idle meanwhile), while it is still incomplete.
        self._head_since: float | None = None
        self._wait: trio.CancelScope | None = None
        # The peer's end was read (or the socket closed): nothing more will
        # come, so the connection closes as soon as it is idle.
        self._gone = False
        self._started = False
        self._head_deadline = 0.0
        # Set when the timer is armed again (the task waits for it after the
        # server stopped while a request was in flight).
        self._rearmed: trio.Event | None = None

    async def restart(self, task_group: Any, action: Any) -> None:
        """Arm the timer: ``action``'s server (a ``TCPServer``, whose
        ``_idle_timeout`` this replaces) is closed if still idle after its
        ``keep_alive_timeout``."""
        self._armed = True
        self._idle_since = trio.current_time()
        self._head_since = None
        if not self._started:
            self._started = True
            task_group._nursery.start_soon(self._run, action.__self__)
        if self._rearmed is not None:
            self._rearmed.set()
        if self._gone and self._wait is not None:
            self._wait.cancel()  # its response is done: close now

    async def stop(self) -> None:
        """Disarm the timer (a request is in flight)."""
        self._armed = False
        self._head_since = None

    def head_begun(self, header_timeout: float) -> None:
        """Bytes of a request head arrived on the idle connection, not all of it:
        the rest must follow within ``header_timeout`` or the connection is closed
        (only a head split across reads gets here: a whole one disarms the timer)."""
        if self._head_since is None:
            self._head_since = trio.current_time()
            self._head_deadline = self._head_since + header_timeout
            if self._wait is not None:
                self._wait.deadline = min(self._wait.deadline, self._head_deadline)

    def gone(self) -> None:
        """The connection's reader stopped (the peer's end, a reset): close it
        once idle, not a keep-alive later (hypercorn's timer kept the
        connection, its descriptor and its slot of the connection cap that long)."""
        self._gone = True
        if self._wait is not None:
            self._wait.cancel()

    def _due(self, timeout: float) -> float:
        """When the connection, idle, is closed: its keep-alive, or its head's
        deadline; at once once gone."""
        if self._gone:
            return self._idle_since
        due = self._idle_since + timeout
        return due if self._head_since is None else min(due, self._head_deadline)

    async def _run(self, server: Any) -> None:
        terminated = server.context.terminated  # hypercorn's EventWrapper
        timeout = server.config.keep_alive_timeout
        while not (self._armed and trio.current_time() >= self._due(timeout)):
            # Idle: wait until the keep-alive (or a head's time) runs out. Busy: check again in as long.
            deadline = self._due(timeout) if self._armed else trio.current_time() + timeout
            with trio.move_on_at(deadline) as self._wait:
                await terminated.wait()
                break  # the server stops
        self._wait = None
        if not self._armed:  # it stops while a request is in flight: close once that is done
            self._rearmed = trio.Event()
            await self._rearmed.wait()
        with trio.CancelScope(shield=True):
            await server._initiate_server_close()


_original_read_data = TCPServer._read_data


async def _read_data(self: TCPServer) -> None:
    """hypercorn's ``TCPServer._read_data``: wait until readable, then read."""
    if type(self.stream) is not trio.SocketStream or self.config.read_timeout:
        await _original_read_data(self)
        timer = getattr(self, "idle_task", None)
        if type(timer) is _KeepAliveTimer:
            timer.gone()
        return
    sock = self.stream.socket._sock  # only this task reads it
    timer = getattr(self, "idle_task", None)
    # The node's server config says how long a head may take (api/connections.py).
    header_timeout = getattr(self.config, "header_timeout", None) if type(timer) is _KeepAliveTimer else None
    while True:
        try:
            if sock.fileno() == -1:
                break  # closed by the node (hypercorn's close)
            await trio.lowlevel.wait_readable(sock)
            data = sock.recv(MAX_RECV)
        except BlockingIOError:
            continue  # readable, yet nothing to read after all: wait again
        except (trio.ClosedResourceError, OSError):  # closed while waiting, or reset
            break
        await self.protocol.handle(RawData(data))
        if not data:
            break  # the peer's end
        if header_timeout and timer._armed:  # still idle: this request's head is not whole yet
            timer.head_begun(header_timeout)
    await self.protocol.handle(Closed())
    if type(timer) is _KeepAliveTimer:
        timer.gone()


class _AppQueue:
    """hypercorn's channel between a request's (or websocket's) connection and
    its application task: at most ``max_size`` messages held (hypercorn's
    ``max_app_queue_size``; 0, a rendezvous there, holds one here). A message
    passes at once when it can, with no checkpoint; a full queue makes the
    sender wait, an empty one the receiver. It stands in for the Trio memory
    channel hypercorn opens per request, whose two ends, shared state,
    statistics and ``open_memory_channel[...]`` subscription were ~3 % of the
    node's main thread under load: a deque, and a parking lot made only when
    a side has to wait."""

    __slots__ = ("_items", "_max", "_receivers", "_senders")

    def __init__(self, max_size: int) -> None:
        self._items: deque[Any] = deque()
        self._max = max(max_size, 1)
        self._receivers: ParkingLot | None = None
        self._senders: ParkingLot | None = None

    async def put(self, message: Any) -> None:
        while len(self._items) >= self._max:  # full: wait for room, as hypercorn did
            if self._senders is None:
                self._senders = ParkingLot()
            await self._senders.park()
        self._items.append(message)
        if self._receivers:
            self._receivers.unpark()

    async def get(self) -> Any:
        while not self._items:  # nothing yet: wait for it, as hypercorn did
            if self._receivers is None:
                self._receivers = ParkingLot()
            await self._receivers.park()
        message = self._items.popleft()
        if self._senders:
            self._senders.unpark()
        return message


async def _spawn_app(self: TaskGroup, app: Any, config: Any, scope: Any, send: Any) -> Any:
    """hypercorn's ``TaskGroup.spawn_app``, with an :class:`_AppQueue` for its
    memory channel."""
    queue = _AppQueue(config.max_app_queue_size)
    assert self._nursery is not None
    self._nursery.start_soon(
        task_group._handle, app, config, scope, queue.get, send, trio.to_thread.run_sync, trio.from_thread.run,
    )
    return queue.put


def _installed_hypercorn() -> str:
    """The installed hypercorn's version (its distribution metadata)."""
    return importlib.metadata.version("hypercorn")


def _trio_socket_wraps_a_stdlib_socket() -> bool:
    """Whether a Trio socket still keeps its stdlib socket as ``_sock`` (Trio's
    private attribute, written to and read from directly by two changes)."""
    with socket.socket() as plain:  # closed here: the Trio wrapper is only looked at
        return getattr(trio.socket.from_stdlib_socket(plain), "_sock", None) is plain


def refusal() -> str | None:
    """Why the changes would not be installed here, or None when they would."""
    found = _installed_hypercorn()
    if found != WRITTEN_FOR:
        return f"hypercorn {found} is installed; the patch was written for {WRITTEN_FOR}"
    if not _trio_socket_wraps_a_stdlib_socket():
        return f"trio {trio.__version__}'s socket no longer keeps a stdlib socket as _sock"
    return None


def apply() -> bool:
    """Install the six changes (idempotent) and return True; or, when
    :func:`refusal` names a reason, log it, leave hypercorn's own code in place
    and return False (the node serves the same, at hypercorn's cost)."""
    reason = refusal()
    if reason is not None:
        logs.event(
            log, logging.WARNING, "hypercorn patch not applied: serving with hypercorn's own code",
            reason=reason, written_for=WRITTEN_FOR, see="docs/hypercorn-patch.md",
        )
        return False
    if TCPServer.protocol_send is not _protocol_send:
        TCPServer.protocol_send = _protocol_send  # type: ignore[method-assign]
    if H11Protocol._send_h11_event is not _send_h11_event:
        H11Protocol._send_h11_event = _send_h11_event  # type: ignore[method-assign]
    if tcp_server.TrioSingleTask is TrioSingleTask:  # what TCPServer() makes its idle_task of
        tcp_server.TrioSingleTask = _KeepAliveTimer  # type: ignore[misc,assignment]
    if TaskGroup.spawn_app is not _spawn_app:
        TaskGroup.spawn_app = _spawn_app  # type: ignore[method-assign]
    if TCPServer._read_data is not _read_data:
        TCPServer._read_data = _read_data  # type: ignore[method-assign]
    return True
