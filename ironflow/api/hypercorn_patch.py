"""Six changes to hypercorn's Trio worker (0.18), installed by :func:`apply`.

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

**A write the socket takes at once costs no task switch.** hypercorn sends
every write under the connection's send lock through Trio's ``send_all``:
the lock's acquire and the send each end with a checkpoint that yields to
the scheduler, twice per response (and per websocket frame the node sends).
A write is now first offered to the socket directly when no other write is
under way (the lock is free): taken whole, it is done; what the socket did
not take (full, or broken) goes hypercorn's way, lock and all, which also
raises or closes as before. The bytes and their order are unchanged. Plain
TCP only: a TLS stream's writes go hypercorn's way.

**The keep-alive timer noted, not restarted.** A connection's idle timer is
stopped when a request arrives and started again when its response is done
(``TrioSingleTask``): per request, two lock acquisitions, a cancelled task
and a ``Nursery.start`` of a new one, whose started-handshake costs a task
switch of its own (this module's earlier ``_SingleTask`` still started a
task per request). :class:`_KeepAliveTimer` keeps ONE task per connection,
and a request's arrival and its response's end only note the time and the
state: the task wakes at its deadline and either closes the connection (idle
``keep_alive_timeout`` since its last response) or waits again. What it
does when it fires is hypercorn's: an idle connection past its keep-alive,
or one idle while the server stops, is closed
(``TCPServer._initiate_server_close``); a connection busy with a request
when the server stops is closed once idle.

**A message to or from the application costs no task switch when it can
pass at once.** hypercorn hands the application its request (the body, then
its end, then a disconnect once the response is done) and a websocket's
frames through a memory channel per request or connection, and Trio's
channel ``send`` and ``receive`` each end with a checkpoint that yields to
the scheduler even when the message passed without waiting: five task
switches per ``POST /v1/events`` (two in the connection's reader, three in
the request's task) of the ~10 such a request cost. :func:`_spawn_app` gives
both sides an :class:`_AppQueue` instead: a message that fits the buffer
(hypercorn's ``max_app_queue_size``) or one already waiting passes at once,
and only a full or empty queue waits, as before (so the buffer still bounds
what a slow application is sent). It is also cheaper to make than the memory
channel it replaces. The messages and their order are the same. Each side
still yields at its next wait: the reader at its next socket read, the
application at its first store call.

**A socket read is a wait and a read.** hypercorn's connection reader enters
a ``fail_after(read_timeout)`` scope per read (a generator context manager
and a cancel scope, even with no read timeout, the default) and reads through
Trio's ``receive_some``: two more context managers, and on a keep-alive
connection a first ``recv`` that finds nothing (the next request is not sent
before this response) before it waits and reads again. Together ~12 % of the
node's main thread under load (docs/benchmarks.md). :func:`_read_data` waits
until the socket is readable, then reads once. The bytes, the events the
protocol is handed (``RawData``, an empty one at the peer's end, then
``Closed``) and when the reader stops (the peer's end, a reset, the socket
closed by the node) are hypercorn's. A configured ``read_timeout``, or a TLS
stream, reads hypercorn's way.
"""

from __future__ import annotations

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
        self._started = False
        # Set when the timer is armed again (the task waits for it after the
        # server stopped while a request was in flight).
        self._rearmed: trio.Event | None = None

    async def restart(self, task_group: Any, action: Any) -> None:
        """Arm the timer: ``action``'s server (a ``TCPServer``, whose
        ``_idle_timeout`` this replaces) is closed if still idle after its
        ``keep_alive_timeout``."""
        self._armed = True
        self._idle_since = trio.current_time()
        if not self._started:
            self._started = True
            task_group._nursery.start_soon(self._run, action.__self__)
        if self._rearmed is not None:
            self._rearmed.set()

    async def stop(self) -> None:
        """Disarm the timer (a request is in flight)."""
        self._armed = False

    async def _run(self, server: Any) -> None:
        terminated = server.context.terminated  # hypercorn's EventWrapper
        timeout = server.config.keep_alive_timeout
        while not (self._armed and trio.current_time() >= self._idle_since + timeout):
            # Idle: wait until the keep-alive runs out. Busy: check again in as long.
            deadline = (self._idle_since if self._armed else trio.current_time()) + timeout
            with trio.move_on_at(deadline):
                await terminated.wait()
                break  # the server stops
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
        return
    sock = self.stream.socket._sock  # only this task reads it
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
    await self.protocol.handle(Closed())


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


def apply() -> None:
    """Install the six changes (idempotent)."""
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
