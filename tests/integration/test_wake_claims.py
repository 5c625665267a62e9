"""The waker's claims through real node processes (seed: docs/seeds/crash-recovery.txt).

"Exactly one node claims each step"; a claimer that dies between its claim
and its resume leaves the step ``waking`` until loop 2 (the stale-claim
sweeper) restores its ``pre_claim_status``. Counted in the database: the
steps table, and the audit records the node writes for an audit-enabled
function in the same transaction as the change (``step.woke`` per resume,
``step.claim.restored`` per restore). The worker is
``tests/procs/wake_worker.py``.
"""

from __future__ import annotations

import signal
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import msgspec
import pytest
import trio

from tests.integration.conftest import serve_node
from tests.integration.procs import ROOT, Proc, count, db_rows, read_effects, start_wake_worker
from tests.procs.node_exit_after_wake_claim import EXIT_CODE

# ``ironflow serve`` with a store that exits the process right after the
# waker's first claim commits (a fault injected from outside the engine).
EXIT_AFTER_CLAIM = [sys.executable, str(ROOT / "tests" / "procs" / "node_exit_after_wake_claim.py")]

pytestmark = pytest.mark.slow

THRESHOLD_S = 2.0


def audit_of(db: str, kind: str) -> list[tuple[str, float, dict[str, object]]]:
    rows = db_rows(db, "SELECT run_id, at, data FROM audit_log WHERE type = ? ORDER BY at", (kind,))
    return [(r[0], float(r[1]), msgspec.json.decode(r[2])) for r in rows]


async def test_a_claimer_dying_between_claim_and_resume_is_restored_by_loop_2_and_the_run_completes_once(
    database_url: str, tmp_path: Path, procs: list[Proc]
) -> None:
    db = database_url
    effects = tmp_path / "effects.log"
    # Node A crashes (os._exit) right after its waker's claim commits.
    a = await serve_node(procs, db, tmp_path, "node-a", program=EXIT_AFTER_CLAIM)
    w1 = await start_wake_worker(procs, a.url, tmp_path, "w1", "--effects", str(effects))
    async with httpx.AsyncClient(base_url=a.url, timeout=10) as http:
        at = time.time() + 1.0
        resp = await http.post("/v1/events", json={"name": "nap.go", "data": {"at": at, "before": True}})
        run_id = resp.json()["run_ids"][0]
    assert await a.proc.wait_exit(timeout=15) == EXIT_CODE, a.proc.tail()
    w1.signal(signal.SIGKILL)
    [(status, claimed_by)] = db_rows(
        db, "SELECT status, claimed_by FROM steps WHERE run_id = ? AND name = 'nap'", (run_id,)
    )
    assert (status, claimed_by) == ("waking", "node-a")
    # Node B: another node on PostgreSQL, the restarted node on SQLite (same
    # file); its loop 2 runs every 0.5 s with a 2 s threshold (which must be
    # at least twice the heartbeat interval).
    b = await serve_node(
        procs, db, tmp_path, "node-b", "--heartbeat-interval", "1",
        "--stale-claim-threshold", str(THRESHOLD_S), "--stale-claim-interval", "0.5",
    )
    w2 = await start_wake_worker(procs, b.url, tmp_path, "w2", "--effects", str(effects))
    async with httpx.AsyncClient(base_url=b.url, timeout=10) as http:
        with trio.fail_after(20):
            while (run := (await http.get(f"/v1/runs/{run_id}")).json()["run"])["status"] != "completed":
                await trio.sleep(0.05)
    assert run["output"] == w2.pid
    assert run["attempt"] == 1 and run["recovery_count"] == 0
    # Exactly once, in the database: one row per step, each completed; the
    # run resumed once (its second segment is its last).
    steps = db_rows(db, "SELECT name, status FROM steps WHERE run_id = ? ORDER BY name", (run_id,))
    assert steps == [("after", "completed"), ("before", "completed"), ("nap", "completed")]
    [(seq,)] = db_rows(db, "SELECT current_execution_seq FROM runs WHERE id = ?", (run_id,))
    assert seq == 2
    # Restored once (node A's claim), no sooner than the threshold, then claimed
    # and resumed once by node B.
    [(_, restored_at, restored)] = audit_of(db, "step.claim.restored")
    assert restored["claimed_by"] == "node-a"
    assert restored_at - float(restored["claimed_at"]) >= THRESHOLD_S  # type: ignore[arg-type]
    [(_, _, woke)] = audit_of(db, "step.woke")
    assert woke["node_id"] == "node-b" and woke["from"] == "sleeping"
    rows = read_effects(effects)
    assert count(rows, run_id, "before") == 1 and count(rows, run_id, "after") == 1


SLEEPS = 1000


async def test_two_postgres_nodes_racing_claim_and_resume_each_of_1000_sleeps_exactly_once(
    pg_url: str, tmp_path: Path, procs: list[Proc]
) -> None:
    a = await serve_node(procs, pg_url, tmp_path, "node-a")
    b = await serve_node(procs, pg_url, tmp_path, "node-b")
    await start_wake_worker(procs, a.url, tmp_path, "wa")
    await start_wake_worker(procs, b.url, tmp_path, "wb")
    t0 = time.time()
    at = round(t0 + 8.0)  # the same second for every sleep
    async with httpx.AsyncClient(base_url=a.url, timeout=60) as http:
        events = [{"name": "nap.go", "data": {"at": at}} for _ in range(SLEEPS)]
        resp = await http.post("/v1/events/batch", json={"events": events})
        run_ids = [r for e in resp.json()["events"] for r in e["run_ids"]]
    assert len(run_ids) == SLEEPS
    # Every sleep must be parked before it is due, or this is no race.
    with trio.fail_after(at - time.time()):
        while db_rows(pg_url, "SELECT count(*) FROM steps WHERE name = 'nap'")[0][0] < SLEEPS:
            await trio.sleep(0.2)
    parked = time.time() - t0
    with trio.fail_after(30):
        while db_rows(pg_url, "SELECT count(*) FROM runs WHERE status = 'completed'")[0][0] < SLEEPS:
            await trio.sleep(0.2)
    runs = db_rows(pg_url, "SELECT status, current_execution_seq, attempt, recovery_count FROM runs")
    assert len(runs) == SLEEPS and set(runs) == {("completed", 2, 1, 0)}
    steps = db_rows(pg_url, "SELECT name, status, count(*) FROM steps GROUP BY name, status ORDER BY name")
    assert steps == [("after", "completed", SLEEPS), ("nap", "completed", SLEEPS)]
    woke = audit_of(pg_url, "step.woke")
    per_step = Counter((run_id, str(data["step_id"])) for run_id, _, data in woke)
    assert len(per_step) == SLEEPS and set(per_step.values()) == {1}
    assert not audit_of(pg_url, "step.claim.restored")
    by_node = Counter(str(data["node_id"]) for _, _, data in woke)
    print(f"\n{SLEEPS} sleeps parked in {parked:.1f} s, due at once, woken by node: {dict(by_node)}")
    assert set(by_node) == {"node-a", "node-b"}  # both wakers took part
