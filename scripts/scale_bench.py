"""Node cost against stored work: a fixed probe on an empty database and on
databases holding 100k parked waits, 100k sleeping runs, 300k finished runs
(``--finished 1000000`` with ``--pg`` for the larger PostgreSQL figure).

Usage: python scripts/scale_bench.py [--pg] [--db URL] [--states empty,waits,sleeping,finished]
       [--waits 100000] [--sleeping 100000] [--finished 300000] [--repeat 3] [--idle-seconds 10]

For each state a fresh node on a fresh database (SQLite in a temp dir; with
``--pg`` a throwaway PostgreSQL with its default durability, one database per
state) and one worker serving:

* ``probe`` (event ``probe.go``, one step): the probe is 300 ``probe.go``
  emits offered at 100/s; node CPU per run once every probe run completed;
* ``parker`` (``park.go``): ``wait_for_event("probe.go", match="data.k")`` for
  its own key, an hour's timeout — **waits on the emitted name**, matching none;
* ``sleeper`` (``sleep.go``): one ``step.sleep`` of a day;
* ``quick`` (``quick.go``): one step, the finished runs.

The state is built through the HTTP API (batches of 1,000 events), then each
round measures the node's idle CPU over ``--idle-seconds`` (no emits: the
waker, scanners and heartbeats alone), the probe's node CPU per run and its
emit p99. The target: every state within 1.1x of the empty database on each
figure. Prints medians per state and the ratio to ``empty``.
"""

from __future__ import annotations

import argparse
import atexit
import os
import statistics
import sys
import time
from typing import Any

import httpx
import trio
from children import (
    REPO,
    cleanup_all,
    free_port,
    mkdtemp,
    spawn_dev_node,
    start_script_worker,
    stop,
    wait_ready,
)

PROBE_RUNS = 300
PROBE_RATE = 100.0
BATCH = 1000
IN_FLIGHT = 32
DAY_S = 86_400


def serve(url: str) -> None:
    """The worker (``--worker URL``)."""
    from children import serve_worker_until_stopped

    import ironflow

    async def nothing() -> int:
        return 1

    @ironflow.function(id="probe", triggers=[ironflow.event("probe.go")])
    async def probe(ctx: Any) -> Any:
        return await ctx.step.run("one", nothing)

    @ironflow.function(id="quick", triggers=[ironflow.event("quick.go")])
    async def quick(ctx: Any) -> Any:
        return await ctx.step.run("one", nothing)

    @ironflow.function(id="parker", triggers=[ironflow.event("park.go")])
    async def parker(ctx: Any) -> Any:
        return await ctx.step.wait_for_event("w", event="probe.go", match="data.k", timeout=3600)

    @ironflow.function(id="sleeper", triggers=[ironflow.event("sleep.go")])
    async def sleeper(ctx: Any) -> Any:
        await ctx.step.sleep("nap", DAY_S)

    worker = ironflow.StreamingWorker(url, [probe, quick, parker, sleeper], max_concurrent_jobs=200)
    serve_worker_until_stopped(worker)


def _threads_ns(pid: int) -> dict[str, int]:
    """CPU nanoseconds of each live thread of ``pid`` (schedstat: /proc/PID/stat
    counts 10 ms ticks, too coarse for an idle node's few ms a second)."""
    out: dict[str, int] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as fh:
                out[task] = int(fh.read().split()[0])
        except FileNotFoundError:  # a thread that just ended
            pass
    return out


def _cpu_since(pid: int, before: dict[str, int]) -> float:
    """CPU seconds of ``pid`` since the :func:`_threads_ns` snapshot ``before``:
    each thread's growth (a new thread counts whole; a thread that ended in
    between loses its last moments, which an idle store thread spends idle)."""
    after = _threads_ns(pid)
    return sum(ns - before.get(tid, 0) for tid, ns in after.items()) / 1e9


