"""Property-based fuzzing of a real node process (SQLite) with an honest worker.

HTTP bodies and websocket frames are generated from the protocol types
(``wire_strategies``) and mutated. Whatever arrives, the node answers with a
4xx (never a 5xx), closes a socket with a 1xxx code other than 1011, restarts
no actor, and the honest worker's runs still complete afterwards.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio_websocket
from hypothesis import given
from hypothesis import strategies as st

from ironflow.protocol import (
    SESSION_SECRET_HEADER,
    CancelRequest,
    EmitBatchRequest,
    EmitRequest,
    Heartbeat,
    InvokeRequest,
    JobAck,
    JobCompleted,
    JobFailed,
    JobNack,
    JobYielded,
    KeyCreateRequest,
    PullPollRequest,
    Register,
    StepCompleted,
    StepFailed,
    WorkerMessage,
)
from tests.integration.fuzz_target import Target, assert_node_unharmed, fuzz_settings, metric
from tests.integration.wire_strategies import document, mutated

pytestmark = pytest.mark.slow

# Example counts: enough to reach every endpoint and frame type many times,
# small enough for CI (each HTTP example is one request, each frame one socket).
HTTP_EXAMPLES = 300
FRAME_EXAMPLES = 120

# The messages each pull endpoint accepts: most fuzzed bodies are shaped like
# one of them, so they get past the routing and reach the store.
PULL_MESSAGES: dict[str, Any] = {
    "heartbeat": Heartbeat,
    "ack": JobAck,
    "nack": JobNack,
    "steps": StepCompleted | StepFailed,
    "result": JobCompleted | JobFailed | JobYielded,
}


def endpoints(t: Target) -> list[tuple[str, str, Any, dict[str, str]]]:
    """(method, path, body type, extra headers) of every endpoint that takes a body."""
    mine = {SESSION_SECRET_HEADER: t.secret}
    sid = t.session_id
    out: list[tuple[str, str, Any, dict[str, str]]] = [
        ("POST", "/v1/events", EmitRequest, {}),
        ("POST", "/v1/events/batch", EmitBatchRequest, {}),
        ("POST", "/v1/functions/crashy/invoke", InvokeRequest, {}),
        ("POST", "/v1/runs/run_nope/cancel", CancelRequest, {}),
        ("POST", "/v1/keys", KeyCreateRequest, {}),
        ("POST", "/v1/worker/register", Register, {}),
        ("POST", f"/v1/worker/sessions/{sid}/poll", PullPollRequest, mine),
        ("POST", f"/v1/worker/sessions/{sid}/ack", WorkerMessage, mine),
        ("POST", "/v1/worker/sessions/ses_nope/result", WorkerMessage, {}),
    ]
    for tail, kind in PULL_MESSAGES.items():
        out += [("POST", f"/v1/worker/sessions/{sid}/{tail}", kind, mine)] * 2
    return out
@st.composite
def http_case(draw: st.DrawFn, t: Target) -> tuple[str, str, bytes, dict[str, str]]:
    method, path, kind, headers = draw(st.sampled_from(endpoints(t)))
    return method, path, draw(mutated(document(kind))), headers


def test_fuzzed_http_bodies_never_get_a_5xx(fuzz_target: Target) -> None:
    restarts_before = metric(fuzz_target, "ironflow_actor_restarts_total")

    @fuzz_settings(HTTP_EXAMPLES)
    @given(case=http_case(fuzz_target))
    def check(case: tuple[str, str, bytes, dict[str, str]]) -> None:
        method, path, body, headers = case
        resp = fuzz_target.http.request(method, path, content=body, headers={**headers, "content-type": "application/json"})
        assert resp.status_code < 500, (path, body[:300], resp.text[:300])
        if resp.status_code >= 400:
            assert resp.json()["message"], resp.text

    check()
    assert_node_unharmed(fuzz_target, restarts_before)


async def frame_outcome(url: str, frames: list[bytes]) -> int | None:
    """Send ``frames`` on a fresh socket; the close code, or None if still open after 1 s."""
    ws_url = url.replace("http://", "ws://") + "/v1/worker"
    async with trio_websocket.open_websocket_url(ws_url, max_message_size=16 * 1024 * 1024) as ws:
        try:
            for frame in frames:
                await ws.send_message(frame.decode(errors="replace"))
            with trio.move_on_after(1.0):
                while True:
                    await ws.get_message()
        except trio_websocket.ConnectionClosed as exc:
            return int(exc.reason.code)
    return None


def test_fuzzed_worker_frames_never_close_a_socket_1011(fuzz_target: Target) -> None:
    restarts_before = metric(fuzz_target, "ironflow_actor_restarts_total")
    register = b'{"type": "register", "worker_id": "fz", "functions": [], "max_concurrent_jobs": 1}'

    @fuzz_settings(FRAME_EXAMPLES)
    @given(registered=st.booleans(), frames=st.lists(mutated(document(WorkerMessage)), min_size=1, max_size=3))
    def check(registered: bool, frames: list[bytes]) -> None:
        code = trio.run(frame_outcome, fuzz_target.url, ([register] if registered else []) + frames)
        assert code != 1011, frames

    check()
    assert_node_unharmed(fuzz_target, restarts_before)
