"""Batched websocket frames: a frame may carry a JSON array of messages once the
peer said it reads them (``Register.batch_frames`` / ``Registered.batch_frames``).
Both backends, through a real node."""

from __future__ import annotations

import json

import httpx
import pytest
import trio
import trio_websocket

from ironflow.node import Node
from ironflow.protocol import (
    FunctionDef,
    JobAck,
    JobAssignment,
    JobCompleted,
    Register,
    Registered,
    StepCompleted,
    Trigger,
    encoder,
    engine_message_decoder,
)
from tests.integration.helpers import emit, wait_for_run

FN = FunctionDef(id="batched", triggers=[Trigger("batched.go")])


def ws_url(node: Node) -> str:
    return node.url.replace("http://", "ws://") + "/v1/worker"


async def register(ws: trio_websocket.WebSocketConnection, *, batch_frames: bool, slots: int) -> Registered:
    await ws.send_message(encoder.encode(
        Register(worker_id="raw", functions=[FN], max_concurrent_jobs=slots, batch_frames=batch_frames)
    ).decode())
    with trio.fail_after(5):
        registered = engine_message_decoder.decode(await ws.get_message())
    assert isinstance(registered, Registered)
    return registered


async def frames_until(ws: trio_websocket.WebSocketConnection, count: int) -> list[object]:
    """Raw JSON frames until ``count`` assignments arrived."""
    frames: list[object] = []
    seen = 0
    with trio.fail_after(10):
        while seen < count:
            frame = json.loads(await ws.get_message())
            frames.append(frame)
            seen += len(frame) if isinstance(frame, list) else 1
    return frames


async def test_a_batch_capable_worker_gets_queued_assignments_in_one_frame_and_may_answer_in_one(
    node: Node, http: httpx.AsyncClient
) -> None:
    async with trio_websocket.open_websocket_url(ws_url(node)) as ws:
        await register(ws, batch_frames=True, slots=1)  # makes the function known
    # Ten runs queued while no worker is connected: the next session's first
    # dispatch round hands out all ten at once.
    run_ids = [(await emit(http, "batched.go", {"i": i}))["run_ids"][0] for i in range(10)]
    async with trio_websocket.open_websocket_url(ws_url(node)) as ws:
        registered = await register(ws, batch_frames=True, slots=10)
        assert registered.batch_frames  # the engine reads batches
        frames = await frames_until(ws, 10)
        assert any(isinstance(f, list) and len(f) > 1 for f in frames), frames
        assignments = [
            engine_message_decoder.decode(json.dumps(m))
            for f in frames for m in (f if isinstance(f, list) else [f])
        ]
        assert sorted(a.run_id for a in assignments if isinstance(a, JobAssignment)) == sorted(run_ids)
        # Everything a job says, in order, in ONE frame per job; then all jobs' ends in one.
        for a in assignments:
            assert isinstance(a, JobAssignment)
            fence = {"job_id": a.job_id, "run_id": a.run_id, "execution_seq": a.execution_seq,
                     "lease_token": a.lease_token}
            await ws.send_message(encoder.encode([
                JobAck(**fence),
                StepCompleted(**fence, step_id=f"{a.run_id}:s", name="s", output={"ok": a.run_id}),
            ]).decode())
        await ws.send_message(encoder.encode([
            JobCompleted(job_id=a.job_id, run_id=a.run_id, execution_seq=a.execution_seq,
                         lease_token=a.lease_token, output={"done": a.run_id})
            for a in assignments if isinstance(a, JobAssignment)
        ]).decode())
        for run_id in run_ids:
            detail = await wait_for_run(http, run_id)
            assert detail["run"]["status"] == "completed" and detail["run"]["output"] == {"done": run_id}
            assert [s["output"] for s in detail["steps"]] == [{"ok": run_id}]


async def test_a_worker_that_did_not_ask_for_batches_never_gets_one(node: Node, http: httpx.AsyncClient) -> None:
    async with trio_websocket.open_websocket_url(ws_url(node)) as ws:
        await register(ws, batch_frames=False, slots=10)
        for i in range(10):
            await emit(http, "batched.go", {"i": i})
        frames = await frames_until(ws, 10)
        assert all(isinstance(f, dict) for f in frames) and len(frames) == 10


async def test_an_empty_or_partly_invalid_batch_is_refused_and_the_socket_closed(node: Node) -> None:
    for frame in ("[]", '[{"type": "heartbeat"}, {"type": "no_such_message"}]'):
        async with trio_websocket.open_websocket_url(ws_url(node)) as ws:
            await register(ws, batch_frames=True, slots=1)
            await ws.send_message(frame)
            with trio.fail_after(5):
                refused = json.loads(await ws.get_message())
                assert refused["type"] == "refused" and refused["code"] == "INVALID_MESSAGE"
                with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                    await ws.get_message()
            assert closed.value.reason is not None and closed.value.reason.code == 1007
