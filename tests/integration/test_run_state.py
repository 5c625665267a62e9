"""A run's state is bounded and never shipped whole: a later segment's
assignment carries its step outputs only up to the inline budget (the worker
reads the rest by step id), a run whose step outputs pass
``limits.max_run_state_bytes`` fails with RUN_STATE_TOO_LARGE (not retried,
the step named), a step output over the frame limit is that step's error —
and in every case the worker's other jobs carry on."""

from __future__ import annotations

import hashlib
from typing import Any

import httpx
import pytest
import trio

import ironflow
from ironflow.node import Node
from tests.integration.helpers import emit, wait_for_run

STEP_BYTES = 300 * 1024
# Each asserts a wall-clock bound (other runs within 2 s, /healthz within 50 ms).
pytestmark = pytest.mark.serial
WORKERS = {"stream": ironflow.StreamingWorker, "pull": ironflow.PullWorker}


def blob(i: int, size: int) -> str:
    """``size`` characters, different per step."""
    return (f"{i:04d}" * (size // 4 + 1))[:size]


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@ironflow.function(id="quick", triggers=[ironflow.event("quick.go")])
async def quick(ctx: Any) -> Any:
    return await ctx.step.run("one", lambda: ctx.event.data["n"])


async def others_complete_within(http: httpx.AsyncClient, n: int, bound_s: float) -> list[float]:
    """Emit ``n`` runs of ``quick``; each run's emit-to-end time (all must end)."""
    started = {}
    for i in range(n):
        started[(await emit(http, "quick.go", {"n": i}))["run_ids"][0]] = trio.current_time()
    took = []
    for run_id, at in started.items():
        run = await wait_for_run(http, run_id, timeout=bound_s + 5)
        assert run["run"]["status"] == "completed", run
        took.append(trio.current_time() - at)
    return took


@pytest.mark.parametrize("kind", WORKERS)
async def test_fifteen_steps_of_300_kb_then_a_sleep_complete_and_other_runs_carry_on(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery, kind: str
) -> None:
    slept = trio.Event()

    @ironflow.function(id="big-state", triggers=[ironflow.event("big.go")])
    async def big(ctx: Any) -> Any:
        outputs = [await ctx.step.run(f"s{i}", lambda i=i: blob(i, STEP_BYTES)) for i in range(15)]
        slept.set()
        await ctx.step.sleep("nap", 0.5)
        # Every output as replayed after the sleep: the ones left out of the
        # assignment were read by step id.
        return [digest(o) for o in outputs]

    worker = WORKERS[kind](node.url, [big, quick], handle_signals=False)
    fetched: list[str] = []
    fetch = worker.fetch_step_output

    async def counted(run_id: str, step_id: str) -> Any:
        fetched.append(step_id.rsplit(":", 2)[1])
        return await fetch(run_id, step_id)

    worker.fetch_step_output = counted  # type: ignore[method-assign]
    await nursery.start(worker.run)
    run_id = (await emit(http, "big.go"))["run_ids"][0]
    with trio.fail_after(30):
        await slept.wait()
    took = await others_complete_within(http, 5, 2.0)
    run = await wait_for_run(http, run_id, timeout=30)
    assert run["run"]["status"] == "completed", run["run"]
    assert run["run"]["output"] == [digest(blob(i, STEP_BYTES)) for i in range(15)]
    # The assignment after the sleep carried the first 3 outputs (1 MiB inline
    # budget); the worker read the other 12 by step id.
    assert fetched == [f"s{i}" for i in range(3, 15)]
    assert max(took) < 2.0, took
    worker.stop()


@pytest.mark.parametrize("kind", WORKERS)
async def test_a_run_past_its_state_budget_fails_not_retried_naming_the_step(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery, kind: str
) -> None:
    size = 3 * 1024 * 1024  # 24 of these: 72 MiB, past the default 64 MiB

    @ironflow.function(id="huge-state", triggers=[ironflow.event("huge.go")], retries=3)
    async def huge(ctx: Any) -> Any:
        for i in range(24):
            await ctx.step.run(f"s{i}", lambda i=i: blob(i, size))
            await trio.sleep(0)
        return "never"

    worker = WORKERS[kind](node.url, [huge, quick], handle_signals=False)
    await nursery.start(worker.run)
    run_id = (await emit(http, "huge.go"))["run_ids"][0]
    took = await others_complete_within(http, 5, 2.0)
    run = await wait_for_run(http, run_id, timeout=60)
    assert run["run"]["status"] == "failed", run["run"]
    error = run["run"]["error"]
    assert error["code"] == "RUN_STATE_TOO_LARGE" and "limits.max_run_state_bytes" in error["message"]
    assert "step 's21'" in error["message"]  # 22 × 3 MiB = 66 MiB: the 22nd crosses 64 MiB
    assert run["run"]["attempt"] == 1  # not retried
    failed = [s for s in run["steps"] if s["status"] == "failed"]
    assert [s["name"] for s in failed] == ["s21"]
    assert max(took) < 2.0, took
    # The worker is still connected and serving.
    assert max(await others_complete_within(http, 3, 2.0)) < 2.0
    worker.stop()


async def test_a_step_output_over_the_frame_limit_is_that_steps_error_not_a_closed_socket(
    node: Node, http: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    too_big = node.config.max_frame_bytes + 1

    @ironflow.function(id="too-big", triggers=[ironflow.event("too.go")], retries=3)
    async def oversized(ctx: Any) -> Any:
        try:
            await ctx.step.run("huge", lambda: "x" * too_big)
        except ironflow.StepOutputTooLargeError as exc:
            caught = exc.code
        await ctx.step.run("huge-again", lambda: "x" * too_big)  # not caught: the run fails
        return caught

    worker = ironflow.StreamingWorker(node.url, [oversized, quick], handle_signals=False)
    await nursery.start(worker.run)
    run_id = (await emit(http, "too.go"))["run_ids"][0]
    run = await wait_for_run(http, run_id, timeout=30)
    assert run["run"]["status"] == "failed" and run["run"]["attempt"] == 1, run["run"]  # not retried
    assert run["run"]["error"]["code"] == "STEP_OUTPUT_TOO_LARGE"
    assert "max_frame_bytes" in run["run"]["error"]["message"]
    assert [(s["name"], s["status"], s["error"]["code"]) for s in run["steps"]] == [
        ("huge", "failed", "STEP_OUTPUT_TOO_LARGE"), ("huge-again", "failed", "STEP_OUTPUT_TOO_LARGE"),
    ]
    assert max(await others_complete_within(http, 3, 2.0)) < 2.0
    worker.stop()
