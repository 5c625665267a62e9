"""Run control on two nodes over one PostgreSQL, driven through the HTTP API at
full rate as a user would (ironflow/store/run_control.py):

- runs that failed at their second step, resumed in bulk through both nodes
  at once: each is resumed exactly once, ends exactly once, and no step
  before the failed one runs again;
- runs asleep in a durable sleep, paused and resumed through alternating
  nodes — half resumed before their sleep ends, half after it ended while
  they were paused: each completes once, no step runs twice, and a sleep
  ends at the time it was given, whatever the pause.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import ironflow
from ironflow.node import Node
from tests.integration.conftest import node_config
from tests.integration.helpers import emit, eventually

pytestmark = pytest.mark.slow

# Runs per test: enough that both nodes' requests interleave on every run.
FAILED_RUNS = 150
NAPPING_RUNS = 100
# A bulk resume page: small, so each node makes many calls and the two sweeps cross.
PAGE = 10
# The durable sleep: longer than the emits, the pause and the early resumes
# take on a loaded machine (at 4 s a run's sleep ended before the last
# emitted run had begun its own), so those land inside it; the other half
# is resumed after it ended.
NAP_S = 6.0
# Bounds on a failure, not timing guesses.
SETTLE_S = 30.0


@asynccontextmanager
async def _two_clients(a: Node, b: Node) -> AsyncIterator[list[httpx.AsyncClient]]:
    """A client on each node: the i-th request of a batch goes to node i % 2."""
    async with httpx.AsyncClient(base_url=a.url, timeout=30) as on_a, \
            httpx.AsyncClient(base_url=b.url, timeout=30) as on_b:
        yield [on_a, on_b]


async def _runs(http: httpx.AsyncClient, function_id: str) -> list[dict[str, Any]]:
    resp = await http.get("/v1/runs", params={"include": "data", "function": function_id, "limit": 1000})
    return list(resp.json()["runs"])


async def _all(http: httpx.AsyncClient, function_id: str, status: str, n: int) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []

    async def check() -> list[dict[str, Any]] | None:
        seen[:] = await _runs(http, function_id)
        return seen if len(seen) == n and all(r["status"] == status for r in seen) else None

    try:
        return list(await eventually(check, timeout=SETTLE_S, interval=0.1, message=f"all {n} runs {status}"))
    except AssertionError as exc:
        raise AssertionError(f"{exc}; by status: {Counter(r['status'] for r in seen)}") from None


async def _audit(http: httpx.AsyncClient, kind: str) -> Counter[str]:
    events = (await http.get("/v1/audit", params={"include": "data", "type": kind, "limit": 1000})).json()["events"]
    return Counter(e["run_id"] for e in events)


async def _start(nursery: trio.Nursery, tmp_path: Path, pg_url: str, *functions: Any) -> tuple[Node, Node]:
    a: Node = await nursery.start(Node(node_config(pg_url, tmp_path / "a")).run)
    b: Node = await nursery.start(Node(node_config(pg_url, tmp_path / "b")).run)
    for node in (a, b):  # a worker on each node
        worker = ironflow.StreamingWorker(node.url, list(functions), handle_signals=False, max_concurrent_jobs=50)
        await nursery.start(worker.run)
    return a, b


async def test_failed_runs_resumed_in_bulk_through_both_nodes_at_once_are_each_resumed_and_ended_once(
    pg_url: str, tmp_path: Path, nursery: trio.Nursery
) -> None:
    ran: Counter[tuple[str, str]] = Counter()
    partner_down = True

    @ironflow.function(id="flaky", triggers=[ironflow.event("flaky.go")], audit=True)
    async def flaky(ctx: Any) -> Any:
        run_id = ctx.run.id

        def step(name: str, value: int) -> int:
            ran[(run_id, name)] += 1
            if name == "two" and partner_down:
                raise ironflow.NonRetryableError("the partner API is down")
            return value

        return [await ctx.step.run(name, step, name, i) for i, name in enumerate(("one", "two", "three"), 1)]

    a, b = await _start(nursery, tmp_path, pg_url, flaky)
    async with _two_clients(a, b) as clients:
        async with trio.open_nursery() as emits:
            for i in range(FAILED_RUNS):
                emits.start_soon(emit, clients[i % 2], "flaky.go", {"i": i})
        failed = {r["id"] for r in await _all(clients[0], "flaky", "failed", FAILED_RUNS)}
        assert all(ran[(r, "one")] == 1 and ran[(r, "two")] == 1 and ran[(r, "three")] == 0 for r in failed)

        partner_down = False
        resumed_by: dict[int, list[str]] = {0: [], 1: []}

        async def sweep(side: int) -> None:
            """``runs resume --status failed --since 1h`` through one node, page by page."""
            cursor = None
            while True:
                body = {"since_s": 3600, "function_id": "flaky", "limit": PAGE, "cursor": cursor}
                resp = await clients[side].post("/v1/runs/resume", json=body)
                assert resp.status_code == 200, resp.text
                page = resp.json()
                assert all(r["resumed_from"] == "failed" and r["from_step"] == "two" for r in page["resumed"])
                resumed_by[side] += [r["run_id"] for r in page["resumed"]]
                cursor = page["next_cursor"]
                if cursor is None:
                    return

        async with trio.open_nursery() as sweeps:
            sweeps.start_soon(sweep, 0)
            sweeps.start_soon(sweep, 1)
        both = resumed_by[0] + resumed_by[1]
        assert len(both) == len(set(both)) and set(both) == failed, "a run resumed twice, or not at all"
        assert resumed_by[0] and resumed_by[1], "one node resumed everything: the sweeps never crossed"

        completed = await _all(clients[1], "flaky", "completed", FAILED_RUNS)
        assert all(r["output"] == [1, 2, 3] and r["attempt"] == 1 for r in completed)
        assert await _audit(clients[0], "run.resumed") == Counter({r: 1 for r in failed})
        assert await _audit(clients[1], "run.completed") == Counter({r: 1 for r in failed})
        for r in failed:  # one never again; two failed once and ran once more; three once
            assert (ran[(r, "one")], ran[(r, "two")], ran[(r, "three")]) == (1, 2, 1), r
    a.stop()
    b.stop()


async def test_sleeping_runs_paused_and_resumed_through_alternating_nodes_each_complete_once_on_time(
    pg_url: str, tmp_path: Path, nursery: trio.Nursery
) -> None:
    ran: Counter[tuple[str, str]] = Counter()

    @ironflow.function(id="napper", triggers=[ironflow.event("nap.go")], audit=True)
    async def napper(ctx: Any) -> Any:
        run_id = ctx.run.id

        def mark(name: str) -> None:
            ran[(run_id, name)] += 1

        await ctx.step.run("one", mark, "one")
        await ctx.step.sleep("nap", NAP_S)
        await ctx.step.run("two", mark, "two")
        return "rested"

    a, b = await _start(nursery, tmp_path, pg_url, napper)
    async with _two_clients(a, b) as clients:
        async with trio.open_nursery() as emits:
            for i in range(NAPPING_RUNS):
                emits.start_soon(emit, clients[i % 2], "nap.go", {"i": i})
        runs = [r["id"] for r in await _all(clients[0], "napper", "waiting", NAPPING_RUNS)]
        # Each run's wake time as its sleep gave it, before any pause.
        wake_at: dict[str, float] = {}

        async def read_wake(i: int, run_id: str) -> None:
            steps = (await clients[i % 2].get(f"/v1/runs/{run_id}")).json()["steps"]
            wake_at[run_id] = next(s["wake_at"] for s in steps if s["name"] == "nap")

        async with trio.open_nursery() as reads:
            for i, r in enumerate(runs):
                reads.start_soon(read_wake, i, r)
        early, late = runs[::2], runs[1::2]

        answers: dict[tuple[str, str], dict[str, Any]] = {}

        async def control(side: int, run_id: str, verb: str) -> None:
            resp = await clients[side].post(f"/v1/runs/{run_id}/{verb}")
            assert resp.status_code == 200, f"{verb} {run_id}: {resp.text}"
            answers[(run_id, verb)] = resp.json()

        async with trio.open_nursery() as calls:  # pause through one node ...
            for i, r in enumerate(runs):
                calls.start_soon(control, i % 2, r, "pause")
        async with trio.open_nursery() as calls:  # ... resume half at once through the other
            for i, r in enumerate(early):
                calls.start_soon(control, (i + 1) % 2, r, "resume")

        # Resumed inside its sleep, a run goes back to waiting on it (a sleep
        # the waker was settling at that instant: queued, held to its wake time).
        early_answers = Counter(answers[(r, "resume")]["status"] for r in early)
        assert early_answers["waiting"] > 0, early_answers

        async def late_ones_slept_while_paused() -> bool:
            for r in late:
                d = (await clients[1].get(f"/v1/runs/{r}")).json()
                nap = next(s for s in d["steps"] if s["name"] == "nap")
                if (d["run"]["status"], nap["status"], d["queue"]) != ("paused", "completed", None):
                    return False
            return True

        await eventually(late_ones_slept_while_paused, timeout=SETTLE_S, interval=0.2,
                         message="the late half's sleeps ended, the runs still paused")
        async with trio.open_nursery() as calls:
            for i, r in enumerate(late):
                calls.start_soon(control, i % 2, r, "resume")

        await _all(clients[1], "napper", "completed", NAPPING_RUNS)
        assert await _audit(clients[0], "run.paused") == Counter({r: 1 for r in runs})
        assert await _audit(clients[1], "run.resumed") == Counter({r: 1 for r in runs})
        assert await _audit(clients[0], "run.completed") == Counter({r: 1 for r in runs})
        for r in runs:
            assert (ran[(r, "one")], ran[(r, "two")]) == (1, 1), r
            nap = next(s for s in (await clients[0].get(f"/v1/runs/{r}")).json()["steps"] if s["name"] == "nap")
            assert nap["wake_at"] == wake_at[r], f"{r}: the pause moved its sleep's end"
    a.stop()
    b.stop()
