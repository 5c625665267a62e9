"""Sleeps woken ahead of their time (``waker_lookahead``), through real node
and worker processes on both backends: the handler past the sleep never sees
``time.time()`` before the wake time, and a worker killed while it holds a
woken job leaves a run that completes once, on another worker, after the wake
time. The worker is ``tests/procs/wake_worker.py`` (audit on: ``step.woke``
records when each step was claimed)."""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import trio

from tests.integration.conftest import serve_node
from tests.integration.procs import Proc, count, db_rows, read_effects, start_wake_worker

pytestmark = pytest.mark.slow

RUNS = 40


async def wait_completed(http: httpx.AsyncClient, run_ids: list[str], timeout: float = 30.0) -> dict[str, dict]:
    done: dict[str, dict] = {}
    with trio.fail_after(timeout):
        while len(done) < len(run_ids):
            for run_id in run_ids:
                if run_id not in done:
                    run = (await http.get(f"/v1/runs/{run_id}")).json()["run"]
                    if run["status"] in ("completed", "failed", "cancelled"):
                        done[run_id] = run
            await trio.sleep(0.1)
    return done


async def test_with_lookahead_the_handler_past_a_sleep_never_sees_a_time_before_its_wake_time(
    database_url: str, tmp_path: Path, procs: list[Proc]
) -> None:
    effects = tmp_path / "effects.log"
    node = await serve_node(procs, database_url, tmp_path, "node-a", "--waker-lookahead", "1.5")
    await start_wake_worker(procs, node.url, tmp_path, "w1", "--effects", str(effects))
    # Due at several instants a few ms apart, so some are held for a whole
    # look-ahead and some for a moment.
    at = [time.time() + 4.0 + i * 0.007 for i in range(RUNS)]
    async with httpx.AsyncClient(base_url=node.url, timeout=30) as http:
        resp = await http.post("/v1/events/batch", json={"events": [{"name": "nap.go", "data": {"at": t}} for t in at]})
        run_ids = [r for e in resp.json()["events"] for r in e["run_ids"]]
        wake_at = dict(zip(run_ids, at, strict=True))
        runs = await wait_completed(http, run_ids)
    assert {r["status"] for r in runs.values()} == {"completed"}
    rows = read_effects(effects)
    for run_id, due in wake_at.items():
        due = math.ceil(due * 1000) / 1000  # the SDK parks the wake time in whole ms, rounded up
        [resumed] = [t for t, r, what, _ in rows if r == run_id and what == "resumed"]
        [after] = [t for t, r, what, _ in rows if r == run_id and what == "after"]
        assert due <= resumed <= after, (run_id, resumed - due)
    # Claimed and resumed ahead of the wake time: the look-ahead was in play.
    woke = db_rows(database_url, "SELECT run_id, data FROM audit_log WHERE type = 'step.woke'")
    ahead = [wake_at[run_id] - float(msgspec.json.decode(data)["claimed_at"]) for run_id, data in woke]
    assert len(ahead) == RUNS and min(ahead) > 0.5, sorted(ahead)[:3]


async def test_a_worker_killed_while_it_holds_a_woken_job_leaves_the_run_to_complete_once_after_the_wake_time(
    database_url: str, tmp_path: Path, procs: list[Proc]
) -> None:
    effects = tmp_path / "effects.log"
    # A 2.5 s look-ahead (the dev reservation expiry, 5 s, allows up to half
    # of it): time to kill the worker mid-hold and start another before the
    # wake time.
    node = await serve_node(procs, database_url, tmp_path, "node-a", "--waker-lookahead", "2.5")
    w1 = await start_wake_worker(procs, node.url, tmp_path, "w1", "--effects", str(effects))
    at = time.time() + 6.0
    async with httpx.AsyncClient(base_url=node.url, timeout=30) as http:
        resp = await http.post("/v1/events", json={"name": "nap.go", "data": {"at": at, "before": True}})
        run_id = resp.json()["run_ids"][0]
        # Held by w1: its resumed segment acked (a lease), the wake time ahead.
        with trio.fail_after(10):
            while True:
                detail = (await http.get(f"/v1/runs/{run_id}")).json()
                if detail["run"]["current_execution_seq"] == 2 and detail["lease"] is not None:
                    break
                await trio.sleep(0.05)
        held_at = time.time()
        assert held_at < at - 1.0, "no hold to interrupt: the machine is too slow for this test"
        w1.signal(signal.SIGKILL)
        w2 = await start_wake_worker(procs, node.url, tmp_path, "w2", "--effects", str(effects))
        w2_ready = time.time()
        [run] = (await wait_completed(http, [run_id])).values()
    assert run["status"] == "completed" and run["output"] == w2.pid
    assert run["attempt"] == 1 and run["current_execution_seq"] == 3  # recovered once, at the disconnect
    rows = read_effects(effects)
    assert count(rows, run_id, "before") == 1  # nothing before the sleep ran again
    assert [pid for _, r, what, pid in rows if r == run_id and what in ("resumed", "after")] == [w2.pid, w2.pid]
    [resumed] = [t for t, r, what, _ in rows if r == run_id and what == "resumed"]
    assert resumed >= math.ceil(at * 1000) / 1000
    # w2 was connected before the wake time: it was sent the recovered
    # segment ahead of it and held it until then.
    assert w2_ready < at, (w2_ready - at)
    recovered = db_rows(
        database_url, "SELECT count(*) FROM audit_log WHERE run_id = ? AND type = 'capacity.segment.recovered'",
        (run_id,),
    )
    assert recovered == [(1,)]
