"""``step.compensate`` in the SDK (ironflow/sdk/compensation.py): the
registration the engine is told of, and a compensation segment (its memo
holds ``compensate:begin``) replaying the handler and running the undos."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

import ironflow
from ironflow.protocol import (
    CompensationBegin,
    ErrorInfo,
    JobCompleted,
    JobFailed,
    JobYielded,
    MemoStep,
    StepCompleted,
    StepFailed,
    compensation_step_id,
)
from ironflow.sdk.context import JobState, execute_job

# Every test here runs on asyncio and on trio (tests/sdk/conftest.py).
pytestmark = pytest.mark.anyio

RUN = "r1"
ORIGINAL = ErrorInfo(message="card declined", code="DECLINED", retryable=False)


def done(name: str, output: Any = None, n: int = 0) -> MemoStep:
    return MemoStep(f"{RUN}:{name}:{n}", name, "run", "completed", output)


def failed(name: str, error: ErrorInfo, n: int = 0) -> MemoStep:
    return MemoStep(f"{RUN}:{name}:{n}", name, "run", "failed", None, error)


def marker(which: str, output: Any = None) -> MemoStep:
    return MemoStep(compensation_step_id(RUN, which), f"compensate:{which}", "run", "completed", output)  # type: ignore[arg-type]


def begin(cause: str = "failure", error: ErrorInfo = ORIGINAL) -> MemoStep:
    return marker("begin", msgspec.to_builtins(CompensationBegin(cause, error)))  # type: ignore[arg-type]


def undo_done(name: str, status: str = "completed") -> MemoStep:
    return MemoStep(f"{RUN}:compensate\\:{name}:0", f"compensate:{name}", "run", status)


async def run(handler: Any, factory: Any, reporter: Any, memo: list[MemoStep]) -> list[Any]:
    job = JobState(factory(run_id=RUN, completed_steps=memo))
    await execute_job(ironflow.function(id="fn")(handler), job, reporter)
    return reporter.messages


def shipping(calls: list[str]) -> Any:
    """reserve → undo release; charge → undo refund(charge id); ship fails for good."""

    def release(sku: str) -> None:
        calls.append(f"release {sku}")

    async def refund(charge: dict[str, Any]) -> str:
        calls.append(f"refund {charge['id']}")
        return "refunded"

    def ship() -> None:
        calls.append("ship")
        raise ironflow.NonRetryableError("no courier")

    async def handler(ctx: Any) -> Any:
        sku = await ctx.step.run("reserve", lambda: calls.append("reserve") or "sku-1")
        await ctx.step.compensate("release", release, sku)
        charge = await ctx.step.run("charge", lambda: calls.append("charge") or {"id": "ch_9"})
        await ctx.step.compensate("refund", refund, charge)
        await ctx.step.run("ship", ship)
        return "shipped"

    return handler


async def test_the_first_registration_of_a_run_is_recorded_once(assignment_factory, list_reporter):
    calls: list[str] = []
    msgs = await run(shipping(calls), assignment_factory, list_reporter, [])
    # The undos do not run in the failing segment: the engine decides.
    assert calls == ["reserve", "charge", "ship"]
    steps = [(type(m).__name__, m.step_id) for m in msgs if isinstance(m, StepCompleted | StepFailed)]
    assert steps == [
        ("StepCompleted", f"{RUN}:reserve:0"),
        ("StepCompleted", compensation_step_id(RUN, "registered")),
        ("StepCompleted", f"{RUN}:charge:0"),
        ("StepFailed", f"{RUN}:ship:0"),
    ]
    assert isinstance(msgs[-1], JobFailed) and msgs[-1].error.code == "NON_RETRYABLE"


async def test_a_replay_with_the_registration_recorded_does_not_record_it_again(
    assignment_factory, list_reporter
):
    calls: list[str] = []
    memo = [done("reserve", "sku-1"), marker("registered")]
    msgs = await run(shipping(calls), assignment_factory, list_reporter, memo)
    assert compensation_step_id(RUN, "registered") not in [getattr(m, "step_id", None) for m in msgs]
    assert calls == ["charge", "ship"]


async def test_a_compensation_segment_runs_the_undos_newest_first_and_reports_the_original_error(
    assignment_factory, list_reporter
):
    calls: list[str] = []
    memo = [
        done("reserve", "sku-1"), marker("registered"), done("charge", {"id": "ch_9"}),
        failed("ship", ErrorInfo("no courier", "NON_RETRYABLE", retryable=False)), begin(),
    ]
    msgs = await run(shipping(calls), assignment_factory, list_reporter, memo)
    # Not one step of the handler runs again (ship, which failed, included);
    # each undo gets the arguments the replay computed from memoised outputs.
    assert calls == ["refund ch_9", "release sku-1"]
    assert [(m.step_id, m.name) for m in msgs[:-1]] == [
        (f"{RUN}:compensate\\:refund:0", "compensate:refund"),
        (f"{RUN}:compensate\\:release:0", "compensate:release"),
    ]
    assert all(isinstance(m, StepCompleted) for m in msgs[:-1])
    final = msgs[-1]
    assert isinstance(final, JobFailed)
    assert (final.error.message, final.error.code, final.error.retryable) == ("card declined", "DECLINED", False)


async def test_undos_recorded_before_a_crash_do_not_run_again(assignment_factory, list_reporter):
    calls: list[str] = []
    memo = [
        done("reserve", "sku-1"), marker("registered"), done("charge", {"id": "ch_9"}),
        failed("ship", ORIGINAL), begin(), undo_done("refund"),
    ]
    msgs = await run(shipping(calls), assignment_factory, list_reporter, memo)
    assert calls == ["release sku-1"]
    assert [m.name for m in msgs[:-1]] == ["compensate:release"]
    # A failed undo is recorded too: it is not run again either.
    calls.clear()
    list_reporter.messages.clear()
    memo[-1] = undo_done("refund", "failed")
    memo.append(undo_done("release", "failed"))
    msgs = await run(shipping(calls), assignment_factory, list_reporter, memo)
    assert calls == [] and isinstance(msgs[-1], JobFailed) and len(msgs) == 1


async def test_a_failing_undo_is_recorded_and_the_others_still_run(assignment_factory, list_reporter):
    calls: list[str] = []

    async def handler(ctx: Any) -> None:
        for name in ("one", "two", "three"):
            await ctx.step.run(name, lambda: None)
            await ctx.step.compensate(f"undo-{name}", lambda n=name: calls.append(n) or (n == "two" and 1 / 0))
        await ctx.step.run("four", lambda: None)

    memo = [done("one"), marker("registered"), done("two"), done("three"), begin("cancel")]
    msgs = await run(handler, assignment_factory, list_reporter, memo)
    assert calls == ["three", "two", "one"]
    assert [(type(m).__name__, m.name) for m in msgs[:-1]] == [
        ("StepCompleted", "compensate:undo-three"),
        ("StepFailed", "compensate:undo-two"),
        ("StepCompleted", "compensate:undo-one"),
    ]
    assert "division by zero" in msgs[1].error.message
    assert isinstance(msgs[-1], JobFailed) and msgs[-1].error.code == "DECLINED"


async def test_a_cancel_replay_stops_at_the_first_step_with_no_record(assignment_factory, list_reporter):
    """Cancelled mid-run: the step in flight and everything after it never
    run, and an undo registered after it is not run either."""
    calls: list[str] = []

    async def handler(ctx: Any) -> None:
        await ctx.step.run("a", lambda: calls.append("a"))
        await ctx.step.compensate("undo-a", lambda: calls.append("undo-a"))
        await ctx.step.run("b", lambda: calls.append("b"))
        await ctx.step.compensate("undo-b", lambda: calls.append("undo-b"))

    cancel = ErrorInfo("cancelled by event evt_1", "CANCELLED", retryable=False)
    msgs = await run(handler, assignment_factory, list_reporter, [done("a"), marker("registered"), begin("cancel", cancel)])
    assert calls == ["undo-a"]
    assert isinstance(msgs[-1], JobFailed) and msgs[-1].error.code == "CANCELLED"


async def test_a_sleep_or_wait_with_no_record_stops_the_replay_instead_of_parking(
    assignment_factory, list_reporter
):
    calls: list[str] = []

    async def handler(ctx: Any) -> None:
        await ctx.step.compensate("undo", lambda: calls.append("undo"))
        await ctx.step.sleep("nap", 60)
        await ctx.step.wait_for_event("approval", event="order.approved")

    msgs = await run(handler, assignment_factory, list_reporter, [marker("registered"), begin("cancel")])
    assert calls == ["undo"]
    assert not any(isinstance(m, JobYielded | JobCompleted) for m in msgs)
    assert isinstance(msgs[-1], JobFailed)


async def test_a_replayed_failure_takes_the_same_except_path(assignment_factory, list_reporter):
    """A failure the handler caught raises its recorded error again (as the
    same class), so the undos registered on that path are registered again."""
    calls: list[str] = []
    seen: list[str] = []

    async def handler(ctx: Any) -> None:
        try:
            await ctx.step.run("primary", lambda: None, timeout=1)
        except ironflow.StepTimeoutError:
            seen.append("timeout")
            await ctx.step.run("fallback", lambda: None)
            await ctx.step.compensate("undo-fallback", lambda: calls.append("undo-fallback"))
        await ctx.step.run("last", lambda: None)

    memo = [
        failed("primary", ErrorInfo("step 'primary' timed out after 1 s", "STEP_TIMEOUT")),
        done("fallback"), marker("registered"), failed("last", ORIGINAL), begin(),
    ]
    msgs = await run(handler, assignment_factory, list_reporter, memo)
    assert seen == ["timeout"] and calls == ["undo-fallback"]
    assert isinstance(msgs[-1], JobFailed)


async def test_an_undo_has_its_own_idempotency_key(assignment_factory, list_reporter):
    keys: list[str] = []

    async def handler(ctx: Any) -> None:
        await ctx.step.compensate("refund", lambda: keys.append(ironflow.step_info().idempotency_key))
        await ctx.step.compensate("refund", lambda: keys.append(ironflow.step_info().idempotency_key))

    await run(handler, assignment_factory, list_reporter, [marker("registered"), begin()])
    assert len(keys) == 2 and len(set(keys)) == 2 and all(k.startswith("ifstep_") for k in keys)


async def test_bad_registrations_are_refused_with_clear_errors(assignment_factory, list_reporter):
    errors: list[str] = []

    async def refund() -> None: ...

    async def handler(ctx: Any) -> str:
        for name, fn, kwargs in (
            ("refund", 42, {}),
            ("refund", refund(), {}),
            ("", refund, {}),
            ("x" * 502, refund, {}),
            ("refund", refund, {"timeout": -1}),
        ):
            try:
                await ctx.step.compensate(name, fn, **kwargs)
            except (TypeError, ValueError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        try:
            await ctx.step.run("compensate:refund", lambda: None)
        except ValueError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        return "ok"

    msgs = await run(handler, assignment_factory, list_reporter, [])
    assert len(errors) == 6, errors
    assert errors[0].startswith("TypeError: step.compensate('refund') takes a callable, got int")
    assert errors[1].startswith("TypeError: step.compensate('refund') takes a callable, got a coroutine")
    assert errors[2].startswith("ValueError: step.compensate needs a non-empty name")
    assert errors[3].startswith("ValueError: undo name") and "at most 501" in errors[3]
    assert errors[4].startswith("ValueError: step.compensate('refund'): timeout must be a positive")
    assert "are the undos'" in errors[5]
    # Nothing was registered: no registration was recorded.
    assert [type(m) for m in msgs] == [JobCompleted]


async def test_a_parallel_with_a_step_without_a_record_stops_the_replay(assignment_factory, list_reporter):
    calls: list[str] = []

    async def handler(ctx: Any) -> None:
        await ctx.step.compensate("undo", lambda: calls.append("undo"))
        await ctx.step.parallel([("a", lambda: calls.append("a")), ("b", lambda: calls.append("b"))])
        await ctx.step.compensate("later", lambda: calls.append("later"))

    msgs = await run(handler, assignment_factory, list_reporter, [marker("registered"), done("a"), begin("cancel")])
    assert calls == ["undo"]  # b never ran, "later" was never registered
    assert [m.name for m in msgs[:-1]] == ["compensate:undo"] and isinstance(msgs[-1], JobFailed)
