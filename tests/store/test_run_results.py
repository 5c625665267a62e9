"""A completion announces each run's result as its commit wrote it, so a result
wait answers without reading the run back (both backends)."""

from __future__ import annotations

from ironflow.protocol import RunResult
from ironflow.store import Fence, StepResult
from tests.store.behaviour import fn, running, worker


async def test_a_completion_announces_each_runs_result_before_its_end_and_a_read_agrees(store):
    s = await worker(store, fn("a"), slots=3)
    heard: list[tuple[str, object]] = []
    store.on_run_results(lambda results: heard.extend(("result", r) for r in results))
    store.on_runs_ended(lambda run_ids: heard.extend(("ended", r) for r in run_ids))
    one, two, stale = [await running(store, s) for _ in range(3)]
    await store.complete_job(one, {"v": 1})
    await store.complete_jobs([
        (two, [1, "two"], [StepResult("s1", "s", "completed", 7)]),
        (Fence(stale.session_id, stale.run_id, stale.execution_seq, "0" * 32), "no", []),
    ])
    assert heard == [
        ("result", RunResult(one.run_id, "completed", True, {"v": 1})),
        ("ended", one.run_id),
        ("result", RunResult(two.run_id, "completed", True, [1, "two"])),
        ("ended", two.run_id),
    ]  # the stale completion wrote nothing and announces nothing
    for _, result in heard[::2]:
        assert isinstance(result, RunResult)
        run = await store.get_run_record(result.run_id)
        assert RunResult(run.id, run.status, True, run.output, run.error) == result
