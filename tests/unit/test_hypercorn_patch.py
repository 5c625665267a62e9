"""The hypercorn patch writes a fixed-length response in one socket write,
byte for byte what hypercorn wrote in several (ironflow/hypercorn_patch.py)."""

from __future__ import annotations

from typing import Any

import h11
import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.events import RawData
from hypercorn.protocol.events import Body, EndBody, Response
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.worker_context import WorkerContext

from ironflow import hypercorn_patch

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




async def test_the_keep_alive_timer_runs_once_and_stops() -> None:
    """The idle timer hypercorn restarts per request: one run at a time,
    a restart cancels the previous run, a stop cancels the current one."""
    hypercorn_patch.apply()
    from hypercorn.trio import tcp_server

    running: list[int] = []
    ended: list[int] = []

    def action(n: int) -> Any:
        async def run() -> None:
            running.append(n)
            try:
                await trio.sleep_forever()
            finally:
                ended.append(n)

        return run

    timer = tcp_server.TrioSingleTask()
    async with trio.open_nursery() as nursery:
        group: Any = type("TaskGroup", (), {"_nursery": nursery})()  # what the timer uses of one
        await timer.restart(group, action(1))
        await timer.restart(group, action(2))
        await trio.testing.wait_all_tasks_blocked()
        assert set(running) - set(ended) == {2}  # the first was cancelled
        await timer.stop()
        await trio.testing.wait_all_tasks_blocked()
        assert set(running) - set(ended) == set()
        await timer.restart(group, action(3))
        await trio.testing.wait_all_tasks_blocked()
        assert set(running) - set(ended) == {3}
        await timer.stop()
