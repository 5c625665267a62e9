"""The SDK on the user's loop: asyncio code in steps, timeouts, embedding, bad input.

Each test runs on asyncio and on trio (``anyio_backend``); what differs by
loop is asserted by loop.
"""

from __future__ import annotations

import asyncio
import logging
import time

import anyio
import anyio.abc
import httpx
import pytest
import trio
from sdk_fake_engine import FakeEngine, make_assignment

import ironflow
from ironflow.protocol import JobAck, JobCompleted, JobFailed, StepCompleted, StepFailed
from ironflow.sdk.context import JobState, execute_job
from ironflow.sdk.ws import ConnectionClosed

pytestmark = pytest.mark.anyio


async def _run(handler, assignment, reporter):
    fn = ironflow.function(id="fn")(handler)
    await execute_job(fn, JobState(assignment), reporter)
    return reporter.messages


async def test_an_async_step_body_runs_on_the_workers_own_loop(
    anyio_backend, assignment_factory, list_reporter
):
    async def body():
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            trio.lowlevel.current_task()  # raises outside a Trio run
            return "trio"
        return "asyncio"

    async def handler(ctx):
        return await ctx.step.run("which", body)

    msgs = await _run(handler, assignment_factory(), list_reporter)
    assert isinstance(msgs[0], StepCompleted) and bytes(msgs[0].output) == f'"{anyio_backend}"'.encode()


async def test_an_asyncio_library_in_a_step_works_on_asyncio_and_is_a_clear_error_on_trio(
    anyio_backend, assignment_factory, list_reporter
):
    async def body():
        await asyncio.sleep(0.001)
        return "slept"

    async def handler(ctx):
        return await ctx.step.run("asyncio-only", body)

    msgs = await _run(handler, assignment_factory(), list_reporter)
    if anyio_backend == "asyncio":
        assert isinstance(msgs[-1], JobCompleted)
        return
    failed, job = msgs
    assert isinstance(failed, StepFailed) and isinstance(job, JobFailed)
    assert job.error.code == "WRONG_EVENT_LOOP" and not job.error.retryable
    assert "'asyncio-only'" in job.error.message and "runs on trio" in job.error.message


async def test_a_step_timeout_cancels_an_async_body_on_either_loop(
    assignment_factory, list_reporter
):
    cancelled = []

    async def slow():
        try:
            await anyio.sleep(30)
        except anyio.get_cancelled_exc_class():
            cancelled.append(True)
            raise

    async def handler(ctx):
        return await ctx.step.run("slow", slow, timeout=0.05)

    t0 = time.monotonic()
    msgs = await _run(handler, assignment_factory(), list_reporter)
    assert time.monotonic() - t0 < 5 and cancelled == [True]
    assert msgs[-1].error.code == "STEP_TIMEOUT"


async def test_a_timeout_error_the_body_raises_itself_is_not_the_steps_timeout(
    assignment_factory, list_reporter
):
    async def body():
        raise TimeoutError("upstream timed out")

    async def handler(ctx):
        return await ctx.step.run("call", body, timeout=10)

    msgs = await _run(handler, assignment_factory(), list_reporter)
    assert msgs[-1].error.code == "STEP_FAILED" and "upstream timed out" in msgs[-1].error.message


async def test_a_step_body_blocking_the_loop_logs_a_warning_naming_the_step(
    assignment_factory, list_reporter, caplog
):
    async def blocking():
        time.sleep(1.2)  # a sync call inside async code: the loop is stuck
        return 1

    async def handler(ctx):
        return await ctx.step.run("blocker", blocking)

    with caplog.at_level(logging.WARNING, logger="ironflow.sdk"):
        msgs = await _run(handler, assignment_factory(), list_reporter)
    assert isinstance(msgs[-1], JobCompleted)  # nothing lost: the step still counts
    (record,) = [r for r in caplog.records if "blocked the event loop" in r.getMessage()]
    assert "'blocker'" in record.getMessage()


async def test_a_quick_step_body_logs_no_blocking_warning(assignment_factory, list_reporter, caplog):
    async def quick():
        await anyio.sleep(0.01)
        return 1

    async def handler(ctx):
        return await ctx.step.run("quick", quick)

    with caplog.at_level(logging.WARNING, logger="ironflow.sdk"):
        await _run(handler, assignment_factory(), list_reporter)
    assert "blocked the event loop" not in caplog.text


