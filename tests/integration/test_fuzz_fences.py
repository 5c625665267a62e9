"""Property-based fuzzing of the fence: well-formed worker frames, built from the
protocol's own types around a real assignment, with their fence mutated and
their order shuffled.

Each example registers a raw streaming worker on a real node process, takes a
real ``JobAssignment`` and sends a drawn sequence of fenced frames (ack, nack,
step results, job results, yields, heartbeats) for it, each carrying the
genuine fence or a mutation of it: the seq one off, a forged lease token, an
unknown run, an unknown job. Out-of-order falls out of the draw (a step before
the ack, a result after the run ended, a second ack). Whatever the sequence:

- a frame with a mutated fence is refused and changes nothing;
- a frame with the genuine fence changes nothing once that fence is spent
  (the run moved to another seq, ended, or parked), and changes the run only
  while it is live;
- a heartbeat never refreshes a lease it names with a mutated or spent fence;
- the node crashes no actor, closes no socket 1011, and the honest worker's
  run still completes afterwards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, get_args

import msgspec
import pytest
import trio
import trio_websocket
from hypothesis import given
from hypothesis import strategies as st

from ironflow.protocol import (
    TERMINAL_RUN_STATUSES,
    ActiveJob,
    EngineMessage,
    ErrorInfo,
    FencedMessage,
    FunctionDef,
    Heartbeat,
    JobAck,
    JobAssignment,
    JobCompleted,
    JobFailed,
    JobNack,
    JobYielded,
    LeaseStatus,
    Refused,
    Register,
    Registered,
    SleepYield,
    StepCompleted,
    StepFailed,
    Trigger,
    WorkerMessage,
    encoder,
    engine_message_decoder,
)
from tests.integration.fuzz_target import Target, assert_node_unharmed, fuzz_settings, metric

pytestmark = pytest.mark.slow

# Each example is one socket, one run and up to MAX_FRAMES round trips.
EXAMPLES = 40
MAX_FRAMES = 8
FN = FunctionDef(id="fenced", triggers=[Trigger("fenced.go")])
# A sleep that never ends during the test: a parked run stays parked.
FAR_FUTURE_S = 3600.0
# Fence mutations; "genuine" is the fence the node assigned.
MUTATIONS = ["genuine", "seq_minus", "seq_plus", "token", "unknown_run", "unknown_job"]
KINDS = ["ack", "nack", "step_completed", "step_failed", "job_completed", "job_failed",
         "job_yielded", "heartbeat"]
# The job id of the barrier frame: a forged ack for the same run, always refused,
# answered after every earlier frame of that run (a run's frames are handled in order).
BARRIER_JOB = "barrier"


@dataclass(frozen=True)
class Op:
    kind: str
    mutation: str
    retryable: bool = True


ops = st.lists(
    st.builds(Op, st.sampled_from(KINDS), st.sampled_from(MUTATIONS), st.booleans()),
    min_size=1,
    max_size=MAX_FRAMES,
)


def fence_of(a: JobAssignment, mutation: str) -> dict[str, Any]:
    """The assignment's fence, mutated."""
    fence = {"job_id": a.job_id, "run_id": a.run_id, "execution_seq": a.execution_seq,
             "lease_token": a.lease_token}
    if mutation == "seq_minus":
        fence["execution_seq"] = a.execution_seq - 1 if a.execution_seq > 1 else a.execution_seq + 2
    elif mutation == "seq_plus":
        fence["execution_seq"] = a.execution_seq + 1
    elif mutation == "token":
        fence["lease_token"] = "f" * len(a.lease_token)
    elif mutation == "unknown_run":
        fence["run_id"] = fence["job_id"] = "run_00000000000000000000000000000000"
    elif mutation == "unknown_job":
        fence["job_id"] = "job-nobody-assigned"
    return fence


def frame(op: Op, fence: dict[str, Any]) -> WorkerMessage:
    if op.kind == "heartbeat":
        return Heartbeat(jobs=[ActiveJob(**fence)])
    error = ErrorInfo("fuzzed failure", retryable=op.retryable)
    build: dict[str, Any] = {
        "ack": lambda: JobAck(**fence),
        "nack": lambda: JobNack(**fence, reason="AT_CAPACITY" if op.retryable else "DRAINING"),
        "step_completed": lambda: StepCompleted(**fence, step_id="s", name="s", output={"n": 1}),
        "step_failed": lambda: StepFailed(**fence, step_id="s", name="s", error=error),
        "job_completed": lambda: JobCompleted(**fence, output="done"),
        "job_failed": lambda: JobFailed(**fence, error=error),
        "job_yielded": lambda: JobYielded(
            **fence, step_id="nap", name="nap",
            yield_info=SleepYield(until=time.time() + FAR_FUTURE_S),
        ),
    }
    message: WorkerMessage = build[op.kind]()
    return message


