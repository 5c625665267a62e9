"""The streaming-worker websocket ``/v1/worker``: one session actor per socket.

Frames are JSON text. A frame that cannot be read closes the socket with a
code saying why (1002 malformed, 1007 invalid, 1003 binary, 1009 too large,
1008 registration refused), after a ``Refused`` frame naming the problem;
1013 "try again later" means the database is unavailable (a Register that
could not be recorded; an open session instead waits the outage out);
1011 means a fault of ours. Sockets still open when the node stops are closed
with 1001.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import trio
from quart import Blueprint, Response, websocket

from actors import session as session_actor
from actors.directory import fresh_start
from ironflow import logs
from ironflow.api.auth import require_org
from ironflow.api.errors import ApiFailure, decode_frame, error_response
from ironflow.api.state import ApiDeps, state
from ironflow.protocol import (
    EngineMessage,
    JobAssignment,
    JsonTooDeep,
    Refused,
    Register,
    WorkerMessage,
    encoder,
    worker_frame_decoder,
)
from ironflow.store import StoreUnavailable

log = logging.getLogger("ironflow.api")
bp = Blueprint("worker_socket", __name__)

# Websocket close codes (RFC 6455).
WS_GOING_AWAY = 1001
WS_PROTOCOL_ERROR = 1002
WS_UNSUPPORTED_DATA = 1003
WS_INVALID_PAYLOAD = 1007
WS_POLICY_VIOLATION = 1008
WS_INTERNAL_ERROR = 1011
WS_TRY_AGAIN_LATER = 1013
# How long closing a worker socket may wait for the close handshake.
WS_CLOSE_TIMEOUT_S = 1.0
# Frames read ahead of the session actor, and frames queued for the socket.
INBOUND_BUFFER = 256
# Bound on handing a closed socket's last frames to its session actor.
LAST_FRAMES_TIMEOUT_S = 10.0
OUTBOX_BUFFER = 1024
# Most queued messages the writer puts in one batched frame.
WRITE_BATCH = 256


class _CloseSocket(Exception):
    """Close the worker socket with ``code``; ``refusal`` is sent first when set,
    so the worker's SDK can report why rather than reconnect blindly."""

    def __init__(self, code: int, reason: str, refusal: Refused | None = None) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.refusal = refusal


@bp.websocket("/v1/worker")
async def worker_socket() -> Response | None:
    deps = state().deps
    if deps.shutdown_requested.is_set():
        return error_response(503, "DRAINING", "this node is draining; connect to another node")
    try:
        await require_org(websocket.headers)
    except ApiFailure as exc:
        return error_response(exc.status, exc.code, exc.message)
    await websocket.accept()
    ws = websocket._get_current_object()  # type: ignore[attr-defined]  # tasks outlive the context
    await _serve_socket(ws, deps)
    return None


