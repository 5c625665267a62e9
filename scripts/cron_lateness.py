"""Cron tick lateness: scheduled time → run started, over many ticks.

Usage: python scripts/cron_lateness.py [--ticks 200] [--functions 8]
                                       [--backend postgres|sqlite|both] [--nodes 2]

Per backend: fresh ``--dev`` node(s) (PostgreSQL: a throwaway cluster this
script starts, ``--nodes`` nodes on one database; SQLite: one node) and one
streaming worker (``tests/procs/cron_worker.py``) on the first node serving
``--functions`` functions, each on ``* * * * * *`` (every second), so
``--ticks`` ticks take ``ticks / functions`` seconds. Once the worker is
registered the script waits until that many ticks have runs, stops
everything, and reads the runs from the database, discarding the first two
seconds (the worker's registration). Per tick, two figures:

- engine lateness: the run's ``started_at`` (the database clock when its
  lease was activated, i.e. the worker acked it) − its scheduled time;
- handler lateness: the worker's ``time.time()`` as its handler started
  (returned as the run's output) − its scheduled time (the node, database
  and worker share this machine's clock).

Printed: p50, p99 and max of each, and the ticks that ran twice (must be 0).
"""

from __future__ import annotations

import argparse
import atexit
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from children import LIVE, REPO, child_env, cleanup_all, mkdtemp, spawn_node, stop

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CRON_WORKER = REPO / "tests" / "procs" / "cron_worker.py"
# Ticks in the first seconds after the worker registered are dropped: the
# schedules began at registration, and the worker was still connecting.
WARMUP_S = 2.0


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _rows(db: str) -> list[tuple[float, float | None, float | None, str]]:
    """(scheduled_at, run started_at, handler start, function) of every tick run."""
    sql = (
        "SELECT e.data, r.started_at, r.output, r.function_id FROM runs r JOIN events e ON e.id = r.event_id"
        " WHERE e.name = 'ironflow.cron'"
    )
    if db.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(db) as conn:
            raw = conn.execute(sql).fetchall()
    else:
        import sqlite3

        with sqlite3.connect(db) as conn:
            raw = conn.execute(sql).fetchall()
    out = []
    for data, started_at, output, function_id in raw:
        handler = json.loads(output)["started"] if output else None
        out.append((json.loads(data)["scheduled_at_epoch"], started_at, handler, function_id))
    return out


def one_backend(db: str, nodes: int, ticks: int, functions: int) -> dict[str, float]:
    state = Path(mkdtemp("ifcron."))
    urls = [spawn_node(db, state / f"n{i}", state / f"n{i}.log", node_id=f"cron-{i}") for i in range(nodes)]
    worker = subprocess.Popen(
        [sys.executable, str(CRON_WORKER), urls[0], "--cron", "* * * * * *", "--functions", str(functions)],
        env=child_env(), stdout=subprocess.PIPE, stderr=open(state / "worker.log", "ab"),  # noqa: SIM115
    )
    LIVE.append(worker)
    assert worker.stdout is not None and worker.stdout.readline().startswith(b"READY")
    registered = time.time()
    deadline = registered + WARMUP_S + ticks / functions + 30
    while time.time() < deadline:
        done = [r for r in _rows(db) if r[0] >= registered + WARMUP_S and r[2] is not None]
        if len(done) >= ticks:
            break
        time.sleep(1.0)
    for proc in reversed(LIVE):
        stop(proc)
    every = [r for r in _rows(db) if r[0] >= registered + WARMUP_S]
    twice = len(every) - len({(r[3], r[0]) for r in every})
    rows = sorted(r for r in every if r[2] is not None)[:ticks]
    engine = [(started - at) * 1000 for at, started, _, _ in rows if started is not None]
    handler = [(h - at) * 1000 for at, _, h, _ in rows if h is not None]
    return {
        "ticks": len(rows),
        "twice": twice,
        "engine_p50": _pct(engine, 0.5), "engine_p99": _pct(engine, 0.99), "engine_max": max(engine),
        "handler_p50": _pct(handler, 0.5), "handler_p99": _pct(handler, 0.99), "handler_max": max(handler),
        "handler_mean": statistics.fmean(handler),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ticks", type=int, default=200)
    parser.add_argument("--functions", type=int, default=8)
    parser.add_argument("--backend", choices=["postgres", "sqlite", "both"], default="both")
    parser.add_argument("--nodes", type=int, default=2, help="PostgreSQL nodes (SQLite: always one)")
    args = parser.parse_args()
    from ironflow.testing import ThrowawayPostgres

    atexit.register(cleanup_all)
    pg: ThrowawayPostgres | None = None
    try:
        for backend in (["postgres", "sqlite"] if args.backend == "both" else [args.backend]):
            if backend == "postgres":
                pg = ThrowawayPostgres(durable=True)
                pg.start()
                db, nodes = pg.new_database("cron"), args.nodes
            else:
                db, nodes = f"{mkdtemp('ifcrondb.')}/ironflow.db", 1
            r = one_backend(db, nodes, args.ticks, args.functions)
            cleanup_all()
            print(
                f"{r['ticks']:.0f} ticks of {args.functions} functions on '* * * * * *', {backend},"
                f" {nodes} node{'s' * (nodes > 1)}: run started (lease activated) p50 {r['engine_p50']:.0f} ms,"
                f" p99 {r['engine_p99']:.0f} ms, max {r['engine_max']:.0f} ms; handler started"
                f" p50 {r['handler_p50']:.0f} ms, p99 {r['handler_p99']:.0f} ms, max {r['handler_max']:.0f} ms;"
                f" ran twice: {r['twice']:.0f}",
                flush=True,
            )
            if pg is not None:
                pg.stop()
                pg = None
    finally:
        if pg is not None:
            pg.stop()
        cleanup_all()


if __name__ == "__main__":
    main()
