"""Step ids, memoisation, step reporting order, error mapping and yields."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime

import anyio
import anyio.abc
import msgspec
import pytest

import ironflow
from ironflow.protocol import (
    ErrorInfo,
    InvokeYield,
    JobCompleted,
    JobFailed,
    JobYielded,
    MemoStep,
    SleepYield,
    StepCompleted,
    StepFailed,
    WaitYield,
)
from ironflow.sdk.context import JobState, escape_step_name, execute_job

# Every test here runs on asyncio and on trio (tests/sdk/conftest.py).
pytestmark = pytest.mark.anyio


async def _run(handler, assignment, reporter, function_id="fn"):
    fn = ironflow.function(id=function_id)(handler)
    job = JobState(assignment)
    await execute_job(fn, job, reporter)
    return reporter.messages


def test_escape_step_name():
    assert escape_step_name("a:b\\c") == "a\\:b\\\\c"
    assert escape_step_name("plain") == "plain"


async def test_step_ids_are_stable_and_unique_for_repeated_names(
    assignment_factory, list_reporter
):
    a = assignment_factory(run_id="r1")

    async def handler(ctx):
        for _ in range(2):
            await ctx.step.run("fetch", lambda: 1)
        await ctx.step.run("a:b", lambda: 2)
        return "ok"

    msgs = await _run(handler, a, list_reporter)
    ids = [m.step_id for m in msgs if isinstance(m, StepCompleted)]
    assert ids == ["r1:fetch:0", "r1:fetch:1", "r1:a\\:b:0"]
    assert isinstance(msgs[-1], JobCompleted)


async def test_memoised_steps_are_skipped(assignment_factory, list_reporter):
    calls = []
    a = assignment_factory(
        run_id="r2",
        completed_steps=[
            MemoStep(step_id="r2:one:0", name="one", kind="run", status="completed", output=10),
        ],
    )

    async def one():
        calls.append("one")
        return 1

    async def two():
        calls.append("two")
        return 2

    async def handler(ctx):
        x = await ctx.step.run("one", one)
        y = await ctx.step.run("two", two)
        return x + y

    msgs = await _run(handler, a, list_reporter)
    assert calls == ["two"]
    assert [m.step_id for m in msgs if isinstance(m, StepCompleted)] == ["r2:two:0"]
    assert msgs[-1].output == 12 or bytes(msgs[-1].output) == b"12"


async def test_step_completed_is_reported_before_the_next_step_runs(
    assignment_factory, list_reporter
):
    seen_before_second = []

    async def handler(ctx):
        await ctx.step.run("first", lambda: {"a": 1})

        async def second():
            seen_before_second.extend(type(m).__name__ for m in list_reporter.messages)
            return 2

        await ctx.step.run("second", second)

    await _run(handler, assignment_factory(), list_reporter)
    assert seen_before_second == ["StepCompleted"]


async def test_sync_step_runs_in_a_thread_and_returns_json_form(assignment_factory, list_reporter):
    out = []

    async def handler(ctx):
        out.append(await ctx.step.run("t", lambda x: (x, x), 3))

    await _run(handler, assignment_factory(), list_reporter)
    assert out == [[3, 3]]


async def test_plain_exception_is_retryable_error_with_traceback(
    assignment_factory, list_reporter
):
    async def handler(ctx):
        raise RuntimeError("boom")

    msgs = await _run(handler, assignment_factory(), list_reporter)
    (msg,) = msgs
    assert isinstance(msg, JobFailed)
    assert msg.error.code == "ERROR" and msg.error.retryable is True
    assert msg.error.message == "boom"
    assert "RuntimeError" in msg.error.traceback


async def test_non_retryable_error_is_not_retryable(assignment_factory, list_reporter):
    async def handler(ctx):
        raise ironflow.NonRetryableError("bad input", code="BAD_INPUT")

    (msg,) = await _run(handler, assignment_factory(), list_reporter)
    assert msg.error == ErrorInfo(
        message="bad input", code="BAD_INPUT", traceback=msg.error.traceback, retryable=False
    )


async def test_failing_step_reports_step_failed_and_raises_step_error(
    assignment_factory, list_reporter
):
    caught = []

    async def handler(ctx):
        try:
            await ctx.step.run("s", lambda: 1 / 0)
        except ironflow.StepError as exc:
            caught.append(exc)
            raise

    msgs = await _run(handler, assignment_factory(), list_reporter)
    assert isinstance(msgs[0], StepFailed) and msgs[0].error.retryable
    assert isinstance(caught[0].__cause__, ZeroDivisionError)
    assert isinstance(msgs[1], JobFailed)
    assert msgs[1].error.code == "STEP_FAILED" and msgs[1].error.retryable


async def test_non_retryable_step_failure_propagates_non_retryable(
    assignment_factory, list_reporter
):
    async def bad():
        raise ironflow.NonRetryableError("nope")

    async def handler(ctx):
        await ctx.step.run("s", bad)

    msgs = await _run(handler, assignment_factory(), list_reporter)
    assert msgs[0].error.retryable is False
    assert msgs[1].error.retryable is False and msgs[1].error.code == "NON_RETRYABLE"


async def test_nan_output_is_a_serialization_error(assignment_factory, list_reporter):
    async def handler(ctx):
        return {"x": math.nan}

    (msg,) = await _run(handler, assignment_factory(), list_reporter)
    assert msg.error.code == "SERIALIZATION_ERROR" and msg.error.retryable is False


async def test_sleep_yields(assignment_factory, list_reporter):
    async def handler(ctx):
        await ctx.step.run("before", lambda: 1)
        await ctx.step.sleep("nap", 60)
        raise AssertionError("not reached")

    before = time.time()
    msgs = await _run(handler, assignment_factory(run_id="r3"), list_reporter)
    y = msgs[-1]
    assert isinstance(y, JobYielded) and y.step_id == "r3:nap:0" and y.name == "nap"
    assert isinstance(y.yield_info, SleepYield)
    assert before + 59 < y.yield_info.until < time.time() + 61


async def test_yield_is_not_swallowed_by_except_exception(assignment_factory, list_reporter):
    async def handler(ctx):
        try:
            await ctx.step.sleep_until("later", datetime(2100, 1, 1, tzinfo=UTC))
        except Exception:  # noqa: BLE001 - the point of the test
            return "swallowed"

    (msg,) = await _run(handler, assignment_factory(), list_reporter)
    assert isinstance(msg, JobYielded)
    assert msg.yield_info.until == datetime(2100, 1, 1, tzinfo=UTC).timestamp()


async def test_wait_for_event_yields_and_memo_returns(assignment_factory, list_reporter):
    async def handler(ctx):
        return await ctx.step.wait_for_event(
            "approval", event="order.approved", match="data.order_id", timeout=10
        )

    a = assignment_factory(run_id="r4", data={"order_id": 7})
    (msg,) = await _run(handler, a, list_reporter)
    info = msg.yield_info
    assert isinstance(info, WaitYield) and info.event == "order.approved"
    assert info.match == "data.order_id" and bytes(info.match_value) == b"7"
    assert info.timeout_at == pytest.approx(time.time() + 10, abs=2)

    event = {"id": "evt_1", "name": "order.approved", "data": {"ok": 1}, "received_at": 5.0}
    memo_done = MemoStep(
        step_id="r4:approval:0", name="approval", kind="wait", status="completed", output=event
    )

    async def reads_the_event(ctx):
        ev = await ctx.step.wait_for_event("approval", event="order.approved", timeout=10)
        assert isinstance(ev, ironflow.Event) and isinstance(ev, type(ctx.event))
        return [ev.id, ev.name, ev.data["ok"], ev.received_at]

    list_reporter.messages.clear()
    (msg,) = await _run(reads_the_event, assignment_factory(run_id="r4", completed_steps=[memo_done]), list_reporter)
    assert isinstance(msg, JobCompleted) and bytes(msg.output) == b'["evt_1","order.approved",1,5.0]'

    memo_timeout = MemoStep(
        step_id="r4:approval:0", name="approval", kind="wait", status="timed_out"
    )
    list_reporter.messages.clear()
    (msg,) = await _run(handler, assignment_factory(run_id="r4", completed_steps=[memo_timeout]), list_reporter)
    assert bytes(msg.output) == b"null"


async def test_invoke_yields_and_failed_memo_raises_invoke_error(
    assignment_factory, list_reporter
):
    async def handler(ctx):
        return await ctx.step.invoke("child-fn", function="child-fn", data={"n": 1}, timeout=30)

    (msg,) = await _run(handler, assignment_factory(run_id="r5"), list_reporter)
    assert isinstance(msg.yield_info, InvokeYield) and msg.step_id == "r5:child-fn:0"
    assert msg.yield_info.function_id == "child-fn"

    failed = MemoStep(
        step_id="r5:child-fn:0",
        name="child-fn",
        kind="invoke",
        status="failed",
        error=ErrorInfo(message="child broke"),
    )
    list_reporter.messages.clear()
    (msg,) = await _run(handler, assignment_factory(run_id="r5", completed_steps=[failed]), list_reporter)
    assert isinstance(msg, JobFailed)
    assert msg.error.code == "INVOKE_FAILED" and msg.error.retryable is False


def test_sync_handler_is_a_type_error():
    with pytest.raises(TypeError):

        @ironflow.function(id="x")
        def handler(ctx):  # pragma: no cover
            return None


def test_function_definition_options():
    @ironflow.function(
        id="order",
        triggers=[ironflow.event("order.created")],
        retries={"max_attempts": 5},
        concurrency=ironflow.Concurrency(limit=2, key="customer.id"),
        timeout_s=60,
        audit=True,
        name="Order",
    )
    async def handler(ctx):
        return None

    d = handler.definition
    assert d.id == "order" and d.triggers[0].event == "order.created"
    assert d.retries.max_attempts == 5 and d.concurrency.limit == 2
    assert d.timeout_s == 60 and d.audit and d.name == "Order"
    assert handler.handler.__name__ == "handler"


async def test_a_step_name_past_the_engine_limit_fails_the_attempt_saying_so(assignment_factory, list_reporter):
    async def handler(ctx):
        return await ctx.step.run("n" * 513, lambda: 1)

    (msg,) = await _run(handler, assignment_factory(), list_reporter)
    assert "at most 512" in msg.error.message and "shorter name" in msg.error.message


def test_a_function_definition_out_of_bounds_fails_at_the_decorator():
    with pytest.raises(ValueError, match="max_attempts"):
        @ironflow.function(id="f", retries=10**23)
        async def f(ctx):
            return None


async def test_a_lambda_around_a_coroutine_call_is_a_step(assignment_factory, list_reporter):
    async def fetch(n):
        await anyio.sleep(0)
        return n * 2

    async def handler(ctx):
        return await ctx.step.run("fetch", lambda: fetch(21))

    (step, done) = await _run(handler, assignment_factory(), list_reporter)
    assert isinstance(step, StepCompleted) and bytes(done.output) == b"42"


async def test_an_object_with_an_async_call_and_a_sync_function_are_steps(assignment_factory, list_reporter):
    class Fetcher:
        async def __call__(self, n):
            return n + 1

    async def handler(ctx):
        a = await ctx.step.run("obj", Fetcher(), 1)
        b = await ctx.step.run("sync", lambda x: x * 3, a)
        return [a, b]

    msgs = await _run(handler, assignment_factory(), list_reporter)
    assert bytes(msgs[-1].output) == b"[2,6]"


async def test_step_timeout_cancels_the_step_and_raises_step_timeout_error(assignment_factory, list_reporter):
    import time as _time

    async def slow():
        await anyio.sleep(30)

    async def handler(ctx):
        with pytest.raises(ironflow.StepTimeoutError, match="timed out after 0.05 s"):
            await ctx.step.run("slow", slow, timeout=0.05)
        with pytest.raises(ironflow.StepTimeoutError):
            await ctx.step.run("slow-thread", _time.sleep, 5, timeout=0.05)  # abandoned thread
        with pytest.raises(ValueError, match="positive"):
            await ctx.step.run("bad", slow, timeout=-1)
        return "ok"

    t0 = _time.monotonic()
    msgs = await _run(handler, assignment_factory(), list_reporter)
    assert _time.monotonic() - t0 < 2
    failed = [m for m in msgs if isinstance(m, StepFailed)]
    assert [m.error.code for m in failed] == ["STEP_TIMEOUT", "STEP_TIMEOUT"]
    assert all(m.error.retryable for m in failed)


async def test_parallel_steps_run_concurrently_and_return_in_order(assignment_factory, list_reporter):
    async def wait_then(value, delay):
        await anyio.sleep(delay)
        return value

    async def handler(ctx):
        return await ctx.step.parallel([("a", wait_then, "A", 0.3), ("b", wait_then, "B", 0.1)])

    import time as _time

    t0 = _time.monotonic()
    msgs = await _run(handler, assignment_factory(run_id="rp"), list_reporter)
    assert _time.monotonic() - t0 < 0.55  # ~0.3 s, not 0.4 s
    steps = [m for m in msgs if isinstance(m, StepCompleted)]
    assert [m.name for m in steps] == ["b", "a"]  # b finished first...
    assert [m.step_id for m in steps] == ["rp:b:0", "rp:a:0"]  # ...but ids follow the list
    assert bytes(msgs[-1].output) == b'["A","B"]'


async def test_parallel_replays_finished_steps_and_reruns_only_the_rest(assignment_factory, list_reporter):
    calls: list[str] = []

    def mark(name):
        calls.append(name)
        return name

    async def handler(ctx):
        return await ctx.step.parallel([("a", mark, "a"), ("b", mark, "b")])

    done_a = MemoStep(step_id="rq:a:0", name="a", kind="run", status="completed", output="a")
    msgs = await _run(handler, assignment_factory(run_id="rq", completed_steps=[done_a]), list_reporter)
    assert calls == ["b"] and bytes(msgs[-1].output) == b'["a","b"]'


async def test_parallel_refuses_duplicate_names_and_raises_a_failing_steps_error(assignment_factory, list_reporter):
    async def boom():
        raise ironflow.NonRetryableError("no", code="NOPE")

    async def forever():
        await anyio.sleep(30)

    async def handler(ctx):
        with pytest.raises(ValueError, match="distinct"):
            await ctx.step.parallel([("x", forever), ("x", forever)])
        with pytest.raises(ironflow.StepError, match="no"):
            await ctx.step.parallel([("boom", boom), ("slow", forever)])
        return "ok"

    msgs = await _run(handler, assignment_factory(), list_reporter)
    assert bytes(msgs[-1].output) == b'"ok"'


async def test_step_info_gives_a_key_stable_across_re_executions_and_distinct_per_step(
    assignment_factory, list_reporter
):
    def key():
        return ironflow.step_info().idempotency_key

    async def handler(ctx):
        return [await ctx.step.run("pay", key), await ctx.step.run("ship", key)]

    first = await _run(handler, assignment_factory(run_id="rk"), list_reporter)
    list_reporter.messages.clear()
    again = await _run(handler, assignment_factory(run_id="rk"), list_reporter)  # a re-execution
    assert bytes(first[-1].output) == bytes(again[-1].output)
    pay, ship = msgspec.json.decode(bytes(first[-1].output))
    assert pay != ship and pay.startswith("ifstep_")
    with pytest.raises(RuntimeError, match="inside a running step"):
        ironflow.step_info()


async def test_the_old_invoke_form_is_a_type_error_showing_the_new_one(assignment_factory, list_reporter):
    async def handler(ctx):
        with pytest.raises(TypeError, match="function='child-fn'"):
            await ctx.step.invoke("child-fn", {"x": 1}, name="call-child")
        return "ok"

    msgs = await _run(handler, assignment_factory(), list_reporter)
    assert bytes(msgs[-1].output) == b'"ok"'
