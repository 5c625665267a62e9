"""The hypercorn patch writes a fixed-length response in one socket write,
byte for byte what hypercorn wrote in several (ironflow/api/hypercorn_patch.py)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import h11
import pytest
import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.events import RawData
from hypercorn.protocol.events import Body, EndBody, Response
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.worker_context import WorkerContext

from ironflow.api import hypercorn_patch

REQUEST = b"POST /v1/events HTTP/1.1\r\nHost: node\r\nContent-Length: 0\r\n\r\n"


def _protocol(writes: list[bytes]) -> H11Protocol:
    """An H11Protocol that has read one request and records what it writes."""

    async def send(event: Any) -> None:
        if isinstance(event, RawData):
            writes.append(event.data)

    proto = H11Protocol(
        None, Config(), WorkerContext(None), None, {}, False, None, None, send  # type: ignore[arg-type]
    )
    proto.connection.receive_data(REQUEST)
    assert isinstance(proto.connection.next_event(), h11.Request)
    assert isinstance(proto.connection.next_event(), h11.EndOfMessage)
    return proto


async def _respond(proto: H11Protocol, headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> None:
    await proto.stream_send(Response(stream_id=1, headers=headers, status_code=200))
    for chunk in chunks:
        await proto.stream_send(Body(stream_id=1, data=chunk))
    await proto.stream_send(EndBody(stream_id=1))


async def test_a_fixed_length_response_is_one_write_of_the_same_bytes() -> None:
    hypercorn_patch.apply()
    writes: list[bytes] = []
    await _respond(_protocol(writes), [(b"content-length", b"11")], [b'{"ok":true}'])
    assert len(writes) == 1
    head, _, body = writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"content-length: 11" in head
    assert body == b'{"ok":true}'


async def test_a_streamed_response_writes_its_head_at_once() -> None:
    hypercorn_patch.apply()
    writes: list[bytes] = []
    proto = _protocol(writes)
    await proto.stream_send(Response(stream_id=1, headers=[], status_code=200))
    assert len(writes) == 1 and writes[0].startswith(b"HTTP/1.1 200 ")  # not held for a body
    await proto.stream_send(Body(stream_id=1, data=b"data: 1\n\n"))
    await proto.stream_send(EndBody(stream_id=1))
    assert writes[1:] == [b"9\r\ndata: 1\n\n\r\n", b"0\r\n\r\n"]  # chunked, as before


async def test_an_empty_fixed_length_response_is_one_write() -> None:
    hypercorn_patch.apply()
    writes: list[bytes] = []
    await _respond(_protocol(writes), [(b"content-length", b"0")], [])
    assert len(writes) == 1 and writes[0].endswith(b"\r\n\r\n")


class _Server:
    """What the keep-alive timer uses of a ``TCPServer``: its config, its
    worker context, its ``_idle_timeout`` (the action) and its close."""

    def __init__(self) -> None:
        self.config = Config()
        self.config.keep_alive_timeout = 5.0
        self.context = WorkerContext(None)
        self.closed_at: list[float] = []

    async def _idle_timeout(self) -> None:
        raise AssertionError("replaced by the timer")

    async def _initiate_server_close(self) -> None:
        self.closed_at.append(trio.current_time())


async def test_the_keep_alive_timer_closes_an_idle_connection_after_its_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hypercorn_patch.apply()
    from hypercorn.trio import tcp_server

    server, timer = _Server(), tcp_server.TrioSingleTask()
    async with trio.open_nursery() as nursery:
        group: Any = type("TaskGroup", (), {"_nursery": nursery})()  # what the timer uses of one
        await timer.restart(group, server._idle_timeout)  # the connection opens idle
        await trio.sleep(3)
        await timer.stop()  # a request arrives ...
        await trio.sleep(10)  # ... and takes longer than the keep-alive: not closed
        assert server.closed_at == []
        await timer.restart(group, server._idle_timeout)  # its response is done at t=13
        for _ in range(100):  # the next requests: one task for them all, no new one
            await timer.stop()
            await timer.restart(group, server._idle_timeout)
        assert len(nursery.child_tasks) == 1
    assert server.closed_at == [13.0 + 5.0]


async def test_a_stopping_server_closes_its_connections_once_idle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hypercorn_patch.apply()
    from hypercorn.trio import tcp_server

    idle, busy = _Server(), _Server()
    timers = tcp_server.TrioSingleTask(), tcp_server.TrioSingleTask()
    async with trio.open_nursery() as nursery:
        group: Any = type("TaskGroup", (), {"_nursery": nursery})()
        for server, timer in zip((idle, busy), timers, strict=True):
            await timer.restart(group, server._idle_timeout)
        await timers[1].stop()  # a request in flight on `busy`
        await trio.sleep(1)
        await idle.context.terminated.set()
        await busy.context.terminated.set()
        await trio.sleep(2)
        assert idle.closed_at == [1.0] and busy.closed_at == []
        await timers[1].restart(group, busy._idle_timeout)  # its response is done
    assert busy.closed_at == [3.0]


def _server_on(sock: Any) -> Any:
    """What ``TCPServer.protocol_send`` uses of a server: its send lock, its
    stream and its protocol (told when the peer is gone)."""
    from types import SimpleNamespace

    closed: list[Any] = []

    async def handle(event: Any) -> None:
        closed.append(event)

    return SimpleNamespace(
        send_lock=trio.Lock(), stream=trio.SocketStream(sock), protocol=SimpleNamespace(handle=handle), closed=closed
    )


async def _read_all(sock: Any, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = await sock.recv(1 << 16)
        assert chunk, "the peer closed early"
        got += chunk
    return got


async def test_a_write_the_socket_takes_whole_costs_no_checkpoint() -> None:
    a, b = trio.socket.socketpair()
    server = _server_on(a)
    with trio.testing.assert_no_checkpoints():
        await hypercorn_patch._protocol_send(server, RawData(data=b"HTTP/1.1 200 OK\r\n\r\n"))
    assert await _read_all(b, 19) == b"HTTP/1.1 200 OK\r\n\r\n"


async def test_what_the_socket_does_not_take_at_once_follows_in_order() -> None:
    a, b = trio.socket.socketpair()
    server = _server_on(a)
    data = bytes(range(256)) * (16 << 10)  # 4 MiB: far past a socket buffer
    got: list[bytes] = []

    async def read() -> None:
        got.append(await _read_all(b, len(data) + 3))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await hypercorn_patch._protocol_send(server, RawData(data=data))
        await hypercorn_patch._protocol_send(server, RawData(data=b"end"))
    assert got == [data + b"end"]


async def test_a_write_waits_behind_one_under_way() -> None:
    """The send lock is held (an earlier write still going hypercorn's way):
    the next write must not overtake it on the socket."""
    a, b = trio.socket.socketpair()
    server = _server_on(a)
    async with trio.open_nursery() as nursery:
        await server.send_lock.acquire()
        nursery.start_soon(hypercorn_patch._protocol_send, server, RawData(data=b"second"))
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(BlockingIOError):
            b._sock.recv(100)  # nothing written yet
        a._sock.send(b"first ")  # what the holder was writing
        server.send_lock.release()
    assert await _read_all(b, 12) == b"first second"


async def test_a_write_to_a_closed_peer_is_told_as_hypercorn_tells_it() -> None:
    a, b = trio.socket.socketpair()
    server = _server_on(a)
    b.close()
    for _ in range(3):  # the first write may still be taken by the kernel
        await hypercorn_patch._protocol_send(server, RawData(data=b"x" * 100_000))
    assert server.closed, "the protocol was not told the connection closed"


class _Group:
    """What ``_spawn_app`` uses of hypercorn's ``TaskGroup``: its nursery."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery


async def test_a_message_to_or_from_the_application_passes_without_a_checkpoint_when_it_can() -> None:
    """The request's body and end go to the application's channel, and the
    application reads them, with no task switch while the channel has room
    (or a message waiting); a full channel still makes the sender wait."""
    config = Config()
    config.max_app_queue_size = 2
    got: list[Any] = []
    receive_box: list[Any] = []
    app_may_read = trio.Event()

    async def app(scope: Any, receive: Any, send: Any, sync_spawn: Any, call_soon: Any) -> None:
        receive_box.append(receive)
        await app_may_read.wait()
        with trio.CancelScope() as scope_:
            scope_.cancel()  # a checkpoint here would raise Cancelled
            got.append(await receive())
            got.append(await receive())
        got.append(await receive())  # nothing waiting: waits, as before

    async def send(message: Any) -> None:
        pass

    async with trio.open_nursery() as nursery:
        put = await hypercorn_patch._spawn_app(_Group(nursery), app, config, {}, send)  # type: ignore[arg-type]
        with trio.CancelScope() as scope:
            scope.cancel()
            await put({"type": "http.request", "body": b"{}", "more_body": True})
            await put({"type": "http.request", "body": b"", "more_body": False})
        assert not scope.cancelled_caught  # no checkpoint: both fit the buffer
        with trio.move_on_after(0.05) as full:
            await put({"type": "http.disconnect"})  # the buffer is full: waits
        assert full.cancelled_caught
        app_may_read.set()
        await trio.sleep(0.01)
        assert [m["more_body"] for m in got] == [True, False]
        await put({"type": "http.disconnect"})
    assert got[-1] == {"type": "http.disconnect"}


def _reader_on(sock: Any, read_timeout: float | None = None) -> Any:
    """What ``TCPServer._read_data`` uses of a server: its stream, its config
    and its protocol (handed every event the reader produces)."""
    from types import SimpleNamespace

    config = Config()
    config.read_timeout = read_timeout  # type: ignore[assignment]
    events: list[Any] = []

    async def handle(event: Any) -> None:
        events.append(event)

    return SimpleNamespace(
        stream=trio.SocketStream(sock), config=config, protocol=SimpleNamespace(handle=handle), events=events
    )


def _count_fail_after(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every ``trio.fail_after`` entered (hypercorn's reader enters one per read)."""
    entered: list[float] = []
    original = trio.fail_after

    def counting(seconds: float, *args: Any, **kwargs: Any) -> Any:
        entered.append(seconds)
        return original(seconds, *args, **kwargs)

    monkeypatch.setattr(trio, "fail_after", counting)
    return entered


async def test_the_reader_hands_over_what_arrives_then_the_peers_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each read is handed over as it arrives, the peer's end as an empty read
    and then ``Closed``: hypercorn's events, with no timeout scope per read."""
    from hypercorn.events import Closed

    entered = _count_fail_after(monkeypatch)
    a, b = trio.socket.socketpair()
    server = _reader_on(a)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hypercorn_patch._read_data, server)
        for request in (REQUEST, REQUEST + REQUEST):
            await b.send(request)
            with trio.move_on_after(5) as timeout:  # not fail_after: counted
                while not server.events or server.events[-1].data != request:
                    await trio.sleep(0.001)
            assert not timeout.cancelled_caught
        b.close()
    assert server.events == [RawData(REQUEST), RawData(REQUEST + REQUEST), RawData(b""), Closed()]
    assert entered == []  # with no read timeout, none entered (hypercorn: one per read)


async def test_the_reader_stops_when_the_node_closes_the_socket() -> None:
    """hypercorn's own close (keep-alive timeout, server stopping) closes the
    stream while the reader waits: the reader stops, no error."""
    from hypercorn.events import Closed

    a, _b = trio.socket.socketpair()
    server = _reader_on(a)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hypercorn_patch._read_data, server)
            await trio.testing.wait_all_tasks_blocked()
            await server.stream.aclose()
    assert server.events == [Closed()]
    # and a reader started on a socket already closed stops at once
    await hypercorn_patch._read_data(server)
    assert server.events == [Closed(), Closed()]


async def test_the_reader_stops_on_a_reset() -> None:
    import socket
    import struct

    from hypercorn.events import Closed

    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen()
    client = trio.socket.socket()
    await client.connect(listener.getsockname())
    a, _ = await listener.accept()
    server = _reader_on(a)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hypercorn_patch._read_data, server)
            await trio.testing.wait_all_tasks_blocked()
            client.close()  # linger 0: a reset, not an orderly end
    assert server.events == [Closed()]  # the reset ends the reader: no data, no error
    listener.close()


