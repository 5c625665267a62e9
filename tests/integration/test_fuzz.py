"""Property-based fuzzing of a real node process (SQLite) with an honest worker.

HTTP bodies and websocket frames are generated from the protocol types
(``wire_strategies``) and mutated. Whatever arrives, the node answers with a
4xx (never a 5xx), closes a socket with a 1xxx code other than 1011, restarts
no actor, and the honest worker's runs still complete afterwards.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio_websocket
from hypothesis import HealthCheck, given, settings
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
from tests.integration.procs import Proc, start_node, start_worker
from tests.integration.test_node_death import free_port
from tests.integration.wire_strategies import document, mutated

pytestmark = pytest.mark.slow

# Example counts: enough to reach every endpoint and frame type many times,
# small enough for CI (each HTTP example is one request, each frame one socket).
HTTP_EXAMPLES = 300
FRAME_EXAMPLES = 120

def fuzz_settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,  # the same examples every run: CI failures reproduce
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        database=None,
    )


class Target:
    """A node process, an honest worker process, and a pull session of our own."""

    def __init__(self, node: Proc, worker: Proc, url: str, effects: Path) -> None:
        self.node, self.worker, self.url, self.effects = node, worker, url, effects
        self.http = httpx.Client(base_url=url, timeout=30)
        reg = self.http.post(
            "/v1/worker/register",
            json={"type": "register", "worker_id": "fuzz", "functions": [], "max_concurrent_jobs": 1},
        ).json()
        self.session_id, self.secret = reg["session_id"], reg["session_secret"]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    tmp = tmp_path_factory.mktemp("fuzz")
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    async def start() -> tuple[Proc, Proc]:
        # A poll in a fuzzed body may ask to wait: hold none open for long.
        node = await start_node(
            str(tmp / "db.sqlite"), tmp / "state", tmp, node_id="fuzz", port=port,
            extra=["--poll-max-wait", "0.2"],
        )
        worker = await start_worker(url, tmp / "effects", tmp, slow=0.0)
        return node, worker

    node, worker = trio.run(start)
    t = Target(node, worker, url, tmp / "effects")
    try:
        yield t
    finally:
        t.http.close()
        worker.stop()
        node.stop()


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
def metric(t: Target, name: str) -> float:
    text = t.http.get("/metrics").text
    return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def assert_honest_work_completes(t: Target) -> None:
    run_id = t.http.post("/v1/events", json={"name": "crash.go", "data": {}}).json()["run_ids"][0]
    for _ in range(600):
        status = t.http.get(f"/v1/runs/{run_id}").json()["run"]["status"]
        if status == "completed":
            return
        trio.run(trio.sleep, 0.05)
    raise AssertionError(f"honest run {run_id} ended {status!r}, not completed")


@st.composite
def http_case(draw: st.DrawFn, t: Target) -> tuple[str, str, bytes, dict[str, str]]:
    method, path, kind, headers = draw(st.sampled_from(endpoints(t)))
    return method, path, draw(mutated(document(kind))), headers


def test_fuzzed_http_bodies_never_get_a_5xx(target: Target) -> None:
    restarts_before = metric(target, "ironflow_actor_restarts_total")

    @fuzz_settings(HTTP_EXAMPLES)
    @given(case=http_case(target))
    def check(case: tuple[str, str, bytes, dict[str, str]]) -> None:
        method, path, body, headers = case
        resp = target.http.request(method, path, content=body, headers={**headers, "content-type": "application/json"})
        assert resp.status_code < 500, (path, body[:300], resp.text[:300])
        if resp.status_code >= 400:
            assert resp.json()["message"], resp.text

    check()
    assert target.node.alive()
    assert metric(target, "ironflow_actor_restarts_total") == restarts_before
    assert_honest_work_completes(target)


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


def test_fuzzed_worker_frames_never_close_a_socket_1011(target: Target) -> None:
    restarts_before = metric(target, "ironflow_actor_restarts_total")
    register = b'{"type": "register", "worker_id": "fz", "functions": [], "max_concurrent_jobs": 1}'

    @fuzz_settings(FRAME_EXAMPLES)
    @given(registered=st.booleans(), frames=st.lists(mutated(document(WorkerMessage)), min_size=1, max_size=3))
    def check(registered: bool, frames: list[bytes]) -> None:
        code = trio.run(frame_outcome, target.url, ([register] if registered else []) + frames)
        assert code != 1011, frames

    check()
    assert target.node.alive()
    assert metric(target, "ironflow_actor_restarts_total") == restarts_before
    assert_honest_work_completes(target)
