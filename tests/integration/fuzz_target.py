"""What the property-based tests fuzz: a real node process (SQLite) with an
honest worker process beside it, and the checks each test ends with.

Each test module gets its own (``fuzz_target`` is module-scoped, in
``conftest.py``); a module's tests share it, so what one example leaves
behind the next one meets.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import trio
from hypothesis import HealthCheck, settings

from tests.integration.procs import Proc


def fuzz_settings(max_examples: int) -> settings:
    """Bounded and reproducible: the same examples every run, so a CI failure replays."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        database=None,
    )


class Target:
    """A node process, an honest worker process, and a pull session of our own."""

    def __init__(self, node: Proc, worker: Proc, url: str, effects: Path, db: Path) -> None:
        self.node, self.worker, self.url, self.effects, self.db = node, worker, url, effects, db
        self.http = httpx.Client(base_url=url, timeout=30)
        reg = self.http.post(
            "/v1/worker/register",
            json={"type": "register", "worker_id": "fuzz", "functions": [], "max_concurrent_jobs": 1},
        ).json()
        self.session_id, self.secret = reg["session_id"], reg["session_secret"]


def metric(t: Target, name: str) -> float:
    """The sum of a metric's samples on the node's /metrics page."""
    text = t.http.get("/metrics").text
    return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def assert_honest_work_completes(t: Target) -> None:
    """The honest worker still gets a run done, start to end."""
    run_id = t.http.post("/v1/events", json={"name": "crash.go", "data": {}}).json()["run_ids"][0]
    status = ""
    for _ in range(600):
        status = t.http.get(f"/v1/runs/{run_id}").json()["run"]["status"]
        if status == "completed":
            return
        trio.run(trio.sleep, 0.05)
    raise AssertionError(f"honest run {run_id} ended {status!r}, not completed")


def assert_node_unharmed(t: Target, restarts_before: float) -> None:
    """Alive, no actor restarted since ``restarts_before``, honest work still done."""
    assert t.node.alive(), t.node.tail()
    assert metric(t, "ironflow_actor_restarts_total") == restarts_before
    assert_honest_work_completes(t)