async def test_a_read_timeout_still_reads_hypercorns_way(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """A configured ``read_timeout`` keeps hypercorn's reader: a peer silent
    for longer is disconnected."""
    from hypercorn.events import Closed

    entered = _count_fail_after(monkeypatch)
    a, _b = trio.socket.socketpair()
    server = _reader_on(a, read_timeout=30)
    await hypercorn_patch._read_data(server)
    assert server.events == [Closed()] and entered == [30]
    assert trio.current_time() == 30


async def test_the_application_queue_keeps_order_and_bounds_what_it_holds() -> None:
    """Senders beyond the bound wait and go in the order they came; a receiver
    waits for a message; a cancelled wait takes nothing; a bound of 0 holds one."""
    queue = hypercorn_patch._AppQueue(1)
    got: list[Any] = []
    async with trio.open_nursery() as nursery:
        await queue.put("a")  # room: at once
        for name in "bcd":
            nursery.start_soon(queue.put, name)
            await trio.testing.wait_all_tasks_blocked()  # each waits, in turn
        for _ in range(4):
            got.append(await queue.get())
    assert got == ["a", "b", "c", "d"]

    with trio.move_on_after(0.01) as waited:
        await queue.get()  # empty: waits
    assert waited.cancelled_caught
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.put, "e")
        assert await queue.get() == "e"  # the cancelled wait took nothing

    rendezvous = hypercorn_patch._AppQueue(0)
    with trio.testing.assert_no_checkpoints():
        await rendezvous.put("f")
    assert await rendezvous.get() == "f"


