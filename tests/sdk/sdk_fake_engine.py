"""A fake engine for SDK tests: a real websocket server (AnyIO + wsproto) speaking the
protocol, on whichever loop the test runs."""

from __future__ import annotations

import itertools
from typing import Any

import anyio
import anyio.abc
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, RejectConnection, Request

from ironflow.protocol import (
    MAX_FRAME_BYTES,
    EventInfo,
    JobAssignment,
    MemoStep,
    Registered,
    encoder,
    worker_frame_decoder,
    worker_message_decoder,
)
from ironflow.sdk.ws import WebSocket

_seq = itertools.count(1)


def make_assignment(
    function_id: str = "fn",
    *,
    run_id: str | None = None,
    execution_seq: int = 1,
    completed_steps: list[MemoStep] | None = None,
    data: Any = None,
    attempt: int = 1,
    start_delay_ms: int = 0,
    db_now: float | None = None,
) -> JobAssignment:
    run_id = run_id or f"run{next(_seq)}"
    return JobAssignment(
        job_id=f"{run_id}/{execution_seq}",
        run_id=run_id,
        function_id=function_id,
        event=EventInfo(id="ev1", name="test.event", data=data or {}, received_at=0.0),
        attempt=attempt,
        max_attempts=3,
        completed_steps=completed_steps or [],
        execution_seq=execution_seq,
        lease_token=f"tok-{run_id}-{execution_seq}",
        start_delay_ms=start_delay_ms,
        db_now=db_now,
    )


class ListReporter:
    """Records what a job reports, in order; ``outputs`` answers what an
    assignment left out (step id → output)."""

    def __init__(self, max_output_bytes: int = 4 * 1024 * 1024, outputs: dict[str, Any] | None = None) -> None:
        self.messages: list[Any] = []
        self.max_output_bytes = max_output_bytes
        self.outputs = outputs or {}
        self.fetched: list[str] = []

    async def step_output(self, job: Any, step_id: str) -> Any:
        self.fetched.append(step_id)
        return self.outputs[step_id]

    async def step(self, job: Any, msg: Any) -> None:
        self.messages.append(msg)

    async def result(self, job: Any, msg: Any) -> None:
        self.messages.append(msg)

    async def nack(self, job: Any, msg: Any) -> None:
        self.messages.append(msg)


class EngineConn:
    """The engine's side of one worker connection."""

    def __init__(self, ws: Any):
        self.ws = ws
        self.register: Any = None
        self._pending: list[Any] = []
        self.batched_frames = 0  # frames that carried more than one message

    async def recv(self) -> Any:
        """The next worker message, one at a time even when a frame batched several."""
        while not self._pending:
            frame = worker_frame_decoder.decode(await self.ws.get_message())
            if isinstance(frame, list):
                self.batched_frames += len(frame) > 1
                self._pending.extend(frame)
            else:
                self._pending.append(frame)
        return self._pending.pop(0)

    async def recv_until(self, kind: type, *, skip_heartbeats: bool = True) -> Any:
        while True:
            msg = await self.recv()
            if isinstance(msg, kind):
                return msg
            if skip_heartbeats and type(msg).__name__ == "Heartbeat":
                continue
            raise AssertionError(f"expected {kind.__name__}, got {msg!r}")

    async def send(self, msg: Any) -> None:
        await self.ws.send_message(encoder.encode(msg).decode())


class FakeEngine:
    def __init__(
        self,
        heartbeat_interval_ms: int = 60_000,
        reject_status: int | None = None,
        batch_frames: bool = False,
    ):
        self.batch_frames = batch_frames
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.reject_status = reject_status
        self.url = ""
        self.auth_headers: list[str | None] = []
        self._send, self._recv = anyio.create_memory_object_stream[EngineConn](10)

    async def _upgrade(self, stream: anyio.abc.ByteStream) -> WebSocket | None:
        """The server side of the handshake: the socket, or None once rejected."""
        conn = WSConnection(ConnectionType.SERVER)
        while True:
            conn.receive_data(await stream.receive())
            for event in conn.events():
                if isinstance(event, Request):
                    headers = dict(event.extra_headers)
                    self.auth_headers.append(headers.get(b"authorization", b"").decode() or None)
                    if self.reject_status is not None:
                        await stream.send(conn.send(RejectConnection(status_code=self.reject_status)))
                        await stream.aclose()
                        return None
                    await stream.send(conn.send(AcceptConnection()))
                    return WebSocket(stream, conn, max_message_size=MAX_FRAME_BYTES)

    async def _handler(self, stream: anyio.abc.SocketStream) -> None:
        async with stream:
            ws = await self._upgrade(stream)
            if ws is None:
                return
            conn = EngineConn(ws)
            conn.register = worker_message_decoder.decode(await ws.get_message())
            await conn.send(
                Registered(
                    session_id="sess-1",
                    heartbeat_interval_ms=self.heartbeat_interval_ms,
                    lease_expiry_ms=90_000,
                    batch_frames=self.batch_frames,
                )
            )
            await self._send.send(conn)
            await anyio.sleep_forever()

    async def accept(self) -> EngineConn:
        return await self._recv.receive()

    async def start(self, task_group: anyio.abc.TaskGroup) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        task_group.start_soon(listener.serve, self._handler)
        self.url = f"http://127.0.0.1:{port}"
