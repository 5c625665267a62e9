"""Cron ticks through real node and worker processes on one PostgreSQL.

One real-time test (the CI budget): a ``*/2 * * * * *`` schedule on two
nodes, one killed (kill -9) mid-way, then every node down for ~10 s and one
back. Read straight from the database: one run per scheduled time, none
twice, no gap while a node was up, and one catch-up run for the outage.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
import trio

from tests.integration.helpers import eventually
from tests.integration.procs import ROOT, Proc, db_rows, free_port, start_node

pytestmark = pytest.mark.slow

CRON_WORKER = ROOT / "tests" / "procs" / "cron_worker.py"
PERIOD = 2.0


def ticks(db: str) -> list[tuple[float, str, str]]:
    """``(scheduled_at, run status, run id)`` of every run of ``tick``, by scheduled time."""
    rows = db_rows(
        db,
        "SELECT e.data, r.status, r.id FROM runs r JOIN events e ON e.id = r.event_id"
        " WHERE r.function_id = 'tick' AND e.name = 'ironflow.cron'",
    )
    return sorted((json.loads(data)["scheduled_at_epoch"], status, rid) for data, status, rid in rows)


async def test_one_run_per_tick_across_two_nodes_a_kill_and_an_outage(pg_url: str, tmp_path: Path) -> None:
    ports = {"a": free_port(), "b": free_port()}
    procs: list[Proc] = []

    async def node(name: str) -> Proc:
        proc = await start_node(pg_url, tmp_path / name, tmp_path, node_id=f"node-{name}", port=ports[name])
        procs.append(proc)
        return proc

    try:
        async with trio.open_nursery() as nursery:
            for name in ports:
                nursery.start_soon(node, name)
        a, b = procs
        worker = Proc(
            [sys.executable, str(CRON_WORKER), f"http://127.0.0.1:{ports['b']}"], tmp_path / "worker.log"
        )
        procs.append(worker)
        await worker.wait_line("READY")

        # Phase 1: two nodes, node a killed mid-way: 21 s of ticks.
        t0 = time.time()
        await trio.sleep(10)
        a.signal(signal.SIGKILL)
        await trio.sleep(t0 + 21 - time.time())
        window = [t for t in ticks(pg_url) if t0 <= t[0] <= t0 + 21]
        scheduled = [t[0] for t in window]
        assert len(scheduled) in (10, 11), scheduled
        assert len(set(scheduled)) == len(scheduled)
        assert all(b - a == PERIOD for a, b in zip(scheduled, scheduled[1:], strict=False)), scheduled

        # Phase 2: every node down ~10 s, then node b back.
        b.signal(signal.SIGKILL)
        down_at = time.time()
        await b.wait_exit()
        await trio.sleep(10)
        procs.remove(b)
        await node("b")
        await trio.sleep(2 * PERIOD + 0.5)
        after = ticks(pg_url)
        times = [t[0] for t in after]
        assert len(set(times)) == len(times), "a tick ran twice"
        before = [t for t in times if t <= down_at]
        later = [t for t in times if t > down_at]
        # The outage's ticks: one catch-up run, then every tick on time again.
        gaps = [(x, y) for x, y in zip(times, times[1:], strict=False) if y - x != PERIOD]
        assert len(gaps) == 1, gaps
        last_before, catch_up = gaps[0]
        assert last_before == before[-1] and catch_up == later[0]
        assert catch_up - last_before >= 4 * PERIOD  # ticks of the outage skipped, not flooded
        missed = db_rows(
            pg_url, "SELECT data FROM audit_log WHERE type = 'cron.ticks.missed' AND function_id = 'tick'"
        )
        assert [json.loads(m[0])["fired"] for m in missed] == [[catch_up]]

        # The worker (reconnected to node b) ran them all.
        async def all_completed() -> bool:
            return all(status == "completed" for _, status, _ in ticks(pg_url))

        await eventually(all_completed, timeout=30, message="every tick's run completed")
    finally:
        for proc in procs:
            proc.stop()
