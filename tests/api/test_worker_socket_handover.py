"""The websocket reader hands a frame's messages to the session actor without a
checkpoint per message (one wake-up of the actor per frame)."""

from __future__ import annotations

import pytest
import trio

from ironflow.api.worker_socket import _hand_over
from ironflow.protocol import Heartbeat, WorkerMessage


def _beats(n: int) -> list[WorkerMessage]:
    return [Heartbeat(jobs=[]) for _ in range(n)]


async def test_a_frame_with_room_is_handed_over_without_a_checkpoint() -> None:
    send, receive = trio.open_memory_channel[WorkerMessage](8)
    held = _beats(3)
    with trio.CancelScope() as scope:
        scope.cancel()  # any checkpoint inside would raise Cancelled here
        await _hand_over(held, send)
    assert not scope.cancelled_caught
    assert held == []
    assert len([receive.receive_nowait() for _ in range(3)]) == 3


async def test_a_full_channel_waits_and_a_cancel_keeps_the_unsent_messages() -> None:
    send, receive = trio.open_memory_channel[WorkerMessage](1)
    held = _beats(3)
    first, rest = held[0], held[1:]
    with trio.move_on_after(0.01):
        await _hand_over(held, send)
    assert held == rest  # the first went in; the others stay for the caller
    assert receive.receive_nowait() is first
    with pytest.raises(trio.WouldBlock):
        receive.receive_nowait()