async def _serve_socket(ws: Any, deps: ApiDeps) -> None:
    """Shuttle frames between one websocket and its session actor."""
    inbound_send, inbound_receive = trio.open_memory_channel[WorkerMessage](INBOUND_BUFFER)
    outbox_send, outbox_receive = trio.open_memory_channel[EngineMessage](OUTBOX_BUFFER)
    close_code, close_reason = 1000, ""
    refusal: Refused | None = None
    # Whether the worker reads batched frames (its Register says so).
    peer_batches = False

    async def reader() -> None:
        nonlocal peer_batches
        # close() rather than `async with`: aclose() checkpoints, and a cancel
        # arriving there would swallow the _CloseSocket that explains the close.
        held: list[WorkerMessage] = []  # read, not yet handed to the session actor
        try:
            while True:
                data = await ws.receive()
                if isinstance(data, bytes):
                    raise _CloseSocket(WS_UNSUPPORTED_DATA, "binary frames are not supported: send JSON text frames")
                held += _decode_worker_frame(data)
                if held and isinstance(held[0], Register):
                    peer_batches = held[0].batch_frames
                await _hand_over(held, inbound_send)
        except trio.Cancelled:
            # The peer closed: quart-trio cancels this handler as soon as it
            # sees the disconnect, while frames that arrived before it may
            # still be in hand or in quart's buffer (the session actor was
            # behind). They are the worker's last words (a drained worker's
            # results): hand them over too, or their leases would be recovered.
            held += _frames_left_in(ws)
            with trio.CancelScope(shield=True), trio.move_on_after(LAST_FRAMES_TIMEOUT_S):
                for msg in held:
                    await inbound_send.send(msg)
            raise
        finally:
            inbound_send.close()

    async def writer() -> None:
        try:
            async for msg in outbox_receive:
                batch = [msg]
                while peer_batches and len(batch) < WRITE_BATCH:
                    try:
                        batch.append(outbox_receive.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                now = trio.current_time()
                batch = [
                    fresh_start(m, deps.directory.db_clock, now) if isinstance(m, JobAssignment) else m
                    for m in batch
                ]
                frame = batch[0] if len(batch) == 1 else batch
                await ws.send(encoder.encode(frame).decode())
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
        except* StoreUnavailable as group:
            message = str(group.exceptions[0])
            close_code, close_reason = WS_TRY_AGAIN_LATER, _short(f"try again later: {message}")
            refusal = Refused(StoreUnavailable.code, message)
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


async def _hand_over(held: list[WorkerMessage], inbound: trio.MemorySendChannel[WorkerMessage]) -> None:
    """Hand ``held`` to the session actor in order, removing each message once sent.

    Without a checkpoint while the channel has room: a frame's messages are all
    queued before the session actor runs, so it takes the frame as one batch
    (one wake-up per frame, not two task switches per message). Only a full
    channel (the actor is behind) waits, and a cancellation there leaves the
    unsent messages in ``held``.
    """
    sent = 0
    try:
        for msg in held:
            try:
                inbound.send_nowait(msg)
            except trio.WouldBlock:
                await inbound.send(msg)
            sent += 1
    finally:
        del held[:sent]


def _frames_left_in(ws: Any) -> list[WorkerMessage]:
    """Messages of the text frames quart-trio received for ``ws`` that no one has read yet.

    quart-trio queues received frames on a memory channel whose ``receive``
    is the websocket's ``_receive`` (quart-trio 0.12); anything else yields
    nothing. Frames that cannot be read are dropped (the socket is gone, so
    there is no one left to tell).
    """
    channel = getattr(getattr(ws, "_receive", None), "__self__", None)
    messages: list[WorkerMessage] = []
    if not isinstance(channel, trio.MemoryReceiveChannel):
        return messages
    while True:
        try:
            data = channel.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return messages
        if isinstance(data, str):
            try:
                messages += _decode_worker_frame(data)
            except _CloseSocket:
                continue


def _decode_worker_frame(data: str) -> list[WorkerMessage]:
    """The messages of one worker frame (one, or a batch), or
    :class:`_CloseSocket` saying why it cannot be read.

    Malformed JSON is a protocol error (1002); well-formed JSON that is no
    valid message — an unknown type, a wrong field, a number out of bounds,
    nesting too deep — is invalid payload data (1007). Either way the worker
    first receives a ``Refused`` naming the problem.
    """
    try:
        frame: WorkerMessage | list[WorkerMessage] = decode_frame(data, worker_frame_decoder)
        return frame if isinstance(frame, list) else [frame]
    except (msgspec.ValidationError, JsonTooDeep) as exc:  # ValidationError is a DecodeError
        code, message = WS_INVALID_PAYLOAD, f"invalid message: {exc}"
    except msgspec.DecodeError as exc:
        code, message = WS_PROTOCOL_ERROR, f"invalid message: {exc}"
    raise _CloseSocket(code, _short(message), Refused("INVALID_MESSAGE", message))


def _short(reason: str) -> str:
    """A close reason must fit in 123 bytes of UTF-8."""
    encoded = reason.encode()
    return reason if len(encoded) <= 120 else encoded[:117].decode(errors="ignore") + "..."