_FALLBACK_PROBE = """
import logging, sys
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio import tcp_server
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.tcp_server import TCPServer
from ironflow import logs
from ironflow.api import hypercorn_patch

logs.setup("INFO")
hypercorn_patch._installed_hypercorn = lambda: "0.19.0"
before = (TCPServer.protocol_send, TCPServer._read_data, H11Protocol._send_h11_event,
          TaskGroup.spawn_app, tcp_server.TrioSingleTask)
assert hypercorn_patch.apply() is False
after = (TCPServer.protocol_send, TCPServer._read_data, H11Protocol._send_h11_event,
         TaskGroup.spawn_app, tcp_server.TrioSingleTask)
print(all(a is b for a, b in zip(before, after, strict=True)))
"""


def test_another_hypercorn_release_is_refused_with_a_logged_reason_and_served_by_hypercorns_own_code() -> None:
    # A fresh interpreter: this one may have the changes installed already.
    out = subprocess.run(
        [sys.executable, "-c", _FALLBACK_PROBE], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "True"  # not one of the five internals replaced
    assert "hypercorn patch not applied" in out.stderr
    assert "hypercorn 0.19.0 is installed; the patch was written for 0.18.0" in out.stderr


def test_the_release_it_was_written_for_is_the_installed_and_pinned_one() -> None:
    import importlib.metadata
    from pathlib import Path

    assert hypercorn_patch.refusal() is None
    assert importlib.metadata.version("hypercorn") == hypercorn_patch.WRITTEN_FOR
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert f'"hypercorn=={hypercorn_patch.WRITTEN_FOR}"' in pyproject
    assert hypercorn_patch.apply() is True
    from hypercorn.trio.tcp_server import TCPServer

    assert TCPServer.protocol_send is hypercorn_patch._protocol_send


def test_a_trio_socket_without_its_stdlib_socket_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hypercorn_patch, "_trio_socket_wraps_a_stdlib_socket", lambda: False)
    reason = hypercorn_patch.refusal()
    assert reason is not None and "_sock" in reason
