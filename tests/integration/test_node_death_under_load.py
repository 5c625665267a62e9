"""Two nodes on one PostgreSQL under load: kill -9 one mid-way, every run completes
on the survivor, and no step is recorded twice (checked in the database)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import trio

from ironflow.config import DEV_TIMINGS
from tests.integration.procs import Proc, free_port, start_load_worker, start_node

pytestmark = pytest.mark.slow

RUNS = 2000
# Emits per POST /v1/events/batch (the API's limit is 1,000).
EMIT_BATCH = 500
# Share of the runs completed before the kill: "mid-way".
KILL_AFTER = RUNS // 4
# The scanner looks every scanner_interval_s (1 s under --dev) and a recovery is
# one transaction: recovered within lease expiry + this.
RECOVERY_SLACK_S = 1.0 + DEV_TIMINGS["scanner_interval_s"]
# Generous bound for the whole load on a busy 2-core machine.
COMPLETE_TIMEOUT_S = 240.0


def query(url: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


async def completed_runs(url: str) -> int:
    rows = await trio.to_thread.run_sync(
        query, url, "SELECT count(*) FROM runs WHERE function_id = 'load3' AND status = 'completed'"
    )
    return int(rows[0][0])


async def test_a_node_killed_under_load_loses_no_run_and_records_no_step_twice(
    pg_url: str, tmp_path: Path, procs: list[Proc]
) -> None:
    ports = {"node-a": free_port(), "node-b": free_port()}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    nodes = {}
    for name, port in ports.items():
        nodes[name] = await start_node(pg_url, tmp_path / name, tmp_path, node_id=name, port=port)
        procs.append(nodes[name])
    workers = {}
    for name, url in urls.items():
        workers[name] = await start_load_worker(url, tmp_path, name=f"worker-{name}")
        procs.append(workers[name])

    async with httpx.AsyncClient(timeout=60) as http:
        for first in range(0, RUNS, EMIT_BATCH):
            events = [{"name": "load.go", "data": {"i": i}} for i in range(first, first + EMIT_BATCH)]
            url = urls["node-a" if (first // EMIT_BATCH) % 2 == 0 else "node-b"]
            resp = await http.post(f"{url}/v1/events/batch", json={"events": events})
            assert resp.status_code in (200, 201), resp.text

    with trio.fail_after(COMPLETE_TIMEOUT_S):
        while await completed_runs(pg_url) < KILL_AFTER:
            await trio.sleep(0.05)
        # Kill it while it holds leases. Its worker's jobs finish and start in
        # waves (a batch of assignments in one frame), so for a few ms all of
        # its work can sit in reservations instead: freeze it, look, and let it
        # go on until the moment is one with leases.
        while True:
            nodes["node-a"].signal(signal.SIGSTOP)
            held = await trio.to_thread.run_sync(
                query, pg_url, "SELECT run_id FROM concurrency_leases WHERE node_id = 'node-a'"
            )
            if held:
                break
            nodes["node-a"].signal(signal.SIGCONT)
            await trio.sleep(0.02)
    killed_at = nodes["node-a"].signal(signal.SIGKILL)
    await nodes["node-a"].wait_exit()
    # Its worker's socket died with it; it would come back through the survivor
    # (as behind a load balancer), but here the survivor's own worker finishes.
    workers["node-a"].signal(signal.SIGKILL)

    with trio.fail_after(COMPLETE_TIMEOUT_S):
        while await completed_runs(pg_url) < RUNS:
            await trio.sleep(0.25)

    runs = await trio.to_thread.run_sync(
        query, pg_url, "SELECT status, count(*) FROM runs GROUP BY status"
    )
    assert dict(runs) == {"completed": RUNS}
    steps = await trio.to_thread.run_sync(
        query,
        pg_url,
        "SELECT count(*), count(DISTINCT (run_id, step_id)),"
        " count(*) FILTER (WHERE status = 'completed') FROM steps",
    )
    assert steps[0] == (RUNS * 3, RUNS * 3, RUNS * 3)
    per_run = await trio.to_thread.run_sync(
        query, pg_url, "SELECT run_id FROM steps GROUP BY run_id HAVING count(*) <> 3"
    )
    assert per_run == []
    # Every segment the dead node held was recovered by the survivor's scanner
    # within the lease expiry (database time; kill time from this host's clock).
    recovered = await trio.to_thread.run_sync(
        query,
        pg_url,
        "SELECT run_id, min(at) FROM audit_log WHERE type = 'capacity.segment.recovered'"
        " AND at >= %s GROUP BY run_id",
        (killed_at,),
    )
    at = dict(recovered)
    held_ids = {r[0] for r in held}
    assert held_ids <= set(at), f"{len(held_ids - set(at))} held segments never recovered"
    worst = max(at[r] for r in held_ids) - killed_at
    assert worst <= DEV_TIMINGS["lease_expiry_s"] + RECOVERY_SLACK_S, worst