async def test_a_coroutine_object_as_a_step_body_is_a_type_error_that_says_what_to_pass(
    assignment_factory, list_reporter
):
    async def fetch(n):
        return n

    async def handler(ctx):
        return await ctx.step.run("fetch", fetch(42))

    with _no_unawaited_warning():
        msgs = await _run(handler, assignment_factory(), list_reporter)
    (failed,) = msgs  # no step reported: the call never started
    assert isinstance(failed, JobFailed)
    assert "coroutine object" in failed.error.message and "lambda" in failed.error.message


class _no_unawaited_warning:
    """Fails if a 'coroutine ... was never awaited' RuntimeWarning is emitted."""

    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings(record=True)
        self.caught = self._cm.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        import gc

        gc.collect()
        self._cm.__exit__(*exc)
        assert not [w for w in self.caught if "never awaited" in str(w.message)]


def test_a_sync_handler_and_a_coroutine_object_are_refused_at_declaration():
    def sync_handler(ctx):
        return 1

    with pytest.raises(TypeError, match="async def"):
        ironflow.function(id="f")(sync_handler)

    async def handler(ctx):
        return 1

    with pytest.raises(TypeError, match="@ironflow.function"):
        ironflow.StreamingWorker("http://x", [handler], handle_signals=False)
    coro = handler(None)
    with pytest.raises(TypeError, match="@ironflow.function"):
        ironflow.PullWorker("http://x", [coro], handle_signals=False)


async def test_a_non_json_step_output_raises_serialization_error_the_handler_can_catch(
    assignment_factory, list_reporter
):
    caught = []

    async def handler(ctx):
        try:
            await ctx.step.run("bad", lambda: object())
        except ironflow.SerializationError as exc:
            caught.append(exc)
            raise

    msgs = await _run(handler, assignment_factory(), list_reporter)
    assert len(caught) == 1 and not isinstance(caught[0], ironflow.StepError)
    assert "'bad'" in str(caught[0])
    assert msgs[-1].error.code == "SERIALIZATION_ERROR" and not msgs[-1].error.retryable


async def test_result_with_a_negative_timeout_is_a_value_error_naming_it():
    def handle(request: httpx.Request) -> httpx.Response:
        raise AssertionError("no request may be sent")

    async with ironflow.Ironflow("http://node.test", transport=httpx.MockTransport(handle)) as c:
        with pytest.raises(ValueError, match="timeout"):
            await c.result("run1", timeout=-1)
    with ironflow.SyncClient("http://node.test", transport=httpx.MockTransport(handle)) as s:
        with pytest.raises(ValueError, match="timeout"):
            s.result("run1", timeout=-1)


async def test_running_embeds_the_worker_beside_the_apps_tasks_and_drains_on_exit(
    engine: FakeEngine,
):
    gate = anyio.Event()
    completed: list[JobCompleted] = []

    @ironflow.function(id="fn")
    async def handler(ctx):
        await gate.wait()
        return "done"

    async def engine_side(conn) -> None:
        completed.append(await conn.recv_until(JobCompleted))
        with pytest.raises(ConnectionClosed):
            await conn.recv()  # the worker's close, answered: the drain ends

    worker = ironflow.StreamingWorker(engine.url, [handler], drain_timeout=10)
    t0 = time.monotonic()
    async with anyio.create_task_group() as app:
        async with worker.running():
            assert worker.state == "connected"  # entered once registered
            conn = await engine.accept()
            await conn.send(make_assignment(run_id="r1"))
            await conn.recv_until(JobAck)
            app.start_soon(engine_side, conn)
            app.start_soon(_open_later, gate)  # the app's own task carries on beside it
        # Leaving the block drained: the running job finished and was reported first.
        assert worker.state == "stopped" and len(completed) == 1
    assert time.monotonic() - t0 < 5  # closed politely, not cut at the drain deadline


async def _open_later(gate: anyio.Event) -> None:
    await anyio.sleep(0.05)
    gate.set()


async def test_a_frame_that_breaks_the_websocket_protocol_drops_the_connection_and_the_worker_reconnects(
    engine: FakeEngine, task_group: anyio.abc.TaskGroup, caplog
):
    @ironflow.function(id="fn")
    async def handler(ctx):
        return 1

    worker = ironflow.StreamingWorker(
        engine.url, [handler], handle_signals=False, reconnect_delay=0.05
    )
    await task_group.start(worker.run)
    first = await engine.accept()
    await first.ws._stream.send(b"\xff\x80garbage")  # a reserved opcode, a masked server frame
    with anyio.fail_after(5):
        second = await engine.accept()
    assert second.register.worker_id == worker.worker_id
    assert "Engine closed the connection: Invalid opcode" in caplog.text  # wsproto closed it 1002
    worker.stop()
