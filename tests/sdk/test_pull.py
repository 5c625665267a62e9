"""PullWorker against a fake HTTP engine (httpx.MockTransport)."""

from __future__ import annotations

import anyio
import anyio.abc
import httpx
import msgspec
import pytest
from sdk_fake_engine import make_assignment

import ironflow
from ironflow.protocol import (
    JobLeaseStatus,
    LeaseStatus,
    PullPollResponse,
    Registered,
    encoder,
    worker_message_decoder,
)

# Every test here runs on asyncio and on trio (tests/sdk/conftest.py).
pytestmark = pytest.mark.anyio


class FakeHttpEngine:
    def __init__(self, jobs, *, ack_status=200, goodbye_delay=0.0):
        self.jobs = list(jobs)
        self.ack_status = ack_status
        self.goodbye_delay = goodbye_delay
        self.calls: list[tuple[str, str, object]] = []
        self.stale: set[str] = set()

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = msgspec.json.decode(request.content) if request.content else None
        kind = path.rsplit("/", 1)[-1]
        msg = None
        if kind in ("ack", "nack", "steps", "result"):
            msg = worker_message_decoder.decode(request.content)
        self.calls.append((request.method, kind, msg or body))
        if request.method == "DELETE":
            await anyio.sleep(self.goodbye_delay)  # a node slow to answer the goodbye
        if kind == "register":
            out = Registered(session_id="s1", heartbeat_interval_ms=20, lease_expiry_ms=90_000)
            return httpx.Response(200, content=encoder.encode(out))
        if kind == "poll":
            if self.jobs:
                jobs, self.jobs = self.jobs[: body["max_jobs"]], self.jobs[body["max_jobs"] :]
                return httpx.Response(200, content=encoder.encode(PullPollResponse(jobs=jobs)))
            await anyio.sleep(min(body["wait_s"], 0.05))
            return httpx.Response(200, content=b'{"jobs": []}')
        if kind == "ack":
            return httpx.Response(self.ack_status, json={"ok": self.ack_status < 400})
        if kind == "heartbeat":
            states = [
                JobLeaseStatus(
                    job_id=j["job_id"], run_id=j["run_id"], execution_seq=j["execution_seq"],
                    state="STALE" if j["run_id"] in self.stale else "REFRESHED",
                )
                for j in body["jobs"] or []
            ]
            return httpx.Response(200, content=encoder.encode(LeaseStatus(jobs=states)))
        return httpx.Response(200, json={"ok": True})

    def kinds(self):
        return [k for _, k, _ in self.calls if k not in ("poll", "heartbeat")]


def _worker(engine, functions, **kw):
    return ironflow.PullWorker(
        "http://engine.test", functions, transport=httpx.MockTransport(engine.handle),
        handle_signals=False, poll_wait=0.05, **kw,
    )


@ironflow.function(id="fn")
async def two_steps(ctx):
    a = await ctx.step.run("a", lambda: 1)
    b = await ctx.step.run("b", lambda: 2)
    return a + b


async def _serve_until_a_result_then_drain(worker: ironflow.PullWorker, engine: FakeHttpEngine) -> None:
    """Run ``worker`` until ``engine`` has received a job result, then drain it."""
    async with anyio.create_task_group() as task_group:
        await task_group.start(worker.run)
        with anyio.fail_after(5):
            while "result" not in engine.kinds():
                await anyio.sleep(0.01)
        await worker.drain()


async def test_pull_worker_acks_runs_reports_and_says_goodbye():
    engine = FakeHttpEngine([make_assignment(run_id="p1")])
    worker = _worker(engine, [two_steps])
    await _serve_until_a_result_then_drain(worker, engine)
    assert engine.kinds() == ["register", "ack", "steps", "steps", "result", "s1"]
    result = [m for _, k, m in engine.calls if k == "result"][0]
    assert result.output == 3
    assert engine.calls[-1][0] == "DELETE"


async def test_pull_worker_drops_job_when_ack_is_refused():
    engine = FakeHttpEngine([make_assignment(run_id="p2")], ack_status=409)
    worker = _worker(engine, [two_steps])
    async with anyio.create_task_group() as task_group:
        await task_group.start(worker.run)
        with anyio.fail_after(5):
            while "ack" not in engine.kinds():
                await anyio.sleep(0.01)
        await anyio.sleep(0.05)
        worker.stop()
    assert "steps" not in engine.kinds() and "result" not in engine.kinds()


async def test_pull_worker_abandons_stale_lease_from_heartbeat():
    gate = anyio.Event()

    @ironflow.function(id="fn")
    async def blocked(ctx):
        await gate.wait()
        return 1

    engine = FakeHttpEngine([make_assignment(run_id="p3")])
    engine.stale.add("p3")
    worker = _worker(engine, [blocked])
    async with anyio.create_task_group() as task_group:
        await task_group.start(worker.run)
        with anyio.fail_after(5):
            while "ack" not in engine.kinds() or worker.active_jobs:
                await anyio.sleep(0.01)
        gate.set()
        await worker.drain()
    assert "result" not in engine.kinds()


async def test_a_slow_goodbye_is_cut_at_the_drain_deadline():
    # The job ends at once; the node never answers the DELETE in time. Before,
    # the goodbye got its own 5 s after the deadline.
    engine = FakeHttpEngine([make_assignment(run_id="p4")], goodbye_delay=30)
    worker = _worker(engine, [two_steps], drain_timeout=0.5)
    async with anyio.create_task_group() as task_group:
        await task_group.start(worker.run)
        with anyio.fail_after(5):
            while "result" not in engine.kinds():
                await anyio.sleep(0.01)
        t0 = anyio.current_time()
        await worker.drain()
        took = anyio.current_time() - t0
    assert engine.calls[-1][0] == "DELETE"
    assert 0.4 < took < 0.6


async def test_a_job_cut_at_the_deadline_still_gets_its_goodbye_within_it():
    @ironflow.function(id="fn")
    async def endless(ctx):
        return await ctx.step.run("forever", anyio.sleep_forever)

    engine = FakeHttpEngine([make_assignment(run_id="p5")])
    worker = _worker(engine, [endless], drain_timeout=1.0)
    async with anyio.create_task_group() as task_group:
        await task_group.start(worker.run)
        with anyio.fail_after(5):
            while "ack" not in engine.kinds():
                await anyio.sleep(0.01)
        t0 = anyio.current_time()
        await worker.drain()
        took = anyio.current_time() - t0
    # The job is cut a goodbye's reserve before the deadline, so the DELETE
    # (which makes the node recover its lease at once) lands within it.
    assert engine.calls[-1][0] == "DELETE"
    assert "result" not in engine.kinds()
    assert 0.7 < took <= 1.0


async def test_pull_worker_says_in_each_poll_that_it_holds_a_job_until_its_start_delay():
    engine = FakeHttpEngine([make_assignment(run_id="p9", start_delay_ms=200)])
    worker = _worker(engine, [two_steps])
    await _serve_until_a_result_then_drain(worker, engine)
    polls = [body for _, k, body in engine.calls if k == "poll"]
    assert polls and all(p["delayed_start"] for p in polls)
    acked, stepped = (next(i for i, (_, k, _) in enumerate(engine.calls) if k == kind) for kind in ("ack", "steps"))
    # Acked on receipt, and the handler's first step only after the 200 ms hold
    # (heartbeats every 20 ms and polls come between).
    assert stepped - acked > 2