class Counter:
    """Counts runs by function and status straight from the database, so that
    the node under measurement spends nothing on the script's polling (its
    stats route reads every run of its window: 100k finished runs made it the
    biggest cost of the state it measures)."""

    def __init__(self, db: str):
        self.db = db
        self._conn: Any = None

    def count(self, function_id: str, status: str) -> int:
        sql = "SELECT count(*) FROM runs WHERE function_id = %s AND status = %s"
        if self._conn is None:
            if self.db.startswith("postgresql"):
                import psycopg

                self._conn = psycopg.connect(self.db, autocommit=True)
            else:
                import sqlite3

                self._conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, isolation_level=None)
        if not self.db.startswith("postgresql"):
            sql = sql.replace("%s", "?")
        return int(self._conn.execute(sql, (function_id, status)).fetchone()[0])

    def wait_for(self, function_id: str, status: str, n: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while (have := self.count(function_id, status)) < n:
            if time.monotonic() > deadline:
                raise SystemExit(f"{function_id}: {have} {status} after {timeout_s:g} s, want {n}")
            time.sleep(0.25)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


def _fill(http: httpx.Client, counter: Counter, name: str, n: int, function_id: str, status: str) -> None:
    """``n`` ``name`` events in batches (keys 0..n-1); wait until ``n`` runs of
    ``function_id`` are ``status``."""
    t0 = time.monotonic()
    for first in range(0, n, BATCH):
        events = [{"name": name, "data": {"k": i}} for i in range(first, min(n, first + BATCH))]
        for _attempt in range(10):  # a 503 (Retry-After) is retried, as a client would
            resp = http.post("/v1/events/batch", json={"events": events})
            if resp.status_code != 503:
                break
            print(f"    batch answered 503 ({resp.json().get('code')}), retrying", flush=True)
            time.sleep(float(resp.headers.get("retry-after", "1")))
        resp.raise_for_status()
        # Keep the queue short so the worker never holds the node's writer for long.
        counter.wait_for(function_id, status, min(n, first + BATCH) - BATCH // 2, 600)
    counter.wait_for(function_id, status, n, 1800)
    print(f"    built {n:,} {function_id} runs {status} in {time.monotonic() - t0:.0f} s", flush=True)


async def _offer(url: str, first_key: int) -> list[float]:
    """The probe's emits at its rate; each emit's answer time (seconds)."""
    limiter = trio.CapacityLimiter(IN_FLIGHT)
    took: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        t0 = trio.current_time()

        async def one(i: int) -> None:
            async with limiter:
                body = {"name": "probe.go", "data": {"k": -(first_key + i) - 1}}
                sent = trio.current_time()
                (await http.post("/v1/events", json=body)).raise_for_status()
                took.append(trio.current_time() - sent)

        async with trio.open_nursery() as nursery:
            for i in range(PROBE_RUNS):
                await trio.sleep_until(t0 + i / PROBE_RATE)
                nursery.start_soon(one, i)
    return took


def _measure_state(state: str, args: argparse.Namespace, db: str | None) -> list[dict[str, float]]:
    tmp = mkdtemp("ifscale.")
    port = free_port()
    db = db or f"{tmp}/ironflow.db"
    node = spawn_dev_node(db, tmp, port)
    counter = Counter(db)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, node)
    worker = start_script_worker(__file__, url)
    rows: list[dict[str, float]] = []
    try:
        with httpx.Client(base_url=url, timeout=120) as http:
            if state == "waits":
                _fill(http, counter, "park.go", args.waits, "parker", "waiting")
            elif state == "sleeping":
                _fill(http, counter, "sleep.go", args.sleeping, "sleeper", "waiting")
            elif state == "finished":
                _fill(http, counter, "quick.go", args.finished, "quick", "completed")
            time.sleep(2.0)  # let the build's tail (acks, janitor) settle
            done = 0
            for round_no in range(args.repeat):
                c0 = _threads_ns(node.pid)
                time.sleep(args.idle_seconds)
                idle = _cpu_since(node.pid, c0) * 1000 / args.idle_seconds
                c0 = _threads_ns(node.pid)
                took = sorted(trio.run(_offer, url, round_no * PROBE_RUNS))
                done += PROBE_RUNS
                counter.wait_for("probe", "completed", done, 300)
                per_run = _cpu_since(node.pid, c0) * 1000 / PROBE_RUNS
                p99 = took[min(len(took) - 1, int(len(took) * 0.99))] * 1000
                rows.append({"idle_ms_per_s": idle, "cpu_ms_per_run": per_run, "emit_p99_ms": p99})
                print(f"  {state:>9} round {round_no + 1}: idle {idle:6.2f} CPU-ms/s,"
                      f" probe {per_run:5.2f} CPU-ms per run, emit p99 {p99:5.1f} ms", flush=True)
            if state == "waits" and (parked := counter.count("parker", "waiting")) != args.waits:
                raise SystemExit(f"a probe emit resolved a wait: {parked} of {args.waits} still waiting")
    finally:
        counter.close()
        stop(worker)
        stop(node)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--states", default="empty,waits,sleeping,finished")
    parser.add_argument("--waits", type=int, default=100_000)
    parser.add_argument("--sleeping", type=int, default=100_000)
    parser.add_argument("--finished", type=int, default=300_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--db", default=None, help="a PostgreSQL server URL without a database part")
    parser.add_argument("--pg", action="store_true", help="start a throwaway PostgreSQL")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        serve(args.worker)
        return
    sys.path.insert(0, str(REPO))
    from ironflow.testing import ThrowawayPostgres

    pg: ThrowawayPostgres | None = None
    if args.pg or args.db:
        pg = ThrowawayPostgres(args.db, durable=True) if args.db else ThrowawayPostgres(durable=True)
        if not args.db:
            pg.start()
            atexit.register(pg.stop)
    atexit.register(cleanup_all)
    states = args.states.split(",")
    print(f"backend {'postgresql' if pg else 'sqlite'}: probe {PROBE_RUNS} one-step runs at"
          f" {PROBE_RATE:g}/s, idle over {args.idle_seconds:g} s, {args.repeat} rounds per state", flush=True)
    results: dict[str, dict[str, float]] = {}
    for state in states:
        db = pg.new_database(f"scale_{state}") if pg else None
        rows = _measure_state(state, args, db)
        results[state] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    base = results.get("empty")
    print("\nmedians (ratio to empty):")
    for state, med in results.items():
        ratios = "" if base is None else (
            f"  ({med['idle_ms_per_s'] / base['idle_ms_per_s']:.2f}x idle,"
            f" {med['cpu_ms_per_run'] / base['cpu_ms_per_run']:.2f}x per run,"
            f" {med['emit_p99_ms'] / base['emit_p99_ms']:.2f}x emit p99)"
        )
        print(f"  {state:>9}: idle {med['idle_ms_per_s']:6.2f} CPU-ms/s, probe {med['cpu_ms_per_run']:5.2f}"
              f" CPU-ms per run, emit p99 {med['emit_p99_ms']:5.1f} ms{ratios}")


if __name__ == "__main__":
    sys.exit(main())