def snapshot(t: Target, run_id: str) -> tuple[Any, ...]:
    """What a write would change: the run row and its steps."""
    detail = t.http.get(f"/v1/runs/{run_id}").json()
    run = detail["run"]
    steps = tuple(sorted((s["step_id"], s["kind"], s["status"], s["execution_seq"],
                          msgspec.json.encode(s["output"])) for s in detail["steps"]))
    return (run["status"], run["current_execution_seq"], run["attempt"], run["recovery_count"],
            msgspec.json.encode(run["output"]), msgspec.json.encode(run["error"]), steps)


def spent(snap: tuple[Any, ...], a: JobAssignment) -> bool:
    """The assignment's fence can no longer be live: another seq, ended, or parked."""
    status, seq, *_, steps = snap
    parked = any(kind != "run" and step_seq == a.execution_seq for _, kind, _, step_seq, _ in steps)
    return seq != a.execution_seq or status in TERMINAL_RUN_STATUSES or parked


class Socket:
    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        self.ws = ws

    async def send(self, msg: WorkerMessage) -> None:
        await self.ws.send_message(encoder.encode(msg).decode())

    async def until(self, wanted: Any, timeout: float = 5.0) -> list[EngineMessage]:
        """Every message up to and including the first for which ``wanted(msg)``."""
        seen: list[EngineMessage] = []
        with trio.fail_after(timeout):
            while True:
                msg = engine_message_decoder.decode(await self.ws.get_message())
                seen.append(msg)
                if wanted(msg):
                    return seen


async def play(t: Target, script: list[Op]) -> None:
    ws_url = t.url.replace("http://", "ws://") + "/v1/worker"
    async with trio_websocket.open_websocket_url(ws_url) as ws:
        sock = Socket(ws)
        await sock.send(Register(worker_id="fence-fuzz", functions=[FN], max_concurrent_jobs=4))
        await sock.until(lambda m: isinstance(m, Registered))
        run_id = t.http.post("/v1/events", json={"name": "fenced.go"}).json()["run_ids"][0]
        seen = await sock.until(lambda m: isinstance(m, JobAssignment) and m.run_id == run_id)
        a = seen[-1]
        assert isinstance(a, JobAssignment)
        for op in script:
            fence = fence_of(a, op.mutation)
            before = snapshot(t, run_id)
            await sock.send(frame(op, fence))
            if op.kind == "heartbeat":
                answers = await sock.until(lambda m: isinstance(m, LeaseStatus))
                status = answers[-1]
                assert isinstance(status, LeaseStatus)
                states = {(j.run_id, j.execution_seq): j.state for j in status.jobs}
                state = states.get((fence["run_id"], fence["execution_seq"]))
                if op.mutation not in ("genuine", "unknown_job") or spent(before, a):
                    assert state != "REFRESHED", (op, status)
                continue
            if fence["run_id"] == run_id:
                barrier = JobAck(BARRIER_JOB, run_id, a.execution_seq, "0" * 32)
                await sock.send(barrier)
                answers = await sock.until(lambda m: isinstance(m, Refused) and m.job_id == BARRIER_JOB)
            else:
                unknown = fence["run_id"]
                answers = await sock.until(lambda m, r=unknown: isinstance(m, Refused) and m.run_id == r)
            refused = [m for m in answers if isinstance(m, Refused) and m.job_id == fence["job_id"]]
            after = snapshot(t, run_id)
            forged = op.mutation not in ("genuine", "unknown_job")
            if forged or spent(before, a):
                assert after == before, (op, before, after)
                assert refused, (op, answers)
            elif after != before:
                assert not refused, (op, answers)
        status = snapshot(t, run_id)[0]
        if status not in TERMINAL_RUN_STATUSES:
            t.http.post(f"/v1/runs/{run_id}/cancel", json={"reason": "example over"})


def test_fuzzed_fences_never_change_a_run_and_stale_ones_are_refused(fuzz_target: Target) -> None:
    restarts_before = metric(fuzz_target, "ironflow_actor_restarts_total")
    refused_before = metric(fuzz_target, "ironflow_stale_messages_total")

    @fuzz_settings(EXAMPLES)
    @given(script=ops)
    def check(script: list[Op]) -> None:
        trio.run(play, fuzz_target, script)

    check()
    assert metric(fuzz_target, "ironflow_stale_messages_total") > refused_before
    assert_node_unharmed(fuzz_target, restarts_before)


def test_the_draw_builds_every_fenced_message() -> None:
    """A fenced message added to the protocol must be added to KINDS too."""
    a = JobAssignment("j", "r", "f", None, 1, 1, [], 1, "t")  # type: ignore[arg-type]
    built = {type(frame(Op(kind, "genuine"), fence_of(a, "genuine"))) for kind in KINDS}
    assert set(get_args(FencedMessage)) <= built
